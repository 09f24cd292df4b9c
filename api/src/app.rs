//! The router: every route of the API, with a request id on every request and the per-key
//! rate limit in front. The state the handlers share is in `state`, the handlers in `routes`.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderName, Request};
use axum::routing::{get, post};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

use crate::routes;
pub use crate::state::AppState;
use crate::state::MAX_BODY_BYTES;

/// Longest a client may take to send a request's body (a 50 MiB corpus over a slow link
/// included).
pub const BODY_TIMEOUT: Duration = Duration::from_secs(120);
/// The header that carries each request's id, set when the client sends none.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Answers 429 `rate_limited` to a request whose bearer key is past its rate limit, before
/// anything else (the key is not even looked up).
async fn rate_limited(
    axum::extract::State(state): axum::extract::State<Arc<AppState>>,
    request: Request<axum::body::Body>,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let key = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    if let Some(key) = key
        && let Err(limited) = state.take_request(key)
    {
        return axum::response::IntoResponse::into_response(limited);
    }
    next.run(request).await
}

/// The API's routes, with a request id on every request, its answer and its log lines, and
/// the per-key rate limit in front of them all; `/metrics` among them.
pub fn router(state: Arc<AppState>) -> Router {
    router_serving(state, true)
}

/// `/metrics` and `/healthz` alone: a port of their own, which only the cluster's scraper
/// reaches (`serve --metrics-listen`).
pub fn metrics_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/metrics", get(routes::metrics))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(state)
}

/// [`router`], with `/metrics` on it or (`metrics` false) on a port of its own.
pub fn router_serving(state: Arc<AppState>, metrics: bool) -> Router {
    let request_id = HeaderName::from_static(REQUEST_ID_HEADER);
    let trace = TraceLayer::new_for_http().make_span_with(|request: &Request<_>| {
        let id = request
            .headers()
            .get(REQUEST_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-");
        tracing::info_span!("request", request_id = %id, method = %request.method(), path = %request.uri().path())
    });
    let routes = Router::new()
        .route("/v1/harvest", post(routes::submit).get(routes::list))
        .route("/v1/account", get(routes::account))
        .route(
            "/v1/harvest/{job_id}",
            get(routes::status).delete(routes::cancel),
        )
        .route("/v1/models", get(routes::models))
        .route("/files/{job_id}/{file}", get(routes::download))
        .route("/", get(crate::page::index))
        .route("/page/{file}", get(crate::page::asset))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(routes::ready));
    let routes = match metrics {
        true => routes.route("/metrics", get(routes::metrics)),
        false => routes,
    };
    routes
        .fallback(routes::no_route)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state),
            rate_limited,
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
            BODY_TIMEOUT,
        ))
        .layer(PropagateRequestIdLayer::new(request_id.clone()))
        .layer(trace)
        .layer(SetRequestIdLayer::new(request_id, MakeRequestUuid))
        .with_state(state)
}
