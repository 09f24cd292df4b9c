//! The fake kubelet: runs each new Pod's first container as a local process (the image is
//! mapped to a local executable), and reports its phase, container state and termination
//! message. Tests can inject an OOM kill or an eviction.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::store::{ResourceKey, Store, rfc3339};

/// How the kubelet runs containers.
#[derive(Debug, Clone, Default)]
pub struct KubeletConfig {
    /// Image name → local executable. A Pod whose image is not here waits in `ErrImagePull`.
    pub images: HashMap<String, PathBuf>,
    /// Extra environment for every container (a real cluster would mount or inject these).
    pub env: Vec<(String, String)>,
    /// Where container logs and termination messages go.
    pub work_dir: PathBuf,
}

/// A failure a test injects into a running Pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Injected {
    /// SIGKILL reported as `OOMKilled`, exit 137.
    OomKill,
    /// SIGKILL reported as a node-pressure eviction.
    Evict,
    /// The Pod was deleted: SIGTERM, then SIGKILL after a grace period; nothing is reported.
    Delete,
}

/// The kubelet.
#[derive(Debug)]
pub struct Kubelet {
    running: Mutex<HashMap<String, mpsc::Sender<Injected>>>,
    started: Mutex<HashMap<String, u32>>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

fn pods() -> ResourceKey {
    ResourceKey::new("/api/v1", "pods")
}

fn stamp() -> String {
    rfc3339(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    )
}

impl Kubelet {
    /// Starts watching the store for Pods.
    pub fn start(store: Arc<Store>, config: KubeletConfig) -> Arc<Self> {
        let kubelet = Arc::new(Self {
            running: Mutex::default(),
            started: Mutex::default(),
            task: Mutex::default(),
        });
        let this = kubelet.clone();
        let task = tokio::spawn(async move {
            let mut wake = store.subscribe();
            let mut last = 0;
            loop {
                for change in store.changes_since(&pods(), last) {
                    last = change.rv;
                    let pod = &change.object;
                    let key = format!(
                        "{}/{}",
                        pod["metadata"]["namespace"].as_str().unwrap_or_default(),
                        pod["metadata"]["name"].as_str().unwrap_or_default()
                    );
                    let gone = change.type_ == "DELETED"
                        || pod["metadata"]["deletionTimestamp"].is_string();
                    if gone {
                        this.send(&key, Injected::Delete);
                    } else if change.type_ == "ADDED" {
                        let (tx, rx) = mpsc::channel(4);
                        this.running
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .insert(key.clone(), tx);
                        *this
                            .started
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .entry(key)
                            .or_default() += 1;
                        tokio::spawn(run_pod(store.clone(), config.clone(), pod.clone(), rx));
                    }
                }
                if wake.changed().await.is_err() {
                    return;
                }
            }
        });
        *kubelet
            .task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(task);
        kubelet
    }

    fn send(&self, key: &str, what: Injected) -> bool {
        let sender = self
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(key)
            .cloned();
        sender.is_some_and(|s| s.try_send(what).is_ok())
    }

    /// Injects a failure into a running Pod; false if it is not running.
    pub fn signal(&self, namespace: &str, pod: &str, what: Injected) -> bool {
        self.send(&format!("{namespace}/{pod}"), what)
    }

    /// Processes started, per `namespace/pod`.
    pub fn started(&self) -> HashMap<String, u32> {
        self.started
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Stops watching and kills every running Pod.
    pub fn shutdown(&self) {
        if let Some(task) = self
            .task
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
        {
            task.abort();
        }
        for sender in self
            .running
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
        {
            let _ = sender.try_send(Injected::Delete);
        }
    }
}

async fn run_pod(
    store: Arc<Store>,
    config: KubeletConfig,
    pod: Value,
    mut commands: mpsc::Receiver<Injected>,
) {
    let ns = pod["metadata"]["namespace"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let name = pod["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let container = pod["spec"]["containers"][0].clone();
    let container_name = container["name"].as_str().unwrap_or("main").to_owned();
    let image = container["image"].as_str().unwrap_or_default().to_owned();
    let set =
        |change: Box<dyn FnOnce(&mut Value) + Send>| store.set_status(&pods(), &ns, &name, change);
    let Some(executable) = config.images.get(&image).cloned() else {
        let message = format!("image {image:?} is not known to the fake kubelet");
        set(Box::new(move |s| {
            *s = json!({"phase": "Pending", "containerStatuses": [{"name": container_name, "ready": false, "restartCount": 0, "image": image,
                "state": {"waiting": {"reason": "ErrImagePull", "message": message}}}]});
        }));
        return;
    };
    let message_path = container["terminationMessagePath"]
        .as_str()
        .unwrap_or("/dev/termination-log")
        .to_owned();
    let local_message = config.work_dir.join(format!("{ns}_{name}.termination-log"));
    let _ = std::fs::remove_file(&local_message);
    let args: Vec<String> = container["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(|a| {
            if a == message_path {
                local_message.display().to_string()
            } else {
                a.to_owned()
            }
        })
        .collect();
    let log =
        |suffix: &str| std::fs::File::create(config.work_dir.join(format!("{ns}_{name}.{suffix}")));
    let mut command = tokio::process::Command::new(&executable);
    command.args(&args).stdin(Stdio::null()).kill_on_drop(true);
    for env in container["env"].as_array().into_iter().flatten() {
        if let (Some(k), Some(v)) = (env["name"].as_str(), env["value"].as_str()) {
            command.env(k, v);
        }
    }
    for (k, v) in &config.env {
        command.env(k, v);
    }
    if let (Ok(out), Ok(err)) = (log("stdout"), log("stderr")) {
        command.stdout(out).stderr(err);
    }
    let started_at = stamp();
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => {
            let message = format!("starting {}: {e}", executable.display());
            set(Box::new(move |s| {
                *s = json!({"phase": "Failed", "containerStatuses": [{"name": container_name, "ready": false, "restartCount": 0, "image": image,
                    "state": {"terminated": {"exitCode": 128, "reason": "StartError", "message": message, "finishedAt": stamp()}}}]});
            }));
            return;
        }
    };
    {
        let (container_name, image, started_at) =
            (container_name.clone(), image.clone(), started_at.clone());
        set(Box::new(move |s| {
            *s = json!({"phase": "Running", "startTime": started_at, "hostIP": "127.0.0.1", "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True"}],
                "containerStatuses": [{"name": container_name, "ready": true, "restartCount": 0, "image": image, "started": true,
                    "state": {"running": {"startedAt": started_at}}}]});
        }));
    }
    let deadline = pod["spec"]["activeDeadlineSeconds"]
        .as_u64()
        .map_or(Duration::from_secs(86_400 * 365), Duration::from_secs);
    let pid = child.id().map(|p| nix::unistd::Pid::from_raw(p as i32));
    let kill = |signal| {
        if let Some(pid) = pid {
            let _ = nix::sys::signal::kill(pid, signal);
        }
    };
    let outcome = tokio::select! {
        status = child.wait() => Ok(status.ok().and_then(|s| s.code()).unwrap_or(137)),
        command = commands.recv() => Err(command.unwrap_or(Injected::Delete)),
        () = tokio::time::sleep(deadline) => Ok(-1),
    };
    let (phase, pod_reason, pod_message, exit_code, reason) = match outcome {
        Ok(-1) => {
            kill(nix::sys::signal::Signal::SIGKILL);
            let _ = child.wait().await;
            (
                "Failed",
                Some("DeadlineExceeded"),
                Some("Pod was active on the node longer than the specified deadline"),
                137,
                "Error",
            )
        }
        Ok(0) => ("Succeeded", None, None, 0, "Completed"),
        Ok(code) => ("Failed", None, None, code, "Error"),
        Err(Injected::OomKill) => {
            kill(nix::sys::signal::Signal::SIGKILL);
            let _ = child.wait().await;
            ("Failed", None, None, 137, "OOMKilled")
        }
        Err(Injected::Evict) => {
            kill(nix::sys::signal::Signal::SIGKILL);
            let _ = child.wait().await;
            (
                "Failed",
                Some("Evicted"),
                Some("The node was low on resource: memory."),
                137,
                "Error",
            )
        }
        Err(Injected::Delete) => {
            kill(nix::sys::signal::Signal::SIGTERM);
            if tokio::time::timeout(Duration::from_secs(5), child.wait())
                .await
                .is_err()
            {
                kill(nix::sys::signal::Signal::SIGKILL);
                let _ = child.wait().await;
            }
            return;
        }
    };
    let mut message = std::fs::read_to_string(&local_message).unwrap_or_default();
    message.truncate(4096);
    if message.is_empty() && exit_code != 0 {
        let stderr = std::fs::read_to_string(config.work_dir.join(format!("{ns}_{name}.stderr")))
            .unwrap_or_default();
        let tail: Vec<&str> = stderr.lines().rev().take(20).collect();
        message = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
        message.truncate(2048);
    }
    set(Box::new(move |s| {
        let mut status = json!({"phase": phase, "startTime": started_at,
            "containerStatuses": [{"name": container_name, "ready": false, "restartCount": 0, "image": image, "started": false,
                "state": {"terminated": {"exitCode": exit_code, "reason": reason, "message": message, "startedAt": started_at, "finishedAt": stamp()}}}]});
        if let Some(r) = pod_reason {
            status["reason"] = json!(r);
        }
        if let Some(m) = pod_message {
            status["message"] = json!(m);
        }
        *s = status;
    }));
}
