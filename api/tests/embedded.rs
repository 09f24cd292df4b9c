//! The embedded server for real, on loopback: the `harvest-api` binary, the real `harvester`
//! worker and the real SmolLM2 checkpoint (imported by scripts/fetch-model.sh). Submit,
//! long-poll, download through signed links with a plain HTTP client and no key; cancel; kill
//! the server mid-job and restart it.

#![allow(clippy::unwrap_used)]

mod suite;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use suite::*;

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

#[test]
fn the_seed_flow_long_polls_and_downloads_without_a_key_the_bytes_of_a_direct_run() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = start(&write_config(dir.path(), port, 1), port);
    let key = create_key(&server.config, "acme");
    seed_flow(&server, &key, dir.path());
}

#[test]
fn a_rest_submit_with_project_onto_returns_the_activations_times_the_unit_directions() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = start(&write_config(dir.path(), port, 1), port);
    let key = create_key(&server.config, "acme");
    projection_flow(&server, &key, dir.path());
}

#[test]
fn keys_unknown_jobs_the_account_lane_and_revocation_answer_as_the_contract_says() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = start(&write_config(dir.path(), port, 1), port);
    let key = create_key(&server.config, "other");
    lane_flow(&server, &key);
    revoke_flow(&server, &key, &[]);
}

#[test]
fn cancelling_a_running_job_stops_its_harvester_and_charges_the_reservation() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = start(&write_config(dir.path(), port, 1), port);
    let key = create_key(&server.config, "acme");
    let other = create_key(&server.config, "other");
    let id = cancel_flow(&server, &key, &other, |id| !harvester_pids(id).is_empty());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !harvester_pids(&id).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the harvester of a cancelled job is still running"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
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
