//! One Pod's life on the fake node: placement, configuration, then the container's runs
//! (with probes and restarts) until it finishes or the Pod is deleted.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::probe::Probe;
use super::{Injected, Link, Node, Wake, lock, schedule, stamp};
use crate::launch::{self, Launch, PodHost};
use crate::store::Store;

/// How long a deleted Pod's process has between SIGTERM and SIGKILL.
const GRACE: Duration = Duration::from_secs(5);
/// How often readiness is probed, whatever `periodSeconds` says, so that tests are quick.
const READINESS_PERIOD: Duration = Duration::from_secs(1);
/// The longest wait between restarts (a real kubelet's back-off reaches five minutes).
const MAX_BACKOFF: Duration = Duration::from_secs(10);

pub(super) struct PodTask {
    pub node: Arc<Node>,
    pub pod: Value,
    pub key: String,
    pub started: Arc<Mutex<HashMap<String, u32>>>,
}

enum Outcome {
    Exited(i32),
    Injected(Injected),
    Deadline,
    Unhealthy,
}

fn conditions(scheduled: bool, ready: bool) -> Value {
    let flag = |b: bool| if b { "True" } else { "False" };
    json!([
        {"type": "PodScheduled", "status": flag(scheduled)},
        {"type": "Initialized", "status": flag(scheduled)},
        {"type": "ContainersReady", "status": flag(ready)},
        {"type": "Ready", "status": flag(ready)},
    ])
}

impl PodTask {
    fn name(&self) -> (&str, &str) {
        (
            self.pod["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default(),
            self.pod["metadata"]["name"].as_str().unwrap_or_default(),
        )
    }

    fn container(&self) -> &Value {
        &self.pod["spec"]["containers"][0]
    }

    fn set(&self, status: Value) {
        let (ns, name) = self.name();
        self.node.link.set_status(ns, name, status);
    }

    fn container_status(&self, ready: bool, restarts: u32, state: Value, last: &Value) -> Value {
        let mut status = json!({"name": self.container()["name"].as_str().unwrap_or("main"),
            "image": self.container()["image"], "ready": ready, "restartCount": restarts,
            "started": state.get("running").is_some(), "state": state});
        if !last.is_null() {
            status["lastState"] = last.clone();
        }
        status
    }

    /// Waits for any change in the cluster, or a second; false once the Pod is deleted.
    async fn wait(&self, wake: &mut Wake, commands: &mut mpsc::Receiver<Injected>) -> bool {
        tokio::select! {
            () = wake.changed() => true,
            command = commands.recv() => command.is_some_and(|c| c != Injected::Delete),
            () = tokio::time::sleep(Duration::from_secs(1)) => true,
        }
    }

    pub async fn run(self, mut commands: mpsc::Receiver<Injected>) {
        let placed = match &self.node.link {
            Link::Store(store) => self.place(store, &mut commands).await,
            // A real scheduler bound the Pod to this node.
            Link::Remote(_) => true,
        };
        if placed {
            self.configure_and_run(&mut commands).await;
        }
        lock(&self.node.placed).remove(&self.key);
    }

    /// Waits until the Pod fits a node and holds its GPUs there; false if it was deleted.
    async fn place(&self, store: &Store, commands: &mut mpsc::Receiver<Injected>) -> bool {
        let mut wake = self.node.link.wake();
        let mut reported = String::new();
        loop {
            let placed = {
                let mut placed = lock(&self.node.placed);
                let mut taken = HashMap::new();
                for (node, gpus) in placed.values() {
                    *taken.entry(node.clone()).or_insert(0) += gpus;
                }
                let fit = schedule::place(store, &self.pod, &taken);
                if let Ok(node) = &fit {
                    let gpus = schedule::gpus_requested(&self.pod);
                    placed.insert(self.key.clone(), (node.clone(), gpus));
                }
                fit
            };
            match placed {
                Ok(_) => return true,
                Err(message) if message != reported => {
                    reported.clone_from(&message);
                    self.set(
                        json!({"phase": "Pending", "conditions": [{"type": "PodScheduled",
                        "status": "False", "reason": "Unschedulable", "message": message,
                        "lastTransitionTime": stamp()}]}),
                    );
                }
                Err(_) => {}
            }
            if !self.wait(&mut wake, commands).await {
                return false;
            }
        }
    }

    async fn configure_and_run(&self, commands: &mut mpsc::Receiver<Injected>) {
        let image = self.container()["image"].as_str().unwrap_or_default();
        let Some(executable) = self.node.config.images.get(image).cloned() else {
            let message = format!("image {image:?} is not known to the fake kubelet");
            let state = json!({"waiting": {"reason": "ErrImagePull", "message": message}});
            self.set(
                json!({"phase": "Pending", "conditions": conditions(true, false),
                "containerStatuses": [self.container_status(false, 0, state, &Value::Null)]}),
            );
            return;
        };
        let (ns, name) = self.name();
        let dir = self
            .node
            .config
            .work_dir
            .join("pods")
            .join(format!("{ns}_{name}"));
        let ip = self.node.pod_ip();
        let claim_root = self.node.config.work_dir.join("claims");
        let host = PodHost {
            dir: &dir,
            ip: &ip,
            api: &self.node.api,
            claims: &self.node.config.claims,
            claim_root: &claim_root,
            in_image: self.node.config.engine.is_some(),
        };
        let mut wake = self.node.link.wake();
        let mut reported = String::new();
        // Fetched once, when the apiserver first grants it.
        let mut token: Option<Option<String>> = None;
        let launch = loop {
            let token = match &token {
                Some(token) => token.clone(),
                None => match self.node.link.token(&self.pod).await {
                    Ok(fetched) => {
                        token = Some(fetched.clone());
                        fetched
                    }
                    Err(message) => {
                        if message != reported {
                            reported.clone_from(&message);
                            let state = json!({"waiting": {"reason": "ContainerCreating", "message": message}});
                            self.set(json!({"phase": "Pending", "hostIP": "127.0.0.1", "podIP": ip,
                            "conditions": conditions(true, false),
                            "containerStatuses": [self.container_status(false, 0, state, &Value::Null)]}));
                        }
                        if !self.wait(&mut wake, commands).await {
                            return;
                        }
                        continue;
                    }
                },
            };
            let resolved = match &self.node.link {
                Link::Store(store) => launch::resolve(&**store, &self.pod, &host, token.as_deref()),
                Link::Remote(remote) => {
                    let objects = remote.snapshot(&self.pod).await;
                    launch::resolve(&objects, &self.pod, &host, token.as_deref())
                }
            };
            match resolved {
                Ok(launch) => break launch,
                Err(not_ready) if not_ready.message != reported => {
                    reported.clone_from(&not_ready.message);
                    let state = json!({"waiting": {"reason": not_ready.reason, "message": not_ready.message}});
                    self.set(json!({"phase": "Pending", "hostIP": "127.0.0.1", "podIP": ip,
                        "conditions": conditions(true, false),
                        "containerStatuses": [self.container_status(false, 0, state, &Value::Null)]}));
                }
                Err(_) => {}
            }
            if !self.wait(&mut wake, commands).await {
                return;
            }
        };
        if let Some(refusal) = self.runs_as_root_refusal(&executable, &launch).await {
            let state =
                json!({"waiting": {"reason": "CreateContainerConfigError", "message": refusal}});
            self.set(
                json!({"phase": "Pending", "hostIP": "127.0.0.1", "podIP": ip,
                "conditions": conditions(true, false),
                "containerStatuses": [self.container_status(false, 0, state, &Value::Null)]}),
            );
            return;
        }
        self.run_container(&executable, &launch, &ip, commands)
            .await;
    }

    fn restarts_after(&self, outcome: &Outcome) -> bool {
        let policy = self.pod["spec"]["restartPolicy"]
            .as_str()
            .unwrap_or("Always");
        match outcome {
            Outcome::Exited(0) => policy == "Always",
            Outcome::Exited(_) | Outcome::Unhealthy | Outcome::Injected(Injected::OomKill) => {
                policy != "Never"
            }
            _ => false,
        }
    }

    async fn run_container(
        &self,
        executable: &std::path::Path,
        launch: &Launch,
        ip: &str,
        commands: &mut mpsc::Receiver<Injected>,
    ) {
        let (ns, name) = self.name();
        let work_dir = &self.node.config.work_dir;
        let pod_started = stamp();
        let deadline = Instant::now()
            + self.pod["spec"]["activeDeadlineSeconds"]
                .as_u64()
                .map_or(Duration::from_secs(86_400 * 365), Duration::from_secs);
        let (mut restarts, mut last) = (0u32, Value::Null);
        loop {
            *lock(&self.started).entry(self.key.clone()).or_default() += 1;
            let _ = std::fs::remove_file(&launch.termination_log);
            let log = |suffix: &str| {
                std::fs::File::create(work_dir.join(format!("{ns}_{name}.{suffix}")))
            };
            let uid = self.pod["metadata"]["uid"].as_str().unwrap_or(name);
            let container = format!("harvest-pod-{uid}-{restarts}");
            let mut command = match &self.node.config.engine {
                Some(engine) => self.in_image(engine, executable, launch, &container),
                None => {
                    let mut command = tokio::process::Command::new(executable);
                    command
                        .args(&launch.args)
                        .env_clear()
                        .envs(launch.env.iter().map(|(k, v)| (k, v)))
                        .envs(self.node.config.env.iter().map(|(k, v)| (k, v)));
                    command
                }
            };
            command.stdin(Stdio::null()).kill_on_drop(true);
            if let (Ok(out), Ok(err)) = (log("stdout"), log("stderr")) {
                command.stdout(out).stderr(err);
            }
            let started_at = stamp();
            let mut child = match command.spawn() {
                Ok(child) => child,
                Err(e) => {
                    let message = format!("starting {}: {e}", executable.display());
                    let state = json!({"terminated": {"exitCode": 128, "reason": "StartError", "message": message, "finishedAt": stamp()}});
                    self.set(json!({"phase": "Failed", "conditions": conditions(true, false),
                        "containerStatuses": [self.container_status(false, restarts, state, &last)]}));
                    return;
                }
            };
            let running = json!({"running": {"startedAt": started_at}});
            let readiness = Probe::of(self.container(), "readinessProbe");
            let report = |ready: bool| {
                self.set(json!({"phase": "Running", "startTime": pod_started, "hostIP": "127.0.0.1", "podIP": ip,
                    "conditions": conditions(true, ready),
                    "containerStatuses": [self.container_status(ready, restarts, running.clone(), &last)]}));
            };
            report(readiness.is_none());
            let outcome = self
                .supervise(&mut child, ip, readiness, deadline, commands, &report)
                .await;
            let pid = child.id().map(|p| nix::unistd::Pid::from_raw(p as i32));
            let kill = |signal| {
                if let Some(pid) = pid {
                    let _ = nix::sys::signal::kill(pid, signal);
                }
            };
            let exit_code = match outcome {
                Outcome::Exited(code) => code,
                Outcome::Injected(Injected::Delete) => {
                    kill(Signal::SIGTERM);
                    if tokio::time::timeout(GRACE, child.wait()).await.is_err() {
                        kill(Signal::SIGKILL);
                        let _ = child.wait().await;
                    }
                    self.remove_container(&container).await;
                    return;
                }
                _ => {
                    kill(Signal::SIGKILL);
                    let _ = child.wait().await;
                    137
                }
            };
            // A killed `docker run` leaves its container behind.
            self.remove_container(&container).await;
            let (reason, pod_reason, pod_message) = match outcome {
                Outcome::Exited(0) => ("Completed", None, None),
                Outcome::Injected(Injected::OomKill) => ("OOMKilled", None, None),
                Outcome::Injected(Injected::Evict) => (
                    "Error",
                    Some("Evicted"),
                    Some("The node was low on resource: memory."),
                ),
                Outcome::Deadline => (
                    "Error",
                    Some("DeadlineExceeded"),
                    Some("Pod was active on the node longer than the specified deadline"),
                ),
                _ => ("Error", None, None),
            };
            let message = self.termination_message(launch, exit_code);
            let terminated = json!({"terminated": {"exitCode": exit_code, "reason": reason, "message": message,
                "startedAt": started_at, "finishedAt": stamp()}});
            if self.restarts_after(&outcome) {
                restarts += 1;
                last = terminated;
                let backoff = MAX_BACKOFF.min(Duration::from_secs(1 << restarts.min(4)) / 2);
                let waiting = json!({"waiting": {"reason": "CrashLoopBackOff",
                    "message": format!("back-off {}s restarting failed container", backoff.as_secs())}});
                self.set(json!({"phase": "Running", "startTime": pod_started, "hostIP": "127.0.0.1", "podIP": ip,
                    "conditions": conditions(true, false),
                    "containerStatuses": [self.container_status(false, restarts, waiting, &last)]}));
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    command = commands.recv() => if command.is_none_or(|c| c == Injected::Delete) { return; },
                }
                continue;
            }
            let phase = if exit_code == 0 {
                "Succeeded"
            } else {
                "Failed"
            };
            let mut status = json!({"phase": phase, "startTime": pod_started, "hostIP": "127.0.0.1", "podIP": ip,
                "conditions": conditions(true, false),
                "containerStatuses": [self.container_status(false, restarts, terminated, &last)]});
            if let Some(r) = pod_reason {
                status["reason"] = json!(r);
            }
            if let Some(m) = pod_message {
                status["message"] = json!(m);
            }
            self.set(status);
            return;
        }
    }

    /// `docker run` of the container in its image, as a kubelet's runtime would start it:
    /// its mounts, environment and securityContext; SIGTERM reaches it through the client.
    fn in_image(
        &self,
        engine: &super::Engine,
        image: &std::path::Path,
        launch: &Launch,
        container: &str,
    ) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(&engine.docker);
        command.env_clear();
        if let Some(host) = &engine.host {
            command.env("DOCKER_HOST", host);
        }
        command.args(["run", "--rm", "--name", container, "--network", "host"]);
        // So that whoever stops the node can find what it left running.
        command.arg("--label").arg(format!(
            "harvest.dev/kubelet-dir={}",
            self.node.config.work_dir.display()
        ));
        let security = &launch.security;
        if let Some(user) = &security.user {
            command.args(["--user", user]);
        }
        if security.read_only_root {
            command.arg("--read-only");
        }
        if security.drop_all_capabilities {
            command.args(["--cap-drop", "ALL"]);
        }
        if security.no_new_privileges {
            command.args(["--security-opt", "no-new-privileges"]);
        }
        if let Some(entrypoint) = &launch.entrypoint {
            command.args(["--entrypoint", entrypoint]);
        }
        for mount in &launch.mounts {
            let mode = if mount.read_only { ":ro" } else { "" };
            command
                .arg("-v")
                .arg(format!("{}:{}{mode}", mount.local.display(), mount.path));
        }
        for (key, value) in launch.env.iter().chain(&self.node.config.env) {
            command.arg("-e").arg(format!("{key}={value}"));
        }
        command.arg(image).args(&launch.args);
        command
    }

    /// The kubelet's refusal of a `runAsNonRoot` container whose image would run as root (or
    /// as a user name it cannot check), when no `runAsUser` overrides it.
    async fn runs_as_root_refusal(
        &self,
        image: &std::path::Path,
        launch: &Launch,
    ) -> Option<String> {
        let engine = self.node.config.engine.as_ref()?;
        if !launch.security.run_as_non_root || launch.security.user.is_some() {
            return None;
        }
        let mut command = tokio::process::Command::new(&engine.docker);
        if let Some(host) = &engine.host {
            command.env("DOCKER_HOST", host);
        }
        let inspected = command
            .args(["image", "inspect", "-f", "{{.Config.User}}"])
            .arg(image)
            .output()
            .await
            .ok()?;
        launch::runs_as_root_refusal(String::from_utf8_lossy(&inspected.stdout).trim())
    }

    async fn remove_container(&self, container: &str) {
        let Some(engine) = &self.node.config.engine else {
            return;
        };
        let mut command = tokio::process::Command::new(&engine.docker);
        if let Some(host) = &engine.host {
            command.env("DOCKER_HOST", host);
        }
        let _ = command
            .args(["rm", "-f", container])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await;
    }

    fn termination_message(&self, launch: &Launch, exit_code: i32) -> String {
        let (ns, name) = self.name();
        let mut message = std::fs::read_to_string(&launch.termination_log).unwrap_or_default();
        message.truncate(4096);
        let fallback =
            self.container()["terminationMessagePolicy"].as_str() == Some("FallbackToLogsOnError");
        if message.is_empty() && exit_code != 0 && fallback {
            let stderr = std::fs::read_to_string(
                self.node
                    .config
                    .work_dir
                    .join(format!("{ns}_{name}.stderr")),
            )
            .unwrap_or_default();
            let tail: Vec<&str> = stderr.lines().rev().take(20).collect();
            message = tail.into_iter().rev().collect::<Vec<_>>().join("\n");
            message.truncate(2048);
        }
        message
    }

    /// Watches the running container: its exit, injected failures, the deadline and probes.
    async fn supervise(
        &self,
        child: &mut tokio::process::Child,
        ip: &str,
        readiness: Option<Probe>,
        deadline: Instant,
        commands: &mut mpsc::Receiver<Injected>,
        report: &impl Fn(bool),
    ) -> Outcome {
        let liveness = Probe::of(self.container(), "livenessProbe");
        let start = Instant::now();
        let mut ready_tick = tokio::time::interval_at(
            start
                + readiness
                    .as_ref()
                    .map_or(Duration::ZERO, |p| p.initial_delay),
            READINESS_PERIOD,
        );
        let mut live_tick = tokio::time::interval_at(
            start
                + liveness
                    .as_ref()
                    .map_or(Duration::ZERO, |p| p.initial_delay + p.period),
            liveness
                .as_ref()
                .map_or(Duration::from_secs(3600), |p| p.period),
        );
        let (mut ready, mut ready_failures, mut live_failures) = (readiness.is_none(), 0, 0);
        loop {
            tokio::select! {
                status = child.wait() => {
                    let code = status.ok().map_or(137, |s| {
                        use std::os::unix::process::ExitStatusExt;
                        s.code().or_else(|| s.signal().map(|n| 128 + n)).unwrap_or(137)
                    });
                    return Outcome::Exited(code);
                }
                command = commands.recv() => return Outcome::Injected(command.unwrap_or(Injected::Delete)),
                () = tokio::time::sleep_until(deadline) => return Outcome::Deadline,
                _ = ready_tick.tick(), if readiness.is_some() => {
                    let Some(probe) = &readiness else { continue };
                    if probe.check(ip).await {
                        ready_failures = 0;
                        if !ready {
                            ready = true;
                            report(true);
                        }
                    } else {
                        ready_failures += 1;
                        if ready && ready_failures >= probe.failure_threshold {
                            ready = false;
                            report(false);
                        }
                    }
                }
                _ = live_tick.tick(), if liveness.is_some() => {
                    let Some(probe) = &liveness else { continue };
                    if probe.check(ip).await {
                        live_failures = 0;
                    } else {
                        live_failures += 1;
                        if live_failures >= probe.failure_threshold {
                            return Outcome::Unhealthy;
                        }
                    }
                }
            }
        }
    }
}
