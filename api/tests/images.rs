//! The worker and API images as the cluster runs them (read-only root, user 65532, no
//! capabilities): the worker image's harvest equals, byte for byte, the same harvest run outside
//! it, and the API image serves the seed client's flow with the embedded backend, the worker
//! image's harvester beside it. `scripts/test.sh` builds the images (scripts/images.sh) and
//! names their tag; elsewhere these tests say they are skipped.

#![allow(clippy::unwrap_used)]

mod suite;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use harvest_testkit::images::{Container, Images, RESTRICTED, docker, docker_ok};
use serde_json::json;
use suite::*;

/// A folder the image's user (65532) may write, mounted at the same path inside the container
/// so that paths in configurations and manifests read the same on both sides.
fn shared_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    dir
}

fn same_path(dir: &Path, mode: &str) -> String {
    let path = dir.to_str().unwrap();
    format!("{path}:{path}:{mode}")
}

/// Every file under `dir`, relative, sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(next) = todo.pop() {
        for entry in std::fs::read_dir(&next).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else {
                out.push(path.strip_prefix(dir).unwrap().to_owned());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn the_worker_image_harvests_read_only_as_65532_with_no_network_the_bytes_of_a_run_outside_it() {
    let Some(images) = Images::built("worker image") else {
        return;
    };
    let image = images.name("harvester");
    images.assert_runs_unprivileged(&image);
    let dir = shared_dir();
    let inputs = dir.path().join("in");
    std::fs::create_dir(&inputs).unwrap();
    let prompts = inputs.join("prompts.jsonl");
    std::fs::write(&prompts, harvest_core::worker::write_prompts_jsonl(&SEED)).unwrap();
    let outputs = dir.path().join("out");
    std::fs::create_dir(&outputs).unwrap();
    std::fs::set_permissions(&outputs, std::fs::Permissions::from_mode(0o777)).unwrap();
    let in_image = outputs.join("image");
    let model = smollm2();

    let mut args = vec!["run"];
    args.extend(RESTRICTED);
    let (model_mount, inputs_mount, outputs_mount) = (
        same_path(&model, "ro"),
        same_path(&inputs, "ro"),
        same_path(&outputs, "rw"),
    );
    args.extend([
        "--rm",
        "--network",
        "none",
        "--tmpfs",
        "/tmp",
        "-v",
        &model_mount,
        "-v",
        &inputs_mount,
        "-v",
        &outputs_mount,
        &image,
        "run",
        "--model",
        model.to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "--out",
        in_image.to_str().unwrap(),
        "--layers",
        "8,16,24",
        "--progress",
        "off",
        "--model-name",
        "smollm2-135m",
    ]);
    docker_ok(&args);

    let outside = dir.path().join("outside");
    let status = Command::new(harvester())
        .args(["run", "--model", model.to_str().unwrap(), "--prompts"])
        .arg(&prompts)
        .arg("--out")
        .arg(&outside)
        .args(["--layers", "8,16,24", "--progress", "off"])
        .args(["--model-name", "smollm2-135m"])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let written = files(&in_image);
    assert_eq!(written, files(&outside));
    assert!(
        written.iter().any(|f| f.ends_with("manifest.json")),
        "{written:?}"
    );
    for file in &written {
        let (ours, theirs) = (
            std::fs::read(in_image.join(file)).unwrap(),
            std::fs::read(outside.join(file)).unwrap(),
        );
        if file == Path::new("result.json") {
            // The run's report: the same but for its timings and where it wrote.
            let report = |bytes: &[u8]| {
                let mut report: serde_json::Value = serde_json::from_slice(bytes).unwrap();
                let object = report.as_object_mut().unwrap();
                object.remove("timings");
                object.remove("output");
                report
            };
            assert_eq!(report(&ours), report(&theirs));
            continue;
        }
        assert!(
            ours == theirs,
            "{} differs between the image's run and the one outside it",
            file.display()
        );
    }
}

#[test]
fn the_api_image_serves_the_seed_flow_with_the_worker_images_harvester_beside_it() {
    let Some(images) = Images::built("API image") else {
        return;
    };
    let (api, worker) = (images.name("harvest-api"), images.name("harvester"));
    images.assert_runs_unprivileged(&api);
    let dir = shared_dir();
    // The worker image's own binary, as a Pod would mount it from an image volume.
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let holder = format!("harvest-test-worker-{}", std::process::id());
    docker_ok(&["create", "--name", &holder, &worker]);
    let copied = docker(&[
        "cp",
        &format!("{holder}:/usr/local/bin/harvester"),
        bin.to_str().unwrap(),
    ]);
    docker_ok(&["rm", &holder]);
    assert!(copied.status.success(), "{copied:?}");

    let port = free_port();
    let config = dir.path().join("config.json");
    let model = smollm2();
    std::fs::write(
        &config,
        json!({
            "data_dir": dir.path().join("data"),
            "harvester": bin.join("harvester"),
            "max_workers": 1,
            "worker_threads": 1,
            "public_url": format!("http://127.0.0.1:{port}"),
            "models": [{"name": "smollm2-135m", "path": model, "lane": "small"}],
            "accounts": [{"name": "acme", "limits": {"daily_tokens": 10_000_000}}],
        })
        .to_string(),
    )
    .unwrap();
    let name = format!("harvest-test-api-{}", std::process::id());
    let (dir_mount, model_mount, listen) = (
        same_path(dir.path(), "rw"),
        same_path(&model, "ro"),
        format!("127.0.0.1:{port}"),
    );
    let mut args = RESTRICTED.to_vec();
    args.extend([
        "--network",
        "host",
        "--tmpfs",
        "/tmp",
        "-e",
        "RUST_LOG=warn",
        "-v",
        &dir_mount,
        "-v",
        &model_mount,
        &api,
        "--config",
        config.to_str().unwrap(),
        "serve",
        "--listen",
        &listen,
    ]);
    let container = Container::start(&name, &args);
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while reqwest::blocking_get(&format!("{base}/healthz")).is_err() {
        assert!(
            container.running(),
            "the API container exited at start:\n{}",
            container.logs()
        );
        assert!(
            Instant::now() < deadline,
            "the API container did not answer /healthz in 60 s:\n{}",
            container.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The key as the install guide makes it: the image's binary, run in the container.
    let key = docker_ok(&[
        "exec",
        &name,
        "/usr/local/bin/harvest-api",
        "--config",
        config.to_str().unwrap(),
        "create-key",
        "--account",
        "acme",
    ]);
    // The server's handle follows the container: it ends when the container does.
    let follower = Command::new("docker")
        .args(["logs", "--follow", &name])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = Server {
        child: follower,
        base,
        config,
    };
    seed_flow(&server, key.trim(), dir.path());
    drop(container);
}
