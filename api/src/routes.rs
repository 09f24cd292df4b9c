//! The handlers: authentication, the submit path (validate → count → backend submit), status
//! with long-poll, cancel, the catalogue, signed downloads, health and metrics. Each reaches
//! jobs through the state's [`JobBackend`](crate::backend::JobBackend) only.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use harvest_core::lifecycle::JobStatus;
use serde::Deserialize;
use tower::ServiceExt;

use crate::backend::Caller;
use crate::catalogue::CatalogueModel;
use crate::counting::{self, Counted, Counts};
use crate::error::ApiError;
use crate::job::{JobRecord, JobSpec};
use crate::listing::{JobFilter, JobList, Usage};
use crate::paths::{JobPaths, now};
use crate::permits::Scope;
use crate::state::{AppState, LONG_POLL_RETRY_AFTER_S, MAX_BODY_BYTES, MAX_JOB_TOKENS, MAX_WAIT_S};
use crate::wire::{
    self, DryRun, Estimate, FileSizes, HarvestRequest, JobView, PartialInfo, ReadyShardUrl,
    ShardFiles, Submission,
};
use harvest_core::estimate::{self, JobShape, KeptTokens, Predicted};
use harvest_core::format::{Contents, ModelInfo};

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
        state
            .backend
            .authenticate(key)
            .await?
            .ok_or(ApiError::Unauthorized)
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
            Err(rejection) => Err(json_rejection(&rejection)),
        }
    }
}

fn json_rejection(rejection: &JsonRejection) -> ApiError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::PayloadTooLarge {
            limit_mib: MAX_BODY_BYTES >> 20,
        }
    } else {
        ApiError::invalid(rejection.body_text())
    }
}

/// Queue a harvest job.
#[utoipa::path(post, tag = "harvest", path = "/v1/harvest", request_body = HarvestRequest, security(("bearer" = [])),
    responses((status = 202, description = "The job, pending", body = JobView),
        (status = 200, description = "With dry_run (our extension): what the job would be; no job is made and no quota is used", body = DryRun),
        (status = 400, description = "invalid_request or harvest_too_large", body = crate::error::ErrorEnvelope),
        (status = 401, description = "invalid_api_key", body = crate::error::ErrorEnvelope),
        (status = 413, description = "payload_too_large", body = crate::error::ErrorEnvelope),
        (status = 429, description = "harvest_count_busy, harvest_concurrency_exceeded, budget_exceeded, harvest_quota_exceeded, or rate_limited (the key is over its request rate); Retry-After says when to retry", body = crate::error::ErrorEnvelope),
        (status = 507, description = "insufficient_storage (our extension): the job's files would not fit the server's disk or the account's storage budget", body = crate::error::ErrorEnvelope),
        (status = 503, description = "harvest_unavailable, with the job id", body = crate::error::ErrorEnvelope)))]
pub(crate) async fn submit(
    State(state): State<Arc<AppState>>,
    caller: Caller,
    AppJson(request): AppJson<HarvestRequest>,
) -> Result<Response, ApiError> {
    let model = catalogue_model(&state, &request.model)?;
    let dry_run = request.dry_run.unwrap_or(false);
    let chat = model
        .chat
        .as_ref()
        .map(AsRef::as_ref)
        .map_err(String::as_str);
    let submission = request.validate(&model.model, chat)?;
    if submission.parallelism > model.max_parallelism {
        return Err(ApiError::invalid(format!(
            "parallelism {} is above model {}'s cap of {}: use at most {}, or leave it out for one worker",
            submission.parallelism, model.model.name, model.max_parallelism, model.max_parallelism
        )));
    }
    let counts = count_tokens(&state, &caller, model, &submission).await?;
    let predicted = predict(model, &submission, &counts);
    let throughput = state.backend.throughput(&submission.model).await?;
    let seconds = throughput.map(|rate| counts.total() as f64 / rate);
    if dry_run {
        return Ok(
            Json(dry_run_answer(&submission, &counts, &predicted, throughput)).into_response(),
        );
    }
    let estimate = Estimate {
        bytes: predicted.total(),
        seconds,
    };
    let job = new_job(&caller, &submission, &estimate);
    if let Err(error) = state.backend.submit(&job, &submission, model).await {
        // A job recorded as failed for want of a worker was admitted all the same.
        let counter = match error {
            ApiError::Denied(_) => Some(&state.metrics.denied),
            ApiError::Unavailable { .. } => Some(&state.metrics.submitted),
            _ => None,
        };
        counter.map(prometheus_client::metrics::counter::Counter::inc);
        return Err(error);
    }
    state.metrics.submitted.inc();
    let job = state
        .backend
        .get(&job.id)
        .await?
        .ok_or(ApiError::NotFound)?;
    Ok((StatusCode::ACCEPTED, Json(view(&state, &job).await?)).into_response())
}

/// The catalogue entry a request names, or a 400 that says why there is none.
fn catalogue_model<'a>(state: &'a AppState, name: &str) -> Result<&'a CatalogueModel, ApiError> {
    state.catalogue.get(name).ok_or_else(|| {
        let available = state.catalogue.names().join(", ");
        match state.catalogue.unavailable(name) {
            Some(reason) => ApiError::invalid(format!(
                "model {name:?} is not available on this server: {reason}; available: {available}"
            )),
            None => ApiError::invalid(format!(
                "unknown model {name:?}: GET /v1/models lists the models; available: {available}"
            )),
        }
    })
}

/// The sizes of the files the job will write, from its counted tokens.
fn predict(model: &CatalogueModel, submission: &Submission, counts: &Counts) -> Predicted {
    let (contents, width) = match &submission.directions {
        Some((n, _)) => (Contents::Projections, *n),
        None => (Contents::Activations, model.model.shape.hidden_size),
    };
    let router = harvest_core::format::RouterInfo::of_job(&model.model.shape, &submission.options);
    estimate::predict(&JobShape {
        token_counts: &counts.per_prompt,
        truncated: &counts.truncated,
        shard_size: submission.options.shard_size.get(),
        layers: submission.options.layers.as_slice(),
        sites: &submission.options.sites,
        layout: submission.options.layout,
        // A job that names none runs in its device's own; f32's name sizes the manifest, a
        // byte off bf16's.
        precision: submission.options.precision.unwrap_or_default(),
        selection: counts.kept.as_deref().map(|kept_counts| KeptTokens {
            rules: &submission.options.selection,
            kept_counts,
            dropped: counts.dropped,
        }),
        contents,
        width,
        model: ModelInfo {
            name: submission.model.clone(),
            architecture: model.architecture.clone(),
            num_layers: model.model.shape.num_layers,
            hidden_size: model.model.shape.hidden_size,
        },
        add_special_tokens: submission.options.add_special_tokens,
        bos_token_id: model.bos_token_id,
        max_tokens: submission.options.max_tokens(model.max_tokens),
        conversations: submission.conversations.is_some(),
        router: router.as_ref(),
    })
}

/// What a dry run answers.
fn dry_run_answer(
    submission: &Submission,
    counts: &Counts,
    predicted: &Predicted,
    throughput: Option<f64>,
) -> DryRun {
    DryRun {
        dry_run: true,
        model: submission.model.clone(),
        n_prompts: submission.prompts.len(),
        layers: submission.options.layers.as_slice().to_vec(),
        sites: submission
            .options
            .sites
            .names()
            .into_iter()
            .map(str::to_owned)
            .collect(),
        tokens: counts.total(),
        kept_tokens: counts
            .kept
            .as_ref()
            .map(|kept| kept.iter().map(|&n| n as u64).sum()),
        reserved_tokens: submission.reserved_tokens,
        files: FileSizes {
            shards: ShardFiles {
                count: predicted.shards.len(),
                bytes: predicted.shards.iter().sum(),
            },
            stats_bytes: predicted.stats,
            manifest_bytes: predicted.manifest,
        },
        total_bytes: predicted.total(),
        estimated_seconds: throughput.map(|rate| counts.total() as f64 / rate),
        tokens_per_second: throughput,
    }
}

/// The record of a job about to be submitted.
fn new_job(caller: &Caller, submission: &Submission, estimate: &Estimate) -> JobRecord {
    JobRecord {
        // Time-ordered, so jobs made in the same millisecond still list in the order they came.
        id: uuid::Uuid::now_v7().to_string(),
        run_id: uuid::Uuid::new_v4().to_string(),
        account: caller.account.clone(),
        key_hash: caller.key_hash.clone(),
        model: submission.model.clone(),
        status: JobStatus::Pending,
        n_prompts: submission.prompts.len(),
        reserved: submission.reserved_tokens,
        tokens: None,
        created_at: now(),
        started_at: None,
        completed_at: None,
        result: None,
        error: None,
        progress: None,
        spec: JobSpec {
            options: submission.options.clone(),
            has_directions: submission.directions.is_some(),
            lane: submission.lane,
            estimated_bytes: estimate.bytes,
            estimated_ms: estimate.seconds.map(|s| (s * 1000.0).round() as u64),
            parallelism: submission.parallelism,
        },
    }
}

/// Tokenizes the corpus for real: one submit per account and two server-wide at a time, within
/// the configured counting timeout, and at most [`MAX_JOB_TOKENS`].
async fn count_tokens(
    state: &Arc<AppState>,
    caller: &Caller,
    model: &CatalogueModel,
    submission: &Submission,
) -> Result<Counts, ApiError> {
    let _turn = state
        .counting_turn(&caller.account)
        .ok_or(ApiError::CountBusy)?;
    let _permit = Arc::clone(&state.counting)
        .try_acquire_owned()
        .map_err(|_| ApiError::CountBusy)?;
    let shared = state
        .shared_permit(Scope::count(&caller.account), state.count_timeout)
        .await
        .ok_or(ApiError::CountBusy)?;
    let counted = count_within_timeout(state, model, submission).await;
    // Before the answer goes out: a client's next submit (after its dry run) must find the
    // account's turn free among the replicas too.
    if let Some(shared) = shared {
        shared.give_back().await;
    }
    counted
}

/// The count itself, stopped at the configured timeout.
async fn count_within_timeout(
    state: &Arc<AppState>,
    model: &CatalogueModel,
    submission: &Submission,
) -> Result<Counts, ApiError> {
    let tokenizer = Arc::clone(&model.tokenizer);
    let prompts = submission.prompts.clone();
    // A conversation is its template's rendering, tokenized without special tokens and left
    // one BOS, as the worker tokenizes it.
    let conversations = submission.conversations.is_some();
    let special = submission.options.add_special_tokens && !conversations;
    let bos_once = conversations.then_some(model.tokenizer_bos).flatten();
    let max_tokens = submission.options.max_tokens(model.max_tokens) as u64;
    let selection = submission.options.selection;
    let spans = submission
        .spans
        .clone()
        .filter(|_| selection.roles.is_some());
    let cancelled = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&cancelled);
    let counting = tokio::task::spawn_blocking(move || {
        let options = counting::CountOptions {
            add_special_tokens: special,
            bos_once,
            max_tokens,
            cap: MAX_JOB_TOKENS,
            selection: (!selection.is_everything()).then_some(&selection),
            spans: spans.as_deref(),
        };
        counting::count(&tokenizer, &prompts, options, &flag)
    });
    let Ok(joined) = tokio::time::timeout(state.count_timeout, counting).await else {
        // The blocking count sees the flag at its next chunk and stops.
        cancelled.store(true, Ordering::Relaxed);
        return Err(ApiError::CountBusy);
    };
    let counted = joined
        .map_err(|e| ApiError::Internal {
            detail: e.to_string(),
        })?
        .map_err(|e| ApiError::invalid(format!("a prompt could not be tokenized: {e}")))?;
    match counted {
        Counted::Total(counts) => Ok(counts),
        Counted::Empty { index } => Err(ApiError::invalid(format!(
            "prompt {index} is empty after tokenization: give it some text, or keep add_special_tokens true"
        ))),
        Counted::OverCap { at_least } => Err(ApiError::TooLarge {
            message: format!(
                "the corpus has at least {at_least} tokens, more than the {MAX_JOB_TOKENS} a job may hold: split it into several jobs"
            ),
        }),
        Counted::Cancelled => Err(ApiError::CountBusy),
    }
}

/// The job as answered, with fresh links for a done job whose files are kept.
async fn view(state: &AppState, job: &JobRecord) -> Result<JobView, ApiError> {
    let mut view = summary(job);
    if job.status == JobStatus::Done {
        match state.backend.result(job).await? {
            Some(mut r) => {
                let expires = (now().0 + state.url_ttl_s * 1000) / 1000;
                let mut files = vec!["manifest.json".to_owned(), "stats.safetensors".to_owned()];
                files.extend((0..r.n_shards).map(|i| r.layout.file_name(i)));
                let mut urls = state
                    .backend
                    .links(&job.id, &files, expires)
                    .await?
                    .into_iter();
                r.manifest_url = urls.next().unwrap_or_default();
                r.stats_url = urls.next().unwrap_or_default();
                r.shard_urls = urls.collect();
                view.result = Some(r);
                view.urls_expire_at =
                    Some(harvest_core::clock::UnixMillis(expires * 1000).to_iso8601());
            }
            None => view.urls_expired = Some(true),
        }
    }
    Ok(view)
}

/// The job as answered, without its result: what the list shows of each job.
fn summary(job: &JobRecord) -> JobView {
    JobView {
        job_id: job.id.clone(),
        run_id: job.run_id.clone(),
        status: job.status,
        model: job.model.clone(),
        n_prompts: job.n_prompts,
        reserved_tokens: job.reserved,
        layers: job.spec.options.layers.as_slice().to_vec(),
        sites: (!job.spec.options.sites.is_default()).then(|| {
            job.spec
                .options
                .sites
                .names()
                .into_iter()
                .map(str::to_owned)
                .collect()
        }),
        tokens: job.tokens,
        created_at: job.created_at.to_iso8601(),
        started_at: wire::timestamp(job.started_at),
        completed_at: wire::timestamp(job.completed_at),
        result: None,
        urls_expire_at: None,
        urls_expired: None,
        error: job.error.clone(),
        progress: (job.status == JobStatus::Running)
            .then(|| job.progress.clone())
            .flatten(),
        estimate: (job.spec.estimated_bytes > 0).then(|| Estimate {
            bytes: job.spec.estimated_bytes,
            seconds: job.spec.estimated_ms.map(|ms| ms as f64 / 1000.0),
        }),
        ready_shard_urls: None,
        partial: None,
    }
}

/// What a shuffled job answers to `?partial=true`.
const SHUFFLED_NOT_READY: &str = "the shuffled layout writes its training files when the job commits: none is ready before it ends (use the by_prompt layout to read shards while it runs)";

/// The job as answered, and with `partial` its ready shards while it is pending or running.
async fn answer(state: &AppState, job: &JobRecord, partial: bool) -> Result<JobView, ApiError> {
    let mut view = view(state, job).await?;
    if !partial {
        return Ok(view);
    }
    if job.status.is_terminal() {
        state.records.forget(&job.id);
        return Ok(view);
    }
    if job.spec.options.layout.name() != harvest_core::layout::LayoutName::ByPrompt {
        view.ready_shard_urls = Some(Vec::new());
        view.partial = Some(PartialInfo {
            shards_total: None,
            bos_token_id: None,
            unavailable: Some(SHUFFLED_NOT_READY.to_owned()),
        });
        return Ok(view);
    }
    let ready = crate::ready::scan(&state.backend.outputs(), &job.id, &state.records)
        .await
        .map_err(|detail| ApiError::Internal { detail })?;
    let expires = (now().0 + state.url_ttl_s * 1000) / 1000;
    let urls = state
        .backend
        .links(&job.id, &crate::ready::file_names(&ready), expires)
        .await?;
    view.ready_shard_urls = Some(
        ready
            .shards
            .into_iter()
            .zip(urls)
            .map(|(shard, url)| ReadyShardUrl {
                file: shard.file,
                url,
                prompts: shard.prompts,
                bytes: shard.bytes,
                sha256: shard.sha256,
            })
            .collect(),
    );
    view.urls_expire_at = Some(harvest_core::clock::UnixMillis(expires * 1000).to_iso8601());
    view.partial = Some(PartialInfo {
        shards_total: Some(job.n_prompts.div_ceil(job.spec.options.shard_size.get())),
        bos_token_id: ready.bos_token_id,
        unavailable: None,
    });
    Ok(view)
}

/// The job id of the path; one that does not even decode is no job's (404, in the envelope).
fn path_job_id(path: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    path.map(|Path(id)| id).map_err(|_| ApiError::NotFound)
}

/// Looks up the caller's own job; an unknown id and another account's job look the same.
async fn own_job(state: &AppState, caller: &Caller, job_id: &str) -> Result<JobRecord, ApiError> {
    if !wire::is_valid_job_id(job_id) {
        return Err(ApiError::NotFound);
    }
    match state.backend.get(job_id).await? {
        Some(job) if job.account == caller.account => Ok(job),
        _ => Err(ApiError::NotFound),
    }
}

#[derive(Deserialize)]
pub(crate) struct WaitQuery {
    pub(crate) wait: Option<String>,
    pub(crate) partial: Option<String>,
}

fn wants_partial(query: &WaitQuery) -> Result<bool, ApiError> {
    match query.partial.as_deref() {
        None | Some("" | "false" | "0") => Ok(false),
        Some("true" | "1") => Ok(true),
        Some(text) => Err(ApiError::invalid(format!(
            "partial={text:?} must be true or false"
        ))),
    }
}

fn wait_seconds(query: &WaitQuery) -> Result<f64, ApiError> {
    match query.wait.as_deref() {
        None | Some("") => Ok(0.0),
        Some(text) => match text.parse::<f64>() {
            Ok(w) if w.is_finite() && w >= 0.0 => Ok(w.min(MAX_WAIT_S)),
            _ => Err(ApiError::invalid(format!(
                "wait={text:?} must be a number of seconds from 0 to 60"
            ))),
        },
    }
}

/// A harvest job, optionally waiting up to `wait` seconds (60 at most) for its status to
/// change (pending to running, or to an end).
#[utoipa::path(get, tag = "harvest", path = "/v1/harvest/{job_id}", security(("bearer" = [])),
    params(("job_id" = String, Path, description = "The job's UUID"),
        ("wait" = Option<String>, Query, description = "Seconds to wait for the status to change, at most 60"),
        ("partial" = Option<String>, Query, description = "Our extension: true adds ready_shard_urls, the finished shards of a pending or running job")),
    responses((status = 200, description = "The job; X-Acs-Longpoll: declined when a wait was refused", body = JobView),
        (status = 400, description = "invalid_request: a wait or partial that is not one, named", body = crate::error::ErrorEnvelope),
        (status = 401, description = "invalid_api_key", body = crate::error::ErrorEnvelope),
        (status = 404, description = "not_found", body = crate::error::ErrorEnvelope),
        (status = 429, description = "rate_limited: the key is over its request rate; Retry-After says when to retry", body = crate::error::ErrorEnvelope)))]
pub(crate) async fn status(
    State(state): State<Arc<AppState>>,
    caller: Caller,
    job_id: Result<Path<String>, PathRejection>,
    query: Result<Query<WaitQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let job_id = path_job_id(job_id)?;
    let Query(query) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    let job = own_job(&state, &caller, &job_id).await?;
    let wait = wait_seconds(&query)?;
    let partial = wants_partial(&query)?;
    if wait == 0.0 || job.status.is_terminal() {
        return Ok(Json(answer(&state, &job, partial).await?).into_response());
    }
    let lasts = Duration::from_secs_f64(wait);
    let Some(_slot) = state.long_poll_slot(&caller.key_hash, lasts).await else {
        state.metrics.long_polls_declined.inc();
        let mut response = Json(answer(&state, &job, partial).await?).into_response();
        response
            .headers_mut()
            .insert("x-acs-longpoll", HeaderValue::from_static("declined"));
        response.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from(LONG_POLL_RETRY_AFTER_S),
        );
        return Ok(response);
    };
    let deadline = tokio::time::Instant::now() + lasts;
    let waited = tokio::select! {
        waited = state.backend.wait(&job_id, job.status, deadline) => waited?,
        // A stopping server answers at once, with the job as it is.
        () = state.stopped() => state.backend.get(&job_id).await?,
    };
    let job = waited
        .filter(|job| job.account == caller.account)
        .ok_or(ApiError::NotFound)?;
    Ok(Json(answer(&state, &job, partial).await?).into_response())
}

/// The caller's account's jobs, newest first, a page at a time (our extension).
#[utoipa::path(get, tag = "harvest", path = "/v1/harvest", security(("bearer" = [])),
    params(("limit" = Option<usize>, Query, description = "Jobs in the page, 1 to 100 (default 20)"),
        ("after" = Option<String>, Query, description = "Only jobs older than this one: the next_after of the previous page"),
        ("status" = Option<String>, Query, description = "Only jobs in this status: pending, running, done, failed or cancelled")),
    responses((status = 200, description = "A page of jobs, each without its result (GET the job for its links)", body = JobList),
        (status = 400, description = "invalid_request, naming the parameter", body = crate::error::ErrorEnvelope),
        (status = 401, description = "invalid_api_key", body = crate::error::ErrorEnvelope),
        (status = 429, description = "rate_limited: the key is over its request rate; Retry-After says when to retry", body = crate::error::ErrorEnvelope)))]
pub(crate) async fn list(
    State(state): State<Arc<AppState>>,
    caller: Caller,
    query: Result<Query<std::collections::BTreeMap<String, String>>, QueryRejection>,
) -> Result<Json<JobList>, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    let filter = JobFilter::parse(&query)?;
    let page = state.backend.list(&caller.account, &filter).await?;
    let next_after = page
        .has_more
        .then(|| page.jobs.last().map(|j| j.id.clone()))
        .flatten();
    Ok(Json(JobList {
        data: page.jobs.iter().map(summary).collect(),
        has_more: page.has_more,
        next_after,
    }))
}

/// The caller's account: lanes, token budgets, the key's job quota and storage, each used
/// against its limit (our extension).
#[utoipa::path(get, tag = "harvest", path = "/v1/account", security(("bearer" = [])),
    responses((status = 200, description = "The account's usage", body = Usage),
        (status = 401, description = "invalid_api_key", body = crate::error::ErrorEnvelope),
        (status = 429, description = "rate_limited: the key is over its request rate; Retry-After says when to retry", body = crate::error::ErrorEnvelope)))]
pub(crate) async fn account(
    State(state): State<Arc<AppState>>,
    caller: Caller,
) -> Result<Json<Usage>, ApiError> {
    Ok(Json(state.backend.usage(&caller).await?))
}

/// Cancel a pending or running harvest job.
#[utoipa::path(delete, tag = "harvest", path = "/v1/harvest/{job_id}", security(("bearer" = [])),
    params(("job_id" = String, Path, description = "The job's UUID")),
    responses((status = 200, description = "The cancelled job", body = JobView),
        (status = 401, description = "invalid_api_key", body = crate::error::ErrorEnvelope),
        (status = 404, description = "not_found", body = crate::error::ErrorEnvelope),
        (status = 409, description = "harvest_not_cancellable", body = crate::error::ErrorEnvelope),
        (status = 429, description = "rate_limited: the key is over its request rate; Retry-After says when to retry", body = crate::error::ErrorEnvelope)))]
pub(crate) async fn cancel(
    State(state): State<Arc<AppState>>,
    caller: Caller,
    job_id: Result<Path<String>, PathRejection>,
) -> Result<Json<JobView>, ApiError> {
    let job_id = path_job_id(job_id)?;
    own_job(&state, &caller, &job_id).await?;
    let job = state.backend.cancel(&job_id).await?;
    Ok(Json(view(&state, &job).await?))
}

/// The models catalogue.
#[utoipa::path(get, tag = "harvest", path = "/v1/models", security(("bearer" = [])),
    responses((status = 200, description = "The models", body = crate::catalogue::ModelList),
        (status = 401, description = "invalid_api_key", body = crate::error::ErrorEnvelope),
        (status = 429, description = "rate_limited: the key is over its request rate; Retry-After says when to retry", body = crate::error::ErrorEnvelope)))]
pub(crate) async fn models(
    State(state): State<Arc<AppState>>,
    _caller: Caller,
) -> Json<serde_json::Value> {
    Json(serde_json::json!({ "models": state.catalogue.views() }))
}

#[derive(Deserialize)]
pub(crate) struct LinkQuery {
    expires: i64,
    sig: String,
}

fn is_output_file(name: &str) -> bool {
    let numbered = |prefix: &str| {
        name.strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix(".safetensors"))
            .is_some_and(|digits| digits.len() == 5 && digits.bytes().all(|b| b.is_ascii_digit()))
    };
    name == "manifest.json"
        || name == "stats.safetensors"
        || numbered("shard_")
        || numbered("train_")
}

/// Serves one output file through a link this server signed.
pub(crate) async fn download(
    State(state): State<Arc<AppState>>,
    Path((job_id, file)): Path<(String, String)>,
    Query(link): Query<LinkQuery>,
    request: Request,
) -> Result<Response, ApiError> {
    if !wire::is_valid_job_id(&job_id) || !is_output_file(&file) {
        return Err(ApiError::NotFound);
    }
    state
        .signer
        .verify(&job_id, &file, link.expires, &link.sig, now().0 / 1000)?;
    let path = JobPaths::new(&state.data_dir, &job_id).output().join(&file);
    if !path.is_file() {
        return Err(ApiError::NotFound);
    }
    state.metrics.downloads.inc();
    let response = tower_http::services::ServeFile::new(path)
        .oneshot(request)
        .await
        .map_err(|e| ApiError::Internal {
            detail: e.to_string(),
        })?;
    Ok(response.into_response())
}

/// Any path no route serves: the JSON envelope, naming the path.
pub(crate) async fn no_route(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::NoRoute {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

/// A route asked with a method it does not take: the JSON envelope, naming both.
pub(crate) async fn method_not_allowed(
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> ApiError {
    ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: uri.path().to_owned(),
    }
}

pub(crate) async fn ready(State(state): State<Arc<AppState>>) -> Response {
    if state.backend.ready().await {
        (StatusCode::OK, "ready").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "store or harvester unavailable",
        )
            .into_response()
    }
}

pub(crate) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let unfinished = state.backend.unfinished().await;
    state
        .metrics
        .unfinished
        .set(i64::try_from(unfinished).unwrap_or(i64::MAX));
    let mut body = String::new();
    if let Err(error) =
        prometheus_client::encoding::text::encode(&mut body, &state.metrics.registry)
    {
        return ApiError::Internal {
            detail: format!("encoding metrics: {error}"),
        }
        .into_response();
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response()
}
