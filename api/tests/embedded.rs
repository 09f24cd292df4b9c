//! The embedded server for real, on loopback: the `harvest-api` binary, the real `harvester`
//! worker and the real SmolLM2 checkpoint (imported by scripts/fetch-model.sh). Submit,
//! long-poll, download through signed links with a plain HTTP client and no key; cancel; kill
//! the server mid-job and restart it.

#![allow(clippy::unwrap_used)]

mod suite;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use suite::*;

fn write_config(dir: &Path, port: u16, max_workers: usize) -> PathBuf {
    write_config_with(dir, port, max_workers, json!({}))
}

/// The test configuration with `extra`'s keys added (or replaced).
fn write_config_with(dir: &Path, port: u16, max_workers: usize, extra: Value) -> PathBuf {
    let mut config = json!({
        "data_dir": dir.join("data"),
        "harvester": harvester(),
        "max_workers": max_workers,
        "worker_threads": 1,
        "public_url": format!("http://127.0.0.1:{port}"),
        "models": [{"name": "smollm2-135m", "path": smollm2(), "lane": "small"}],
        "accounts": [{"name": "acme", "limits": {"daily_tokens": 10_000_000}}, {"name": "other"}],
    });
    if let (Some(config), Some(extra)) = (config.as_object_mut(), extra.as_object()) {
        config.extend(extra.clone());
    }
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
fn keys_unknown_jobs_the_account_lane_the_job_list_and_revocation_answer_as_the_contract_says() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = start(&write_config(dir.path(), port, 1), port);
    let key = create_key(&server.config, "other");
    lane_flow(&server, &key);
    list_flow(&server, &key, &create_key(&server.config, "acme"));
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
    let store =
        harvest_api::embedded::store::Store::open(&dir.path().join("data/harvest.sqlite")).unwrap();
    let (_, ledger) = store.account("acme").unwrap();
    assert_eq!(
        ledger.tokens_today,
        done["tokens"].as_u64().unwrap(),
        "charged once, what ran"
    );
    assert_eq!(ledger.active_small, 0);
}

#[test]
fn a_hosted_key_imports_lists_without_its_secret_and_revokes_by_label() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = write_config(dir.path(), port, 1);
    let server = start(&config, port);
    key_admin_flow(&server, &[]);
}

#[test]
fn an_account_taken_out_of_the_configuration_gets_401_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = write_config(dir.path(), port, 1);
    let server = start(&config, port);
    let key = create_key(&config, "other");
    let models = format!("{}/v1/models", server.base);
    assert_eq!(request("GET", &models, &key, None).0, 200);
    drop(server);
    let mut edited: Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    edited["accounts"] = json!([{"name": "acme"}]);
    std::fs::write(&config, edited.to_string()).unwrap();
    let server = start(&config, port);
    assert_eq!(request("GET", &models, &key, None).0, 401);
    drop(server);
    edited["accounts"] = json!([{"name": "acme"}, {"name": "other"}]);
    std::fs::write(&config, edited.to_string()).unwrap();
    let _server = start(&config, port);
    assert_eq!(
        request("GET", &models, &key, None).0,
        200,
        "restored with it"
    );
}

/// Kills the job's harvester with SIGKILL, as the OOM killer would.
fn kill_harvester(id: &str) {
    for pid in harvester_pids(id) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

#[test]
fn a_harvester_killed_by_a_signal_is_run_again_and_the_job_is_charged_once() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = start(&write_config(dir.path(), port, 1), port);
    let key = create_key(&server.config, "acme");
    let id = long_job(&server, &key);
    wait_for(&server, &key, &id, |j| {
        j["progress"]["prompts_done"].as_u64().unwrap_or(0) >= 4
    });
    let first = harvester_pids(&id);
    kill_harvester(&id);
    let done = wait_for(&server, &key, &id, |j| {
        j["status"]
            .as_str()
            .is_some_and(|s| s != "pending" && s != "running")
    });
    assert_eq!(done["status"], "done", "{done}");
    assert!(!first.is_empty() && harvester_pids(&id).is_empty());
    let store =
        harvest_api::embedded::store::Store::open(&dir.path().join("data/harvest.sqlite")).unwrap();
    let (_, ledger) = store.account("acme").unwrap();
    assert_eq!(
        ledger.tokens_today,
        done["tokens"].as_u64().unwrap(),
        "charged once"
    );
    assert_eq!(ledger.active_small, 0);
}

#[test]
fn a_job_past_the_servers_deadline_fails_naming_it_and_its_harvester_is_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = write_config_with(dir.path(), port, 1, json!({"job_timeout_seconds": 2}));
    let server = start(&config, port);
    let key = create_key(&server.config, "acme");
    let id = long_job(&server, &key);
    let failed = wait_for(&server, &key, &id, |j| j["status"] == "failed");
    let error = failed["error"].as_str().unwrap();
    assert!(error.contains("job_timeout_seconds (2 s)"), "{error}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !harvester_pids(&id).is_empty() {
        assert!(Instant::now() < deadline, "the harvester still runs");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_harvester_gets_none_of_the_servers_environment_but_what_it_needs() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = write_config(dir.path(), port, 1);
    let server = start_with(&config, port, &[("HARVEST_TEST_SECRET", "hunter2")]);
    let key = create_key(&config, "acme");
    let id = long_job(&server, &key);
    wait_for(&server, &key, &id, |_| !harvester_pids(&id).is_empty());
    let pid = harvester_pids(&id)[0];
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let names: Vec<String> = environ
        .split(|&b| b == 0)
        .filter_map(|entry| entry.split(|&b| b == b'=').next())
        .map(|name| String::from_utf8_lossy(name).into_owned())
        .filter(|name| !name.is_empty())
        .collect();
    assert!(
        !names.contains(&"HARVEST_TEST_SECRET".to_owned()),
        "{names:?}"
    );
    for name in &names {
        assert!(
            harvest_api::embedded::workers::PASSED_ENV.contains(&name.as_str())
                || ["RUST_LOG", "HARVEST_THREADS"].contains(&name.as_str()),
            "{name} reached the harvester"
        );
    }
}

#[test]
fn with_a_metrics_port_of_its_own_metrics_are_served_there_and_not_on_the_public_port() {
    let dir = tempfile::tempdir().unwrap();
    let (port, metrics_port) = (free_port(), free_port());
    let metrics_address = format!("127.0.0.1:{metrics_port}");
    let server = start_with(
        &write_config(dir.path(), port, 1),
        port,
        &[("HARVEST_METRICS_LISTEN", metrics_address.as_str())],
    );
    let scraped = String::from_utf8(
        reqwest::blocking_get(&format!("http://{metrics_address}/metrics")).unwrap(),
    )
    .unwrap();
    assert!(scraped.contains("harvest_"), "{scraped}");
    let (status, body) = request("GET", &format!("{}/metrics", server.base), "", None);
    assert_eq!(status, 404, "{body}");
}

/// A value of the server's `/metrics`, if it is listed.
fn metric(server: &Server, name: &str) -> Option<f64> {
    let text = reqwest::blocking_get(&format!("{}/metrics", server.base)).ok()?;
    String::from_utf8(text).ok()?.lines().find_map(|line| {
        let (key, value) = line.split_once(' ')?;
        (key == name).then(|| value.trim().parse().ok()).flatten()
    })
}

#[test]
fn sigterm_answers_open_long_polls_stops_workers_and_the_next_start_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = write_config(dir.path(), port, 1);
    let mut server = start(&config, port);
    let key = create_key(&config, "acme");
    let id = long_job(&server, &key);
    wait_for(&server, &key, &id, |j| {
        j["progress"]["prompts_done"].as_u64().unwrap_or(0) >= 4
    });
    let url = format!("{}/v1/harvest/{id}?wait=60", server.base);
    let poll = {
        let key = key.clone();
        std::thread::spawn(move || {
            let asked = Instant::now();
            let (status, job) = request("GET", &url, &key, None);
            (status, job, asked.elapsed())
        })
    };
    // Signal once the server says the long-poll is waiting.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !metric(&server, "harvest_long_polls_waiting").is_some_and(|n| n >= 1.0) {
        assert!(
            Instant::now() < deadline,
            "the long-poll never began waiting"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let signalled = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let (status, job, waited) = poll.join().unwrap();
    assert_eq!(
        (status, job["status"].as_str()),
        (200, Some("running")),
        "{job}"
    );
    assert!(
        waited < Duration::from_secs(30),
        "the long-poll was answered at once: {waited:?}"
    );
    let exit = server.child.wait().unwrap();
    assert!(exit.success(), "{exit}");
    assert!(
        signalled.elapsed() < Duration::from_secs(30),
        "the server exited within its grace"
    );
    assert!(harvester_pids(&id).is_empty(), "its worker was stopped");
    drop(server);
    let server = start(&config, port);
    let done = wait_for(&server, &key, &id, |j| j["status"] == "done");
    assert_eq!(done["result"]["n_shards"], 6);
}

#[test]
fn an_ended_jobs_files_are_deleted_after_the_retention_and_its_record_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = write_config_with(
        dir.path(),
        port,
        1,
        json!({"retention_days": 3.0 / 86_400.0, "sweep_interval_seconds": 1}),
    );
    let server = start(&config, port);
    let key = create_key(&config, "acme");
    let (status, job) = request(
        "POST",
        &format!("{}/v1/harvest", server.base),
        &key,
        Some(json!({"model": "smollm2-135m", "prompts": SEED})),
    );
    assert_eq!(status, 202, "{job}");
    let id = job["job_id"].as_str().unwrap().to_owned();
    let done = long_poll_done(&server, &key, &id);
    assert!(done["result"].is_object(), "{done}");
    let files = dir.path().join("data/jobs").join(&id);
    assert!(files.join("input/prompts.jsonl").is_file());
    let expired = wait_for(&server, &key, &id, |j| j["urls_expired"] == true);
    assert_eq!(expired["status"], "done");
    assert!(expired.get("result").is_none(), "{expired}");
    assert!(!files.exists(), "inputs and outputs are gone");
    assert_eq!(expired["tokens"], done["tokens"], "the record stays");
}

#[test]
fn a_client_that_never_finishes_its_headers_is_disconnected() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut server = start(&write_config(dir.path(), port, 1), port);
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let asked = Instant::now();
    let mut answer = Vec::new();
    // The server closes the connection (EOF, or a reset) instead of waiting for ever.
    let _ = stream.read_to_end(&mut answer);
    let waited = asked.elapsed();
    assert!(
        waited >= Duration::from_secs(5) && waited < Duration::from_secs(45),
        "closed after {waited:?}, answered {:?}; the server: {:?}",
        String::from_utf8_lossy(&answer),
        server.child.try_wait()
    );
    assert!(
        !String::from_utf8_lossy(&answer).contains("200 OK"),
        "an unfinished request was served"
    );
}

/// Every file of a done job (manifest, stats, shards), fetched through its links.
fn job_files(job: &Value) -> Vec<Vec<u8>> {
    let result = &job["result"];
    let mut urls = vec![result["manifest_url"].clone(), result["stats_url"].clone()];
    urls.extend(result["shard_urls"].as_array().unwrap().iter().cloned());
    urls.iter()
        .map(|url| reqwest::blocking_get(url.as_str().unwrap()).unwrap())
        .collect()
}

#[test]
fn a_job_run_as_three_harvesters_writes_the_bytes_of_one_and_is_charged_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let models = json!({"models": [{"name": "smollm2-135m", "path": smollm2(), "lane": "small", "max_parallelism": 3}]});
    let server = start(&write_config_with(dir.path(), port, 1, models), port);
    let key = create_key(&server.config, "acme");
    let prompts: Vec<String> = (0..14)
        .map(|i| {
            format!(
                "Parallel prompt {i}: {}",
                "the residual stream ".repeat(1 + i % 6)
            )
        })
        .collect();
    let submit = |parallelism: Option<usize>| {
        let mut body = json!({"model": "smollm2-135m", "prompts": prompts, "layers": [3, 17], "shard_size": 3});
        if let Some(n) = parallelism {
            body["parallelism"] = json!(n);
        }
        let id = submit_ok(&server, &key, body);
        wait_for(&server, &key, &id, |j| {
            j["status"] == "done" || j["status"] == "failed"
        })
    };
    let one = submit(None);
    let three = submit(Some(3));
    assert_eq!(three["status"], "done", "{three}");
    // It did run as three: each part left its termination message beside the job's.
    let job_dir = dir
        .path()
        .join("data/jobs")
        .join(three["job_id"].as_str().unwrap());
    for part in 0..3 {
        let log = job_dir.join(format!("termination-part-{part}.log"));
        let text =
            std::fs::read_to_string(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        assert!(text.contains(&format!("\"part\":\"{part}/3\"")), "{text}");
    }
    assert_eq!(three["tokens"], one["tokens"]);
    assert_eq!(job_files(&three), job_files(&one));
    // More processes than shards, or with the norm filter, is refused by name.
    for (extra, named) in [
        (json!({"parallelism": 6}), "more than the job's 5 shards"),
        (
            json!({"parallelism": 2, "max_norm_multiple": 3.0}),
            "max_norm_multiple",
        ),
        (
            json!({"parallelism": 0}),
            "parallelism must be between 1 and 16",
        ),
    ] {
        let mut body = json!({"model": "smollm2-135m", "prompts": prompts, "shard_size": 3});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, answer) = request(
            "POST",
            &format!("{}/v1/harvest", server.base),
            &key,
            Some(body),
        );
        assert_eq!(status, 400, "{answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(named), "{message}");
    }
    parts_flow(&server, &key, 3);
}

#[test]
fn a_random_part_killed_mid_job_is_run_again_from_its_records_and_the_job_is_charged_once() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = start(&write_config(dir.path(), port, 1), port);
    let key = create_key(&server.config, "acme");
    let submit = |parallelism: usize| {
        let body = json!({"model": "smollm2-135m", "prompts": long_prompts(), "layers": "all", "shard_size": 4, "parallelism": parallelism});
        submit_ok(&server, &key, body)
    };
    let single = submit(1);
    let single = wait_for(&server, &key, &single, |j| j["status"] == "done");
    let mut charged = single["tokens"].as_u64().unwrap();
    for parallelism in [2, 3] {
        let id = submit(parallelism);
        wait_for(&server, &key, &id, |j| {
            j["progress"]["prompts_done"].as_u64().unwrap_or(0) >= 4
        });
        let parts = harvester_pids(&id);
        assert_eq!(parts.len(), parallelism, "the parts run at once: {parts:?}");
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos() as usize;
        let victim = parts[nanos % parallelism];
        eprintln!("of {parallelism} parts, killing the harvester with pid {victim}");
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(victim),
            nix::sys::signal::Signal::SIGKILL,
        );
        let done = wait_for(&server, &key, &id, |j| {
            j["status"] != "pending" && j["status"] != "running"
        });
        assert_eq!(done["status"], "done", "{done}");
        assert_eq!(job_files(&done), job_files(&single), "{parallelism} parts");
        charged += done["tokens"].as_u64().unwrap();
    }
    let store =
        harvest_api::embedded::store::Store::open(&dir.path().join("data/harvest.sqlite")).unwrap();
    let (_, ledger) = store.account("acme").unwrap();
    assert_eq!(ledger.tokens_today, charged, "each job charged once");
}

#[test]
fn a_running_jobs_ready_shards_download_as_the_bytes_the_finished_job_lists() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = start(&write_config(dir.path(), port, 1), port);
    let key = create_key(&server.config, "acme");
    for parallelism in [1, 2] {
        let body = json!({"model": "smollm2-135m", "prompts": long_prompts(), "layers": "all",
            "shard_size": 4, "parallelism": parallelism});
        let early = partial_flow(&server, &key, body);
        eprintln!("{parallelism} part(s): {early} of 6 shards read before the end");
    }
    // A shuffled job has nothing ready before it commits, and says so.
    let body = json!({"model": "smollm2-135m", "prompts": long_prompts(), "layers": [3],
        "shard_size": 4, "layout": "shuffled"});
    let id = submit_ok(&server, &key, body);
    let url = format!("{}/v1/harvest/{id}?partial=true", server.base);
    let (_, job) = request("GET", &url, &key, None);
    assert!(
        job["status"] == "pending" || job["status"] == "running",
        "{job}"
    );
    assert_eq!(job["ready_shard_urls"], json!([]));
    let why = job["partial"]["unavailable"].as_str().unwrap();
    assert!(why.contains("shuffled layout"), "{why}");
    partial_refusals(&server, &key, &id);
    wait_for(&server, &key, &id, |j| j["status"] == "done");
}

/// The reference conversations and SmolLM2's token ids for them, as transformers'
/// `apply_chat_template` makes them (`scripts/reference/make_chat_fixtures.py`).
fn chat_reference() -> (Vec<Value>, Vec<Vec<u32>>, Vec<Vec<u8>>) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../harvester/tests/fixtures/chat/reference.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases: Vec<&Value> = reference["families"]["smollm2"]["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|case| case["add_generation_prompt"] == true)
        .collect();
    let conversations = cases
        .iter()
        .map(|case| {
            reference["conversations"][case["conversation"].as_u64().unwrap() as usize].clone()
        })
        .collect();
    let ids = cases
        .iter()
        .map(|case| serde_json::from_value(case["ids"].clone()).unwrap())
        .collect();
    let roles = cases
        .iter()
        .map(|case| serde_json::from_value(case["roles"].clone()).unwrap())
        .collect();
    (conversations, ids, roles)
}

#[test]
fn a_job_of_conversations_counts_and_harvests_the_chat_template_s_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let server = start(&write_config(dir.path(), port, 1), port);
    let key = create_key(&server.config, "acme");
    let (conversations, expected, roles) = chat_reference();
    let url = format!("{}/v1/harvest", server.base);
    let body = json!({"model": "smollm2-135m", "conversations": conversations,
                      "add_generation_prompt": true, "layers": [3], "shard_size": 8});
    let mut dry = body.clone();
    dry["dry_run"] = json!(true);
    let (status, counted) = request("POST", &url, &key, Some(dry));
    assert_eq!(status, 200, "{counted}");
    let tokens: u64 = expected.iter().map(|ids| ids.len() as u64).sum();
    assert_eq!(
        counted["tokens"], tokens,
        "the count is of the template's tokens: {counted}"
    );
    assert_eq!(counted["n_prompts"], expected.len());
    let job = submit_ok(&server, &key, body.clone());
    let done = long_poll_done(&server, &key, &job);
    assert_eq!(done["result"]["tokens"], tokens, "{done}");
    let shard = reqwest::blocking_get(done["result"]["shard_urls"][0].as_str().unwrap()).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&shard).unwrap();
    for (prompt, ids) in expected.iter().enumerate() {
        let tokens: Vec<u32> = tensors
            .tensor(&format!("tokens_{prompt}"))
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(&tokens, ids, "conversation {prompt}");
        assert_eq!(
            tensors.tensor(&format!("roles_{prompt}")).unwrap().data(),
            &roles[prompt][..],
            "conversation {prompt}"
        );
    }
    // Assistant-only: the dry run counts what the worker keeps, and the bytes it writes.
    let assistant: u64 = roles.iter().flatten().filter(|&&r| r == 3).count() as u64;
    let mut only = body.clone();
    only["roles"] = json!(["assistant"]);
    let mut dry = only.clone();
    dry["dry_run"] = json!(true);
    let (status, counted) = request("POST", &url, &key, Some(dry));
    assert_eq!(status, 200, "{counted}");
    assert_eq!(counted["kept_tokens"], assistant, "{counted}");
    let job = submit_ok(&server, &key, only);
    let done = long_poll_done(&server, &key, &job);
    let manifest: Value = reqwest::blocking_get(done["result"]["manifest_url"].as_str().unwrap())
        .map(|bytes| serde_json::from_slice(&bytes).unwrap())
        .unwrap();
    assert_eq!(
        manifest["selection"]["kept_tokens"], assistant,
        "{manifest}"
    );
    assert_eq!(
        manifest["selection"]["rules"]["roles"],
        json!(["assistant"])
    );
    assert_eq!(manifest["roles"]["ids"]["3"], "assistant");
    assert_eq!(
        manifest["shards"][0]["bytes"], counted["files"]["shards"]["bytes"],
        "the dry run predicts the shard to the byte"
    );
    // roles on plain prompts is refused by name.
    let (status, refused) = request(
        "POST",
        &url,
        &key,
        Some(json!({"model": "smollm2-135m", "prompts": ["hi"], "roles": ["assistant"]})),
    );
    assert_eq!(status, 400, "{refused}");
    assert!(refused.to_string().contains("roles"), "{refused}");
    // A refusal names what to do: a role the seed API knows nothing of.
    let (status, refused) = request(
        "POST",
        &url,
        &key,
        Some(
            json!({"model": "smollm2-135m", "conversations": [[{"role": "narrator", "content": "x"}]]}),
        ),
    );
    assert_eq!(status, 400, "{refused}");
    assert!(refused.to_string().contains("narrator"), "{refused}");
}

#[test]
fn a_router_job_on_a_moe_model_returns_its_expert_choices_as_predicted_and_a_dense_model_refuses() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let afmoe =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../harvester/tests/fixtures/tiny-afmoe-bf16");
    let models = json!([
        {"name": "smollm2-135m", "path": smollm2(), "lane": "small"},
        {"name": "tiny-afmoe", "path": afmoe, "lane": "small"},
    ]);
    let config = write_config_with(dir.path(), port, 1, json!({ "models": models }));
    let server = start(&config, port);
    let key = create_key(&server.config, "acme");
    let url = format!("{}/v1/harvest", server.base);
    let body = json!({"model": "tiny-afmoe", "prompts": ["The quick brown fox.", "Experts, routed."],
                      "layers": [1, 3, 4], "sites": ["resid_post", "router"]});
    let mut dry = body.clone();
    dry["dry_run"] = json!(true);
    let (status, counted) = request("POST", &url, &key, Some(dry));
    assert_eq!(status, 200, "{counted}");
    let job = submit_ok(&server, &key, body);
    let done = long_poll_done(&server, &key, &job);
    let manifest: Value = reqwest::blocking_get(done["result"]["manifest_url"].as_str().unwrap())
        .map(|bytes| serde_json::from_slice(&bytes).unwrap())
        .unwrap();
    assert_eq!(
        manifest["router"]["layer_indices"],
        json!([3, 4]),
        "{manifest}"
    );
    assert_eq!(manifest["router"]["experts_per_token"], 2);
    assert_eq!(
        manifest["shards"][0]["bytes"], counted["files"]["shards"]["bytes"],
        "the dry run predicts the shard to the byte"
    );
    let shard = reqwest::blocking_get(done["result"]["shard_urls"][0].as_str().unwrap()).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&shard).unwrap();
    let tokens = tensors.tensor("tokens_1").unwrap().shape()[0];
    let ids = tensors.tensor("router_ids_1").unwrap();
    assert_eq!(ids.shape(), [2, tokens, 2]);
    let experts: Vec<i32> = ids
        .data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert!(experts.iter().all(|e| (0..8).contains(e)), "{experts:?}");
    assert!(
        experts.chunks(2).all(|pair| pair[0] != pair[1]),
        "two experts per token"
    );
    // A dense model, or no kept sparse layer, is refused by name.
    for (request_body, named) in [
        (
            json!({"model": "smollm2-135m", "prompts": ["hi"], "sites": ["resid_post", "router"]}),
            "smollm2-135m is dense",
        ),
        (
            json!({"model": "tiny-afmoe", "prompts": ["hi"], "layers": [0, 1], "sites": ["resid_post", "router"]}),
            "layers 2..=4",
        ),
    ] {
        let (status, refused) = request("POST", &url, &key, Some(request_body));
        assert_eq!(status, 400, "{refused}");
        assert!(refused.to_string().contains(named), "{refused}");
    }
}
