//! The router and its handlers: authentication, the submit path (validate → count → admit →
//! enqueue), status with long-poll, cancel, the catalogue, signed downloads, health and metrics.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use harvest_core::lifecycle::{JobEvent, JobStatus, Transition};
use harvest_core::plan::shard_file_name;
use serde::Deserialize;
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::catalogue::Catalogue;
use crate::error::ApiError;
use crate::kubernetes::KubeBackend;
use crate::signing::Signer;
use crate::storage::Storage;
use crate::store::{JobRecord, JobSpec, Outcome, Store};
use crate::wire::{self, HarvestRequest, JobResult, JobView, Submission};
use crate::workers::{self, JobPaths, Workers};

/// Largest request body.
pub const MAX_BODY_BYTES: usize = 50 << 20;
/// Most tokens (counted by the real tokenizer) per job.
pub const MAX_JOB_TOKENS: u64 = 2_000_000;
/// Longest a submit may spend counting tokens.
pub const COUNT_TIMEOUT: Duration = Duration::from_secs(10);
/// Submits counted at once, server-wide (one per account besides).
pub const COUNTS_SERVER_WIDE: usize = 2;
/// Long-polls waiting at once per key.
pub const LONG_POLLS_PER_KEY: usize = 4;
/// Long-polls waiting at once, server-wide.
pub const LONG_POLLS_SERVER_WIDE: usize = 8;
/// Longest `?wait=`.
pub const MAX_WAIT_S: f64 = 60.0;
/// What a declined long-poll asks the client to wait.
pub const LONG_POLL_RETRY_AFTER_S: u32 = 3;

/// The embedded backend: the SQLite store and the harvester child processes.
#[derive(Debug)]
pub struct Embedded {
    /// Jobs, accounts, keys.
    pub store: Arc<Store>,
    /// Worker pool.
    pub workers: Arc<Workers>,
}

/// Where jobs live and run.
#[derive(Debug)]
pub enum Backend {
    /// One machine: SQLite and child processes.
    Embedded(Embedded),
    /// HarvestJobs on a cluster, run by the operator.
    Kubernetes(Box<KubeBackend>),
}

/// Everything the handlers share.
#[derive(Debug)]
pub struct AppState {
    /// Where jobs live and run.
    pub backend: Backend,
    /// Models.
    pub catalogue: Catalogue,
    /// Link signer.
    pub signer: Signer,
    /// Base URL of download links.
    pub public_url: String,
    /// Link lifetime.
    pub url_ttl_s: i64,
    /// Data directory.
    pub data_dir: PathBuf,
    counting: Arc<Semaphore>,
    counting_accounts: Mutex<HashSet<String>>,
    long_polls: Mutex<HashMap<String, usize>>,
    metrics: Metrics,
}

#[derive(Debug, Default)]
struct Metrics {
    submitted: AtomicU64,
    denied: AtomicU64,
    long_polls_declined: AtomicU64,
    downloads: AtomicU64,
}

impl AppState {
    /// Builds the state of the embedded backend.
    pub fn new(
        store: Arc<Store>,
        catalogue: Catalogue,
        workers: Arc<Workers>,
        signer: Signer,
        public_url: String,
        url_ttl_s: i64,
        data_dir: PathBuf,
    ) -> Arc<Self> {
        let backend = Backend::Embedded(Embedded { store, workers });
        Self::with_backend(backend, catalogue, signer, public_url, url_ttl_s, data_dir)
    }

    /// Builds the state over any backend.
    pub fn with_backend(
        backend: Backend,
        catalogue: Catalogue,
        signer: Signer,
        public_url: String,
        url_ttl_s: i64,
        data_dir: PathBuf,
    ) -> Arc<Self> {
        Arc::new(Self {
            backend,
            catalogue,
            signer,
            public_url,
            url_ttl_s,
            data_dir,
            counting: Arc::new(Semaphore::new(COUNTS_SERVER_WIDE)),
            counting_accounts: Mutex::default(),
            long_polls: Mutex::default(),
            metrics: Metrics::default(),
        })
    }
}

impl AppState {
    /// The embedded backend, if that is the one in use.
    pub fn embedded(&self) -> Option<&Embedded> {
        match &self.backend {
            Backend::Embedded(embedded) => Some(embedded),
            Backend::Kubernetes(_) => None,
        }
    }

    /// A job by id.
    async fn job(&self, id: &str) -> Result<Option<JobRecord>, ApiError> {
        match &self.backend {
            Backend::Embedded(e) => Ok(e.store.job(id)?),
            Backend::Kubernetes(k) => k.job(id).await,
        }
    }

    /// Wakes on every job change.
    fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        match &self.backend {
            Backend::Embedded(e) => e.workers.subscribe(),
            Backend::Kubernetes(k) => k.subscribe(),
        }
    }

    /// Takes the account's counting turn, or `None` if one of its submits is being counted.
    pub fn counting_turn(&self, account: &str) -> Option<CountingTurn<'_>> {
        let mut accounts = self
            .counting_accounts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        accounts.insert(account.to_owned()).then(|| CountingTurn {
            state: self,
            account: account.to_owned(),
        })
    }
}

/// The API's routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/harvest", axum::routing::post(submit))
        .route("/v1/harvest/{job_id}", get(status).delete(cancel))
        .route("/v1/models", get(models))
        .route("/files/{job_id}/{file}", get(download))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// The authenticated caller.
#[derive(Debug, Clone)]
pub struct Caller {
    account: String,
    key_hash: String,
}

impl FromRequestParts<Arc<AppState>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, ApiError> {
        let key = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or(ApiError::Unauthorized)?;
        let found = match &state.backend {
            Backend::Embedded(e) => e.store.authenticate(key)?,
            Backend::Kubernetes(k) => k.authenticate(&crate::store::key_hash(key)).await?,
        };
        let (account, key_hash) = found.ok_or(ApiError::Unauthorized)?;
        Ok(Self { account, key_hash })
    }
}

/// A JSON body whose rejections are answered in the API's own error envelope.
#[derive(Debug)]
pub struct AppJson<T>(pub T);

impl<T: serde::de::DeserializeOwned, S: Send + Sync> FromRequest<S> for AppJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(Self(value)),
            Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(ApiError::PayloadTooLarge {
                    limit_mib: MAX_BODY_BYTES >> 20,
                })
            }
            Err(rejection) => Err(ApiError::invalid(rejection.body_text())),
        }
    }
}

/// An account's turn to have a submit counted; released when dropped.
#[derive(Debug)]
pub struct CountingTurn<'a> {
    state: &'a AppState,
    account: String,
}

impl Drop for CountingTurn<'_> {
    fn drop(&mut self) {
        self.state
            .counting_accounts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.account);
    }
}

/// Queue a harvest job.
#[utoipa::path(post, tag = "harvest", path = "/v1/harvest", request_body = HarvestRequest, security(("bearer" = [])),
    responses((status = 202, description = "The job, pending", body = JobView),
        (status = 400, description = "invalid_request or harvest_too_large", body = crate::openapi::ErrorEnvelope),
        (status = 401, description = "invalid_api_key", body = crate::openapi::ErrorEnvelope),
        (status = 413, description = "payload_too_large", body = crate::openapi::ErrorEnvelope),
        (status = 429, description = "harvest_count_busy, harvest_concurrency_exceeded, budget_exceeded or harvest_quota_exceeded", body = crate::openapi::ErrorEnvelope),
        (status = 503, description = "harvest_unavailable, with the job id", body = crate::openapi::ErrorEnvelope)))]
pub(crate) async fn submit(
    State(state): State<Arc<AppState>>,
    caller: Caller,
    AppJson(request): AppJson<HarvestRequest>,
) -> Result<Response, ApiError> {
    let model = state.catalogue.get(&request.model).ok_or_else(|| {
        ApiError::invalid(format!(
            "unknown model {:?}: GET /v1/models lists the models; available: {}",
            request.model,
            state.catalogue.names().join(", ")
        ))
    })?;
    let submission = request.validate(&model.entry)?;
    count_tokens(&state, &caller, model, &submission).await?;

    let id = uuid::Uuid::new_v4().to_string();
    let now = workers::now();
    let job = JobRecord {
        id: id.clone(),
        run_id: uuid::Uuid::new_v4().to_string(),
        account: caller.account.clone(),
        key_hash: caller.key_hash.clone(),
        model: submission.model.clone(),
        status: JobStatus::Pending,
        n_prompts: submission.prompts.len(),
        reserved: submission.reserved_tokens,
        tokens: None,
        created_at: now,
        started_at: None,
        completed_at: None,
        result: None,
        error: None,
        progress: None,
        spec: JobSpec {
            layers: submission.layers.as_slice().to_vec(),
            shard_size: submission.shard_size,
            add_special_tokens: submission.add_special_tokens,
            has_directions: submission.directions.is_some(),
            lane: submission.lane,
        },
    };
    match &state.backend {
        Backend::Embedded(embedded) => {
            submit_embedded(&state, embedded, &job, &model.path, &submission, now)?;
        }
        Backend::Kubernetes(kube) => {
            if let Err(error) = kube.submit(&job, &submission, now).await {
                if matches!(error, ApiError::Denied(_)) {
                    state.metrics.denied.fetch_add(1, Ordering::Relaxed);
                }
                return Err(error);
            }
            state.metrics.submitted.fetch_add(1, Ordering::Relaxed);
        }
    }
    let job = state.job(&id).await?.ok_or(ApiError::NotFound)?;
    Ok((StatusCode::ACCEPTED, Json(view(&state, &job).await?)).into_response())
}

/// Writes the inputs, admits the job in the store and hands it to a worker.
fn submit_embedded(
    state: &AppState,
    embedded: &Embedded,
    job: &JobRecord,
    model_path: &std::path::Path,
    submission: &Submission,
    now: harvest_core::clock::UnixMillis,
) -> Result<(), ApiError> {
    let paths = JobPaths::new(&state.data_dir, &job.id);
    write_inputs(&paths, model_path, submission).map_err(|e| ApiError::Internal {
        detail: e.to_string(),
    })?;
    if let Err(error) = embedded.store.admit(job, now) {
        let _ = std::fs::remove_dir_all(&paths.root);
        state.metrics.denied.fetch_add(1, Ordering::Relaxed);
        return Err(error.into());
    }
    state.metrics.submitted.fetch_add(1, Ordering::Relaxed);
    if !embedded.workers.available() {
        let outcome = Outcome {
            result: None,
            error: Some("the harvest worker is not installed on this server".into()),
        };
        embedded
            .store
            .apply(&job.id, JobEvent::Failed, outcome, now)?;
        return Err(ApiError::Unavailable {
            job_id: job.id.clone(),
        });
    }
    embedded.workers.enqueue(job.id.clone());
    Ok(())
}

/// Tokenizes the corpus for real: one submit per account and two server-wide at a time, within
/// [`COUNT_TIMEOUT`], and at most [`MAX_JOB_TOKENS`].
async fn count_tokens(
    state: &Arc<AppState>,
    caller: &Caller,
    model: &crate::catalogue::CatalogueModel,
    submission: &Submission,
) -> Result<u64, ApiError> {
    let _turn = state
        .counting_turn(&caller.account)
        .ok_or(ApiError::CountBusy)?;
    let _permit = Arc::clone(&state.counting)
        .try_acquire_owned()
        .map_err(|_| ApiError::CountBusy)?;
    let tokenizer = Arc::clone(&model.tokenizer);
    let prompts = submission.prompts.clone();
    let special = submission.add_special_tokens;
    let max_tokens = model.max_tokens as u64;
    let counting = tokio::task::spawn_blocking(move || {
        tokenizer
            .encode_batch_fast(prompts, special)
            .map(|encodings| {
                encodings
                    .iter()
                    .map(|e| (e.len() as u64).min(max_tokens))
                    .collect::<Vec<_>>()
            })
    });
    let counts = tokio::time::timeout(COUNT_TIMEOUT, counting)
        .await
        .map_err(|_| ApiError::CountBusy)?
        .map_err(|e| ApiError::Internal {
            detail: e.to_string(),
        })?
        .map_err(|e| ApiError::invalid(format!("a prompt could not be tokenized: {e}")))?;
    if let Some(index) = counts.iter().position(|&n| n == 0) {
        return Err(ApiError::invalid(format!(
            "prompt {index} is empty after tokenization: give it some text, or keep add_special_tokens true"
        )));
    }
    let total: u64 = counts.iter().sum();
    if total > MAX_JOB_TOKENS {
        return Err(ApiError::TooLarge {
            message: format!(
                "the corpus has {total} tokens, more than the {MAX_JOB_TOKENS} a job may hold: split it into several jobs"
            ),
        });
    }
    Ok(total)
}

/// Writes prompts, directions and the harvester plan into the job's input folder.
fn write_inputs(
    paths: &JobPaths,
    model: &std::path::Path,
    submission: &Submission,
) -> std::io::Result<()> {
    let input = paths.input();
    std::fs::create_dir_all(&input)?;
    let lines: Vec<String> = submission
        .prompts
        .iter()
        .map(|p| serde_json::json!({ "text": p }).to_string())
        .collect();
    std::fs::write(input.join("prompts.jsonl"), lines.join("\n") + "\n")?;
    let directions = match &submission.directions {
        Some((n, values)) => {
            let path = input.join("directions.npy");
            std::fs::write(
                &path,
                harvest_core::npy::f32_matrix(*n, values.len() / n, values),
            )?;
            Some(path.display().to_string())
        }
        None => None,
    };
    let plan = harvest_core::RawPlan {
        model: model.display().to_string(),
        prompts: input.join("prompts.jsonl").display().to_string(),
        layers: harvest_core::LayerSelection::Explicit(
            submission
                .layers
                .as_slice()
                .iter()
                .map(|&l| l as i64)
                .collect(),
        ),
        shard_size: submission.shard_size,
        add_special_tokens: submission.add_special_tokens,
        project_onto: directions,
        output: paths.output().display().to_string(),
        batch_tokens: harvest_core::plan::DEFAULT_BATCH_TOKENS,
    };
    std::fs::write(input.join("plan.json"), serde_json::to_vec_pretty(&plan)?)
}

/// A done job's result and whether its files are still there, from its backend.
async fn stored_result(state: &AppState, job: &JobRecord) -> Result<Option<JobResult>, ApiError> {
    match &state.backend {
        Backend::Embedded(_) => {
            let out = JobPaths::new(&state.data_dir, &job.id).output();
            Ok(job
                .result
                .clone()
                .filter(|_| out.join("manifest.json").is_file()))
        }
        Backend::Kubernetes(kube) => {
            let result = kube.result(&job.id).await?;
            match &kube.storage {
                Storage::Local { .. } => {
                    let out = JobPaths::new(&state.data_dir, &job.id).output();
                    Ok(result.filter(|_| out.join("manifest.json").is_file()))
                }
                Storage::S3 { .. } => Ok(result),
            }
        }
    }
}

/// The job as answered, with fresh links for a done job: signed by this server and served by
/// `/files`, or presigned by S3.
async fn view(state: &AppState, job: &JobRecord) -> Result<JobView, ApiError> {
    let mut result = None;
    let (mut urls_expire_at, mut urls_expired) = (None, None);
    if job.status == JobStatus::Done {
        match stored_result(state, job).await? {
            Some(mut r) => {
                let now = workers::now();
                let expires = (now.0 + state.url_ttl_s * 1000) / 1000;
                let mut files = vec!["manifest.json".to_owned(), "stats.safetensors".to_owned()];
                files.extend((0..r.n_shards).map(shard_file_name));
                let mut urls = Vec::with_capacity(files.len());
                for file in &files {
                    urls.push(link(state, &job.id, file, expires).await?);
                }
                let mut urls = urls.into_iter();
                r.manifest_url = urls.next().unwrap_or_default();
                r.stats_url = urls.next().unwrap_or_default();
                r.shard_urls = urls.collect();
                result = Some(r);
                urls_expire_at = Some(harvest_core::clock::UnixMillis(expires * 1000).to_iso8601());
            }
            None => urls_expired = Some(true),
        }
    }
    Ok(JobView {
        job_id: job.id.clone(),
        run_id: job.run_id.clone(),
        status: job.status,
        model: job.model.clone(),
        n_prompts: job.n_prompts,
        reserved_tokens: job.reserved,
        layers: job.spec.layers.clone(),
        tokens: job.tokens,
        created_at: job.created_at.to_iso8601(),
        started_at: wire::timestamp(job.started_at),
        completed_at: wire::timestamp(job.completed_at),
        result,
        urls_expire_at,
        urls_expired,
        error: job.error.clone(),
        progress: (job.status == JobStatus::Running)
            .then(|| job.progress.clone())
            .flatten(),
    })
}

/// A link to one output file that works until `expires` (Unix seconds).
async fn link(state: &AppState, id: &str, file: &str, expires: i64) -> Result<String, ApiError> {
    if let Backend::Kubernetes(kube) = &state.backend {
        let ttl = Duration::from_secs(state.url_ttl_s.max(1) as u64);
        let presigned = kube
            .storage
            .presign(id, file, ttl)
            .await
            .map_err(|detail| ApiError::Internal { detail })?;
        if let Some(url) = presigned {
            return Ok(url);
        }
    }
    Ok(state.signer.url(&state.public_url, id, file, expires))
}

/// Looks up the caller's own job; an unknown id and another account's job look the same.
async fn own_job(state: &AppState, caller: &Caller, job_id: &str) -> Result<JobRecord, ApiError> {
    if !wire::is_valid_job_id(job_id) {
        return Err(ApiError::NotFound);
    }
    match state.job(job_id).await? {
        Some(job) if job.account == caller.account => Ok(job),
        _ => Err(ApiError::NotFound),
    }
}

#[derive(Deserialize)]
pub(crate) struct WaitQuery {
    pub(crate) wait: Option<String>,
}

/// Releases a long-poll slot when dropped.
struct LongPollSlot<'a> {
    state: &'a AppState,
    key: String,
}

impl Drop for LongPollSlot<'_> {
    fn drop(&mut self) {
        let mut polls = self
            .state
            .long_polls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = polls.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                polls.remove(&self.key);
            }
        }
    }
}

fn long_poll_slot<'a>(state: &'a AppState, key: &str) -> Option<LongPollSlot<'a>> {
    let mut polls = state
        .long_polls
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let total: usize = polls.values().sum();
    let mine = polls.get(key).copied().unwrap_or(0);
    if total >= LONG_POLLS_SERVER_WIDE || mine >= LONG_POLLS_PER_KEY {
        return None;
    }
    *polls.entry(key.to_owned()).or_default() += 1;
    Some(LongPollSlot {
        state,
        key: key.to_owned(),
    })
}

/// A harvest job, optionally waiting up to `wait` seconds (60 at most) for it to end.
#[utoipa::path(get, tag = "harvest", path = "/v1/harvest/{job_id}", security(("bearer" = [])),
    params(("job_id" = String, Path, description = "The job's UUID"),
        ("wait" = Option<String>, Query, description = "Seconds to wait for a terminal status, at most 60")),
    responses((status = 200, description = "The job; X-Acs-Longpoll: declined when a wait was refused", body = JobView),
        (status = 401, description = "invalid_api_key", body = crate::openapi::ErrorEnvelope),
        (status = 404, description = "not_found", body = crate::openapi::ErrorEnvelope)))]
pub(crate) async fn status(
    State(state): State<Arc<AppState>>,
    caller: Caller,
    Path(job_id): Path<String>,
    Query(query): Query<WaitQuery>,
) -> Result<Response, ApiError> {
    let job = own_job(&state, &caller, &job_id).await?;
    let wait = match query.wait.as_deref() {
        None | Some("") => 0.0,
        Some(text) => match text.parse::<f64>() {
            Ok(w) if w.is_finite() && w >= 0.0 => w.min(MAX_WAIT_S),
            _ => {
                return Err(ApiError::invalid(format!(
                    "wait={text:?} must be a number of seconds from 0 to 60"
                )));
            }
        },
    };
    if wait == 0.0 || job.status.is_terminal() {
        return Ok(Json(view(&state, &job).await?).into_response());
    }
    let Some(_slot) = long_poll_slot(&state, &caller.key_hash) else {
        state
            .metrics
            .long_polls_declined
            .fetch_add(1, Ordering::Relaxed);
        let mut response = Json(view(&state, &job).await?).into_response();
        response
            .headers_mut()
            .insert("x-acs-longpoll", HeaderValue::from_static("declined"));
        response.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from(LONG_POLL_RETRY_AFTER_S),
        );
        return Ok(response);
    };
    let deadline = Instant::now() + Duration::from_secs_f64(wait);
    let mut changes = state.subscribe();
    loop {
        let job = own_job(&state, &caller, &job_id).await?;
        if job.status.is_terminal() {
            return Ok(Json(view(&state, &job).await?).into_response());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || tokio::time::timeout(left, changes.changed()).await.is_err() {
            let job = own_job(&state, &caller, &job_id).await?;
            return Ok(Json(view(&state, &job).await?).into_response());
        }
    }
}

/// Cancel a pending or running harvest job.
#[utoipa::path(delete, tag = "harvest", path = "/v1/harvest/{job_id}", security(("bearer" = [])),
    params(("job_id" = String, Path, description = "The job's UUID")),
    responses((status = 200, description = "The cancelled job", body = JobView),
        (status = 404, description = "not_found", body = crate::openapi::ErrorEnvelope),
        (status = 409, description = "harvest_not_cancellable", body = crate::openapi::ErrorEnvelope)))]
pub(crate) async fn cancel(
    State(state): State<Arc<AppState>>,
    caller: Caller,
    Path(job_id): Path<String>,
) -> Result<Json<JobView>, ApiError> {
    own_job(&state, &caller, &job_id).await?;
    let job = match &state.backend {
        Backend::Embedded(embedded) => {
            let (job, transition) = embedded.store.apply(
                &job_id,
                JobEvent::Cancel,
                Outcome::default(),
                workers::now(),
            )?;
            if let Transition::To {
                stop_worker: true, ..
            } = transition
            {
                embedded.workers.cancel(&job_id);
                embedded.workers.notify();
            }
            job
        }
        Backend::Kubernetes(kube) => kube.cancel(&job_id).await?,
    };
    Ok(Json(view(&state, &job).await?))
}

/// The models catalogue.
#[utoipa::path(get, tag = "harvest", path = "/v1/models", security(("bearer" = [])),
    responses((status = 200, description = "The models", body = crate::openapi::ModelList)))]
pub(crate) async fn models(
    State(state): State<Arc<AppState>>,
    _caller: Caller,
) -> Json<serde_json::Value> {
    Json(serde_json::json!({ "models": state.catalogue.views() }))
}

#[derive(Deserialize)]
struct LinkQuery {
    expires: i64,
    sig: String,
}

fn is_output_file(name: &str) -> bool {
    name == "manifest.json"
        || name == "stats.safetensors"
        || name
            .strip_prefix("shard_")
            .and_then(|rest| rest.strip_suffix(".safetensors"))
            .is_some_and(|digits| digits.len() == 5 && digits.bytes().all(|b| b.is_ascii_digit()))
}

async fn download(
    State(state): State<Arc<AppState>>,
    Path((job_id, file)): Path<(String, String)>,
    Query(link): Query<LinkQuery>,
    request: Request,
) -> Result<Response, ApiError> {
    if !wire::is_valid_job_id(&job_id) || !is_output_file(&file) {
        return Err(ApiError::NotFound);
    }
    state.signer.verify(
        &job_id,
        &file,
        link.expires,
        &link.sig,
        workers::now().0 / 1000,
    )?;
    let path = JobPaths::new(&state.data_dir, &job_id).output().join(&file);
    if !path.is_file() {
        return Err(ApiError::NotFound);
    }
    state.metrics.downloads.fetch_add(1, Ordering::Relaxed);
    let response = tower_http::services::ServeFile::new(path)
        .oneshot(request)
        .await
        .map_err(|e| ApiError::Internal {
            detail: e.to_string(),
        })?;
    Ok(response.into_response())
}

async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let ok = match &state.backend {
        Backend::Embedded(e) => e.store.unfinished_count().is_ok() && e.workers.available(),
        Backend::Kubernetes(k) => k.ready().await,
    };
    if ok {
        (StatusCode::OK, "ready").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "store or harvester unavailable",
        )
            .into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let m = &state.metrics;
    let body = format!(
        "# HELP harvest_jobs_submitted_total Jobs admitted.\n# TYPE harvest_jobs_submitted_total counter\nharvest_jobs_submitted_total {}\n\
         # HELP harvest_jobs_denied_total Submits denied by quota.\n# TYPE harvest_jobs_denied_total counter\nharvest_jobs_denied_total {}\n\
         # HELP harvest_long_polls_declined_total Long-polls answered at once for lack of slots.\n# TYPE harvest_long_polls_declined_total counter\nharvest_long_polls_declined_total {}\n\
         # HELP harvest_downloads_total Files served through signed links.\n# TYPE harvest_downloads_total counter\nharvest_downloads_total {}\n\
         # HELP harvest_jobs_unfinished Jobs pending or running.\n# TYPE harvest_jobs_unfinished gauge\nharvest_jobs_unfinished {}\n",
        m.submitted.load(Ordering::Relaxed),
        m.denied.load(Ordering::Relaxed),
        m.long_polls_declined.load(Ordering::Relaxed),
        m.downloads.load(Ordering::Relaxed),
        match &state.backend {
            Backend::Embedded(e) => e.store.unfinished_count().unwrap_or(0),
            Backend::Kubernetes(k) => k.unfinished(),
        },
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}
