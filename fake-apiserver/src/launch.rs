//! Turning a Pod's first container into a local process, as the kubelet would start it in a
//! container: the environment (literal, `valueFrom`, `envFrom`), `$(VAR)` expansion, and the
//! volumes made into local directories. A process shares the host's filesystem and network,
//! so each volume's mount path, the termination log and `0.0.0.0` binds are rewritten, in
//! the arguments, the environment and the files of ConfigMap and Secret volumes, to the
//! Pod's directories and its own loopback address. A container run in its image by an engine
//! ([`PodHost::in_image`]) shares only the network: its volumes are mounted at their paths, so
//! only the binds are rewritten, and its securityContext travels with it ([`Security`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::admission::service_account;
use crate::store::{ResourceKey, Store};

/// Where a container's ConfigMaps, Secrets and claims are read from: the fake's store, or a
/// snapshot a node agent fetched from a real apiserver ([`Snapshot`]).
pub trait Objects {
    /// The core (`/api/v1`) object `plural` `ns/name`, if it exists.
    fn object(&self, plural: &str, ns: &str, name: &str) -> Option<Value>;
}

impl Objects for Store {
    fn object(&self, plural: &str, ns: &str, name: &str) -> Option<Value> {
        self.get(&ResourceKey::new("/api/v1", plural), ns, name)
    }
}

/// Objects fetched ahead of [`resolve`], by `(plural, name)` in the Pod's namespace.
#[derive(Debug, Clone, Default)]
pub struct Snapshot(pub BTreeMap<(String, String), Value>);

impl Objects for Snapshot {
    fn object(&self, plural: &str, _ns: &str, name: &str) -> Option<Value> {
        self.0.get(&(plural.to_owned(), name.to_owned())).cloned()
    }
}

/// Every `(plural, name)` in the Pod's namespace that [`resolve`] may read.
pub fn references(pod: &Value) -> Vec<(&'static str, String)> {
    let container = &pod["spec"]["containers"][0];
    let mut found = Vec::new();
    let mut add = |plural: &'static str, name: Option<&str>| {
        if let Some(name) = name {
            found.push((plural, name.to_owned()));
        }
    };
    for var in container["env"].as_array().into_iter().flatten() {
        add("secrets", var["valueFrom"]["secretKeyRef"]["name"].as_str());
        add(
            "configmaps",
            var["valueFrom"]["configMapKeyRef"]["name"].as_str(),
        );
    }
    for from in container["envFrom"].as_array().into_iter().flatten() {
        add("secrets", from["secretRef"]["name"].as_str());
        add("configmaps", from["configMapRef"]["name"].as_str());
    }
    for volume in pod["spec"]["volumes"].as_array().into_iter().flatten() {
        add("secrets", volume["secret"]["secretName"].as_str());
        add("configmaps", volume["configMap"]["name"].as_str());
        add(
            "persistentvolumeclaims",
            volume["persistentVolumeClaim"]["claimName"].as_str(),
        );
    }
    found.sort();
    found.dedup();
    found
}

/// Where a Pod runs on this machine.
#[derive(Debug, Clone)]
pub struct PodHost<'a> {
    /// The Pod's own directory (volumes, home, kubeconfig).
    pub dir: &'a Path,
    /// Its loopback address, the Pod IP.
    pub ip: &'a str,
    /// How the Pod reaches the apiserver.
    pub api: &'a ApiAccess,
    /// PersistentVolumeClaims backed by a local directory, by `namespace/name` (or `*/name`
    /// for that claim in every namespace).
    pub claims: &'a BTreeMap<String, PathBuf>,
    /// Where unlisted claims are kept.
    pub claim_root: &'a Path,
    /// Whether the container runs in its image through an engine (volumes mounted at their
    /// paths) rather than as a local process (paths rewritten).
    pub in_image: bool,
}

/// The apiserver as a Pod sees it: `KUBERNETES_SERVICE_HOST`/`PORT` and its kubeconfig.
#[derive(Debug, Clone)]
pub struct ApiAccess {
    /// Its address.
    pub addr: std::net::SocketAddr,
    /// `http` for the fake, `https` for a real apiserver.
    pub scheme: &'static str,
    /// The CA certificate that signed a real apiserver's serving certificate.
    pub ca_file: Option<PathBuf>,
}

/// A container ready to start.
#[derive(Debug, Clone, Default)]
pub struct Launch {
    /// Its arguments, after expansion and rewriting.
    pub args: Vec<String>,
    /// Its whole environment.
    pub env: Vec<(String, String)>,
    /// The local file that stands for its termination message path.
    pub termination_log: PathBuf,
    /// In an image: what the engine mounts, local path onto container path.
    pub mounts: Vec<Mount>,
    /// In an image: `command`'s first word, which replaces the image's entrypoint.
    pub entrypoint: Option<String>,
    /// In an image: the Pod's and the container's securityContext, merged.
    pub security: Security,
}

/// A bind mount of a local file or directory into the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The local path.
    pub local: PathBuf,
    /// Where the container sees it.
    pub path: String,
    /// Mounted read-only.
    pub read_only: bool,
}

/// What a container's securityContext (over its Pod's) asks of the engine.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Security {
    /// `runAsUser[:runAsGroup]`, when set.
    pub user: Option<String>,
    /// `runAsNonRoot`: the engine must not start it as root.
    pub run_as_non_root: bool,
    /// `readOnlyRootFilesystem`.
    pub read_only_root: bool,
    /// `capabilities.drop` holds `ALL`.
    pub drop_all_capabilities: bool,
    /// `allowPrivilegeEscalation: false`.
    pub no_new_privileges: bool,
}

impl Security {
    /// The container's securityContext over its Pod's (the fields a Pod may set too).
    pub fn of(pod: &Value, container: &Value) -> Self {
        let (pod, own) = (
            &pod["spec"]["securityContext"],
            &container["securityContext"],
        );
        let either = |key: &str| {
            if own[key].is_null() {
                pod[key].clone()
            } else {
                own[key].clone()
            }
        };
        let user = either("runAsUser").as_u64().map(|uid| {
            either("runAsGroup")
                .as_u64()
                .map_or(uid.to_string(), |gid| format!("{uid}:{gid}"))
        });
        Self {
            user,
            run_as_non_root: either("runAsNonRoot").as_bool() == Some(true),
            read_only_root: own["readOnlyRootFilesystem"].as_bool() == Some(true),
            drop_all_capabilities: own["capabilities"]["drop"]
                .as_array()
                .is_some_and(|drop| drop.iter().any(|c| c == "ALL")),
            no_new_privileges: own["allowPrivilegeEscalation"].as_bool() == Some(false),
        }
    }
}

/// Why a container cannot start yet (the kubelet's `CreateContainerConfigError` and kin).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotReady {
    /// The waiting reason.
    pub reason: &'static str,
    /// The message, in the kubelet's words.
    pub message: String,
}

fn config_error(message: String) -> NotReady {
    NotReady {
        reason: "CreateContainerConfigError",
        message,
    }
}

/// The data of a ConfigMap or Secret (Secret values decoded), or why it is missing.
fn source_data(
    objects: &dyn Objects,
    ns: &str,
    kind: &str,
    name: &str,
) -> Option<BTreeMap<String, Vec<u8>>> {
    let plural = if kind == "secret" {
        "secrets"
    } else {
        "configmaps"
    };
    let object = objects.object(plural, ns, name)?;
    let mut data = BTreeMap::new();
    for (k, v) in object["data"].as_object().into_iter().flatten() {
        let text = v.as_str().unwrap_or_default();
        let bytes = if kind == "secret" {
            decode_base64(text).unwrap_or_default()
        } else {
            text.as_bytes().to_vec()
        };
        data.insert(k.clone(), bytes);
    }
    for (k, v) in object["stringData"].as_object().into_iter().flatten() {
        data.insert(
            k.clone(),
            v.as_str().unwrap_or_default().as_bytes().to_vec(),
        );
    }
    for (k, v) in object["binaryData"].as_object().into_iter().flatten() {
        data.insert(
            k.clone(),
            decode_base64(v.as_str().unwrap_or_default()).unwrap_or_default(),
        );
    }
    Some(data)
}

/// Standard base64, padding optional; `None` for text that is not base64.
pub fn decode_base64(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut buffer, mut bits) = (0u32, 0u32);
    for c in text
        .bytes()
        .filter(|c| !c.is_ascii_whitespace() && *c != b'=')
    {
        let value = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        buffer = (buffer << 6) | u32::from(value);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((buffer >> bits) as u8);
            buffer &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// Replaces each mount path, as a whole path prefix, and `0.0.0.0:` binds.
#[derive(Debug, Clone, Default)]
pub struct Rewrites {
    paths: Vec<(String, String)>,
    ip: String,
}

impl Rewrites {
    fn add(&mut self, from: &str, to: &Path) {
        self.paths.push((
            from.trim_end_matches('/').to_owned(),
            to.display().to_string(),
        ));
        self.paths
            .sort_by_key(|(from, _)| std::cmp::Reverse(from.len()));
    }

    /// `text` with every rewrite applied.
    pub fn apply(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        'scan: while !rest.is_empty() {
            let at_boundary = out
                .chars()
                .last()
                .is_none_or(|c| !(c.is_alphanumeric() || "/._-~".contains(c)));
            if at_boundary {
                for (from, to) in &self.paths {
                    if let Some(after) = rest.strip_prefix(from.as_str())
                        && after
                            .chars()
                            .next()
                            .is_none_or(|c| !(c.is_alphanumeric() || "._-~".contains(c)))
                    {
                        out.push_str(to);
                        rest = after;
                        continue 'scan;
                    }
                }
                if let Some(after) = rest.strip_prefix("0.0.0.0:") {
                    out.push_str(&self.ip);
                    out.push(':');
                    rest = after;
                    continue 'scan;
                }
            }
            let c = rest.chars().next().unwrap_or_default();
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
        out
    }
}

fn pod_field(pod: &Value, path: &str, ip: &str) -> Option<String> {
    let meta = &pod["metadata"];
    let text = |v: &Value| v.as_str().map(str::to_owned);
    match path {
        "metadata.name" => text(&meta["name"]),
        "metadata.namespace" => text(&meta["namespace"]),
        "metadata.uid" => text(&meta["uid"]),
        "spec.serviceAccountName" => Some(service_account(pod).to_owned()),
        "spec.nodeName" | "status.hostIP" => Some("127.0.0.1".into()),
        "status.podIP" => Some(ip.to_owned()),
        _ => {
            let (map, key) = path.strip_suffix("']")?.split_once("['")?;
            match map {
                "metadata.labels" => text(&meta["labels"][key]),
                "metadata.annotations" => text(&meta["annotations"][key]),
                _ => None,
            }
        }
    }
}

/// `$(NAME)` references to defined variables expanded; `$$` escapes; others left as written.
fn expand(text: &str, env: &[(String, String)]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        if let Some(after) = rest.strip_prefix("$$") {
            out.push('$');
            rest = after;
        } else if let Some(close) = rest.strip_prefix("$(").and_then(|r| r.find(')')) {
            let name = &rest[2..2 + close];
            match env.iter().rev().find(|(k, _)| k == name) {
                Some((_, v)) => out.push_str(v),
                None => out.push_str(&rest[..3 + close]),
            }
            rest = &rest[3 + close..];
        } else {
            out.push('$');
            rest = &rest[1..];
        }
    }
    out.push_str(rest);
    out
}

fn key_ref(
    objects: &dyn Objects,
    ns: &str,
    reference: &Value,
    kind: &str,
) -> Result<Option<String>, NotReady> {
    let name = reference["name"].as_str().unwrap_or_default();
    let key = reference["key"].as_str().unwrap_or_default();
    let optional = reference["optional"].as_bool() == Some(true);
    let Some(data) = source_data(objects, ns, kind, name) else {
        return if optional {
            Ok(None)
        } else {
            Err(config_error(format!("{kind} \"{name}\" not found")))
        };
    };
    match data.get(key) {
        Some(value) => Ok(Some(String::from_utf8_lossy(value).into_owned())),
        None if optional => Ok(None),
        None => {
            let title = if kind == "secret" {
                "Secret"
            } else {
                "ConfigMap"
            };
            Err(config_error(format!(
                "couldn't find key {key} in {title} {ns}/{name}"
            )))
        }
    }
}

/// The container's environment as declared (`envFrom`, then `env`), in order.
fn declared_env(
    objects: &dyn Objects,
    pod: &Value,
    container: &Value,
    ip: &str,
) -> Result<Vec<(String, String)>, NotReady> {
    let ns = pod["metadata"]["namespace"].as_str().unwrap_or_default();
    let mut env: Vec<(String, String)> = Vec::new();
    for source in container["envFrom"].as_array().into_iter().flatten() {
        let prefix = source["prefix"].as_str().unwrap_or_default();
        let (kind, reference) = if source["secretRef"].is_object() {
            ("secret", &source["secretRef"])
        } else {
            ("configmap", &source["configMapRef"])
        };
        let name = reference["name"].as_str().unwrap_or_default();
        match source_data(objects, ns, kind, name) {
            Some(data) => env.extend(data.into_iter().map(|(k, v)| {
                (
                    format!("{prefix}{k}"),
                    String::from_utf8_lossy(&v).into_owned(),
                )
            })),
            None if reference["optional"].as_bool() == Some(true) => {}
            None => return Err(config_error(format!("{kind} \"{name}\" not found"))),
        }
    }
    for var in container["env"].as_array().into_iter().flatten() {
        let name = var["name"].as_str().unwrap_or_default().to_owned();
        let from = &var["valueFrom"];
        let value = if let Some(value) = var["value"].as_str() {
            Some(expand(value, &env))
        } else if from["secretKeyRef"].is_object() {
            key_ref(objects, ns, &from["secretKeyRef"], "secret")?
        } else if from["configMapKeyRef"].is_object() {
            key_ref(objects, ns, &from["configMapKeyRef"], "configmap")?
        } else if let Some(path) = from["fieldRef"]["fieldPath"].as_str() {
            Some(pod_field(pod, path, ip).ok_or_else(|| {
                config_error(format!("unsupported fieldPath {path:?} in env {name}"))
            })?)
        } else if from.is_null() {
            Some(String::new())
        } else {
            return Err(config_error(format!(
                "env {name}: this fake kubelet supports value, secretKeyRef, configMapKeyRef and fieldRef"
            )));
        };
        if let Some(value) = value {
            env.push((name, value));
        }
    }
    Ok(env)
}

fn write_files(
    dir: &Path,
    data: &BTreeMap<String, Vec<u8>>,
    items: Option<&Vec<Value>>,
    rewrites: &Rewrites,
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let chosen: Vec<(String, String)> = match items {
        Some(items) => items
            .iter()
            .filter_map(|i| {
                Some((
                    i["key"].as_str()?.to_owned(),
                    i["path"].as_str()?.to_owned(),
                ))
            })
            .collect(),
        None => data.keys().map(|k| (k.clone(), k.clone())).collect(),
    };
    for (key, path) in chosen {
        let Some(bytes) = data.get(&key) else {
            continue;
        };
        let target = dir.join(&path);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        match std::str::from_utf8(bytes) {
            Ok(text) => std::fs::write(target, rewrites.apply(text))?,
            Err(_) => std::fs::write(target, bytes)?,
        }
    }
    Ok(())
}

/// Each volume's local directory, by volume name (made for emptyDir, ConfigMap and Secret
/// volumes, which are filled in [`fill_volumes`]).
fn volume_dirs(
    objects: &dyn Objects,
    pod: &Value,
    host: &PodHost<'_>,
) -> Result<BTreeMap<String, PathBuf>, NotReady> {
    let ns = pod["metadata"]["namespace"].as_str().unwrap_or_default();
    let mut dirs = BTreeMap::new();
    for volume in pod["spec"]["volumes"].as_array().into_iter().flatten() {
        let name = volume["name"].as_str().unwrap_or_default().to_owned();
        let dir = if let Some(claim) = volume["persistentVolumeClaim"]["claimName"].as_str() {
            if objects
                .object("persistentvolumeclaims", ns, claim)
                .is_none()
            {
                return Err(NotReady {
                    reason: "ContainerCreating",
                    message: format!("persistentvolumeclaim \"{claim}\" not found"),
                });
            }
            host.claims
                .get(&format!("{ns}/{claim}"))
                .or_else(|| host.claims.get(&format!("*/{claim}")))
                .cloned()
                .unwrap_or_else(|| host.claim_root.join(ns).join(claim))
        } else if let Some(path) = volume["hostPath"]["path"].as_str() {
            PathBuf::from(path)
        } else {
            host.dir.join("volumes").join(&name)
        };
        dirs.insert(name, dir);
    }
    Ok(dirs)
}

fn fill_volumes(
    objects: &dyn Objects,
    pod: &Value,
    dirs: &BTreeMap<String, PathBuf>,
    rewrites: &Rewrites,
    host: &PodHost<'_>,
) -> Result<(), NotReady> {
    let ns = pod["metadata"]["namespace"].as_str().unwrap_or_default();
    for volume in pod["spec"]["volumes"].as_array().into_iter().flatten() {
        let name = volume["name"].as_str().unwrap_or_default();
        let Some(dir) = dirs.get(name) else { continue };
        let (kind, source, source_name) = if volume["configMap"].is_object() {
            (
                "configmap",
                &volume["configMap"],
                volume["configMap"]["name"].as_str(),
            )
        } else if volume["secret"].is_object() {
            (
                "secret",
                &volume["secret"],
                volume["secret"]["secretName"].as_str(),
            )
        } else {
            let made = std::fs::create_dir_all(dir);
            made.map_err(|e| config_error(format!("volume {name}: {e}")))?;
            // An emptyDir, or a claim this node made, is writable by any user, as a
            // kubelet's emptyDir is: an image runs as its own user, not this node's.
            let ours = dir.starts_with(host.dir) || dir.starts_with(host.claim_root);
            if host.in_image && ours {
                let opened = world_writable(dir);
                opened.map_err(|e| config_error(format!("volume {name}: {e}")))?;
            }
            continue;
        };
        let source_name = source_name.unwrap_or_default();
        match source_data(objects, ns, kind, source_name) {
            Some(data) => write_files(dir, &data, source["items"].as_array(), rewrites)
                .map_err(|e| config_error(format!("volume {name}: {e}")))?,
            None if source["optional"].as_bool() == Some(true) => {
                let made = std::fs::create_dir_all(dir);
                made.map_err(|e| config_error(format!("volume {name}: {e}")))?;
            }
            None => {
                return Err(NotReady {
                    reason: "ContainerCreating",
                    message: format!(
                        "MountVolume.SetUp failed for volume \"{name}\" : {kind} \"{source_name}\" not found"
                    ),
                });
            }
        }
    }
    Ok(())
}

/// The kubelet's refusal of a `runAsNonRoot` container with no `runAsUser`, from its image's
/// configured user (`docker image inspect`'s `Config.User`).
pub fn runs_as_root_refusal(image_user: &str) -> Option<String> {
    let uid = image_user.split(':').next().unwrap_or_default();
    if uid.is_empty() || uid == "0" || uid == "root" {
        Some("container has runAsNonRoot and image will run as root".to_owned())
    } else if uid.parse::<u32>().is_err() {
        Some(format!(
            "container has runAsNonRoot and image has non-numeric user ({image_user}), cannot verify user is non-root"
        ))
    } else {
        None
    }
}

fn world_writable(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mode = if path.is_dir() { 0o1777 } else { 0o666 };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// Resolves the Pod's first container into a local process's arguments and environment.
/// `token` is the ServiceAccount token to put in the Pod's kubeconfig, if one is mounted.
pub fn resolve(
    objects: &dyn Objects,
    pod: &Value,
    host: &PodHost<'_>,
    token: Option<&str>,
) -> Result<Launch, NotReady> {
    let container = &pod["spec"]["containers"][0];
    let dirs = volume_dirs(objects, pod, host)?;
    let mut rewrites = Rewrites {
        ip: host.ip.to_owned(),
        ..Rewrites::default()
    };
    let mut mounts = Vec::new();
    for mount in container["volumeMounts"].as_array().into_iter().flatten() {
        let (Some(name), Some(path)) = (mount["name"].as_str(), mount["mountPath"].as_str()) else {
            continue;
        };
        let Some(dir) = dirs.get(name) else {
            return Err(config_error(format!(
                "volumeMount {name:?} names no volume of the Pod"
            )));
        };
        let sub = mount["subPath"].as_str().unwrap_or_default();
        let local = if sub.is_empty() {
            dir.clone()
        } else {
            dir.join(sub)
        };
        if host.in_image {
            mounts.push(Mount {
                local,
                path: path.to_owned(),
                read_only: mount["readOnly"].as_bool() == Some(true),
            });
        } else {
            rewrites.add(path, &local);
        }
    }
    let message_path = container["terminationMessagePath"]
        .as_str()
        .unwrap_or("/dev/termination-log");
    let termination_log = host.dir.join("termination-log");
    if host.in_image {
        let made = std::fs::create_dir_all(host.dir)
            .and_then(|()| std::fs::write(&termination_log, b""))
            .and_then(|()| world_writable(&termination_log));
        made.map_err(|e| config_error(format!("the termination log: {e}")))?;
        mounts.push(Mount {
            local: termination_log.clone(),
            path: message_path.to_owned(),
            read_only: false,
        });
    } else {
        rewrites.add(message_path, &termination_log);
    }
    fill_volumes(objects, pod, &dirs, &rewrites, host)?;

    let declared = declared_env(objects, pod, container, host.ip)?;
    let home = host.dir.join("home");
    let made = std::fs::create_dir_all(&home);
    made.map_err(|e| config_error(format!("the Pod's home: {e}")))?;
    let mut env = Vec::new();
    if host.in_image {
        // The Pod's own files (home, kubeconfig) where the process would find them, and the
        // apiserver's CA at the path the kubeconfig names; the image keeps its own PATH.
        world_writable(&home).map_err(|e| config_error(format!("the Pod's home: {e}")))?;
        mounts.push(Mount {
            local: host.dir.to_owned(),
            path: host.dir.display().to_string(),
            read_only: true,
        });
        mounts.push(Mount {
            local: home.clone(),
            path: home.display().to_string(),
            read_only: false,
        });
        if let Some(ca) = &host.api.ca_file {
            mounts.push(Mount {
                local: ca.clone(),
                path: ca.display().to_string(),
                read_only: true,
            });
        }
    } else {
        env.push((
            "PATH".to_owned(),
            std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into()),
        ));
    }
    env.extend([
        ("HOME".to_owned(), home.display().to_string()),
        (
            "HOSTNAME".to_owned(),
            pod["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        ),
        (
            "KUBERNETES_SERVICE_HOST".to_owned(),
            host.api.addr.ip().to_string(),
        ),
        (
            "KUBERNETES_SERVICE_PORT".to_owned(),
            host.api.addr.port().to_string(),
        ),
    ]);
    if let Some(token) = token {
        let kubeconfig = host.dir.join("kubeconfig");
        let ns = pod["metadata"]["namespace"].as_str().unwrap_or_default();
        let authority = host.api.ca_file.as_ref().map_or_else(String::new, |ca| {
            format!("\n    certificate-authority: {}", ca.display())
        });
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: in-cluster\n  cluster:\n    server: {}://{}{authority}\ncontexts:\n- name: in-cluster\n  context:\n    cluster: in-cluster\n    user: sa\n    namespace: {ns}\ncurrent-context: in-cluster\nusers:\n- name: sa\n  user:\n    token: {token}\n",
            host.api.scheme, host.api.addr
        );
        let written = std::fs::write(&kubeconfig, text);
        written.map_err(|e| config_error(format!("the Pod's kubeconfig: {e}")))?;
        env.push(("KUBECONFIG".to_owned(), kubeconfig.display().to_string()));
    }
    env.extend(declared.into_iter().map(|(k, v)| {
        let v = rewrites.apply(&v);
        (k, v)
    }));
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(|a| rewrites.apply(&expand(a, &env)))
            .collect()
    };
    // A process's entrypoint is the mapped executable, an image's its own unless `command`
    // names one; `command` past its first word and `args` follow it.
    let command = strings(&container["command"]);
    let entrypoint = command.first().filter(|_| host.in_image).cloned();
    let mut args: Vec<String> = command.into_iter().skip(1).collect();
    args.extend(strings(&container["args"]));
    Ok(Launch {
        args,
        env,
        termination_log,
        mounts,
        entrypoint,
        security: Security::of(pod, container),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths_are_rewritten_as_whole_path_prefixes_only() {
        let mut rewrites = Rewrites {
            ip: "127.9.9.9".into(),
            ..Rewrites::default()
        };
        rewrites.add("/etc/harvest", Path::new("/tmp/p/config"));
        rewrites.add("/models", Path::new("/cache/models"));
        assert_eq!(
            rewrites.apply(r#"{"path": "/models/smollm2", "x": "/modelsX", "c": "/etc/harvest"}"#),
            r#"{"path": "/cache/models/smollm2", "x": "/modelsX", "c": "/tmp/p/config"}"#
        );
        assert_eq!(
            rewrites.apply("--listen=0.0.0.0:8080"),
            "--listen=127.9.9.9:8080"
        );
        assert_eq!(rewrites.apply("/a/models/b"), "/a/models/b");
    }

    #[test]
    fn in_an_image_volumes_are_mounts_at_their_paths_and_only_binds_are_rewritten() {
        let dir = tempfile::tempdir().unwrap();
        let api = ApiAccess {
            addr: "127.0.0.1:6443".parse().unwrap(),
            scheme: "https",
            ca_file: None,
        };
        let claims = BTreeMap::new();
        let host = PodHost {
            dir: &dir.path().join("pod"),
            ip: "127.0.0.7",
            api: &api,
            claims: &claims,
            claim_root: &dir.path().join("claims"),
            in_image: true,
        };
        let pod = serde_json::json!({
            "metadata": {"name": "w", "namespace": "ns"},
            "spec": {
                "securityContext": {"runAsNonRoot": true, "runAsUser": 1000},
                "volumes": [{"name": "scratch", "emptyDir": {}}],
                "containers": [{
                    "name": "c",
                    "command": ["/bin/tool", "serve"],
                    "args": ["--data", "/scratch/x", "--listen", "0.0.0.0:80"],
                    "volumeMounts": [{"name": "scratch", "mountPath": "/scratch", "readOnly": true}],
                    "securityContext": {"runAsUser": 65532, "readOnlyRootFilesystem": true,
                        "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}},
                }],
            },
        });
        let launch = resolve(&Snapshot::default(), &pod, &host, None).unwrap();
        assert_eq!(
            launch.args,
            ["serve", "--data", "/scratch/x", "--listen", "127.0.0.7:80"]
        );
        assert_eq!(launch.entrypoint.as_deref(), Some("/bin/tool"));
        let scratch = launch.mounts.iter().find(|m| m.path == "/scratch").unwrap();
        assert!(scratch.read_only && scratch.local.ends_with("volumes/scratch"));
        assert!(
            launch
                .mounts
                .iter()
                .any(|m| m.path == "/dev/termination-log" && m.local == launch.termination_log)
        );
        assert!(
            launch.env.iter().all(|(k, _)| k != "PATH"),
            "{:?}",
            launch.env
        );
        assert_eq!(
            launch.security,
            Security {
                user: Some("65532".into()),
                run_as_non_root: true,
                read_only_root: true,
                drop_all_capabilities: true,
                no_new_privileges: true,
            }
        );
    }

    #[test]
    fn run_as_non_root_refuses_an_image_of_root_or_of_a_user_name() {
        assert!(runs_as_root_refusal("").is_some());
        assert!(runs_as_root_refusal("0:0").is_some());
        assert!(runs_as_root_refusal("root").is_some());
        assert!(
            runs_as_root_refusal("nonroot")
                .unwrap()
                .contains("non-numeric user (nonroot)")
        );
        assert_eq!(runs_as_root_refusal("65532:65532"), None);
    }

    #[test]
    fn variables_expand_only_when_defined_and_dollar_dollar_escapes() {
        let env = vec![("POD_IP".to_owned(), "127.0.0.5".to_owned())];
        assert_eq!(
            expand("$(POD_IP):80 $(NOPE) $$(POD_IP)", &env),
            "127.0.0.5:80 $(NOPE) $(POD_IP)"
        );
    }

    #[test]
    fn base64_decodes_with_or_without_padding_and_refuses_other_text() {
        assert_eq!(decode_base64("aGFydmVzdA==").unwrap(), b"harvest");
        assert_eq!(decode_base64("aGFydmVzdA").unwrap(), b"harvest");
        assert!(decode_base64("not base64!").is_none());
    }
}
