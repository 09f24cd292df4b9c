//! Kueue on the real tier, installed as a platform team installs it: Kueue's own default
//! install from the module `e2e/kueue/go.mod` pins (`scripts/kueue.sh`), less its Deployment,
//! whose controller runs here as a process of the test. Its webhooks, with the certificates
//! its own rotator makes and injects, are reached as on a cluster: through the
//! `kueue-webhook-service` Service, whose EndpointSlice names this machine's address (the
//! apiserver routes webhooks to endpoints: there is no kube-proxy, and an endpoint may not be
//! a loopback address).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::{LocalCluster, WITHIN, eventually, repo};

/// A running Kueue controller; stopped on drop.
#[derive(Debug)]
pub struct Kueue {
    child: Child,
    /// Its log (JSON lines).
    pub log: PathBuf,
}

impl Drop for Kueue {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port nothing listens on now, on every address.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// `scripts/kueue.sh`: the directory with the controller and its install.
fn built() -> PathBuf {
    let out = Command::new(repo().join("scripts/kueue.sh"))
        .stderr(Stdio::inherit())
        .output()
        .unwrap();
    assert!(out.status.success(), "scripts/kueue.sh failed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// An IPv4 address of this machine other than loopback, which an EndpointSlice may name.
fn host_address() -> String {
    let out = Command::new("hostname").arg("-I").output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .find(|a| {
            a.parse::<std::net::Ipv4Addr>()
                .is_ok_and(|ip| !ip.is_loopback() && !ip.is_link_local())
        })
        .expect("this machine has no IPv4 address besides loopback: the apiserver cannot reach Kueue's webhooks")
        .to_owned()
}

/// Kueue's configuration: the pod integration only, its webhook on `webhook_port` with the
/// certificates its rotator writes to `certs`, no leader election, no metrics server.
fn configuration(webhook_port: u16, health_port: u16, certs: &Path) -> String {
    format!(
        "apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: kueue-system
health: {{healthProbeBindAddress: \"127.0.0.1:{health_port}\"}}
metrics: {{bindAddress: \"0\"}}
webhook: {{port: {webhook_port}, certDir: \"{}\"}}
leaderElection: {{leaderElect: false}}
integrations: {{frameworks: [pod]}}
",
        certs.display()
    )
}

/// The EndpointSlice that sends the webhook Service's port to `address:port`.
fn endpoints(address: &str, port: u16) -> String {
    format!(
        "apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: kueue-webhook-service-host
  namespace: kueue-system
  labels: {{kubernetes.io/service-name: kueue-webhook-service}}
addressType: IPv4
ports: [{{port: {port}, protocol: TCP}}]
endpoints: [{{addresses: [\"{address}\"], conditions: {{ready: true}}}}]
"
    )
}

impl LocalCluster {
    /// Installs Kueue and starts its controller: returns once its webhooks answer (a Pod
    /// create in a managed namespace goes through them).
    pub async fn start_kueue(&self) -> Kueue {
        let kueue = built();
        let install = kueue.join("install");
        self.kubectl(&["apply", "--server-side", "-k", install.to_str().unwrap()])
            .unwrap_or_else(|e| panic!("kubectl apply -k {}: {e}", install.display()));
        let (webhook_port, health_port) = (free_port(), free_port());
        self.kubectl_with_input(
            &["apply", "-f", "-"],
            Some(&endpoints(&host_address(), webhook_port)),
        )
        .unwrap();
        let dir = self.state_dir().join("kueue");
        let certs = dir.join("certs");
        std::fs::create_dir_all(&certs).unwrap();
        let config = dir.join("config.yaml");
        std::fs::write(&config, configuration(webhook_port, health_port, &certs)).unwrap();
        let log = dir.join("kueue.log");
        let child = Command::new(kueue.join("kueue"))
            .arg("--config")
            .arg(&config)
            .arg("--feature-gates=VisibilityOnDemand=false")
            .env("KUBECONFIG", &self.kubeconfig)
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(Stdio::from(
                std::fs::OpenOptions::new().append(true).open(&log).unwrap(),
            ))
            .spawn()
            .unwrap();
        let running = Kueue { child, log };
        // Kueue's rotator writes its certificates to a Secret and waits for them in its
        // certificate directory, where the kubelet would mount that Secret: the test does the
        // kubelet's part, each time the Secret changes.
        let mounted = || self.mount_secret(&certs);
        eventually("Kueue's certificate Secret mounted", WITHIN, mounted).await;
        let ready = format!("http://127.0.0.1:{health_port}/readyz");
        let client = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + WITHIN;
        loop {
            let answer = client.get(&ready).send().await;
            if answer.is_ok_and(|a| a.status().is_success()) {
                break;
            }
            self.mount_secret(&certs).ok();
            assert!(
                tokio::time::Instant::now() < deadline,
                "Kueue not ready within {WITHIN:?}; its log: {}",
                std::fs::read_to_string(&running.log).unwrap_or_default()
            );
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
        // The apiserver reaches the webhook once the rotator's CA is in its configuration:
        // a server-side dry run of a queued Pod is mutated (gated) when it is.
        eventually(
            "Kueue's Pod webhook answering the apiserver",
            WITHIN,
            || {
                self.mount_secret(&certs)?;
                let gated = self.kubectl_with_input(
                    &[
                        "create",
                        "--dry-run=server",
                        "-o",
                        "jsonpath={.spec.schedulingGates[*].name}",
                        "-f",
                        "-",
                    ],
                    Some(PROBE_POD),
                )?;
                gated
                    .contains("kueue.x-k8s.io/admission")
                    .then_some(())
                    .ok_or(gated)
            },
        )
        .await;
        running
    }
}

impl LocalCluster {
    /// Writes the keys of Kueue's certificate Secret into `certs`, as a Secret volume: an
    /// error until the rotator has filled it.
    fn mount_secret(&self, certs: &Path) -> Result<(), String> {
        for key in ["tls.crt", "tls.key"] {
            let template = format!("go-template={{{{index .data \"{key}\" | base64decode}}}}");
            let value = self.kubectl(&[
                "get",
                "secret",
                "kueue-webhook-server-cert",
                "-n",
                "kueue-system",
                "-o",
                &template,
            ])?;
            if value.is_empty() || value.contains("<no value>") {
                return Err(format!("the Secret has no {key} yet"));
            }
            let path = certs.join(key);
            if std::fs::read_to_string(&path).ok().as_deref() != Some(value.as_str()) {
                std::fs::write(&path, value).map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }
}

/// A queued Pod, only ever created as a server-side dry run.
const PROBE_POD: &str = "apiVersion: v1
kind: Pod
metadata:
  name: kueue-probe
  namespace: default
  labels: {kueue.x-k8s.io/queue-name: probe}
spec:
  containers: [{name: probe, image: probe}]
";
