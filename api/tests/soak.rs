//! The soak: mixed traffic against the embedded server (submits that run, status polls,
//! long-polls, cancels and downloads) for `HARVEST_SOAK_SECONDS` (60 in CI; the note reports a
//! ten-minute run), sampling the server's resident memory and open file descriptors. Neither
//! may grow once the server is warm. Latency is the benchmark's business
//! (`scripts/bench_api.py`), not this test's.

#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod suite;

use std::time::{Duration, Instant};

use serde_json::json;
use suite::*;

/// The server's resident set (KiB) and its open file descriptors.
fn footprint(pid: u32) -> (u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    (rss, fds)
}

#[test]
fn memory_and_file_descriptors_stay_flat_under_mixed_traffic() {
    let seconds: u64 = std::env::var("HARVEST_SOAK_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = dir.path().join("config.json");
    std::fs::write(
        &config,
        json!({
            "data_dir": dir.path().join("data"), "harvester": harvester(), "max_workers": 1,
            "worker_threads": 1, "public_url": format!("http://127.0.0.1:{port}"),
            "models": [{"name": "smollm2-135m", "path": smollm2(), "lane": "small"}],
            "accounts": [{"name": "soak", "limits": {"daily_tokens": 1_000_000_000,
                "monthly_jobs_per_key": 1_000_000, "small_concurrency": 3}}],
        })
        .to_string(),
    )
    .unwrap();
    let key = create_key(&config, "soak");
    let server = start(&config, port);
    let pid = server.child.id();
    let base = server.base.clone();
    let started = Instant::now();
    let mut samples = Vec::new();
    let mut last_sample = Instant::now() - Duration::from_secs(10);
    let (mut requests, mut jobs) = (0u64, Vec::<String>::new());
    let mut round = 0u64;
    while started.elapsed() < Duration::from_secs(seconds) {
        round += 1;
        if round % 20 == 1 {
            let (status, job) = request(
                "POST",
                &format!("{base}/v1/harvest"),
                &key,
                Some(json!({"model": "smollm2-135m", "prompts": SEED, "layers": [3]})),
            );
            if status == 202 {
                jobs.push(job["job_id"].as_str().unwrap().to_owned());
            }
            requests += 1;
        }
        if let Some(id) = jobs.last() {
            let url = format!("{base}/v1/harvest/{id}");
            let (_, job) = request("GET", &url, &key, None);
            requests += 1;
            if round.is_multiple_of(7) {
                request("GET", &format!("{url}?wait=1"), &key, None);
                requests += 1;
            }
            if round % 20 == 10 && job["status"] == "pending" {
                request("DELETE", &url, &key, None);
                requests += 1;
            }
            if let Some(link) = job["result"]["shard_urls"][0].as_str()
                && round.is_multiple_of(5)
            {
                assert!(!reqwest::blocking_get(link).unwrap().is_empty());
                requests += 1;
            }
        }
        if last_sample.elapsed() >= Duration::from_secs(5) {
            samples.push(footprint(pid));
            last_sample = Instant::now();
        }
    }
    samples.push(footprint(pid));
    eprintln!(
        "soak: {requests} requests, {} jobs in {} s; (RSS KiB, fds) every 5 s: {samples:?}",
        jobs.len(),
        started.elapsed().as_secs()
    );
    // Warm after the first quarter: caches, pools and the first jobs' buffers exist by then.
    let warm = samples[samples.len() / 4];
    let last = *samples.last().unwrap();
    assert!(
        last.1 <= warm.1 + 16,
        "file descriptors grew from {} to {}",
        warm.1,
        last.1
    );
    assert!(
        last.0 <= warm.0 + warm.0 / 5 + 16 * 1024,
        "resident memory grew from {} KiB to {} KiB",
        warm.0,
        last.0
    );
}
