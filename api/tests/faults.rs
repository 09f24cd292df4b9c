//! The fault test: for about two minutes, clients submit, cancel and long-poll against the
//! embedded server while the test SIGKILLs the server or a worker at random moments (seeded, so
//! a failure replays) and restarts the server. At the end every job is terminal, every
//! account's ledger equals the sum of the contract's charges with no slot left held, no file
//! lives without its job nor a done job without its files, and no harvester is left running.
//! `HARVEST_FAULT_SECONDS` (default 120) and `HARVEST_FAULT_SEED` (default 20261201) change the
//! length and the draw.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod suite;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use harvest_core::lifecycle::JobStatus;
use serde_json::json;
use suite::*;

/// A small, seeded generator (xorshift64*), so a failing run can be replayed.
struct Draw(u64);

impl Draw {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn write_config(dir: &Path, port: u16) -> std::path::PathBuf {
    let config = json!({
        "data_dir": dir.join("data"),
        "harvester": harvester(),
        "max_workers": 2,
        "worker_threads": 1,
        "public_url": format!("http://127.0.0.1:{port}"),
        "shutdown_grace_seconds": 5,
        "models": [{"name": "smollm2-135m", "path": smollm2(), "lane": "small"}],
        "accounts": [
            {"name": "acme", "limits": {"daily_tokens": 100_000_000, "small_concurrency": 2}},
            {"name": "other", "limits": {"daily_tokens": 100_000_000}},
        ],
    });
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

fn submit(server: &Server, key: &str, draw: &mut Draw) -> Option<String> {
    let prompts: Vec<String> = (0..2 + draw.below(10))
        .map(|i| {
            format!(
                "prompt {i}: {}",
                "the residual stream ".repeat(1 + draw.below(12) as usize)
            )
        })
        .collect();
    let layers = if draw.below(2) == 0 {
        json!("all")
    } else {
        json!([3, 17])
    };
    let body =
        json!({"model": "smollm2-135m", "prompts": prompts, "layers": layers, "shard_size": 2});
    let (status, job) = try_request(
        "POST",
        &format!("{}/v1/harvest", server.base),
        key,
        Some(body),
    )?;
    // 429s (a full lane, a busy count) are answers too; only 202s make jobs.
    (status == 202).then(|| job["job_id"].as_str().unwrap().to_owned())
}

/// A request that may meet a server being killed: `None` when the connection failed.
fn try_request(
    method: &str,
    url: &str,
    key: &str,
    body: Option<serde_json::Value>,
) -> Option<(u16, serde_json::Value)> {
    reqwest::runtime().block_on(async {
        let client = reqwest::Client::new();
        let mut builder = client
            .request(method.parse().unwrap(), url)
            .bearer_auth(key)
            .timeout(Duration::from_secs(20));
        if let Some(body) = body {
            builder = builder.json(&body);
        }
        let response = builder.send().await.ok()?;
        let status = response.status().as_u16();
        let body = response.json().await.unwrap_or(serde_json::Value::Null);
        Some((status, body))
    })
}

#[test]
fn kills_of_the_server_and_its_workers_lose_no_job_no_charge_and_no_file() {
    let seconds = env_or("HARVEST_FAULT_SECONDS", 120);
    let mut draw = Draw(env_or("HARVEST_FAULT_SEED", 20_261_201).max(1));
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = write_config(dir.path(), port);
    let keys = [create_key(&config, "acme"), create_key(&config, "other")];
    let mut server = start(&config, port);
    let mut jobs: BTreeMap<String, usize> = BTreeMap::new();
    let (mut server_kills, mut worker_kills, mut cancels) = (0, 0, 0);
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(seconds) {
        let who = draw.below(2) as usize;
        let known: Vec<&String> = jobs.keys().collect();
        match draw.below(10) {
            0..=3 => {
                if let Some(id) = submit(&server, &keys[who], &mut draw) {
                    jobs.insert(id, who);
                }
            }
            4 | 5 if !known.is_empty() => {
                let id = known[draw.below(known.len() as u64) as usize].clone();
                let url = format!("{}/v1/harvest/{id}", server.base);
                if let Some((200, _)) = try_request("DELETE", &url, &keys[jobs[&id]], None) {
                    cancels += 1;
                }
            }
            6 if !known.is_empty() => {
                let id = known[draw.below(known.len() as u64) as usize];
                let url = format!("{}/v1/harvest/{id}?wait=2", server.base);
                try_request("GET", &url, &keys[jobs[id]], None);
            }
            7 | 8 => {
                let running: Vec<i32> = jobs.keys().flat_map(|id| harvester_pids(id)).collect();
                if !running.is_empty() {
                    let pid = running[draw.below(running.len() as u64) as usize];
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                    worker_kills += 1;
                }
            }
            _ => {
                std::thread::sleep(Duration::from_millis(draw.below(1500)));
                server.child.kill().unwrap();
                server.child.wait().unwrap();
                drop(server);
                server_kills += 1;
                server = start(&config, port);
            }
        }
    }
    // Let every job end, on a server left alone (also a job admitted just before a kill, whose
    // 202 never reached its client).
    let store =
        harvest_api::embedded::store::Store::open(&dir.path().join("data/harvest.sqlite")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let open: Vec<String> = ["acme", "other"]
            .iter()
            .flat_map(|a| store.jobs_of(a).unwrap())
            .filter(|j| !j.status.is_terminal())
            .map(|j| j.id)
            .collect();
        if open.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "jobs never ended: {open:?}");
        std::thread::sleep(Duration::from_millis(500));
    }
    eprintln!(
        "fault test: {} jobs, {server_kills} server kills, {worker_kills} worker kills, {cancels} cancels in {} s",
        jobs.len(),
        started.elapsed().as_secs()
    );
    check_books_files_and_processes(dir.path(), &store, &jobs);
    assert!(
        server_kills > 0 && !jobs.is_empty(),
        "the draw killed nothing"
    );
    drop(server);
}

/// The end state: charges as the contract says, summed in each ledger; files where and only
/// where jobs are; no harvester left.
fn check_books_files_and_processes(
    dir: &Path,
    store: &harvest_api::embedded::store::Store,
    answered: &BTreeMap<String, usize>,
) {
    let mut all = Vec::new();
    for account in ["acme", "other"] {
        let mut charged = 0;
        for job in store.jobs_of(account).unwrap() {
            let tokens = job.tokens.expect("a terminal job has its charge");
            let expected = match job.status {
                JobStatus::Done => job.result.as_ref().map(|r| r.tokens).unwrap(),
                JobStatus::Cancelled if job.started_at.is_some() => job.reserved,
                JobStatus::Cancelled | JobStatus::Failed => 0,
                other => panic!("job {} is {other:?}", job.id),
            };
            assert_eq!(
                tokens, expected,
                "job {} ({:?}) charged by the contract",
                job.id, job.status
            );
            charged += tokens;
            let out = dir.join("data/jobs").join(&job.id).join("out");
            if job.status == JobStatus::Done {
                let manifest: serde_json::Value = serde_json::from_str(
                    &std::fs::read_to_string(out.join("manifest.json")).unwrap(),
                )
                .unwrap();
                for shard in manifest["shards"].as_array().unwrap() {
                    assert!(
                        out.join(shard["file"].as_str().unwrap()).is_file(),
                        "job {} lost a shard",
                        job.id
                    );
                }
            }
            assert!(
                harvester_pids(&job.id).is_empty(),
                "a harvester of {} is left",
                job.id
            );
            all.push(job.id);
        }
        let (_, ledger) = store.account(account).unwrap();
        assert_eq!(
            ledger.tokens_total, charged,
            "{account}'s ledger is the sum of its charges"
        );
        assert_eq!(
            (ledger.active_small, ledger.active_large),
            (0, 0),
            "{account} holds no slot"
        );
    }
    for id in answered.keys() {
        assert!(all.contains(id), "job {id} was answered 202 and then lost");
    }
    for entry in std::fs::read_dir(dir.join("data/jobs")).unwrap().flatten() {
        let id = entry.file_name().into_string().unwrap();
        assert!(all.contains(&id), "files of no job: {id}");
    }
}
