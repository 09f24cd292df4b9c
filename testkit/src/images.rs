//! The images `scripts/images.sh build` made, run through a Docker engine as the cluster runs
//! them: read-only root, a numeric non-root user, no capabilities. `scripts/test.sh` builds
//! them and names their tag in `HARVEST_IMAGE_TAG`; without it a test that needs them says it
//! is skipped and why.

use std::process::{Command, Output};

/// Where `scripts/images.sh` puts the images, as `manifests/` names them.
pub const REGISTRY: &str = "ghcr.io/harvest-dev";

/// The user every image runs as (distroless's nonroot).
pub const USER: &str = "65532:65532";

/// The built images' tag, read from `HARVEST_IMAGE_TAG`.
#[derive(Debug, Clone)]
pub struct Images {
    tag: String,
}

impl Images {
    /// The built images, or `None` (with a line naming `test` as skipped) when none were built.
    pub fn built(test: &str) -> Option<Self> {
        match std::env::var("HARVEST_IMAGE_TAG") {
            Ok(tag) if !tag.is_empty() => Some(Self { tag }),
            _ => {
                eprintln!(
                    "{test}: skipped, no images: run eval \"$(scripts/images.sh engine)\"; scripts/images.sh build; then HARVEST_IMAGE_TAG=<its tag> (scripts/test.sh does)"
                );
                None
            }
        }
    }

    /// `REGISTRY/name:tag`.
    pub fn name(&self, image: &str) -> String {
        format!("{REGISTRY}/{image}:{}", self.tag)
    }

    /// Refuses an image that would run as root or without a numeric user, which a Pod's
    /// `runAsNonRoot` cannot check; every run here is also `--read-only`, so an image that
    /// writes its root fails its test.
    pub fn assert_runs_unprivileged(&self, image: &str) {
        let user = docker_ok(&["image", "inspect", "-f", "{{.Config.User}}", image]);
        let uid = user.trim().split(':').next().unwrap_or_default();
        assert!(
            uid.parse::<u32>().is_ok_and(|uid| uid != 0),
            "{image} runs as {:?}: its Dockerfile must say USER 65532:65532 (numeric, not root)",
            user.trim()
        );
    }
}

/// The flags every run here shares: the restricted Pod Security level's.
pub const RESTRICTED: [&str; 7] = [
    "--read-only",
    "--user",
    USER,
    "--cap-drop",
    "ALL",
    "--security-opt",
    "no-new-privileges",
];

/// `docker ARGS`, its output.
pub fn docker(args: &[&str]) -> Output {
    Command::new("docker")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("docker {args:?}: {e}: is the docker command installed?"))
}

/// `docker ARGS`, which must succeed; its stdout.
pub fn docker_ok(args: &[&str]) -> String {
    let out = docker(args);
    assert!(
        out.status.success(),
        "docker {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A detached container, removed (killed if need be) on drop.
#[derive(Debug)]
pub struct Container {
    /// Its name.
    pub name: String,
}

impl Container {
    /// `docker run -d --name NAME ARGS`.
    pub fn start(name: &str, args: &[&str]) -> Self {
        // A container of an earlier, killed run may still hold the name.
        let _ = docker(&["rm", "-f", name]);
        let mut all = vec!["run", "-d", "--name", name];
        all.extend_from_slice(args);
        docker_ok(&all);
        Self {
            name: name.to_owned(),
        }
    }

    /// Its logs, stdout and stderr.
    pub fn logs(&self) -> String {
        let out = docker(&["logs", &self.name]);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// Whether it still runs.
    pub fn running(&self) -> bool {
        docker(&["inspect", "-f", "{{.State.Running}}", &self.name])
            .stdout
            .starts_with(b"true")
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = docker(&["rm", "-f", &self.name]);
    }
}
