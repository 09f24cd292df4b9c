//! `harvest-e2e`, for tests only: the local test cluster exactly as a newcomer starts it
//! (`scripts/cluster.sh up`, which applies `manifests/` with `kubectl apply -k`), and the
//! two ways in that users have: `kubectl` and the REST API through the harvest-api Service.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3, AmazonS3Builder};

mod kueue;
pub use kueue::Kueue;

/// How long a test waits for a condition the cluster reaches on its own (generous: the CI
/// machine has two cores and runs these tests side by side).
pub const WITHIN: Duration = Duration::from_secs(240);

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// Where cargo built the binaries (beside the test binary's `deps/`).
fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_owned()
}

/// A cluster `scripts/cluster.sh up` started in a directory of its own; `down` on drop.
#[derive(Debug)]
pub struct LocalCluster {
    dir: tempfile::TempDir,
    /// Its kubeconfig (the administrator's).
    pub kubeconfig: PathBuf,
    /// `http://127.0.0.1:PORT/v1`, the harvest-api Service.
    pub api: String,
    /// The kubectl that matches it: the real tier's own build, else the machine's.
    pub kubectl: PathBuf,
    /// Which Kubernetes it runs on.
    pub tier: Tier,
    /// What `scripts/cluster.sh up` wrote to stderr (kubectl's warnings among it).
    pub setup_log: String,
    /// A real tier's place among those running at once (released after `down`).
    _slot: Option<RealSlot>,
}

/// Real-tier clusters one test binary runs at once: each is a control plane and five node
/// agents with their Pods, and more than two on a two-core machine starve each other's start.
const REAL_AT_ONCE: usize = 2;

static REAL_RUNNING: (std::sync::Mutex<usize>, std::sync::Condvar) =
    (std::sync::Mutex::new(0), std::sync::Condvar::new());

/// A held place among [`REAL_AT_ONCE`]; given back on drop.
#[derive(Debug)]
struct RealSlot;

impl RealSlot {
    fn take() -> Self {
        let (count, freed) = &REAL_RUNNING;
        let mut running = count
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        while *running >= REAL_AT_ONCE {
            running = freed
                .wait(running)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        *running += 1;
        Self
    }
}

impl Drop for RealSlot {
    fn drop(&mut self) {
        let (count, freed) = &REAL_RUNNING;
        *count
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) -= 1;
        freed.notify_one();
    }
}

/// Which Kubernetes a [`LocalCluster`] runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// The fake apiserver (`fake-apiserver/`): fast, with exact fault injection.
    Fake,
    /// kube-apiserver, controller-manager, scheduler and etcd built from the Kubernetes
    /// modules, with node agents (`scripts/cluster.sh up --real`).
    Real,
}

impl Tier {
    /// `HARVEST_E2E_TIER` (`fake` or `real`), fake when unset: the tier the shared suite runs on.
    pub fn from_env() -> Self {
        match std::env::var("HARVEST_E2E_TIER").as_deref() {
            Ok("real") => Self::Real,
            Ok("fake") | Err(_) => Self::Fake,
            Ok(other) => panic!("HARVEST_E2E_TIER={other:?}: use fake or real"),
        }
    }
}

/// How `scripts/cluster.sh up` installs harvest (`HARVEST_INSTALL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Install {
    /// `kubectl apply -k manifests/crds/`, then `-k manifests/`.
    Kustomize,
    /// `helm install harvest charts/harvest` (the real tier only).
    Helm,
    /// Nothing: an empty real cluster with its storage ready, for docs/install.md's test.
    Nothing,
}

impl Install {
    fn name(self) -> &'static str {
        match self {
            Self::Kustomize => "kustomize",
            Self::Helm => "helm",
            Self::Nothing => "none",
        }
    }
}

fn script(dir: &Path, args: &[&str]) -> std::process::Output {
    script_installing(dir, args, Install::Kustomize)
}

fn script_installing(dir: &Path, args: &[&str], install: Install) -> std::process::Output {
    Command::new(repo().join("scripts/cluster.sh"))
        .args(args)
        .env("HARVEST_CLUSTER_DIR", dir)
        .env("HARVEST_BIN_DIR", bin_dir())
        .env("HARVEST_INSTALL", install.name())
        .output()
        .unwrap()
}

impl LocalCluster {
    /// `scripts/cluster.sh up` on the tier `HARVEST_E2E_TIER` names, its exports read back.
    pub fn up() -> Self {
        Self::up_on(Tier::from_env())
    }

    /// `scripts/cluster.sh up` (`--real` for the real tier), its exports read back.
    pub fn up_on(tier: Tier) -> Self {
        Self::up_installing(tier, Install::Kustomize)
    }

    /// `scripts/cluster.sh up` with harvest installed as `install` says.
    pub fn up_installing(tier: Tier, install: Install) -> Self {
        Self::up_with(tier, install, false)
    }

    /// `scripts/cluster.sh up --real --images`: the real tier, every Pod run in its image (the
    /// ones `HARVEST_IMAGE_TAG` names) through the Docker engine `DOCKER_HOST` names.
    pub fn up_in_images() -> Self {
        Self::up_with(Tier::Real, Install::Kustomize, true)
    }

    fn up_with(tier: Tier, install: Install, in_images: bool) -> Self {
        let slot = (tier == Tier::Real).then(RealSlot::take);
        let dir = tempfile::tempdir().unwrap();
        let mut args = vec!["up"];
        if tier == Tier::Real {
            args.push("--real");
        }
        if in_images {
            args.push("--images");
        }
        let out = script_installing(dir.path(), &args, install);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            // What it started before it failed (the S3 server, the cluster) must not outlive
            // the test: no `LocalCluster` exists to stop it on drop.
            script(dir.path(), &["down"]);
        }
        assert!(
            out.status.success(),
            "scripts/cluster.sh up failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let export = |name: &str| {
            stdout
                .lines()
                .find_map(|l| l.strip_prefix(&format!("export {name}=")))
                .unwrap_or_else(|| panic!("no export of {name} in {stdout}"))
                .to_owned()
        };
        let kubectl = std::fs::read_to_string(dir.path().join("state/kubectl"))
            .map_or_else(|_| PathBuf::from("kubectl"), |p| PathBuf::from(p.trim()));
        Self {
            kubeconfig: export("KUBECONFIG").into(),
            // Nothing installed, no API yet.
            api: if install == Install::Nothing {
                String::new()
            } else {
                export("HARVEST_API")
            },
            kubectl,
            tier,
            setup_log: String::from_utf8_lossy(&out.stderr).into_owned(),
            _slot: slot,
            dir,
        }
    }

    /// Runs kubectl with this cluster's kubeconfig: its stdout, or its stderr as the error.
    pub fn kubectl(&self, args: &[&str]) -> Result<String, String> {
        self.kubectl_with_input(args, None)
    }

    /// Runs Helm (a cluster `up` installed with [`Install::Helm`]) in the repository root,
    /// with this cluster's kubeconfig and Helm's state in its directory: its stdout, or its
    /// stderr as the error.
    pub fn helm(&self, args: &[&str]) -> Result<String, String> {
        let state = self.dir.path().join("state");
        let helm = std::fs::read_to_string(state.join("helm")).unwrap();
        let home = state.join("helm-home");
        let out = Command::new(helm.trim())
            .args(args)
            .current_dir(repo())
            .env("KUBECONFIG", &self.kubeconfig)
            .env("HELM_CACHE_HOME", home.join("cache"))
            .env("HELM_CONFIG_HOME", home.join("config"))
            .env("HELM_DATA_HOME", home.join("data"))
            .output()
            .unwrap();
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// Runs `script` with `bash -euo pipefail` in the repository root as an administrator's
    /// shell on this cluster: its kubeconfig, its kubectl first on `PATH`, and
    /// `scripts/cluster.sh` pointed at it (for the local stand-ins docs/install.md names).
    pub fn shell(&self, script: &str) -> std::process::Output {
        let kubectl_dir = self
            .kubectl
            .parent()
            .map(Path::to_owned)
            .unwrap_or_default();
        let path = std::env::var_os("PATH").unwrap_or_default();
        let path =
            std::env::join_paths(std::iter::once(kubectl_dir).chain(std::env::split_paths(&path)))
                .unwrap();
        Command::new("bash")
            .args(["-euo", "pipefail", "-c", script])
            .current_dir(repo())
            .env("KUBECONFIG", &self.kubeconfig)
            .env("PATH", path)
            .env("HARVEST_CLUSTER_DIR", self.dir.path())
            .env("HARVEST_BIN_DIR", bin_dir())
            .output()
            .unwrap()
    }

    /// Runs kubectl with `input` on its stdin.
    pub fn kubectl_with_input(&self, args: &[&str], input: Option<&str>) -> Result<String, String> {
        run_kubectl(&self.kubectl, &self.kubeconfig, args, input)
    }

    /// Sends `signal` (`STOP`, `CONT`) to a real-tier node: its agent and every Pod process
    /// it runs, as a node that hangs or drops off the network (and comes back).
    pub fn signal_node(&self, node: &str, signal: &str) {
        let pid = std::fs::read_to_string(self.dir.path().join(format!("agent-{node}.pid")))
            .unwrap_or_else(|e| panic!("node {node} has no agent here: {e}"));
        let status = Command::new("kill")
            .args([
                format!("-{signal}"),
                "--".into(),
                format!("-{}", pid.trim()),
            ])
            .status()
            .unwrap();
        assert!(
            status.success(),
            "kill -{signal} of node {node}'s process group"
        );
    }

    /// Compacts the real tier's etcd to its current revision: every list or watch from an
    /// older resourceVersion is answered 410 Gone. Returns the revision.
    pub fn compact_etcd(&self) -> u64 {
        let bin = std::fs::read_to_string(self.state_dir().join("controlplane")).unwrap();
        let out = Command::new(Path::new(bin.trim()).join("harvest-controlplane"))
            .args(["compact", "--dir"])
            .arg(self.state_dir())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }

    /// Restarts the real tier's kube-apiserver (as an upgrade does) and waits until the new
    /// one is ready: every watch is cut, and the new watch cache starts at etcd's revision.
    pub async fn restart_apiserver(&self) {
        let marker = self.state_dir().join("apiserver.generation");
        let generation = || std::fs::read_to_string(&marker).unwrap_or_default();
        let before: u32 = generation().trim().parse().unwrap();
        let pid = std::fs::read_to_string(self.dir.path().join("cluster.pid")).unwrap();
        let status = Command::new("kill")
            .args(["-USR1", pid.trim()])
            .status()
            .unwrap();
        assert!(status.success());
        eventually("kube-apiserver ready again", WITHIN, || {
            let now = generation();
            (now.trim().parse::<u32>().ok() == Some(before + 1))
                .then_some(())
                .ok_or(now)
        })
        .await;
    }

    /// The cluster's state directory (control plane, node agents, Pod logs).
    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }
}

/// Runs `kubectl` with `kubeconfig`, `input` on its stdin: its stdout, or its stderr as the error.
fn run_kubectl(
    kubectl: &Path,
    kubeconfig: &Path,
    args: &[&str],
    input: Option<&str>,
) -> Result<String, String> {
    {
        use std::io::Write as _;
        let mut child = Command::new(kubectl)
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .current_dir(repo())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        if let Some(input) = input {
            stdin.write_all(input.as_bytes()).unwrap();
        }
        drop(stdin);
        let out = child.wait_with_output().unwrap();
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }
}

impl LocalCluster {
    /// `kubectl get … -o jsonpath=…`, or "" when the object or the field is missing.
    pub fn field(&self, args: &[&str], jsonpath: &str) -> String {
        let mut all = vec!["get"];
        all.extend_from_slice(args);
        let output = format!("jsonpath={jsonpath}");
        all.extend(["-o", &output]);
        self.kubectl(&all).unwrap_or_default()
    }

    /// `scripts/cluster.sh create-key ACCOUNT`.
    pub fn create_key(&self, account: &str) -> String {
        let out = script(self.dir.path(), &["create-key", account]);
        assert!(
            out.status.success(),
            "create-key failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// docs/install.md's key step, `kubectl exec deploy/harvest-api -- harvest-api --config
    /// /etc/harvest/api.json create-key --account ACCOUNT`: the command runs as an API Pod
    /// would run it, with that Pod's ServiceAccount and the API's ConfigMap. The key, or
    /// what the command said when it failed.
    pub fn create_key_in_api_pod(&self, account: &str) -> Result<String, String> {
        let pod = self.field(
            &[
                "pods",
                "-n",
                "harvest-system",
                "-l",
                "app.kubernetes.io/name=harvest-api",
            ],
            "{.items[0].metadata.name}",
        );
        let config = self.field(
            &["configmap", "harvest-api", "-n", "harvest-system"],
            "{.data.api\\.json}",
        );
        let path = self.dir.path().join("api-pod.json");
        std::fs::write(&path, config).unwrap();
        let out = Command::new(bin_dir().join("harvest-api"))
            .arg("--config")
            .arg(&path)
            .args(["create-key", "--account", account])
            .env("KUBECONFIG", self.pod_kubeconfig("harvest-system", &pod))
            .output()
            .unwrap();
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// The local S3 server's `bucket`, with the credentials `up` gave the cluster.
    pub fn bucket(&self, bucket: &str) -> Arc<AmazonS3> {
        let endpoint = std::fs::read_to_string(self.dir.path().join("s3.endpoint")).unwrap();
        Arc::new(
            AmazonS3Builder::new()
                .with_bucket_name(bucket)
                .with_region("us-east-1")
                .with_endpoint(endpoint.trim())
                .with_access_key_id("harvest-local")
                .with_secret_access_key("harvest-local-secret")
                .with_allow_http(true)
                .build()
                .unwrap(),
        )
    }

    /// Where a Pod's directory and logs are: the fake's state directory, or the directory
    /// of the node agent that runs it.
    fn pod_root(&self, namespace: &str, pod: &str) -> PathBuf {
        let state = self.state_dir();
        match self.tier {
            Tier::Fake => state,
            Tier::Real => {
                let node = self.field(&["pod", pod, "-n", namespace], "{.spec.nodeName}");
                state.join("agents").join(node)
            }
        }
    }

    /// The kubeconfig the kubelet gave a Pod: its ServiceAccount's token.
    pub fn pod_kubeconfig(&self, namespace: &str, pod: &str) -> PathBuf {
        self.pod_root(namespace, pod)
            .join("pods")
            .join(format!("{namespace}_{pod}"))
            .join("kubeconfig")
    }

    /// `GET path` (or, with a body, `POST`) with a Pod's ServiceAccount token: the answer's
    /// body, or the refusal.
    pub async fn as_pod(
        &self,
        namespace: &str,
        pod: &str,
        path: &str,
        post: Option<&serde_json::Value>,
    ) -> Result<String, String> {
        let kubeconfig = self.pod_kubeconfig(namespace, pod);
        match self.tier {
            // The real apiserver's TLS is kubectl's to speak.
            Tier::Real => match post {
                None => run_kubectl(&self.kubectl, &kubeconfig, &["get", "--raw", path], None),
                Some(body) => run_kubectl(
                    &self.kubectl,
                    &kubeconfig,
                    &["create", "--raw", path, "-f", "-"],
                    Some(&body.to_string()),
                ),
            },
            // kubectl sends no token over plain HTTP, so the request is made as the Pod's
            // kube client makes it.
            Tier::Fake => {
                let text = std::fs::read_to_string(kubeconfig).map_err(|e| e.to_string())?;
                let field = |name: &str| {
                    text.lines()
                        .find_map(|l| l.trim().strip_prefix(name))
                        .unwrap_or_default()
                        .trim()
                        .to_owned()
                };
                let url = format!("{}{path}", field("server:"));
                let http = reqwest::Client::new();
                let request = match post {
                    None => http.get(url),
                    Some(body) => http.post(url).json(body),
                };
                let answer = request.bearer_auth(field("token:")).send().await.unwrap();
                let ok = answer.status().is_success();
                let body = answer.text().await.unwrap();
                if ok { Ok(body) } else { Err(body) }
            }
        }
    }

    /// The example's tenant namespace and its HarvestAccount. The namespace gets nothing else
    /// from harvest: workers run in harvest-system, so no ServiceAccount, models claim or
    /// storage Secret is needed here, and the tenant never holds the storage credentials.
    pub fn tenant(&self, namespace: &str) {
        // `kubectl create namespace` sends protobuf, which the stand-in does not decode.
        let objects = format!("apiVersion: v1\nkind: Namespace\nmetadata: {{name: {namespace}}}\n");
        self.kubectl_with_input(&["apply", "--validate=false", "-f", "-"], Some(&objects))
            .unwrap();
        self.kubectl(&[
            "apply",
            "--validate=false",
            "-f",
            "manifests/examples/harvestaccount.yaml",
        ])
        .unwrap();
    }

    /// `count` prompts of about `words` words, where the example job reads its corpus.
    pub async fn upload_example_prompts(&self, count: usize, words: usize) {
        use object_store::ObjectStoreExt as _;
        self.bucket("harvest-inputs")
            .put(
                &object_store::path::Path::from("probing/prompts.jsonl"),
                prompts(count, words).into_bytes().into(),
            )
            .await
            .unwrap();
    }

    /// Edits the operator's `config.yaml` and rolls the operator out with it.
    pub fn set_operator_config(&self, edit: impl FnOnce(String) -> String) {
        let config = self.field(
            &["configmap", "harvest-operator", "-n", "harvest-system"],
            "{.data.config\\.yaml}",
        );
        let patch = serde_json::json!({"data": {"config.yaml": edit(config)}}).to_string();
        let ns = ["-n", "harvest-system"];
        let run = |args: &[&str]| self.kubectl(&[args, &ns[..]].concat()).unwrap();
        run(&[
            "patch",
            "configmap",
            "harvest-operator",
            "--type=merge",
            "-p",
            &patch,
        ]);
        run(&["rollout", "restart", "deployment/harvest-operator"]);
        run(&[
            "rollout",
            "status",
            "deployment/harvest-operator",
            "--timeout=240s",
        ]);
    }

    /// A Pod's log, from the cluster's directory.
    pub fn pod_log(&self, namespace: &str, pod: &str) -> String {
        let root = self.pod_root(namespace, pod);
        let read = |stream: &str| {
            std::fs::read_to_string(root.join(format!("{namespace}_{pod}.{stream}")))
                .unwrap_or_default()
        };
        read("stdout") + &read("stderr")
    }

    /// The logs of every Pod in `namespace` whose name starts with `prefix` that ran on this
    /// cluster, deleted ones included (a Deployment's Pods replaced meanwhile, say).
    pub fn pod_logs_ever(&self, namespace: &str, prefix: &str) -> String {
        let state = self.state_dir();
        let roots: Vec<PathBuf> = match self.tier {
            Tier::Fake => vec![state],
            Tier::Real => std::fs::read_dir(state.join("agents"))
                .map(|nodes| nodes.flatten().map(|node| node.path()).collect())
                .unwrap_or_default(),
        };
        let mut files: Vec<PathBuf> = roots
            .iter()
            .filter_map(|root| std::fs::read_dir(root).ok())
            .flat_map(|entries| entries.flatten().map(|entry| entry.path()))
            .filter(|path| {
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                name.starts_with(&format!("{namespace}_{prefix}"))
                    && (name.ends_with(".stdout") || name.ends_with(".stderr"))
            })
            .collect();
        files.sort();
        files
            .iter()
            .map(|file| std::fs::read_to_string(file).unwrap_or_default())
            .collect()
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        let _ = script(self.dir.path(), &["down"]);
    }
}

/// Waits until `probe` answers `Some`, for at most `within`; fails naming `what` and the last
/// answer.
pub async fn eventually<T>(
    what: &str,
    within: Duration,
    mut probe: impl FnMut() -> Result<T, String>,
) -> T {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match probe() {
            Ok(found) => return found,
            Err(last) if tokio::time::Instant::now() >= deadline => {
                panic!("timed out after {within:?} waiting for {what}; last: {last}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// JSONL prompts: `count` lines of about `words` words each.
pub fn prompts(count: usize, words: usize) -> String {
    (0..count)
        .map(|i| {
            let text = format!(
                "Prompt {i}: {}",
                "the quick brown fox jumps over the lazy dog ".repeat(words.div_ceil(9))
            );
            format!("{}\n", serde_json::json!({ "text": text }))
        })
        .collect()
}
