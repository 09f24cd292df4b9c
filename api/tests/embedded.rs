//! The embedded server for real, on loopback: the `harvest-api` binary, the real `harvester`
//! worker and the real SmolLM2 checkpoint (imported by scripts/fetch-model.sh). Submit,
//! long-poll, download through signed links with a plain HTTP client and no key; cancel; kill
//! the server mid-job and restart it.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

struct Server {
    child: Child,
    base: String,
    config: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn cache() -> PathBuf {
    std::env::var_os("HARVEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/harvest"))
}

fn smollm2() -> PathBuf {
    let dir = cache().join("models/smollm2-135m");
    assert!(
        dir.join("model.safetensors").exists(),
        "{} is missing: run scripts/fetch-model.sh",
        dir.display()
    );
    dir
}

/// The harvester binary built beside this test (`cargo test --workspace` builds it).
fn harvester() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join("harvester");
    assert!(
        path.exists(),
        "{} is missing: run cargo build -p harvester (scripts/test.sh does)",
        path.display()
    );
    path
}

fn write_config(dir: &Path, port: u16, max_workers: usize) -> PathBuf {
    let config = json!({
        "data_dir": dir.join("data"),
        "harvester": harvester(),
        "max_workers": max_workers,
        "worker_threads": 1,
        "public_url": format!("http://127.0.0.1:{port}"),
        "models": [{"name": "smollm2-135m", "path": smollm2(), "lane": "small"}],
        "accounts": [{"name": "acme", "limits": {"daily_tokens": 10_000_000}}, {"name": "other"}],
    });
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start(config: &Path, port: u16) -> Server {
    let child = Command::new(env!("CARGO_BIN_EXE_harvest-api"))
        .args([
            "--config",
            config.to_str().unwrap(),
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while reqwest::blocking_get(&format!("{base}/healthz")).is_err() {
        assert!(Instant::now() < deadline, "the server did not come up");
        std::thread::sleep(Duration::from_millis(100));
    }
    Server {
        child,
        base,
        config: config.to_owned(),
    }
}

fn create_key(config: &Path, account: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_harvest-api"))
        .args([
            "--config",
            config.to_str().unwrap(),
            "create-key",
            "--account",
            account,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

mod reqwest {
    //! A tiny blocking facade over the async client, so the tests read top to bottom.
    pub use ::reqwest::*;

    pub fn runtime() -> &'static tokio::runtime::Runtime {
        static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
        RUNTIME.get_or_init(|| tokio::runtime::Runtime::new().unwrap())
    }

    pub fn blocking_get(url: &str) -> Result<Vec<u8>> {
        runtime().block_on(async {
            Ok(::reqwest::get(url)
                .await?
                .error_for_status()?
                .bytes()
                .await?
                .to_vec())
        })
    }
}

fn request(method: &str, url: &str, key: &str, body: Option<Value>) -> (u16, Value) {
    reqwest::runtime().block_on(async {
        let client = reqwest::Client::new();
        let mut builder = client
            .request(method.parse().unwrap(), url)
            .bearer_auth(key);
        if let Some(body) = body {
            builder = builder.json(&body);
        }
        let response = builder.send().await.unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    })
}

const SEED: [&str; 2] = [
    "The quick brown fox jumps over the lazy dog.",
    "Interpretability research reads the residual stream.",
];

#[test]
fn the_seed_flow_long_polls_and_downloads_without_a_key_the_bytes_of_a_direct_run() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = start(&write_config(dir.path(), port, 1), port);
    let key = create_key(&server.config, "acme");
    let (status, job) = request(
        "POST",
        &format!("{}/v1/harvest", server.base),
        &key,
        Some(json!({"model": "smollm2-135m", "prompts": SEED, "layers": [8, 16, 24]})),
    );
    assert_eq!(status, 202, "{job}");
    let url = format!(
        "{}/v1/harvest/{}?wait=60",
        server.base,
        job["job_id"].as_str().unwrap()
    );
    let mut done = Value::Null;
    for _ in 0..5 {
        let (_, answer) = request("GET", &url, &key, None);
        if answer["status"] == "done" {
            done = answer;
            break;
        }
        assert!(
            ["pending", "running"].contains(&answer["status"].as_str().unwrap()),
            "{answer}"
        );
    }
    assert_eq!(done["status"], "done", "{done}");
    assert_eq!(done["tokens"], done["result"]["tokens"]);
    assert!(done["urls_expire_at"].as_str().unwrap().ends_with("+00:00"));

    let prompts = dir.path().join("direct.jsonl");
    std::fs::write(
        &prompts,
        SEED.iter()
            .map(|p| json!({"text": p}).to_string() + "\n")
            .collect::<String>(),
    )
    .unwrap();
    let direct = dir.path().join("direct");
    let status = Command::new(harvester())
        .args([
            "run",
            "--model",
            smollm2().to_str().unwrap(),
            "--prompts",
            prompts.to_str().unwrap(),
            "--out",
        ])
        .arg(&direct)
        .args([
            "--layers",
            "8,16,24",
            "--progress",
            "off",
            "--model-name",
            "smollm2-135m",
        ])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let shard = reqwest::blocking_get(done["result"]["shard_urls"][0].as_str().unwrap()).unwrap();
    assert_eq!(
        shard,
        std::fs::read(direct.join("shard_00000.safetensors")).unwrap()
    );
    let stats = reqwest::blocking_get(done["result"]["stats_url"].as_str().unwrap()).unwrap();
    assert_eq!(
        stats,
        std::fs::read(direct.join("stats.safetensors")).unwrap()
    );
    let manifest: Value = serde_json::from_slice(
        &reqwest::blocking_get(done["result"]["manifest_url"].as_str().unwrap()).unwrap(),
    )
    .unwrap();
    assert_eq!(manifest["layer_indices"], json!([8, 16, 24]));
}

fn harvester_pids(job_id: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_str()?.parse::<i32>().ok()?;
            let cmdline = String::from_utf8_lossy(&std::fs::read(e.path().join("cmdline")).ok()?)
                .into_owned();
            (cmdline.contains(job_id) && cmdline.contains("plan.json")).then_some(pid)
        })
        .collect()
}

fn long_job(server: &Server, key: &str) -> String {
    let prompts: Vec<String> = (0..24)
        .map(|i| {
            format!(
                "Prompt {i}: {}",
                "the residual stream of a language model ".repeat(12)
            )
        })
        .collect();
    let (status, job) = request(
        "POST",
        &format!("{}/v1/harvest", server.base),
        key,
        Some(
            json!({"model": "smollm2-135m", "prompts": prompts, "layers": "all", "shard_size": 4}),
        ),
    );
    assert_eq!(status, 202, "{job}");
    job["job_id"].as_str().unwrap().to_owned()
}

fn wait_for(server: &Server, key: &str, id: &str, what: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let (_, job) = request(
            "GET",
            &format!("{}/v1/harvest/{id}", server.base),
            key,
            None,
        );
        if what(&job) {
            return job;
        }
        assert!(Instant::now() < deadline, "timed out; last state {job}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn cancelling_a_running_job_stops_its_harvester_and_charges_the_reservation() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = start(&write_config(dir.path(), port, 1), port);
    let key = create_key(&server.config, "acme");
    let id = long_job(&server, &key);
    wait_for(&server, &key, &id, |j| {
        j["status"] == "running" && !harvester_pids(&id).is_empty()
    });
    let (status, cancelled) = request(
        "DELETE",
        &format!("{}/v1/harvest/{id}", server.base),
        &key,
        None,
    );
    assert_eq!(
        (status, cancelled["status"].as_str()),
        (200, Some("cancelled")),
        "{cancelled}"
    );
    assert_eq!(cancelled["tokens"], cancelled["reserved_tokens"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !harvester_pids(&id).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the harvester of a cancelled job is still running"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let other = create_key(&server.config, "other");
    let (status, _) = request(
        "GET",
        &format!("{}/v1/harvest/{id}", server.base),
        &other,
        None,
    );
    assert_eq!(status, 404);
}

#[test]
fn a_server_killed_mid_job_finishes_it_after_a_restart_without_double_charging() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = write_config(dir.path(), port, 1);
    let mut server = start(&config, port);
    let key = create_key(&config, "acme");
    let id = long_job(&server, &key);
    wait_for(&server, &key, &id, |j| {
        j["progress"]["prompts_done"].as_u64().unwrap_or(0) >= 4
    });
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    drop(server);
    let server = start(&config, port);
    let done = wait_for(&server, &key, &id, |j| {
        j["status"]
            .as_str()
            .is_some_and(|s| s != "pending" && s != "running")
    });
    assert_eq!(done["status"], "done", "{done}");
    assert_eq!(done["result"]["n_shards"], 6);
    assert!(
        harvester_pids(&id).is_empty(),
        "no harvester of the job is left running"
    );
    let shard = reqwest::blocking_get(done["result"]["shard_urls"][5].as_str().unwrap()).unwrap();
    assert!(!shard.is_empty());
    let store = harvest_api::store::Store::open(&dir.path().join("data/harvest.sqlite")).unwrap();
    let (_, ledger) = store.account("acme").unwrap();
    assert_eq!(
        ledger.tokens_today,
        done["tokens"].as_u64().unwrap(),
        "charged once, what ran"
    );
    assert_eq!(ledger.active_small, 0);
}
