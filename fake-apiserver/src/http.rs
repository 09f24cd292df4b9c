//! The HTTP face of the fake server: path parsing, discovery, CRUD, watch streams and tables.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::kinds;
use crate::store::{ApiError, PatchKind, ResourceKey, Store, matches};

/// The router. `logs` is the fake kubelet's work directory, where each container's output is.
pub fn router(store: Arc<Store>, logs: std::path::PathBuf) -> Router {
    Router::new().fallback(
        move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
            let (store, logs) = (store.clone(), logs.clone());
            async move { handle(&store, &logs, method, uri, headers, body).await }
        },
    )
}

/// `GET pods/NAME/log`: the container's stdout then stderr, or their last `tailLines` lines.
pub(crate) fn pod_log(
    logs: &std::path::Path,
    ns: &str,
    name: &str,
    query: &HashMap<String, String>,
) -> Response {
    let read = |stream: &str| {
        std::fs::read_to_string(logs.join(format!("{ns}_{name}.{stream}"))).unwrap_or_default()
    };
    let text = read("stdout") + &read("stderr");
    let lines: Vec<&str> = text.lines().collect();
    let tail = query
        .get("tailLines")
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(lines.len())
        .min(lines.len());
    let mut body = lines[lines.len() - tail..].join("\n");
    if !body.is_empty() {
        body.push('\n');
    }
    (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain")], body).into_response()
}

fn json_response(code: StatusCode, value: &Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        value.to_string(),
    )
        .into_response()
}

fn error(e: &ApiError) -> Response {
    json_response(
        StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        &e.status(),
    )
}

/// A parsed resource path.
struct Target {
    key: ResourceKey,
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
    log: bool,
    sub: Option<String>,
}

fn parse_path(path: &str) -> Option<Target> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (api, rest) = match parts.as_slice() {
        ["api", version, rest @ ..] => (format!("/api/{version}"), rest),
        ["apis", group, version, rest @ ..] => (format!("/apis/{group}/{version}"), rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some((*ns).to_owned()), rest),
        _ => (None, rest),
    };
    let (plural, name, sub) = match rest {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some((*name).to_owned()), None),
        [plural, name, sub] => (*plural, Some((*name).to_owned()), Some(*sub)),
        _ => return None,
    };
    Some(Target {
        key: ResourceKey::new(&api, plural),
        namespace,
        name,
        status: sub == Some("status"),
        log: sub == Some("log"),
        sub: sub.map(str::to_owned),
    })
}

async fn handle(
    store: &Arc<Store>,
    logs: &std::path::Path,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path();
    let query: HashMap<String, String> = uri.query().map(url_decode_pairs).unwrap_or_default();
    let kinds = store.kinds();
    match path.trim_end_matches('/') {
        "/version" => {
            return json_response(
                StatusCode::OK,
                &json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-harvest-fake", "platform": "linux/amd64"}),
            );
        }
        "/api" => return json_response(StatusCode::OK, &kinds::core_versions()),
        "/apis" => return json_response(StatusCode::OK, &kinds::group_list(&kinds)),
        "/healthz" | "/readyz" | "/livez" => return (StatusCode::OK, "ok").into_response(),
        _ => {}
    }
    if let Some(list) = kinds::resource_list(&kinds, path.trim_end_matches('/')) {
        return json_response(StatusCode::OK, &list);
    }
    store.count_request(method.as_str(), path);
    if let Some(injected) = store.take_fault(method.as_str(), path) {
        return error(&injected);
    }
    let Some(target) = parse_path(path) else {
        return error(&ApiError::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource {path}"),
        ));
    };
    let Some(kind) = store.kind(&target.key) else {
        return error(&ApiError::new(
            404,
            "NotFound",
            format!("the server could not find the requested resource {path}"),
        ));
    };
    let ns = target.namespace.clone().unwrap_or_default();
    if let Err(refusal) = authorize(store, &headers, &method, &query, &target, &kind) {
        return error(&refusal);
    }
    if target.log {
        let name = target.name.clone().unwrap_or_default();
        if store.get(&target.key, &ns, &name).is_none() {
            return error(&ApiError::new(
                404,
                "NotFound",
                format!("pods \"{name}\" not found"),
            ));
        }
        return pod_log(logs, &ns, &name, &query);
    }
    let binary = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| {
            t.starts_with("application/vnd.kubernetes.protobuf")
                || t.starts_with("application/cbor")
        });
    let body_value = || -> Result<Value, ApiError> {
        if body.is_empty() {
            return Ok(Value::Null);
        }
        // As an apiserver without the encoding answers; clients then resend JSON.
        if binary {
            return Err(ApiError::new(
                415,
                "UnsupportedMediaType",
                "the body's content type is not supported: send application/json or YAML".into(),
            ));
        }
        serde_json::from_slice(&body)
            .or_else(|_| serde_yaml::from_slice(&body))
            .map_err(|e| {
                ApiError::new(
                    400,
                    "BadRequest",
                    format!("the body is neither JSON nor YAML: {e}"),
                )
            })
    };
    let result = match (&method, &target.name) {
        (&Method::GET, None)
            if matches!(query.get("watch").map(String::as_str), Some("true" | "1")) =>
        {
            return watch(store.clone(), target, query);
        }
        (&Method::GET, None) => {
            let (rv, items) = store.list_at(&target.key, target.namespace.as_deref());
            let items: Vec<Value> = items
                .into_iter()
                .filter(|o| {
                    matches(
                        o,
                        query.get("labelSelector").map(String::as_str),
                        query.get("fieldSelector").map(String::as_str),
                    )
                })
                .collect();
            let rv = rv.to_string();
            if wants_table(&headers) {
                return json_response(StatusCode::OK, &table(&kind, &items, &rv));
            }
            Ok(
                json!({"kind": format!("{}List", kind.kind), "apiVersion": kind.api_version(), "metadata": {"resourceVersion": rv}, "items": items}),
            )
        }
        (&Method::GET, Some(name)) => {
            match store.get(&target.key, if kind.namespaced { &ns } else { "" }, name) {
                Some(object) if wants_table(&headers) => {
                    return json_response(
                        StatusCode::OK,
                        &table(&kind, &[object], &store.resource_version().to_string()),
                    );
                }
                Some(object) => Ok(object),
                None => Err(ApiError::new(
                    404,
                    "NotFound",
                    format!("{}.{} \"{name}\" not found", kind.plural, kind.group),
                )),
            }
        }
        (&Method::POST, None) => body_value().and_then(|b| store.create(&target.key, &ns, b)),
        (&Method::PUT, Some(name)) => {
            body_value().and_then(|b| store.replace(&target.key, &ns, name, b, target.status))
        }
        (&Method::PATCH, Some(name)) => {
            let content_type = headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            let patch_kind = if content_type.starts_with("application/json-patch") {
                PatchKind::Json
            } else if content_type.starts_with("application/apply-patch") {
                PatchKind::Apply
            } else {
                PatchKind::Merge
            };
            body_value()
                .and_then(|b| store.patch(&target.key, &ns, name, patch_kind, b, target.status))
        }
        (&Method::DELETE, Some(name)) => store.delete(&target.key, &ns, name),
        _ => Err(ApiError::new(
            405,
            "MethodNotAllowed",
            format!("{method} is not supported on {path}"),
        )),
    };
    match result {
        Ok(object) if method == Method::POST => json_response(StatusCode::CREATED, &object),
        Ok(object) => json_response(StatusCode::OK, &object),
        Err(e) => error(&e),
    }
}

/// RBAC for requests with a ServiceAccount token (`crate::rbac`).
fn authorize(
    store: &Store,
    headers: &HeaderMap,
    method: &Method,
    query: &HashMap<String, String>,
    target: &Target,
    kind: &kinds::Kind,
) -> Result<(), ApiError> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let identity = store.identity(token);
    let watching = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    let verb = match (method.as_str(), &target.name) {
        ("GET", None) if watching => "watch",
        ("GET", None) => "list",
        ("GET", Some(_)) => "get",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", None) => "deletecollection",
        _ => "delete",
    };
    let resource = match &target.sub {
        Some(sub) => format!("{}/{sub}", kind.plural),
        None => kind.plural.clone(),
    };
    let request = crate::rbac::Attributes {
        verb,
        group: &kind.group,
        resource: &resource,
        namespace: target.namespace.as_deref().unwrap_or_default(),
        name: target.name.as_deref(),
    };
    if crate::rbac::allowed(store, &identity, &request) {
        Ok(())
    } else {
        Err(ApiError::new(
            403,
            "Forbidden",
            crate::rbac::refusal(&identity, &request),
        ))
    }
}

fn url_decode_pairs(query: &str) -> HashMap<String, String> {
    query
        .split('&')
        .filter_map(|pair| pair.split_once('=').or(Some((pair, ""))))
        .map(|(k, v)| (decode(k), decode(v)))
        .collect()
}

fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%' && i + 2 < bytes.len())
            .then(|| u8::from_str_radix(&text[i + 1..i + 3], 16).ok())
            .flatten();
        match (bytes[i], escaped) {
            (_, Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b'+', None) => {
                out.push(b' ');
                i += 1;
            }
            (byte, None) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn wants_table(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("as=Table"))
}

/// A `meta.k8s.io/v1` Table: NAME, the CRD's printer columns (or AGE), like the apiserver's.
fn table(kind: &kinds::Kind, items: &[Value], rv: &str) -> Value {
    let mut columns = vec![
        json!({"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}),
    ];
    let printer: Vec<Value> = if kind.printer_columns.is_empty() {
        vec![json!({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"})]
    } else {
        kind.printer_columns.clone()
    };
    for column in &printer {
        columns.push(json!({"name": column["name"], "type": column["type"], "format": "", "description": "", "priority": column["priority"].as_i64().unwrap_or(0)}));
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let rows: Vec<Value> = items
        .iter()
        .map(|item| {
            let mut cells = vec![item["metadata"]["name"].clone()];
            for column in &printer {
                let path = column["jsonPath"].as_str().unwrap_or_default();
                let value = column_value(item, path).clone();
                let cell = match (column["type"].as_str(), &value) {
                    (_, Value::Null) => Value::Null,
                    (Some("date"), Value::String(stamp)) => json!(age(parse_rfc3339(stamp).map_or(0, |t| now.saturating_sub(t)))),
                    _ => value,
                };
                cells.push(cell);
            }
            json!({"cells": cells, "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": item["metadata"]}})
        })
        .collect();
    json!({"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": rv}, "columnDefinitions": columns, "rows": rows})
}

/// A printer column's value: a dotted path whose steps may be list filters,
/// `.status.conditions[?(@.type=="Finished")].reason` (what CRDs' columns use); null when absent.
fn column_value<'v>(item: &'v Value, path: &str) -> &'v Value {
    const NULL: &Value = &Value::Null;
    let (mut value, mut rest) = (item, path.trim_start_matches('.'));
    while !rest.is_empty() {
        if let Some(filter) = rest.strip_prefix("[?(@.") {
            let Some((condition, tail)) = filter.split_once(")]") else {
                return NULL;
            };
            let Some((key, wanted)) = condition.split_once("==") else {
                return NULL;
            };
            let wanted = wanted.trim_matches('"');
            let found = value.as_array().and_then(|items| {
                items
                    .iter()
                    .find(|entry| entry[key].as_str() == Some(wanted))
            });
            value = found.unwrap_or(NULL);
            rest = tail.trim_start_matches('.');
        } else {
            let end = rest.find(['.', '[']).unwrap_or(rest.len());
            value = &value[&rest[..end]];
            rest = rest[end..].trim_start_matches('.');
        }
    }
    value
}

fn parse_rfc3339(stamp: &str) -> Option<u64> {
    let (date, time) = stamp.trim_end_matches('Z').split_once('T')?;
    let d: Vec<i64> = date
        .split('-')
        .map(|p| p.parse().ok())
        .collect::<Option<_>>()?;
    let t: Vec<i64> = time
        .split(':')
        .map(|p| p.split('.').next().unwrap_or("0").parse().ok())
        .collect::<Option<_>>()?;
    let (y, m, day) = (d[0] - i64::from(d[1] <= 2), d[1], d[2]);
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from(days * 86_400 + t[0] * 3600 + t[1] * 60 + t[2]).ok()
}

fn age(seconds: u64) -> String {
    match seconds {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// A watch: replays changes after `resourceVersion` (or the current objects as ADDED when it is
/// unset or 0), then streams new ones until `timeoutSeconds`.
fn watch(store: Arc<Store>, target: Target, query: HashMap<String, String>) -> Response {
    let labels = query.get("labelSelector").cloned();
    let fields = query.get("fieldSelector").cloned();
    let timeout = Duration::from_secs(
        query
            .get("timeoutSeconds")
            .and_then(|t| t.parse().ok())
            .unwrap_or(300)
            .min(1800),
    );
    let since: u64 = query
        .get("resourceVersion")
        .and_then(|rv| rv.parse().ok())
        .unwrap_or(0);
    let namespace = target.namespace.clone();
    let key = target.key.clone();
    let mut wake = store.subscribe();
    let stream = async_stream(
        move |tx: tokio::sync::mpsc::Sender<Result<Bytes, Infallible>>| async move {
            let deadline = tokio::time::Instant::now() + timeout;
            let mut last = since;
            if since == 0 {
                let (rv, items) = store.list_at(&key, namespace.as_deref());
                last = rv;
                for object in items {
                    if matches(&object, labels.as_deref(), fields.as_deref()) {
                        let line = format!("{}\n", json!({"type": "ADDED", "object": object}));
                        if tx.send(Ok(Bytes::from(line))).await.is_err() {
                            return;
                        }
                    }
                }
            }
            loop {
                for change in store.changes_since(&key, last) {
                    last = change.rv;
                    let in_namespace = namespace.as_deref().is_none_or(|ns| {
                        change.object["metadata"]["namespace"].as_str() == Some(ns)
                    });
                    if in_namespace && matches(&change.object, labels.as_deref(), fields.as_deref())
                    {
                        let line = format!(
                            "{}\n",
                            json!({"type": change.type_, "object": change.object})
                        );
                        if tx.send(Ok(Bytes::from(line))).await.is_err() {
                            return;
                        }
                    }
                }
                tokio::select! {
                    changed = wake.changed() => if changed.is_err() { return },
                    () = tokio::time::sleep_until(deadline) => return,
                    () = tx.closed() => return,
                }
            }
        },
    );
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(stream)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// A streaming body fed by a task.
fn async_stream<F, Fut>(producer: F) -> Body
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Bytes, Infallible>>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(producer(tx));
    Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::column_value;

    #[test]
    fn a_printer_column_reads_dotted_paths_and_list_filters_as_kubectl_shows_them() {
        let job = json!({"spec": {"model": "m"}, "status": {"conditions": [
            {"type": "Running", "reason": "PodRunning"},
            {"type": "Finished", "reason": "Succeeded"}]}});
        assert_eq!(column_value(&job, ".spec.model"), "m");
        let reason = ".status.conditions[?(@.type==\"Finished\")].reason";
        assert_eq!(column_value(&job, reason), "Succeeded");
        let missing = ".status.conditions[?(@.type==\"Failed\")].reason";
        assert!(column_value(&job, missing).is_null());
        assert!(column_value(&job, ".status.phase").is_null());
    }
}
