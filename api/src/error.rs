//! Every API error, its HTTP status, its stable code and its headers: one table.
//!
//! The envelope, for every error:
//! ```json
//! {"error": {"code": "harvest_concurrency_exceeded", "message": "the small lane is full: …", "job_id": null}}
//! ```
//! `code` is stable and machine-readable; `message` says what to do; `job_id` is set where the
//! error concerns a job that exists (503 `harvest_unavailable`).

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use harvest_core::quota::Denial;

/// Seconds a client should wait before retrying a full lane.
pub const CONCURRENCY_RETRY_AFTER_S: u32 = 30;
/// Seconds a client should wait before retrying when counting is busy.
pub const COUNT_BUSY_RETRY_AFTER_S: u32 = 5;

/// An error the API answers with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or a value is invalid.
    #[error("{message}")]
    InvalidRequest {
        /// What is wrong and how to fix it.
        message: String,
    },
    /// The corpus is over the per-job caps.
    #[error("{message}")]
    TooLarge {
        /// Which cap, and the advice to split the job.
        message: String,
    },
    /// No or an unknown API key.
    #[error("missing or invalid API key: send Authorization: Bearer <key>")]
    Unauthorized,
    /// No such job for this key (unknown, or another account's).
    #[error("no such harvest job for this API key")]
    NotFound,
    /// No route has this path.
    #[error(
        "no route {method} {path}: the API serves /v1/harvest, /v1/harvest/{{job_id}} and /v1/models"
    )]
    NoRoute {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The route exists, but not with this method.
    #[error(
        "{path} does not take {method}: docs/api.md and api/openapi.json list each route's methods"
    )]
    MethodNotAllowed {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The job has already ended.
    #[error("{message}")]
    NotCancellable {
        /// The job's status, in words.
        message: String,
    },
    /// The body is over the size limit.
    #[error("the request body is larger than {limit_mib} MiB: split the corpus into several jobs")]
    PayloadTooLarge {
        /// The limit.
        limit_mib: usize,
    },
    /// The key sent more requests than its rate limit allows (our extension).
    #[error(
        "this API key is over its request rate limit ({per_second} a second): retry after the Retry-After seconds"
    )]
    RateLimited {
        /// The sustained limit.
        per_second: f64,
        /// Whole seconds until the key may send again.
        retry_after_s: u32,
    },
    /// Token counting is busy for this account or the server.
    #[error(
        "token counting is busy: another submit of this account is being counted, or the corpus took too long to count; retry after the Retry-After seconds or split the corpus"
    )]
    CountBusy,
    /// A quota or lane denied the job.
    #[error("{0}")]
    Denied(#[from] Denial),
    /// The job's files would not fit the disk or the account's storage budget (our extension of
    /// the contract).
    #[error("{message}")]
    InsufficientStorage {
        /// What would not fit, in bytes, and what to do.
        message: String,
    },
    /// The worker backend for the model cannot be reached.
    #[error(
        "the harvest backend for this model is unavailable right now; quote job {job_id} when reporting it"
    )]
    Unavailable {
        /// The job that was recorded.
        job_id: String,
    },
    /// A download link that was tampered with or has expired.
    #[error("{0}")]
    Link(#[from] crate::signing::LinkError),
    /// A bug or an unexpected failure; the detail is logged, not sent.
    #[error("internal error")]
    Internal {
        /// The detail, for the log.
        detail: String,
    },
}

impl ApiError {
    /// Shorthand for [`ApiError::InvalidRequest`].
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. } | Self::TooLarge { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::NotFound | Self::NoRoute { .. } => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Self::Link(_) => StatusCode::FORBIDDEN,
            Self::NotCancellable { .. } => StatusCode::CONFLICT,
            Self::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::CountBusy | Self::Denied(_) | Self::RateLimited { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            Self::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::InsufficientStorage { .. } => StatusCode::INSUFFICIENT_STORAGE,
            Self::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidRequest { .. } => "invalid_request",
            Self::TooLarge { .. } => "harvest_too_large",
            Self::Unauthorized => "invalid_api_key",
            Self::NotFound | Self::NoRoute { .. } => "not_found",
            Self::MethodNotAllowed { .. } => "method_not_allowed",
            Self::Link(crate::signing::LinkError::Expired) => "link_expired",
            Self::Link(crate::signing::LinkError::Invalid) => "link_invalid",
            Self::NotCancellable { .. } => "harvest_not_cancellable",
            Self::PayloadTooLarge { .. } => "payload_too_large",
            Self::CountBusy => "harvest_count_busy",
            Self::RateLimited { .. } => "rate_limited",
            Self::Denied(Denial::Concurrency { .. }) => "harvest_concurrency_exceeded",
            Self::Denied(Denial::Budget { .. }) => "budget_exceeded",
            Self::Denied(Denial::JobQuota { .. }) => "harvest_quota_exceeded",
            Self::Unavailable { .. } => "harvest_unavailable",
            Self::InsufficientStorage { .. } => "insufficient_storage",
            Self::Internal { .. } => "internal_error",
        }
    }

    /// The `Retry-After` seconds, where the contract gives one.
    pub fn retry_after(&self) -> Option<u32> {
        match self {
            Self::Denied(Denial::Concurrency { .. }) => Some(CONCURRENCY_RETRY_AFTER_S),
            Self::CountBusy => Some(COUNT_BUSY_RETRY_AFTER_S),
            Self::RateLimited { retry_after_s, .. } => Some(*retry_after_s),
            _ => None,
        }
    }

    /// The JSON envelope.
    pub fn body(&self) -> serde_json::Value {
        let job_id = match self {
            Self::Unavailable { job_id } => Some(job_id.as_str()),
            _ => None,
        };
        serde_json::json!({"error": {"code": self.code(), "message": self.to_string(), "job_id": job_id}})
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// The configuration or a model of the catalogue is unusable.
    #[error("{0}")]
    Config(String),
    /// The store could not be opened.
    #[error("store: {0}")]
    Store(String),
    /// A file or socket failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl StartupError {
    /// Shorthand for [`StartupError::Config`].
    pub fn config(message: impl Into<String>) -> Self {
        Self::Config(message.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let Self::Internal { detail } = &self {
            tracing::error!(%detail, "internal error");
        }
        let mut response = (self.status(), Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after() {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// The error envelope every error is answered with.
#[derive(Debug, utoipa::ToSchema)]
pub struct ErrorEnvelope {
    /// The error.
    pub error: ErrorBody,
}

/// One error.
#[derive(Debug, utoipa::ToSchema)]
pub struct ErrorBody {
    /// A stable machine-readable code, e.g. `harvest_concurrency_exceeded`.
    pub code: String,
    /// What went wrong and what to do.
    pub message: String,
    /// The job concerned, where one was recorded (503 `harvest_unavailable`).
    pub job_id: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use harvest_core::quota::{BudgetWindow, Lane};

    #[test]
    fn every_variant_has_its_documented_status_and_code() {
        let cases: Vec<(ApiError, u16, &str)> = vec![
            (ApiError::invalid("x"), 400, "invalid_request"),
            (
                ApiError::TooLarge {
                    message: "x".into(),
                },
                400,
                "harvest_too_large",
            ),
            (ApiError::Unauthorized, 401, "invalid_api_key"),
            (ApiError::NotFound, 404, "not_found"),
            (
                ApiError::NoRoute {
                    method: "GET".into(),
                    path: "/v2".into(),
                },
                404,
                "not_found",
            ),
            (
                ApiError::MethodNotAllowed {
                    method: "PUT".into(),
                    path: "/v1/models".into(),
                },
                405,
                "method_not_allowed",
            ),
            (
                crate::signing::LinkError::Expired.into(),
                403,
                "link_expired",
            ),
            (
                crate::signing::LinkError::Invalid.into(),
                403,
                "link_invalid",
            ),
            (
                ApiError::NotCancellable {
                    message: "x".into(),
                },
                409,
                "harvest_not_cancellable",
            ),
            (
                ApiError::PayloadTooLarge { limit_mib: 50 },
                413,
                "payload_too_large",
            ),
            (ApiError::CountBusy, 429, "harvest_count_busy"),
            (
                ApiError::RateLimited {
                    per_second: 1.0,
                    retry_after_s: 1,
                },
                429,
                "rate_limited",
            ),
            (
                Denial::Concurrency {
                    lane: Lane::Small,
                    limit: 3,
                }
                .into(),
                429,
                "harvest_concurrency_exceeded",
            ),
            (
                Denial::Budget {
                    window: BudgetWindow::Daily,
                    limit: 1,
                    used: 1,
                    requested: 1,
                }
                .into(),
                429,
                "budget_exceeded",
            ),
            (
                Denial::JobQuota { limit: 200 }.into(),
                429,
                "harvest_quota_exceeded",
            ),
            (
                ApiError::Unavailable { job_id: "j".into() },
                503,
                "harvest_unavailable",
            ),
            (
                ApiError::InsufficientStorage {
                    message: "x".into(),
                },
                507,
                "insufficient_storage",
            ),
            (
                ApiError::Internal {
                    detail: "secret".into(),
                },
                500,
                "internal_error",
            ),
        ];
        for (error, status, code) in cases {
            assert_eq!(error.status().as_u16(), status, "{error:?}");
            assert_eq!(error.code(), code);
            assert_eq!(error.body()["error"]["code"], code);
        }
    }

    #[test]
    fn a_full_lane_says_which_and_asks_for_30_seconds() {
        let response = ApiError::from(Denial::Concurrency {
            lane: Lane::Large,
            limit: 1,
        })
        .into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "30");
        let message = ApiError::from(Denial::Concurrency {
            lane: Lane::Large,
            limit: 1,
        })
        .to_string();
        assert!(message.contains("large lane"), "{message}");
    }

    #[test]
    fn internal_details_never_reach_the_client_and_503_carries_the_job() {
        assert!(
            !ApiError::Internal {
                detail: "db path".into()
            }
            .body()
            .to_string()
            .contains("db path")
        );
        assert_eq!(
            ApiError::Unavailable {
                job_id: "abc".into()
            }
            .body()["error"]["job_id"],
            "abc"
        );
    }
}
