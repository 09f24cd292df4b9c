//! The black-box REST suite, shared by the embedded and the Kubernetes backends: the same
//! client calls against the `harvest-api` binary, whatever runs the jobs behind it.
#![allow(clippy::unwrap_used, dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub struct Server {
    pub child: Child,
    pub base: String,
    pub config: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub use harvest_testkit::{free_port, harvester, smollm2};

pub fn start(config: &Path, port: u16) -> Server {
    start_with(config, port, &[])
}

/// Starts the server binary with extra environment variables.
pub fn start_with(config: &Path, port: u16, env: &[(&str, &str)]) -> Server {
    let child = Command::new(env!("CARGO_BIN_EXE_harvest-api"))
        .args([
            "--config",
            config.to_str().unwrap(),
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut server = Server {
        child,
        base: base.clone(),
        config: config.to_owned(),
    };
    while reqwest::blocking_get(&format!("{base}/healthz")).is_err() {
        if let Ok(Some(exit)) = server.child.try_wait() {
            panic!("the server exited at start ({exit}): is port {port} taken?");
        }
        assert!(Instant::now() < deadline, "the server did not come up");
        std::thread::sleep(Duration::from_millis(100));
    }
    server
}

pub fn create_key(config: &Path, account: &str) -> String {
    create_key_with(config, account, &[])
}

/// Creates a key through the binary with extra environment variables.
pub fn create_key_with(config: &Path, account: &str, env: &[(&str, &str)]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_harvest-api"))
        .args([
            "--config",
            config.to_str().unwrap(),
            "create-key",
            "--account",
            account,
        ])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

pub mod reqwest {
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

pub fn request(method: &str, url: &str, key: &str, body: Option<Value>) -> (u16, Value) {
    let (status, body, _) = request_with_headers(method, url, key, body);
    (status, body)
}

/// A request's status, JSON body and `Retry-After` header.
pub fn request_with_headers(
    method: &str,
    url: &str,
    key: &str,
    body: Option<Value>,
) -> (u16, Value, Option<String>) {
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
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        (
            status,
            response.json().await.unwrap_or(Value::Null),
            retry_after,
        )
    })
}

pub const SEED: [&str; 2] = [
    "The quick brown fox jumps over the lazy dog.",
    "Interpretability research reads the residual stream.",
];

/// Harvester processes working on `job_id` (embedded backend; on the fake cluster the
/// kubelet's processes carry the plan inline).
pub fn harvester_pids(job_id: &str) -> Vec<i32> {
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

/// 24 prompts of some 90 tokens each: with all layers, a job that runs for seconds.
pub fn long_prompts() -> Vec<String> {
    (0..24)
        .map(|i| {
            format!(
                "Prompt {i}: {}",
                "the residual stream of a language model ".repeat(12)
            )
        })
        .collect()
}

/// Submits `body` and returns the job's id, checking that it was accepted.
pub fn submit_ok(server: &Server, key: &str, body: Value) -> String {
    let url = format!("{}/v1/harvest", server.base);
    let (status, job) = request("POST", &url, key, Some(body));
    assert_eq!(status, 202, "{job}");
    job["job_id"].as_str().unwrap().to_owned()
}

/// Cancels job `id` and returns its answer, checking that it reads as cancelled.
pub fn cancel_ok(server: &Server, key: &str, id: &str) -> Value {
    let url = format!("{}/v1/harvest/{id}", server.base);
    let (status, job) = request("DELETE", &url, key, None);
    assert_eq!(
        (status, job["status"].as_str()),
        (200, Some("cancelled")),
        "{job}"
    );
    job
}

pub fn long_job(server: &Server, key: &str) -> String {
    let body = json!({"model": "smollm2-135m", "prompts": long_prompts(), "layers": "all", "shard_size": 4});
    submit_ok(server, key, body)
}

pub fn wait_for(server: &Server, key: &str, id: &str, what: impl Fn(&Value) -> bool) -> Value {
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

/// The seed client's flow, black-box: submit, long-poll to done, then download the files with
/// a plain client and no key and compare them byte for byte with a direct harvester run.
pub fn seed_flow(server: &Server, key: &str, dir: &Path) -> Value {
    let body = json!({"model": "smollm2-135m", "prompts": SEED, "layers": [8, 16, 24]});
    let url = format!("{}/v1/harvest", server.base);
    let mut dry = body.clone();
    dry["dry_run"] = json!(true);
    let (status, predicted) = request("POST", &url, key, Some(dry.clone()));
    assert_eq!(status, 200, "{predicted}");
    let (status, job) = request("POST", &url, key, Some(body));
    assert_eq!(status, 202, "{job}");
    assert_eq!(job["estimate"]["bytes"], predicted["total_bytes"], "{job}");
    let done = long_poll_done(server, key, job["job_id"].as_str().unwrap());
    let (written, total) = (
        done["result"]["bytes_written"].as_u64().unwrap(),
        predicted["total_bytes"].as_u64().unwrap(),
    );
    assert!(
        written.abs_diff(total) * 100 <= written,
        "the dry run said {total} bytes, the job wrote {written}"
    );
    // Now that a job of the model ran, a dry run also estimates the time.
    let (_, again) = request("POST", &url, key, Some(dry));
    assert!(
        again["tokens_per_second"].as_f64().unwrap() > 0.0,
        "{again}"
    );
    assert!(
        again["estimated_seconds"].as_f64().unwrap() > 0.0,
        "{again}"
    );
    assert_eq!(done["tokens"], done["result"]["tokens"]);
    assert!(done["urls_expire_at"].as_str().unwrap().ends_with("+00:00"));

    let direct = direct_run(dir, "8,16,24");
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
    done
}

/// Long-polls job `id` until it is done (a few waits of 60 s at most).
pub fn long_poll_done(server: &Server, key: &str, id: &str) -> Value {
    let url = format!("{}/v1/harvest/{id}?wait=60", server.base);
    for _ in 0..5 {
        let (_, answer) = request("GET", &url, key, None);
        if answer["status"] == "done" {
            return answer;
        }
        assert!(
            ["pending", "running"].contains(&answer["status"].as_str().unwrap()),
            "{answer}"
        );
    }
    panic!("job {id} is not done after five long-polls")
}

/// `harvester run` of the seed prompts on SmolLM2 into `dir/direct`, keeping `layers`.
pub fn direct_run(dir: &Path, layers: &str) -> PathBuf {
    let prompts = dir.join("direct.jsonl");
    std::fs::write(&prompts, harvest_core::worker::write_prompts_jsonl(&SEED)).unwrap();
    let direct = dir.join("direct");
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
            layers,
            "--progress",
            "off",
            "--model-name",
            "smollm2-135m",
        ])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    direct
}

/// A tensor of a safetensors file as f32 (bf16 or f32 on disk), with its shape.
fn tensor_f32(bytes: &[u8], name: &str) -> (Vec<usize>, Vec<f32>) {
    let file = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let view = file.tensor(name).unwrap();
    let values = match view.dtype() {
        safetensors::Dtype::BF16 => view
            .data()
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        safetensors::Dtype::F32 => view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        other => panic!("{name} has dtype {other:?}"),
    };
    (view.shape().to_vec(), values)
}

/// A REST submit with `project_onto` (float32, base64, not unit length), checked end to end:
/// each projection equals the raw activation of a direct run times the unit direction, within
/// the bf16 rounding of that activation. The directions are sparse (`5·e₃` and `3·e₅ + 4·e₁₀`),
/// so that rounding bound is tight enough to catch a wrong scale or a missing normalisation.
pub fn projection_flow(server: &Server, key: &str, dir: &Path) {
    const HIDDEN: usize = 576;
    let mut directions = vec![0.0f32; 2 * HIDDEN];
    directions[3] = 5.0;
    directions[HIDDEN + 5] = 3.0;
    directions[HIDDEN + 10] = 4.0;
    let bytes: Vec<u8> = directions.iter().flat_map(|v| v.to_le_bytes()).collect();
    let data = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, &bytes);
    let (status, job) = request(
        "POST",
        &format!("{}/v1/harvest", server.base),
        key,
        Some(
            json!({"model": "smollm2-135m", "prompts": SEED, "layers": [8, 16],
            "project_onto": {"data": data, "dtype": "float32", "shape": [2, HIDDEN]}}),
        ),
    );
    assert_eq!(status, 202, "{job}");
    let done = long_poll_done(server, key, job["job_id"].as_str().unwrap());
    assert_eq!(done["result"]["contents"], "projections");
    let shard = reqwest::blocking_get(done["result"]["shard_urls"][0].as_str().unwrap()).unwrap();
    let raw = std::fs::read(direct_run(dir, "8,16").join("shard_00000.safetensors")).unwrap();
    let units: Vec<Vec<f64>> = directions
        .chunks_exact(HIDDEN)
        .map(|d| {
            let norm = d.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>().sqrt();
            d.iter().map(|&v| f64::from(v) / norm).collect()
        })
        .collect();
    for prompt in 0..SEED.len() {
        let (shape, projected) = tensor_f32(&shard, &format!("prompt_{prompt}"));
        let (raw_shape, activations) = tensor_f32(&raw, &format!("prompt_{prompt}"));
        assert_eq!(shape, [2, raw_shape[1], 2], "prompt {prompt}");
        for (row, x) in activations.chunks_exact(HIDDEN).enumerate() {
            for (d, unit) in units.iter().enumerate() {
                let terms = x.iter().zip(unit).map(|(&a, &u)| f64::from(a) * u);
                let expected: f64 = terms.clone().sum();
                // The shard's activations are bf16: each within 2⁻⁹ of the f32 one projected.
                let bound = terms.map(f64::abs).sum::<f64>() / 256.0 + 1e-6;
                let got = f64::from(projected[row * 2 + d]);
                assert!(
                    (got - expected).abs() <= bound,
                    "prompt {prompt}, row {row}, direction {d}: {got} vs {expected} (bound {bound})"
                );
            }
        }
    }
}

/// Cancels a running job: 200 `cancelled`, charged the reservation, and invisible to another
/// account's key. Returns the job id.
pub fn cancel_flow(
    server: &Server,
    key: &str,
    other_key: &str,
    running: impl Fn(&str) -> bool,
) -> String {
    let id = long_job(server, key);
    wait_for(server, key, &id, |j| {
        j["status"] == "running" && running(j["job_id"].as_str().unwrap_or_default())
    });
    let (status, cancelled) = request(
        "DELETE",
        &format!("{}/v1/harvest/{id}", server.base),
        key,
        None,
    );
    assert_eq!(
        (status, cancelled["status"].as_str()),
        (200, Some("cancelled")),
        "{cancelled}"
    );
    assert_eq!(cancelled["tokens"], cancelled["reserved_tokens"]);
    let (status, _) = request(
        "GET",
        &format!("{}/v1/harvest/{id}", server.base),
        other_key,
        None,
    );
    assert_eq!(status, 404);
    let (status, again) = request(
        "DELETE",
        &format!("{}/v1/harvest/{id}", server.base),
        key,
        None,
    );
    assert_eq!(
        (status, again["status"].as_str()),
        (200, Some("cancelled")),
        "cancel is idempotent"
    );
    id
}

/// The contract's answers that depend on the backend: a wrong key is 401, an unknown job 404,
/// the fourth concurrent small job of an account (limit 3) 429 `harvest_concurrency_exceeded`
/// with `Retry-After: 30` naming the lane, and a slot freed by a cancel is usable again as soon
/// as the cancel has answered.
pub fn lane_flow(server: &Server, key: &str) {
    let submit = || {
        request_with_headers(
            "POST",
            &format!("{}/v1/harvest", server.base),
            key,
            Some(json!({"model": "smollm2-135m", "prompts": SEED, "layers": [1]})),
        )
    };
    let (status, _) = request(
        "GET",
        &format!(
            "{}/v1/harvest/00000000-0000-4000-8000-000000000000",
            server.base
        ),
        "sk-hv-not-a-key",
        None,
    );
    assert_eq!(status, 401);
    let (status, body) = request(
        "GET",
        &format!(
            "{}/v1/harvest/00000000-0000-4000-8000-000000000000",
            server.base
        ),
        key,
        None,
    );
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("not_found"))
    );
    let mut ids = Vec::new();
    for _ in 0..3 {
        let (status, job, _) = submit();
        assert_eq!(status, 202, "{job}");
        ids.push(job["job_id"].as_str().unwrap().to_owned());
    }
    let (status, denied, retry_after) = submit();
    assert_eq!(
        (
            status,
            denied["error"]["code"].as_str(),
            retry_after.as_deref()
        ),
        (429, Some("harvest_concurrency_exceeded"), Some("30")),
        "{denied}"
    );
    assert!(
        denied["error"]["message"]
            .as_str()
            .unwrap()
            .contains("small lane"),
        "{denied}"
    );
    for id in &ids {
        cancel_ok(server, key, id);
    }
    // A slot is free the moment its cancel answers, on both backends: the resubmit right
    // after is admitted.
    let (status, job, _) = submit();
    assert_eq!(
        status, 202,
        "the cancelled jobs did not free their slots: {job}"
    );
    let id = job["job_id"].as_str().unwrap();
    request(
        "DELETE",
        &format!("{}/v1/harvest/{id}", server.base),
        key,
        None,
    );
}

/// Revokes a key through the binary; whether it was an active key.
pub fn revoke_key_with(config: &Path, key: &str, env: &[(&str, &str)]) -> bool {
    Command::new(env!("CARGO_BIN_EXE_harvest-api"))
        .args(["--config", config.to_str().unwrap(), "revoke-key", key])
        .envs(env.iter().copied())
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success()
}

/// A revoked key is refused (401) within seconds, and revoking it again says it is not active.
pub fn revoke_flow(server: &Server, key: &str, env: &[(&str, &str)]) {
    let models = format!("{}/v1/models", server.base);
    assert_eq!(request("GET", &models, key, None).0, 200);
    assert!(revoke_key_with(&server.config, key, env));
    let deadline = Instant::now() + Duration::from_secs(5);
    while request("GET", &models, key, None).0 != 401 {
        assert!(Instant::now() < deadline, "a revoked key still works");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!revoke_key_with(&server.config, key, env), "revoked twice");
}

/// After [`lane_flow`] (its jobs all cancelled): `GET /v1/harvest` walks the key's account's jobs
/// newest first, a page at a time, filters by status, and shows none of them to another
/// account; `GET /v1/account` counts them against the key's monthly quota.
pub fn list_flow(server: &Server, key: &str, other_key: &str) {
    let walk = |key: &str, query: &str| {
        let mut jobs: Vec<Value> = Vec::new();
        let mut after = String::new();
        loop {
            let url = format!("{}/v1/harvest?limit=2{query}{after}", server.base);
            let (status, page) = request("GET", &url, key, None);
            assert_eq!(status, 200, "{url}: {page}");
            jobs.extend(page["data"].as_array().unwrap().iter().cloned());
            match page["next_after"].as_str() {
                Some(next) => after = format!("&after={next}"),
                None => return jobs,
            }
        }
    };
    let all = walk(key, "");
    assert!(all.len() >= 4, "lane_flow made at least four jobs: {all:?}");
    let created: Vec<&str> = all
        .iter()
        .map(|j| j["created_at"].as_str().unwrap())
        .collect();
    assert!(
        created.windows(2).all(|w| w[0] >= w[1]),
        "newest first: {created:?}"
    );
    let ids: Vec<&str> = all.iter().map(|j| j["job_id"].as_str().unwrap()).collect();
    let unique: std::collections::BTreeSet<&str> = ids.iter().copied().collect();
    assert_eq!(unique.len(), ids.len(), "each job once: {ids:?}");
    assert!(all.iter().all(|j| j["status"] == "cancelled"), "{all:?}");
    let cancelled = walk(key, "&status=cancelled");
    assert_eq!(cancelled, all);
    assert!(walk(key, "&status=done").is_empty());
    let theirs = walk(other_key, "");
    assert!(
        theirs
            .iter()
            .all(|j| !unique.contains(j["job_id"].as_str().unwrap())),
        "another account sees none of them: {theirs:?}"
    );
    let (status, usage) = request("GET", &format!("{}/v1/account", server.base), key, None);
    assert_eq!(status, 200, "{usage}");
    // Embedded counts every job the key made this month; Kubernetes only those the operator
    // admitted or that wait for it, so a job cancelled before admission is not counted there.
    let counted = usage["key_jobs_this_month"]["used"].as_u64().unwrap();
    assert!(counted <= ids.len() as u64, "{usage}");
    assert_eq!(usage["lanes"]["small"]["limit"], 3, "{usage}");
}

/// `harvest-api` run as an admin would, with extra environment: its exit status, stdout and
/// stderr.
pub fn admin(
    config: &Path,
    env: &[(&str, &str)],
    args: &[&str],
    stdin: Option<&str>,
) -> (bool, String, String) {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_harvest-api"))
        .arg("--config")
        .arg(config)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
    drop(input);
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The key commands as an operator uses them: a hosted key imported from stdin works, a key
/// of another service is refused naming the accepted prefixes, `list-keys` shows the label and
/// prefix but never the key, and `revoke-key --label` revokes it (a second time says none is
/// left).
pub fn key_admin_flow(server: &Server, env: &[(&str, &str)]) {
    let config = &server.config;
    let models = format!("{}/v1/models", server.base);
    let hosted = "sk-acs-9f8e7d6c5b4a39281706f5e4";
    let import = [
        "create-key",
        "--account",
        "acme",
        "--label",
        "moved",
        "--import",
        "-",
    ];
    let (ok, out, err) = admin(config, env, &import, Some(hosted));
    assert!(ok && out.is_empty(), "{err}");
    // A key made moments ago may take a watch round trip to reach the server's cache.
    let deadline = Instant::now() + Duration::from_secs(30);
    while request("GET", &models, hosted, None).0 != 200 {
        assert!(Instant::now() < deadline, "the imported key never worked");
        std::thread::sleep(Duration::from_millis(100));
    }
    let foreign = [
        "create-key",
        "--account",
        "acme",
        "--import",
        "ak-live-1234567890abcdefgh",
    ];
    let (ok, _, err) = admin(config, env, &foreign, None);
    assert!(!ok && err.contains("sk-acs-"), "{err}");
    let (ok, listing, err) = admin(config, env, &["list-keys", "--account", "acme"], None);
    assert!(ok, "{err}");
    assert!(
        listing.contains("moved") && listing.contains("sk-acs-9f8e"),
        "{listing}"
    );
    assert!(!listing.contains(hosted), "the key itself is never listed");
    let (ok, _, err) = admin(config, env, &["revoke-key", "--label", "moved"], None);
    assert!(ok, "{err}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while request("GET", &models, hosted, None).0 != 401 {
        assert!(Instant::now() < deadline, "the revoked key still works");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (ok, _, err) = admin(config, env, &["revoke-key", "--label", "moved"], None);
    assert!(!ok && err.contains("no active key is labelled"), "{err}");
}

/// The files of a done job, downloaded: the manifest (its `job_uid` and job id left out, which
/// are all two jobs of one plan may differ by), the statistics and every shard.
fn downloaded(job: &Value) -> (Value, Vec<Vec<u8>>) {
    let result = &job["result"];
    let get = |url: &Value| reqwest::blocking_get(url.as_str().unwrap()).unwrap();
    let id = job["job_id"].as_str().unwrap();
    let manifest = String::from_utf8(get(&result["manifest_url"])).unwrap();
    let mut manifest: Value = serde_json::from_str(&manifest.replace(id, "JOB")).unwrap();
    manifest.as_object_mut().unwrap().remove("job_uid");
    let mut files = vec![get(&result["stats_url"])];
    files.extend(result["shard_urls"].as_array().unwrap().iter().map(get));
    (manifest, files)
}

/// A job sent with the `parallelism` extension runs in that many workers and writes the
/// files of one, charged the same; past the model's cap (`max_parallelism`, given as
/// `cap`) it is refused with 400 naming the cap. Both jobs cut their prompts with
/// `max_prompt_tokens`, which reaches every worker.
pub fn parts_flow(server: &Server, key: &str, cap: usize) {
    let prompts: Vec<String> = (0..10)
        .map(|i| {
            format!(
                "Part prompt {i}: {}",
                "the residual stream ".repeat(1 + i % 4)
            )
        })
        .collect();
    let body = |parallelism: Option<usize>| {
        let mut body = json!({"model": "smollm2-135m", "prompts": prompts, "layers": [3, 17], "shard_size": 2, "max_prompt_tokens": 9});
        if let Some(n) = parallelism {
            body["parallelism"] = json!(n);
        }
        body
    };
    let done = |id: String| {
        wait_for(server, key, &id, |j| {
            j["status"] == "done" || j["status"] == "failed"
        })
    };
    let one = done(submit_ok(server, key, body(None)));
    let parts = done(submit_ok(server, key, body(Some(cap))));
    assert_eq!(parts["status"], "done", "{parts}");
    assert_eq!(parts["tokens"], one["tokens"]);
    let (manifest, files) = downloaded(&parts);
    assert_eq!(manifest["tokenizer"]["max_tokens"], 9);
    let cut = manifest["truncated_prompts"].as_array().unwrap();
    assert!(!cut.is_empty() && cut.len() < 10, "{cut:?}");
    assert_eq!((manifest, files), downloaded(&one));
    let (status, answer) = request(
        "POST",
        &format!("{}/v1/harvest", server.base),
        key,
        Some(body(Some(cap + 1))),
    );
    assert_eq!(status, 400, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains(&format!("cap of {cap}")), "{message}");
}

/// Hex sha256, as the ready list gives it.
fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Reading a job while it runs (`?partial=true`): submits `body`, fetches every shard the
/// running job lists as ready (each at its size and sha256, and its prompts in its range),
/// then checks each against the same file of the done job, byte for byte. Returns how many
/// shards were read before the end.
pub fn partial_flow(server: &Server, key: &str, body: Value) -> usize {
    let id = submit_ok(server, key, body);
    let url = format!("{}/v1/harvest/{id}?partial=true", server.base);
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut early: std::collections::BTreeMap<String, Vec<u8>> = Default::default();
    let done = loop {
        let (status, job) = request("GET", &url, key, None);
        assert_eq!(status, 200, "{job}");
        if job["status"] != "pending" && job["status"] != "running" {
            assert!(job.get("ready_shard_urls").is_none(), "{job}");
            break job;
        }
        let ready = job["ready_shard_urls"].as_array().expect("listed").clone();
        let info = &job["partial"];
        assert_eq!(info["shards_total"], 6, "{job}");
        for shard in ready {
            let file = shard["file"].as_str().unwrap().to_owned();
            if early.contains_key(&file) {
                continue;
            }
            let bytes = reqwest::blocking_get(shard["url"].as_str().unwrap()).unwrap();
            assert_eq!(bytes.len() as u64, shard["bytes"].as_u64().unwrap());
            assert_eq!(sha256_hex(&bytes), shard["sha256"].as_str().unwrap());
            let index: usize = file[6..11].parse().unwrap();
            assert_eq!(shard["prompts"], json!([index * 4, index * 4 + 3]));
            assert_eq!(info["bos_token_id"], 1, "SmolLM2's BOS, from the records");
            early.insert(file, bytes);
        }
        assert!(Instant::now() < deadline, "timed out; last state {job}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(done["status"], "done", "{done}");
    assert!(
        !early.is_empty(),
        "no shard was ready while the job ran: the job ended before a poll saw one"
    );
    let urls = done["result"]["shard_urls"].as_array().unwrap();
    for (file, bytes) in &early {
        let index: usize = file[6..11].parse().unwrap();
        let finished = reqwest::blocking_get(urls[index].as_str().unwrap()).unwrap();
        assert!(&finished == bytes, "{file} changed after it was listed");
    }
    early.len()
}

/// `?partial=` answers: a bad value is a 400 naming it, an unknown job a 404, and a job
/// asked without it answers exactly as before (no extension fields).
pub fn partial_refusals(server: &Server, key: &str, id: &str) {
    let base = format!("{}/v1/harvest", server.base);
    let (status, answer) = request("GET", &format!("{base}/{id}?partial=yes"), key, None);
    assert_eq!(status, 400, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains("partial=\"yes\""), "{message}");
    let unknown = "0b0e4d1c-3f1a-4c6e-9d7b-2a1f0e9c8b7a";
    let (status, answer) = request("GET", &format!("{base}/{unknown}?partial=true"), key, None);
    assert_eq!(status, 404, "{answer}");
    let (_, plain) = request("GET", &format!("{base}/{id}"), key, None);
    assert!(plain.get("ready_shard_urls").is_none() && plain.get("partial").is_none());
}
