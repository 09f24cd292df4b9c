//! A real full disk: the server's data directory on a small tmpfs, mounted in a user and mount
//! namespace of the server's own (`unshare -rm`), so the test needs no root. The disk fills
//! while a job runs; that job must fail naming the cause, and nothing else may be lost.
#![allow(clippy::unwrap_used)]

mod suite;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use suite::{Server, free_port, harvester, request, smollm2, wait_for};

/// The data directory's tmpfs.
const DISK_BYTES: u64 = 96 << 20;

fn write_config(dir: &Path, port: u16) -> PathBuf {
    let config = json!({
        "data_dir": dir.join("data"),
        "harvester": harvester(),
        "max_workers": 1,
        "worker_threads": 1,
        "worker_attempts": 2,
        "min_free_bytes": 0,
        "public_url": format!("http://127.0.0.1:{port}"),
        "models": [{"name": "smollm2-135m", "path": smollm2(), "lane": "small"}],
        "accounts": [{"name": "acme", "limits": {"daily_tokens": 100_000_000}}],
    });
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

/// Starts the server with its data directory on a fresh tmpfs of [`DISK_BYTES`], creating a
/// key inside the same namespace (the key's store lives on that tmpfs); returns the server and
/// the key.
fn start_on_tmpfs(dir: &Path) -> (Server, String) {
    let port = free_port();
    let config = write_config(dir, port);
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let key_file = dir.join("key");
    let api = env!("CARGO_BIN_EXE_harvest-api");
    let script = format!(
        "mount -t tmpfs -o size={DISK_BYTES} tmpfs '{data}' && \
         '{api}' --config '{config}' create-key --account acme > '{key}' && \
         exec '{api}' --config '{config}' serve --listen 127.0.0.1:{port}",
        data = data.display(),
        config = config.display(),
        key = key_file.display(),
    );
    let child = Command::new("unshare")
        .args(["-rm", "sh", "-c", &script])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut server = Server {
        child,
        base: format!("http://127.0.0.1:{port}"),
        config,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while suite::reqwest::blocking_get(&format!("{}/healthz", server.base)).is_err() {
        if let Ok(Some(exit)) = server.child.try_wait() {
            panic!("the server in its own namespace exited at start ({exit})");
        }
        assert!(Instant::now() < deadline, "the server did not come up");
        std::thread::sleep(Duration::from_millis(100));
    }
    let key = std::fs::read_to_string(&key_file)
        .unwrap()
        .trim()
        .to_owned();
    (server, key)
}

/// The data directory as the server sees it: its tmpfs, reached through its mount namespace.
fn disk(server: &Server, dir: &Path) -> PathBuf {
    let relative = dir.join("data");
    PathBuf::from(format!("/proc/{}/root", server.child.id()))
        .join(relative.strip_prefix("/").unwrap())
}

/// Fills the disk, leaving about `leave` bytes free; returns the filler's path.
fn fill(disk: &Path, leave: u64) -> PathBuf {
    let filler = disk.join("filler");
    let free = fs_free(disk);
    let mut file = std::fs::File::create(&filler).unwrap();
    let chunk = vec![0u8; 64 << 10];
    let mut written = 0u64;
    while written + leave + chunk.len() as u64 <= free {
        if file.write_all(&chunk).is_err() {
            break;
        }
        written += chunk.len() as u64;
    }
    file.sync_all().unwrap();
    filler
}

fn fs_free(path: &Path) -> u64 {
    let out = Command::new("df")
        .args(["-B1", "--output=avail"])
        .arg(path)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn submit(server: &Server, key: &str, prompts: usize, layers: Value) -> (u16, Value) {
    let prompts: Vec<String> = (0..prompts)
        .map(|i| {
            format!(
                "Prompt {i}: {}",
                "the residual stream of a model ".repeat(8)
            )
        })
        .collect();
    let body =
        json!({"model": "smollm2-135m", "prompts": prompts, "layers": layers, "shard_size": 2});
    request(
        "POST",
        &format!("{}/v1/harvest", server.base),
        key,
        Some(body),
    )
}

#[test]
fn a_disk_that_fills_mid_run_fails_that_job_by_name_and_loses_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let (server, key) = start_on_tmpfs(dir.path());
    let disk = disk(&server, dir.path());

    // A job larger than the whole disk is refused at the door.
    let (status, refused) = submit(&server, &key, 120, json!("all"));
    assert_eq!(status, 507, "{refused}");
    assert_eq!(
        refused["error"]["code"], "insufficient_storage",
        "{refused}"
    );

    // A job that fits finishes, and its files stay.
    let (status, first) = submit(&server, &key, 4, json!([3]));
    assert_eq!(status, 202, "{first}");
    let first_id = first["job_id"].as_str().unwrap().to_owned();
    let done = wait_for(&server, &key, &first_id, |j| j["status"] == "done");
    let first_shards = done["result"]["shard_urls"].as_array().unwrap().len();

    // A job that fits when submitted, but the disk fills while it runs.
    let (status, job) = submit(&server, &key, 40, json!("all"));
    assert_eq!(status, 202, "{job}");
    let id = job["job_id"].as_str().unwrap().to_owned();
    wait_for(&server, &key, &id, |j| {
        j["status"] == "running" && j["progress"]["prompts_done"].as_u64().unwrap_or(0) > 0
    });
    let filler = fill(&disk, 256 << 10);
    let failed = wait_for(&server, &key, &id, |j| {
        j["status"] != "running" && j["status"] != "pending"
    });
    assert_eq!(failed["status"], "failed", "{failed}");
    println!("the job that met the full disk: {}", failed["error"]);
    let error = failed["error"].as_str().unwrap_or_default().to_lowercase();
    assert!(error.contains("no space left on device"), "{failed}");
    assert_eq!(
        failed["tokens"], 0,
        "a failed job is charged nothing: {failed}"
    );

    // The server kept answering, and the finished job's files are whole.
    let (status, again) = request(
        "GET",
        &format!("{}/v1/harvest/{first_id}", server.base),
        &key,
        None,
    );
    assert_eq!((status, &again["status"]), (200, &json!("done")), "{again}");
    let result = &again["result"];
    let shards = result["shard_urls"].as_array().unwrap();
    assert_eq!(shards.len(), first_shards);
    let urls = shards
        .iter()
        .chain([&result["manifest_url"], &result["stats_url"]]);
    for url in urls {
        let url = url.as_str().unwrap();
        suite::reqwest::blocking_get(url).unwrap_or_else(|e| panic!("{url}: {e}"));
    }

    // Space again: the next job runs to the end.
    std::fs::remove_file(filler).unwrap();
    let (status, next) = submit(&server, &key, 4, json!([3]));
    assert_eq!(status, 202, "{next}");
    let next_id = next["job_id"].as_str().unwrap().to_owned();
    wait_for(&server, &key, &next_id, |j| j["status"] == "done");
}
