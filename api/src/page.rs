//! The status page at `/`: three static files built into the binary (`api/page/`), so nothing is
//! fetched from anywhere at run time. The page talks to the REST API only, with the key the user
//! enters (kept in the tab's session storage), so it works on either backend.

use axum::extract::Path;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

const INDEX: &str = include_str!("../page/index.html");
const SCRIPT: &str = include_str!("../page/app.js");
const STYLE: &str = include_str!("../page/style.css");

/// Scripts and styles from this server only, and no framing: the page handles an API key.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn serve(body: &'static str, content_type: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // A new binary may ship a new page; the files are small.
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// `GET /`: the page.
pub(crate) async fn index() -> Response {
    serve(INDEX, "text/html; charset=utf-8")
}

/// `GET /page/{file}`: its script and style sheet.
pub(crate) async fn asset(Path(file): Path<String>) -> Result<Response, ApiError> {
    match file.as_str() {
        "app.js" => Ok(serve(SCRIPT, "text/javascript; charset=utf-8")),
        "style.css" => Ok(serve(STYLE, "text/css; charset=utf-8")),
        _ => Err(ApiError::NoRoute {
            method: "GET".into(),
            path: format!("/page/{file}"),
        }),
    }
}
