//! The REST contract in process (`router().oneshot`): every error code and header of the
//! reference, on the embedded store, with workers held back so jobs stay pending.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use harvest_api::app::{AppState, router};
use harvest_api::config::{AccountConfig, ModelConfig, ServerConfig};
use harvest_api::server;
use harvest_core::lifecycle::JobEvent;
use harvest_core::quota::{AccountLimits, Lane};
use std::time::Duration;

use tower::ServiceExt;

struct Fixture {
    _dir: tempfile::TempDir,
    state: Arc<AppState>,
    store: Arc<harvest_api::embedded::store::Store>,
    key: String,
    other_key: String,
}

fn tiny_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../harvester/tests/fixtures/tiny-qwen2-f32")
}

async fn fixture(harvester: PathBuf, limits: AccountLimits) -> Fixture {
    fixture_with(harvester, limits, |_| {}).await
}

/// A fixture whose configuration `change` adjusts first.
async fn fixture_with(
    harvester: PathBuf,
    limits: AccountLimits,
    change: impl FnOnce(&mut ServerConfig),
) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let mut config = ServerConfig {
        data_dir: dir.path().join("data"),
        unknown_keys: Vec::new(),
        harvester,
        max_workers: 0,
        public_url: "http://harvest.test".into(),
        url_ttl_seconds: 3600,
        worker_threads: None,
        worker_gpus: Some(Vec::new()),
        count_timeout_seconds: 10.0,
        job_timeout_seconds: None,
        worker_attempts: 3,
        shutdown_grace_seconds: 30,
        retention_days: Some(7.0),
        sweep_interval_seconds: 3600,
        min_free_bytes: 0,
        kubernetes: None,
        rate_limit: None,
        models: vec![ModelConfig {
            name: "tiny".into(),
            path: tiny_model(),
            lane: Lane::Small,
            devices: 1,
            optional: false,
            max_parallelism: 16,
        }],
        accounts: vec![
            AccountConfig {
                name: "acme".into(),
                limits,
                storage_bytes: None,
            },
            AccountConfig {
                name: "other".into(),
                limits: AccountLimits::default(),
                storage_bytes: None,
            },
        ],
    };
    change(&mut config);
    let state = server::build(&config).await.unwrap();
    // A second connection to the server's SQLite file, as an operator's admin command has.
    let store = server::open_store(&config).unwrap();
    let now = harvest_api::paths::now();
    let key = store.create_key("acme", "test", now).unwrap();
    let other_key = store.create_key("other", "test", now).unwrap();
    Fixture {
        _dir: dir,
        state,
        store,
        key,
        other_key,
    }
}

/// A harvester path that exists, so submits are accepted (workers never start: max_workers 0).
fn present_harvester() -> PathBuf {
    std::env::current_exe().unwrap()
}

async fn default_fixture() -> Fixture {
    fixture(present_harvester(), AccountLimits::default()).await
}

async fn call(
    state: &Arc<AppState>,
    method: &str,
    uri: &str,
    key: Option<&str>,
    body: Option<String>,
) -> (StatusCode, axum::http::HeaderMap, serde_json::Value) {
    let mut request = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("authorization", format!("Bearer {key}"));
    }
    let response = router(Arc::clone(state))
        .oneshot(
            request
                .body(body.map(Body::from).unwrap_or_default())
                .unwrap(),
        )
        .await
        .unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), 64 << 20)
        .await
        .unwrap();
    let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    (status, headers, json)
}

fn seed_body() -> String {
    serde_json::json!({"model": "tiny", "prompts": ["The quick brown fox jumps over the lazy dog.",
        "Interpretability research reads the residual stream."], "layers": [2, 0]})
    .to_string()
}

async fn submit(
    f: &Fixture,
    body: String,
) -> (StatusCode, axum::http::HeaderMap, serde_json::Value) {
    call(&f.state, "POST", "/v1/harvest", Some(&f.key), Some(body)).await
}

#[tokio::test]
async fn a_submit_answers_202_pending_with_reserved_tokens_and_reads_back() {
    let f = default_fixture().await;
    let (status, _, job) = submit(&f, seed_body()).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{job}");
    assert_eq!(job["status"], "pending");
    assert_eq!(job["reserved_tokens"], 45 + 53);
    assert_eq!(job["layers"], serde_json::json!([0, 2]));
    assert!(job["tokens"].is_null() && job["started_at"].is_null());
    let created = job["created_at"].as_str().unwrap();
    assert!(
        created.ends_with("+00:00") && created.len() == 29,
        "{created}"
    );
    let id = job["job_id"].as_str().unwrap();
    let (status, _, again) = call(
        &f.state,
        "GET",
        &format!("/v1/harvest/{id}"),
        Some(&f.key),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(again["job_id"], id);
}

#[tokio::test]
async fn a_missing_or_wrong_key_gets_401() {
    let f = default_fixture().await;
    let (status, _, body) = call(&f.state, "POST", "/v1/harvest", None, Some(seed_body())).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("invalid_api_key"))
    );
    let (status, _, _) = call(&f.state, "GET", "/v1/models", Some("sk-hv-nope"), None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn bad_requests_get_400_naming_the_problem() {
    let f = default_fixture().await;
    let cases = [
        (
            serde_json::json!({"model": "tiny", "prompts": ["a"], "layerz": [1]}),
            "layerz",
        ),
        (
            serde_json::json!({"model": "llama-8b", "prompts": ["a"]}),
            "tiny",
        ),
        (
            serde_json::json!({"model": "tiny", "prompts": ["a"], "layers": [3]}),
            "layer 3",
        ),
        (
            serde_json::json!({"model": "tiny", "prompts": ["a"], "layers": "All"}),
            "all",
        ),
        (
            serde_json::json!({"model": "tiny", "prompts": ["a"], "shard_size": 0}),
            "shard_size",
        ),
        (
            serde_json::json!({"model": "tiny", "prompts": ["a"], "batch_size": -1}),
            "batch_size",
        ),
        (
            serde_json::json!({"model": "tiny", "prompts": [""], "add_special_tokens": false}),
            "prompt 0 is empty",
        ),
        (
            serde_json::json!({"model": "tiny", "prompts": ["a"], "project_onto":
            {"data": "AAAA", "dtype": "float32", "shape": [1, 64], "compression": "none"}}),
            "3 bytes",
        ),
    ];
    for (body, needle) in cases {
        let (status, _, answer) = submit(&f, body.to_string()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{body}: {message}");
    }
    let (status, _, answer) = submit(
        &f,
        serde_json::json!({"model": "tiny", "prompts": vec!["a"; 4097]}).to_string(),
    )
    .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("harvest_too_large"))
    );
}

#[tokio::test]
async fn a_body_over_50_mib_gets_413() {
    let f = default_fixture().await;
    let big = "x".repeat(51 << 20);
    let (status, _, answer) =
        submit(&f, format!(r#"{{"model": "tiny", "prompts": ["{big}"]}}"#)).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::PAYLOAD_TOO_LARGE, Some("payload_too_large"))
    );
}

#[tokio::test]
async fn the_fourth_small_job_gets_429_naming_the_lane_with_retry_after_30() {
    let f = default_fixture().await;
    for _ in 0..3 {
        assert_eq!(submit(&f, seed_body()).await.0, StatusCode::ACCEPTED);
    }
    let (status, headers, answer) = submit(&f, seed_body()).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(answer["error"]["code"], "harvest_concurrency_exceeded");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("small lane")
    );
    assert_eq!(headers["retry-after"], "30");
    let (status, _, _) = call(
        &f.state,
        "POST",
        "/v1/harvest",
        Some(&f.other_key),
        Some(seed_body()),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "lanes are per account");
}

#[tokio::test]
async fn an_exhausted_budget_and_a_used_up_job_quota_get_their_429s() {
    let limits = AccountLimits {
        daily_tokens: Some(150),
        monthly_jobs_per_key: 2,
        ..Default::default()
    };
    let f = fixture(present_harvester(), limits).await;
    let (status, _, job) = submit(&f, seed_body()).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    let (status, _, answer) = submit(&f, seed_body()).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::TOO_MANY_REQUESTS, Some("budget_exceeded"))
    );
    let id = job["job_id"].as_str().unwrap();
    assert_eq!(
        call(
            &f.state,
            "DELETE",
            &format!("/v1/harvest/{id}"),
            Some(&f.key),
            None
        )
        .await
        .0,
        StatusCode::OK
    );
    assert_eq!(
        submit(&f, seed_body()).await.0,
        StatusCode::ACCEPTED,
        "a cancel before the start releases the hold"
    );
    let (status, _, answer) = submit(&f, seed_body()).await;
    assert_eq!(
        answer["error"]["code"], "harvest_quota_exceeded",
        "{status}"
    );
}

#[tokio::test]
async fn another_accounts_job_unknown_ids_and_malformed_ids_all_get_404() {
    let f = default_fixture().await;
    let (_, _, job) = submit(&f, seed_body()).await;
    let id = job["job_id"].as_str().unwrap();
    for (key, uri) in [
        (&f.other_key, format!("/v1/harvest/{id}")),
        (&f.key, format!("/v1/harvest/{}", uuid::Uuid::new_v4())),
        (&f.key, "/v1/harvest/not-a-uuid".to_owned()),
    ] {
        let (status, _, answer) = call(&f.state, "GET", &uri, Some(key), None).await;
        assert_eq!(
            (status, answer["error"]["code"].as_str()),
            (StatusCode::NOT_FOUND, Some("not_found")),
            "{uri}"
        );
    }
    assert_eq!(
        call(
            &f.state,
            "DELETE",
            &format!("/v1/harvest/{id}"),
            Some(&f.other_key),
            None
        )
        .await
        .0,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn cancel_is_idempotent_and_an_ended_job_gets_409() {
    let f = default_fixture().await;
    let (_, _, job) = submit(&f, seed_body()).await;
    let id = job["job_id"].as_str().unwrap();
    for _ in 0..2 {
        let (status, _, answer) = call(
            &f.state,
            "DELETE",
            &format!("/v1/harvest/{id}"),
            Some(&f.key),
            None,
        )
        .await;
        assert_eq!(
            (status, answer["status"].as_str()),
            (StatusCode::OK, Some("cancelled"))
        );
        assert_eq!(
            answer["tokens"], 0,
            "cancelled before it started: charged nothing"
        );
        assert!(answer["completed_at"].is_string());
    }
    let (_, _, job) = submit(&f, seed_body()).await;
    let done = job["job_id"].as_str().unwrap();
    let now = harvest_api::paths::now();
    f.store
        .apply(done, JobEvent::Started, Default::default(), now)
        .unwrap();
    f.store
        .apply(
            done,
            JobEvent::Succeeded { tokens: 21 },
            Default::default(),
            now,
        )
        .unwrap();
    let (status, _, answer) = call(
        &f.state,
        "DELETE",
        &format!("/v1/harvest/{done}"),
        Some(&f.key),
        None,
    )
    .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("harvest_not_cancellable"))
    );
}

#[tokio::test]
async fn a_fifth_long_poll_of_a_key_is_declined_at_once_as_a_normal_200() {
    let f = default_fixture().await;
    let (_, _, job) = submit(&f, seed_body()).await;
    let uri = format!("/v1/harvest/{}?wait=3", job["job_id"].as_str().unwrap());
    let waiting: Vec<_> = (0..4)
        .map(|_| {
            let (state, key, uri) = (Arc::clone(&f.state), f.key.clone(), uri.clone());
            tokio::spawn(async move { call(&state, "GET", &uri, Some(&key), None).await })
        })
        .collect();
    harvest_testkit::eventually(
        "four waiting long-polls",
        Duration::from_secs(30),
        || async {
            match f.state.long_polls_waiting() {
                4 => Ok(()),
                n => Err(format!("{n} waiting")),
            }
        },
    )
    .await;
    let start = std::time::Instant::now();
    let (status, headers, answer) = call(&f.state, "GET", &uri, Some(&f.key), None).await;
    assert!(start.elapsed() < Duration::from_secs(1), "declined at once");
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["x-acs-longpoll"], "declined");
    assert_eq!(headers["retry-after"], "3");
    assert_eq!(answer["status"], "pending");
    for handle in waiting {
        let (status, headers, _) = handle.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        assert!(
            headers.get("x-acs-longpoll").is_none(),
            "the first four waited"
        );
    }
    let immediate = uri.replace("wait=3", "wait=0");
    assert_eq!(
        call(&f.state, "GET", &immediate, Some(&f.key), None)
            .await
            .0,
        StatusCode::OK
    );
    let bad = uri.replace("wait=3", "wait=soon");
    assert_eq!(
        call(&f.state, "GET", &bad, Some(&f.key), None).await.0,
        StatusCode::BAD_REQUEST
    );
}

#[tokio::test]
async fn a_missing_worker_answers_503_with_the_recorded_job_id() {
    let f = fixture(
        PathBuf::from("/nonexistent/harvester"),
        AccountLimits::default(),
    )
    .await;
    let (status, _, answer) = submit(&f, seed_body()).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("harvest_unavailable"))
    );
    let id = answer["error"]["job_id"].as_str().unwrap();
    let (_, _, job) = call(
        &f.state,
        "GET",
        &format!("/v1/harvest/{id}"),
        Some(&f.key),
        None,
    )
    .await;
    assert_eq!(
        (job["status"].as_str(), job["tokens"].as_u64()),
        (Some("failed"), Some(0))
    );
}

#[tokio::test]
async fn tampered_or_expired_links_get_403_and_models_lists_the_catalogue() {
    let f = default_fixture().await;
    let id = uuid::Uuid::new_v4().to_string();
    let past = f.state.signer.sign(&id, "manifest.json", 1);
    let (status, _, answer) = call(
        &f.state,
        "GET",
        &format!("/files/{id}/manifest.json?expires=1&sig={past}"),
        None,
        None,
    )
    .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::FORBIDDEN, Some("link_expired"))
    );
    let future = 4_000_000_000i64;
    let sig = f.state.signer.sign(&id, "manifest.json", future);
    let (status, _, answer) = call(
        &f.state,
        "GET",
        &format!("/files/{id}/stats.safetensors?expires={future}&sig={sig}"),
        None,
        None,
    )
    .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::FORBIDDEN, Some("link_invalid"))
    );
    let (status, _, models) = call(&f.state, "GET", "/v1/models", Some(&f.key), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(models["models"][0]["name"], "tiny");
    assert_eq!(
        models["models"][0]["default_layers"],
        serde_json::json!([0, 1, 2])
    );
    assert_eq!(models["models"][0]["hidden_size"], 64);
}

#[tokio::test]
async fn a_submit_while_the_account_is_being_counted_gets_429_count_busy_with_retry_after() {
    let f = default_fixture().await;
    let turn = f.state.counting_turn("acme").unwrap();
    let (status, headers, answer) = submit(&f, seed_body()).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::TOO_MANY_REQUESTS, Some("harvest_count_busy"))
    );
    assert!(headers.contains_key("retry-after"));
    let (status, _, _) = call(
        &f.state,
        "POST",
        "/v1/harvest",
        Some(&f.other_key),
        Some(seed_body()),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::ACCEPTED,
        "another account counts meanwhile"
    );
    drop(turn);
    assert_eq!(submit(&f, seed_body()).await.0, StatusCode::ACCEPTED);
}

#[tokio::test]
async fn submits_racing_from_one_account_are_counted_in_turn_and_admit_exactly_the_lanes_three() {
    let f = default_fixture().await;
    let prompts: Vec<String> = (0..2_000)
        .map(|i| format!("prompt {i} about the residual stream"))
        .collect();
    let body = serde_json::json!({"model": "tiny", "prompts": prompts}).to_string();
    let mut accepted = 0;
    for _ in 0..4 {
        let submits: Vec<_> = (0..4)
            .map(|_| {
                let (state, key, body) = (Arc::clone(&f.state), f.key.clone(), body.clone());
                tokio::spawn(async move {
                    call(&state, "POST", "/v1/harvest", Some(&key), Some(body)).await
                })
            })
            .collect();
        for handle in submits {
            let (status, _, answer) = handle.await.unwrap();
            match status {
                StatusCode::ACCEPTED => accepted += 1,
                StatusCode::TOO_MANY_REQUESTS => {
                    let code = answer["error"]["code"].as_str().unwrap();
                    assert!(
                        ["harvest_count_busy", "harvest_concurrency_exceeded"].contains(&code),
                        "{code}"
                    );
                }
                other => panic!("unexpected {other}: {answer}"),
            }
        }
    }
    assert_eq!(accepted, 3, "exactly the three slots of the small lane");
    let (_, ledger) = f.store.account("acme").unwrap();
    assert_eq!(ledger.active_small, 3);
}

#[tokio::test]
async fn a_done_job_whose_files_are_gone_says_urls_expired() {
    let f = default_fixture().await;
    let (_, _, job) = submit(&f, seed_body()).await;
    let id = job["job_id"].as_str().unwrap();
    let now = harvest_api::paths::now();
    let result = harvest_api::wire::JobResult {
        n_shards: 1,
        layout: Default::default(),
        layer_indices: vec![0, 2],
        manifest_url: String::new(),
        shard_urls: vec![],
        stats_url: String::new(),
        contents: "activations".into(),
        tokens: 21,
        bytes_written: 100,
        timings: Default::default(),
    };
    f.store
        .apply(id, JobEvent::Started, Default::default(), now)
        .unwrap();
    let outcome = harvest_api::embedded::store::Outcome {
        result: Some(result),
        error: None,
    };
    f.store
        .apply(id, JobEvent::Succeeded { tokens: 21 }, outcome, now)
        .unwrap();
    let (status, _, answer) = call(
        &f.state,
        "GET",
        &format!("/v1/harvest/{id}"),
        Some(&f.key),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(answer["status"], "done");
    assert_eq!(answer["urls_expired"], true);
    assert!(answer.get("result").is_none() && answer.get("urls_expire_at").is_none());
}

/// SmolLM2 beside the tiny model: its 8,192-token context lets a corpus pass 2M tokens.
fn with_smollm2(config: &mut ServerConfig) {
    config.models.push(ModelConfig {
        name: "smollm2".into(),
        path: harvest_testkit::smollm2(),
        lane: Lane::Small,
        devices: 1,
        optional: false,
        max_parallelism: 16,
    });
}

/// 4,096 prompts of about 600 tokens each: 2.4M tokens in under 5 MB.
fn long_corpus_body() -> String {
    let prompt = " a".repeat(600);
    let prompts: Vec<&str> = (0..4096).map(|_| prompt.as_str()).collect();
    serde_json::json!({"model": "smollm2", "prompts": prompts}).to_string()
}

#[tokio::test]
async fn a_corpus_over_two_million_counted_tokens_gets_400_harvest_too_large() {
    let f = fixture_with(present_harvester(), AccountLimits::default(), with_smollm2).await;
    let (status, _, answer) = submit(&f, long_corpus_body()).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("harvest_too_large")),
        "{answer}"
    );
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("2000000") && message.contains("split"),
        "{message}"
    );
}

#[tokio::test]
async fn a_count_past_the_counting_timeout_gets_429_count_busy_and_frees_the_turn() {
    let f = fixture_with(present_harvester(), AccountLimits::default(), |config| {
        with_smollm2(config);
        config.count_timeout_seconds = 0.001;
    })
    .await;
    let (status, headers, answer) = submit(&f, long_corpus_body()).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::TOO_MANY_REQUESTS, Some("harvest_count_busy")),
        "{answer}"
    );
    assert_eq!(headers["retry-after"], "5");
    assert!(
        f.state.counting_turn("acme").is_some(),
        "the turn was released"
    );
}

#[tokio::test]
async fn a_third_account_is_refused_while_two_others_are_counted() {
    let f = fixture_with(present_harvester(), AccountLimits::default(), |config| {
        with_smollm2(config);
        config.accounts.push(AccountConfig {
            name: "third".into(),
            limits: AccountLimits::default(),
            storage_bytes: None,
        });
    })
    .await;
    let third = f
        .store
        .create_key("third", "test", harvest_api::paths::now())
        .unwrap();
    let counting: Vec<_> = [f.key.clone(), f.other_key.clone()]
        .into_iter()
        .map(|key| {
            let state = Arc::clone(&f.state);
            tokio::spawn(async move {
                call(
                    &state,
                    "POST",
                    "/v1/harvest",
                    Some(&key),
                    Some(long_corpus_body()),
                )
                .await
            })
        })
        .collect();
    harvest_testkit::eventually("two counts at once", Duration::from_secs(30), || async {
        match f.state.counts_in_progress() {
            2 => Ok(()),
            n => Err(format!("{n} counting")),
        }
    })
    .await;
    let (status, _, answer) = call(
        &f.state,
        "POST",
        "/v1/harvest",
        Some(&third),
        Some(seed_body()),
    )
    .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::TOO_MANY_REQUESTS, Some("harvest_count_busy")),
        "{answer}"
    );
    for handle in counting {
        let (status, _, answer) = handle.await.unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    }
    assert_eq!(
        call(
            &f.state,
            "POST",
            "/v1/harvest",
            Some(&third),
            Some(seed_body())
        )
        .await
        .0,
        StatusCode::ACCEPTED,
        "the third account is counted once the others are done"
    );
}

#[tokio::test]
async fn a_long_poll_ends_when_the_status_changes_from_pending_to_running() {
    let f = default_fixture().await;
    let (_, _, job) = submit(&f, seed_body()).await;
    let (_, _, other) = submit(&f, seed_body()).await;
    let id = job["job_id"].as_str().unwrap().to_owned();
    let uri = format!("/v1/harvest/{id}?wait=60");
    let asked = std::time::Instant::now();
    let poll = {
        let (state, key) = (Arc::clone(&f.state), f.key.clone());
        tokio::spawn(async move { call(&state, "GET", &uri, Some(&key), None).await })
    };
    harvest_testkit::eventually("a waiting long-poll", Duration::from_secs(30), || async {
        match f.state.long_polls_waiting() {
            1 => Ok(()),
            n => Err(format!("{n} waiting")),
        }
    })
    .await;
    // The job starts (as a worker marks it), and a change elsewhere wakes the waiters.
    f.store
        .apply(
            &id,
            JobEvent::Started,
            Default::default(),
            harvest_api::paths::now(),
        )
        .unwrap();
    let cancel = format!("/v1/harvest/{}", other["job_id"].as_str().unwrap());
    call(&f.state, "DELETE", &cancel, Some(&f.key), None).await;
    let (status, headers, answer) = poll.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert!(headers.get("x-acs-longpoll").is_none());
    assert_eq!(answer["status"], "running", "{answer}");
    assert!(
        asked.elapsed() < Duration::from_secs(30),
        "answered at the change, not at the end of the wait"
    );
}

#[tokio::test]
async fn a_ninth_long_poll_on_the_server_is_declined_whoever_sends_it() {
    let f = default_fixture().await;
    let now = harvest_api::paths::now();
    let second = f.store.create_key("acme", "second", now).unwrap();
    let third = f.store.create_key("acme", "third", now).unwrap();
    let (_, _, job) = submit(&f, seed_body()).await;
    let uri = format!("/v1/harvest/{}?wait=5", job["job_id"].as_str().unwrap());
    let waiting: Vec<_> = [&f.key, &second]
        .into_iter()
        .flat_map(|key| std::iter::repeat_n(key.clone(), 4))
        .map(|key| {
            let (state, uri) = (Arc::clone(&f.state), uri.clone());
            tokio::spawn(async move { call(&state, "GET", &uri, Some(&key), None).await })
        })
        .collect();
    harvest_testkit::eventually(
        "eight waiting long-polls",
        Duration::from_secs(30),
        || async {
            match f.state.long_polls_waiting() {
                8 => Ok(()),
                n => Err(format!("{n} waiting")),
            }
        },
    )
    .await;
    let (status, headers, _) = call(&f.state, "GET", &uri, Some(&third), None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["x-acs-longpoll"], "declined");
    assert_eq!(headers["retry-after"], "3");
    for handle in waiting {
        let (_, headers, _) = handle.await.unwrap();
        assert!(!headers.contains_key("x-acs-longpoll"));
    }
}

#[tokio::test]
async fn unknown_routes_and_wrong_methods_answer_in_the_json_envelope() {
    let f = default_fixture().await;
    let (status, _, body) = call(&f.state, "GET", "/v2/harvest", Some(&f.key), None).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found")),
        "{body}"
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("GET /v2/harvest"),
        "{body}"
    );
    for (method, uri) in [
        ("PUT", "/v1/models"),
        ("PATCH", "/v1/harvest/071fa547-0000-4000-8000-000000000000"),
        ("PUT", "/v1/harvest"),
    ] {
        let (status, _, body) = call(&f.state, method, uri, Some(&f.key), None).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (StatusCode::METHOD_NOT_ALLOWED, Some("method_not_allowed")),
            "{method} {uri}: {body}"
        );
        assert!(
            body["error"]["message"].as_str().unwrap().contains(method),
            "{body}"
        );
    }
}

#[tokio::test]
async fn a_job_whose_files_would_not_fit_gets_507_naming_the_bytes() {
    let f = fixture_with(present_harvester(), AccountLimits::default(), |config| {
        config.min_free_bytes = u64::MAX / 4;
    })
    .await;
    let (status, _, answer) = submit(&f, seed_body()).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (
            StatusCode::INSUFFICIENT_STORAGE,
            Some("insufficient_storage")
        ),
        "{answer}"
    );
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("bytes") && message.contains("min_free_bytes"),
        "{message}"
    );
}

#[tokio::test]
async fn an_account_past_its_storage_budget_gets_507_and_others_do_not() {
    // A seed job's files take 24,876 bytes (as predicted at submit): one fits, two do not.
    let f = fixture_with(present_harvester(), AccountLimits::default(), |config| {
        config.accounts[0].storage_bytes = Some(40_000);
    })
    .await;
    let (status, _, answer) = submit(&f, seed_body()).await;
    assert_eq!(
        status,
        StatusCode::ACCEPTED,
        "the first job's estimate fits: {answer}"
    );
    assert!(
        answer["estimate"]["bytes"].as_u64().unwrap() < 40_000,
        "{answer}"
    );
    let (status, _, answer) = submit(&f, seed_body()).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (
            StatusCode::INSUFFICIENT_STORAGE,
            Some("insufficient_storage")
        ),
        "{answer}"
    );
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("40000"),
        "{answer}"
    );
    let (status, _, _) = call(
        &f.state,
        "POST",
        "/v1/harvest",
        Some(&f.other_key),
        Some(seed_body()),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED);
}

/// Every page of `GET /v1/harvest` for `key` with `query`, walked by `next_after`: the ids.
async fn list_all(f: &Fixture, key: &str, query: &str) -> Vec<String> {
    let mut ids = Vec::new();
    let mut after = String::new();
    loop {
        let uri = format!("/v1/harvest?{query}{after}");
        let (status, _, page) = call(&f.state, "GET", &uri, Some(key), None).await;
        assert_eq!(status, StatusCode::OK, "{uri}: {page}");
        for job in page["data"].as_array().unwrap() {
            assert!(job.get("result").is_none(), "{job}");
            ids.push(job["job_id"].as_str().unwrap().to_owned());
        }
        if !page["has_more"].as_bool().unwrap() {
            assert!(page["next_after"].is_null(), "{page}");
            return ids;
        }
        after = format!("&after={}", page["next_after"].as_str().unwrap());
    }
}

#[tokio::test]
async fn the_job_list_pages_the_accounts_own_jobs_newest_first_and_filters_by_status() {
    let f = default_fixture().await;
    let mut submitted = Vec::new();
    for _ in 0..3 {
        let (status, _, job) = submit(&f, seed_body()).await;
        assert_eq!(status, StatusCode::ACCEPTED, "{job}");
        submitted.push(job["job_id"].as_str().unwrap().to_owned());
    }
    let (status, _, _) = call(
        &f.state,
        "DELETE",
        &format!("/v1/harvest/{}", submitted[1]),
        Some(&f.key),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let newest_first: Vec<String> = submitted.iter().rev().cloned().collect();
    assert_eq!(list_all(&f, &f.key, "limit=1").await, newest_first);
    assert_eq!(list_all(&f, &f.key, "").await, newest_first);
    assert_eq!(
        list_all(&f, &f.key, "status=cancelled&limit=1").await,
        [submitted[1].clone()]
    );
    assert_eq!(
        list_all(&f, &f.key, "status=pending").await,
        [submitted[2].clone(), submitted[0].clone()]
    );
    assert!(list_all(&f, &f.other_key, "").await.is_empty());
    // Another account's job is not a cursor for this one.
    let uri = format!("/v1/harvest?after={}", submitted[0]);
    let (status, _, answer) = call(&f.state, "GET", &uri, Some(&f.other_key), None).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_request")),
        "{answer}"
    );
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&submitted[0]),
        "{answer}"
    );
    for (query, needle) in [
        ("limit=0", "limit=\"0\""),
        ("limit=500", "limit=\"500\""),
        ("status=finished", "status=\"finished\""),
        ("after=nope", "after=\"nope\""),
        ("cursor=x", "\"cursor\""),
    ] {
        let uri = format!("/v1/harvest?{query}");
        let (status, _, answer) = call(&f.state, "GET", &uri, Some(&f.key), None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{uri}: {answer}");
        assert!(
            answer["error"]["message"]
                .as_str()
                .unwrap()
                .contains(needle),
            "{uri}: {answer}"
        );
    }
    let (status, _, _) = call(&f.state, "GET", "/v1/harvest", None, None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn the_account_answer_counts_running_lanes_held_tokens_and_the_keys_jobs() {
    let f = fixture(
        present_harvester(),
        AccountLimits {
            daily_tokens: Some(1_000_000),
            ..AccountLimits::default()
        },
    )
    .await;
    let (_, _, job) = submit(&f, seed_body()).await;
    let reserved = job["reserved_tokens"].as_u64().unwrap();
    let (status, _, usage) = call(&f.state, "GET", "/v1/account", Some(&f.key), None).await;
    assert_eq!(status, StatusCode::OK, "{usage}");
    assert_eq!(
        usage["lanes"]["small"],
        serde_json::json!({"used": 1, "limit": 3})
    );
    assert_eq!(
        usage["lanes"]["large"],
        serde_json::json!({"used": 0, "limit": 1})
    );
    assert_eq!(
        usage["tokens"]["daily"],
        serde_json::json!({"used": reserved, "limit": 1_000_000})
    );
    assert_eq!(usage["tokens"]["monthly"]["limit"], serde_json::Value::Null);
    assert_eq!(usage["key_jobs_this_month"]["used"], 1);
    assert!(
        usage["storage_bytes"]["used"].as_u64().unwrap() > 0,
        "{usage}"
    );
    let (_, _, theirs) = call(&f.state, "GET", "/v1/account", Some(&f.other_key), None).await;
    assert_eq!(theirs["lanes"]["small"]["used"], 0, "{theirs}");
    assert_ne!(theirs["account"], usage["account"]);
}

#[tokio::test]
async fn the_status_page_and_its_files_are_served_with_a_same_origin_policy() {
    let f = default_fixture().await;
    for (uri, kind) in [
        ("/", "text/html"),
        ("/page/app.js", "text/javascript"),
        ("/page/style.css", "text/css"),
    ] {
        let response = router(Arc::clone(&f.state))
            .oneshot(Request::get(uri).body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{uri}");
        let headers = response.headers();
        assert!(
            headers["content-type"].to_str().unwrap().starts_with(kind),
            "{uri}"
        );
        let policy = headers["content-security-policy"].to_str().unwrap();
        assert!(policy.contains("default-src 'none'") && policy.contains("script-src 'self'"));
    }
    let (status, _, answer) = call(&f.state, "GET", "/page/other.js", None, None).await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
}

/// A model entry whose checkpoint directory does not exist.
fn missing_model(name: &str, optional: bool) -> ModelConfig {
    ModelConfig {
        name: name.into(),
        path: PathBuf::from("/nonexistent/harvest-models").join(name),
        lane: Lane::Large,
        devices: 8,
        optional,
        max_parallelism: 16,
    }
}

#[tokio::test]
async fn an_optional_model_without_files_is_listed_unavailable_and_a_submit_is_refused_naming_it() {
    let f = fixture_with(present_harvester(), AccountLimits::default(), |config| {
        config.models.push(missing_model("llama-405b", true));
    })
    .await;
    let (status, _, listed) = call(&f.state, "GET", "/v1/models", Some(&f.key), None).await;
    assert_eq!(status, StatusCode::OK);
    let models = listed["models"].as_array().unwrap();
    let big = models.iter().find(|m| m["name"] == "llama-405b").unwrap();
    assert_eq!(
        (&big["available"], &big["devices"], &big["lane"]),
        (
            &serde_json::json!(false),
            &serde_json::json!(8),
            &serde_json::json!("large")
        )
    );
    assert!(
        big["unavailable_reason"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/harvest-models/llama-405b/config.json")
    );
    let tiny = models.iter().find(|m| m["name"] == "tiny").unwrap();
    assert_eq!(
        (&tiny["available"], &tiny["devices"]),
        (&serde_json::json!(true), &serde_json::json!(1))
    );
    let body = serde_json::json!({"model": "llama-405b", "prompts": ["a"]}).to_string();
    let (status, _, answer) = submit(&f, body).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("\"llama-405b\" is not available") && message.contains("/nonexistent"),
        "{message}"
    );
}

#[tokio::test]
async fn a_required_model_without_files_stops_the_server_at_start_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let mut config: ServerConfig = serde_json::from_value(serde_json::json!({
        "data_dir": dir.path().join("data"), "public_url": "http://harvest.test",
        "harvester": present_harvester(), "max_workers": 0,
        "models": [], "accounts": [{"name": "acme"}],
    }))
    .unwrap();
    config.models.push(missing_model("llama-8b", false));
    let error = server::build(&config).await.unwrap_err().to_string();
    assert!(
        error.contains("llama-8b")
            && error.contains("/nonexistent/harvest-models/llama-8b/config.json")
            && error.contains("\"optional\": true"),
        "{error}"
    );
}

#[tokio::test]
async fn a_dry_run_answers_the_files_and_makes_no_job_and_uses_no_quota() {
    let f = fixture(
        present_harvester(),
        AccountLimits {
            daily_tokens: Some(1_000_000),
            ..AccountLimits::default()
        },
    )
    .await;
    let mut body: serde_json::Value = serde_json::from_str(&seed_body()).unwrap();
    body["dry_run"] = serde_json::json!(true);
    let (status, _, answer) = submit(&f, body.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["dry_run"], true);
    assert_eq!(
        (answer["n_prompts"].as_u64(), &answer["layers"]),
        (Some(2), &serde_json::json!([0, 2]))
    );
    let files = &answer["files"];
    let total = answer["total_bytes"].as_u64().unwrap();
    assert_eq!(files["shards"]["count"], 1);
    assert_eq!(
        total,
        files["shards"]["bytes"].as_u64().unwrap()
            + files["stats_bytes"].as_u64().unwrap()
            + files["manifest_bytes"].as_u64().unwrap()
    );
    assert!(answer["tokens"].as_u64().unwrap() > 0);
    assert!(
        answer["estimated_seconds"].is_null(),
        "nothing ran yet: {answer}"
    );
    let (_, _, listed) = call(&f.state, "GET", "/v1/harvest", Some(&f.key), None).await;
    assert_eq!(listed["data"], serde_json::json!([]), "no job was made");
    let (_, _, usage) = call(&f.state, "GET", "/v1/account", Some(&f.key), None).await;
    assert_eq!(usage["tokens"]["daily"]["used"], 0, "{usage}");
    assert_eq!(usage["key_jobs_this_month"]["used"], 0, "{usage}");
    // The real submit carries the same estimate in its status.
    let (status, _, job) = submit(&f, seed_body()).await;
    assert_eq!(status, StatusCode::ACCEPTED);
    assert_eq!(job["estimate"]["bytes"].as_u64(), Some(total), "{job}");
    body["dry_run"] = serde_json::json!("yes");
    let (status, _, refused) = submit(&f, body.to_string()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("dry_run"),
        "{refused}"
    );
}

#[tokio::test]
async fn sites_are_answered_in_block_order_and_a_dry_run_prices_each_one() {
    let f = fixture(present_harvester(), AccountLimits::default()).await;
    let mut body: serde_json::Value = serde_json::from_str(&seed_body()).unwrap();
    body["dry_run"] = serde_json::json!(true);
    let (_, _, alone) = submit(&f, body.to_string()).await;
    assert_eq!(alone["sites"], serde_json::json!(["resid_post"]), "{alone}");
    body["sites"] = serde_json::json!(["mlp_out", "resid_post"]);
    let (status, _, two) = submit(&f, body.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{two}");
    assert_eq!(two["sites"], serde_json::json!(["mlp_out", "resid_post"]));
    let bytes = |answer: &serde_json::Value| answer["files"]["shards"]["bytes"].as_u64().unwrap();
    // Two sites hold twice the activation rows; the token ids are not repeated.
    let (one, both) = (bytes(&alone), bytes(&two));
    assert!(both > one * 3 / 2 && both < 2 * one, "{both} vs {one}");
    assert!(two["files"]["stats_bytes"].as_u64() > alone["files"]["stats_bytes"].as_u64());

    body["dry_run"] = serde_json::json!(false);
    let (status, _, job) = submit(&f, body.to_string()).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{job}");
    assert_eq!(job["sites"], serde_json::json!(["mlp_out", "resid_post"]));
    let (status, _, plain) = submit(&f, seed_body()).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{plain}");
    assert!(
        plain.get("sites").is_none(),
        "the seed's answer is unchanged: {plain}"
    );

    for (sites, needle) in [
        (
            serde_json::json!(["resid_post", "attn"]),
            "sites[1] \"attn\"",
        ),
        (serde_json::json!([]), "sites is empty"),
        (serde_json::json!(["mlp_out", "mlp_out"]), "mlp_out twice"),
        (serde_json::json!("resid_post"), "sites"),
    ] {
        body["sites"] = sites;
        let (status, _, refused) = submit(&f, body.to_string()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
        let message = refused["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{message}");
    }
}

#[tokio::test]
async fn a_token_selection_is_counted_by_the_dry_run_and_each_bad_field_is_named() {
    let f = fixture(present_harvester(), AccountLimits::default()).await;
    let mut body: serde_json::Value = serde_json::from_str(&seed_body()).unwrap();
    body["dry_run"] = serde_json::json!(true);
    let (_, _, all) = submit(&f, body.to_string()).await;
    assert!(all["kept_tokens"].is_null(), "{all}");
    body["positions"] = serde_json::json!([0, 2]);
    body["sample_rate"] = serde_json::json!(1.0);
    let (status, _, sliced) = submit(&f, body.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{sliced}");
    assert_eq!(
        sliced["kept_tokens"], 4,
        "two prompts, two positions each: {sliced}"
    );
    assert!(sliced["files"]["shards"]["bytes"].as_u64() < all["files"]["shards"]["bytes"].as_u64());
    for (field, value, needle) in [
        (
            "positions",
            serde_json::json!([3, 3]),
            "[3, 3) is empty or inverted",
        ),
        ("positions", serde_json::json!([1]), "two numbers"),
        (
            "sample_rate",
            serde_json::json!(0),
            "sample_rate 0 is outside (0, 1]",
        ),
        ("sample_rate", serde_json::json!(1.5), "outside (0, 1]"),
        ("max_norm_multiple", serde_json::json!(1), "above 1"),
    ] {
        let mut bad = body.clone();
        bad[field] = value;
        let (status, _, refused) = submit(&f, bad.to_string()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
        let message = refused["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{field}: {message}");
    }
    let mut bad = body.clone();
    bad["max_norm_multiple"] = serde_json::json!(8);
    bad["sites"] = serde_json::json!(["mlp_out"]);
    let (status, _, refused) = submit(&f, bad.to_string()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("add resid_post to sites")
    );
}

#[tokio::test]
async fn a_shuffled_layout_is_priced_as_training_files_and_bad_layouts_are_named() {
    let f = fixture(present_harvester(), AccountLimits::default()).await;
    let mut body: serde_json::Value = serde_json::from_str(&seed_body()).unwrap();
    body["dry_run"] = serde_json::json!(true);
    body["layout"] = serde_json::json!("shuffled");
    body["rows_per_file"] = serde_json::json!(3);
    body["seed"] = serde_json::json!(4);
    let (status, _, answer) = submit(&f, body.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let tokens = answer["tokens"].as_u64().unwrap();
    assert_eq!(
        answer["files"]["shards"]["count"].as_u64(),
        Some(tokens.div_ceil(3))
    );
    for (field, value, needle) in [
        (
            "layout",
            serde_json::json!("sorted"),
            "layout \"sorted\" is not a layout",
        ),
        (
            "rows_per_file",
            serde_json::json!(0),
            "rows_per_file 0 must be between 1 and 16777216",
        ),
        ("rows_per_file", serde_json::json!(16_777_217), "16777217"),
    ] {
        let mut bad = body.clone();
        bad[field] = value;
        let (status, _, refused) = submit(&f, bad.to_string()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
        let message = refused["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{field}: {message}");
    }
    let mut by_prompt = body.clone();
    by_prompt["layout"] = serde_json::json!("by_prompt");
    by_prompt.as_object_mut().unwrap().remove("seed");
    let (status, _, refused) = submit(&f, by_prompt.to_string()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{refused}");
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("applies to layout \"shuffled\" only"),
        "{message}"
    );
}

#[tokio::test]
async fn a_precision_is_one_of_f32_and_bf16() {
    let f = fixture(present_harvester(), AccountLimits::default()).await;
    let mut body: serde_json::Value = serde_json::from_str(&seed_body()).unwrap();
    body["precision"] = serde_json::json!("bf16");
    let (status, _, job) = submit(&f, body.to_string()).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{job}");
    body["precision"] = serde_json::json!("fp8");
    let (status, _, refused) = submit(&f, body.to_string()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let message = refused["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("\"fp8\" is not one of f32, bf16"),
        "{message}"
    );
}

#[tokio::test]
async fn a_key_past_its_rate_limit_gets_429_rate_limited_on_any_route_and_other_keys_do_not() {
    let limit = harvest_api::ratelimit::RateLimit {
        requests_per_second: 0.5,
        burst: 3,
    };
    let f = fixture_with(present_harvester(), AccountLimits::default(), |config| {
        config.rate_limit = Some(limit);
    })
    .await;
    for uri in ["/v1/models", "/v1/account", "/v1/harvest"] {
        let (status, _, _) = call(&f.state, "GET", uri, Some(&f.key), None).await;
        assert_eq!(status, StatusCode::OK, "{uri}");
    }
    let (status, headers, answer) = call(
        &f.state,
        "GET",
        "/v1/harvest/00000000-0000-4000-8000-000000000000",
        Some(&f.key),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(answer["error"]["code"], "rate_limited", "{answer}");
    assert_eq!(headers["retry-after"], "2", "one request per 2 s");
    let (status, _, _) = call(&f.state, "GET", "/v1/models", Some(&f.other_key), None).await;
    assert_eq!(status, StatusCode::OK, "another key has its own allowance");
    // A junk key is limited too, before it is looked up.
    for expected in [401, 401, 401, 429] {
        let (status, _, _) = call(&f.state, "GET", "/v1/harvest", Some("sk-hv-junk"), None).await;
        assert_eq!(status.as_u16(), expected);
    }
    // Requests without a key (the status page, health) are not limited by it.
    for _ in 0..5 {
        let (status, _, _) = call(&f.state, "GET", "/healthz", None, None).await;
        assert_eq!(status, StatusCode::OK);
    }
}
