//! The fake server's state: every object by resource, namespace and name; one resourceVersion
//! counter; the full event history that watches replay from.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use serde_json::{Map, Value, json};

pub use crate::error::ApiError;
use crate::kinds::{self, Kind};

/// A resource collection: `/apis/harvest.dev/v1alpha1` + `harvestjobs`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ResourceKey {
    /// `/api/v1` or `/apis/GROUP/VERSION`.
    pub api: String,
    /// The plural.
    pub plural: String,
}

impl ResourceKey {
    /// A key.
    pub fn new(api: &str, plural: &str) -> Self {
        Self {
            api: api.into(),
            plural: plural.into(),
        }
    }
}

/// One change, as a watch reports it.
#[derive(Debug, Clone)]
pub struct Change {
    /// Which collection.
    pub key: ResourceKey,
    /// `ADDED`, `MODIFIED` or `DELETED`.
    pub type_: &'static str,
    /// The object after the change (before it, for DELETED).
    pub object: Value,
    /// The resourceVersion of the change.
    pub rv: u64,
}

/// What the apiserver checks of every object's metadata: the name is a DNS subdomain and
/// label values are at most 63 characters of the label syntax.
fn metadata_violations(name: &str, object: &Value) -> Vec<crate::schema::Violation> {
    let mut violations = Vec::new();
    let subdomain = name.len() <= 253
        && !name.is_empty()
        && name.split('.').all(|part| {
            !part.is_empty()
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        });
    if !subdomain {
        violations.push((
            "metadata.name".to_owned(),
            format!("metadata.name: Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character, at most 253 characters"),
        ));
    }
    for (key, value) in object["metadata"]["labels"]
        .as_object()
        .into_iter()
        .flatten()
    {
        let value = value.as_str().unwrap_or_default();
        let syntax = value.is_empty()
            || (value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                && value.starts_with(|c: char| c.is_ascii_alphanumeric())
                && value.ends_with(|c: char| c.is_ascii_alphanumeric()));
        if value.len() > 63 {
            violations.push((
                "metadata.labels".to_owned(),
                format!("metadata.labels: Invalid value: \"{value}\": must be no more than 63 characters"),
            ));
        } else if !syntax {
            violations.push((
                "metadata.labels".to_owned(),
                format!("metadata.labels: Invalid value: \"{value}\": a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (label {key})"),
            ));
        }
    }
    violations
}

/// Refuses `object` when its metadata or its kind's schema says it is invalid.
fn check_schema(kind: &Kind, name: &str, object: &Value) -> Result<(), ApiError> {
    let mut violations = metadata_violations(name, object);
    if kind.group == "rbac.authorization.k8s.io" {
        // RBAC names are path segments (`system:aggregate-to-edit`), not subdomains.
        violations.retain(|(field, _)| field != "metadata.name");
    }
    if let Some(schema) = &kind.schema {
        violations.extend(crate::schema::validate(schema, object));
    }
    if violations.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(kind, name, &violations))
    }
}

/// How a PATCH body is to be applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    /// RFC 7386 (strategic merge patches are applied this way too).
    Merge,
    /// RFC 6902.
    Json,
    /// Server-side apply: creates when missing, else merges (no field ownership).
    Apply,
}

/// Collection, namespace (empty when cluster-scoped), name.
type ObjectId = (ResourceKey, String, String);

#[derive(Debug)]
struct Inner {
    rv: u64,
    uid: u64,
    kinds: Vec<Kind>,
    objects: BTreeMap<ObjectId, Value>,
    history: Vec<Change>,
    faults: Vec<Fault>,
    /// Requests received, by `METHOD path`.
    requests: HashMap<String, u64>,
}

/// An injected failure: the next `times` requests with this method and path suffix get
/// `answer` (a 500 unless chosen).
#[derive(Debug)]
struct Fault {
    method: String,
    path_suffix: String,
    times: u32,
    answer: Option<ApiError>,
}

/// Who sent a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// The test's or kubectl's own credentials: allowed everything.
    Admin,
    /// A Pod's ServiceAccount token.
    ServiceAccount {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
    },
}

/// The state.
#[derive(Debug)]
pub struct Store {
    inner: Mutex<Inner>,
    tokens: Mutex<BTreeMap<String, Identity>>,
    changed: tokio::sync::watch::Sender<u64>,
}

impl Default for Store {
    fn default() -> Self {
        Self::new()
    }
}

fn now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    rfc3339(secs)
}

/// Seconds since the epoch as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

impl Store {
    /// Makes the next `times` requests of `method` to a path ending in `path_suffix` fail with
    /// a 500 before they change anything, as if the client had crashed just before them.
    pub fn fail_next(&self, method: &str, path_suffix: &str, times: u32) {
        self.lock().faults.push(Fault {
            method: method.to_owned(),
            path_suffix: path_suffix.to_owned(),
            times,
            answer: None,
        });
    }

    /// Makes the next `times` requests of `method` to a path ending in `path_suffix` answer
    /// `answer` before they change anything: an admission plugin's refusal, such as
    /// ResourceQuota's 403 `exceeded quota`.
    pub fn refuse_next(&self, method: &str, path_suffix: &str, times: u32, answer: ApiError) {
        self.lock().faults.push(Fault {
            method: method.to_owned(),
            path_suffix: path_suffix.to_owned(),
            times,
            answer: Some(answer),
        });
    }

    /// Injected failures not yet used.
    pub fn faults_pending(&self) -> u32 {
        self.lock().faults.iter().map(|f| f.times).sum()
    }

    /// Counts a request the apiserver received.
    pub fn count_request(&self, method: &str, path: &str) {
        *self
            .lock()
            .requests
            .entry(format!("{method} {path}"))
            .or_default() += 1;
    }

    /// Requests received of `method` whose path contains `part`, as a real apiserver's
    /// `apiserver_request_total` would count them.
    pub fn requests(&self, method: &str, part: &str) -> u64 {
        let prefix = format!("{method} ");
        self.lock()
            .requests
            .iter()
            .filter(|(request, _)| {
                request
                    .strip_prefix(&prefix)
                    .is_some_and(|path| path.contains(part))
            })
            .map(|(_, n)| n)
            .sum()
    }

    /// The injected answer of this request, if it is to fail (and counts it).
    pub fn take_fault(&self, method: &str, path: &str) -> Option<ApiError> {
        let mut inner = self.lock();
        let fault = inner
            .faults
            .iter_mut()
            .find(|f| f.times > 0 && f.method == method && path.ends_with(&f.path_suffix))?;
        fault.times -= 1;
        Some(fault.answer.clone().unwrap_or_else(|| {
            ApiError::new(
                500,
                "InternalError",
                format!("injected failure of {method} {path}"),
            )
        }))
    }

    /// A store with the `default` and `kube-system` namespaces.
    pub fn new() -> Self {
        let store = Self {
            inner: Mutex::new(Inner {
                rv: 1,
                uid: 0,
                kinds: kinds::builtins(),
                objects: BTreeMap::new(),
                history: Vec::new(),
                faults: Vec::new(),
                requests: HashMap::new(),
            }),
            changed: tokio::sync::watch::channel(1).0,
            tokens: Mutex::default(),
        };
        for ns in ["default", "kube-system"] {
            let _ = store.create(
                &ResourceKey::new("/api/v1", "namespaces"),
                "",
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
            );
        }
        store
    }

    /// A new bearer token that identifies ServiceAccount `ns/account`.
    pub fn issue_token(&self, ns: &str, account: &str) -> String {
        let token = format!("sa.{}", uuid::Uuid::new_v4().simple());
        self.tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(
                token.clone(),
                Identity::ServiceAccount {
                    namespace: ns.to_owned(),
                    name: account.to_owned(),
                },
            );
        token
    }

    /// Who a bearer token belongs to; any token not issued here is the administrator's.
    pub fn identity(&self, token: Option<&str>) -> Identity {
        token
            .and_then(|t| {
                self.tokens
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .get(t)
                    .cloned()
            })
            .unwrap_or(Identity::Admin)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The served kinds.
    pub fn kinds(&self) -> Vec<Kind> {
        self.lock().kinds.clone()
    }

    /// The kind served at `key`.
    pub fn kind(&self, key: &ResourceKey) -> Option<Kind> {
        self.lock()
            .kinds
            .iter()
            .find(|k| k.api_path() == key.api && k.plural == key.plural)
            .cloned()
    }

    /// Wakes when anything changes.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.lock().rv
    }

    /// Changes after `rv` to collection `key`.
    pub fn changes_since(&self, key: &ResourceKey, rv: u64) -> Vec<Change> {
        let inner = self.lock();
        let start = inner.history.partition_point(|c| c.rv <= rv);
        inner.history[start..]
            .iter()
            .filter(|c| &c.key == key)
            .cloned()
            .collect()
    }

    /// One object.
    pub fn get(&self, key: &ResourceKey, ns: &str, name: &str) -> Option<Value> {
        self.lock()
            .objects
            .get(&(key.clone(), ns.to_owned(), name.to_owned()))
            .cloned()
    }

    /// Every object of `key` and the resourceVersion they are current at, read under one lock:
    /// a watch from that version then misses no change, as with a real apiserver's LIST.
    pub fn list_at(&self, key: &ResourceKey, ns: Option<&str>) -> (u64, Vec<Value>) {
        let inner = self.lock();
        let items = inner
            .objects
            .iter()
            .filter(|((k, n, _), _)| k == key && ns.is_none_or(|ns| ns == n))
            .map(|(_, v)| v.clone())
            .collect();
        (inner.rv, items)
    }

    fn kind_in(inner: &Inner, key: &ResourceKey) -> Result<Kind, ApiError> {
        inner
            .kinds
            .iter()
            .find(|k| k.api_path() == key.api && k.plural == key.plural)
            .cloned()
            .ok_or_else(|| {
                ApiError::new(
                    404,
                    "NotFound",
                    format!(
                        "the server could not find the requested resource {}/{}",
                        key.api, key.plural
                    ),
                )
            })
    }

    fn record(inner: &mut Inner, key: &ResourceKey, type_: &'static str, object: Value) {
        inner.history.push(Change {
            key: key.clone(),
            type_,
            object,
            rv: inner.rv,
        });
    }

    fn bump(inner: &mut Inner, object: &mut Value) {
        inner.rv += 1;
        object["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
    }

    fn notify(&self, rv: u64) {
        self.changed.send_replace(rv);
    }

    /// POST.
    pub fn create(
        &self,
        key: &ResourceKey,
        ns: &str,
        mut object: Value,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let kind = Self::kind_in(&inner, key)?;
        let ns = if kind.namespaced {
            ns.to_owned()
        } else {
            String::new()
        };
        if kind.namespaced
            && !inner.objects.contains_key(&(
                ResourceKey::new("/api/v1", "namespaces"),
                String::new(),
                ns.clone(),
            ))
        {
            return Err(ApiError::new(
                404,
                "NotFound",
                format!("namespaces \"{ns}\" not found"),
            ));
        }
        if !object["metadata"].is_object() {
            object["metadata"] = json!({});
        }
        let name = match object["metadata"]["name"].as_str() {
            Some(name) if !name.is_empty() => name.to_owned(),
            _ => match object["metadata"]["generateName"].as_str() {
                Some(prefix) => {
                    inner.uid += 1;
                    format!("{prefix}{:05x}", inner.uid * 7919 % 0xfffff)
                }
                None => {
                    return Err(ApiError::new(
                        422,
                        "Invalid",
                        format!("{} is invalid: metadata.name: Required value", kind.kind),
                    ));
                }
            },
        };
        let id = (key.clone(), ns.clone(), name.clone());
        if inner.objects.contains_key(&id) {
            return Err(ApiError::new(
                409,
                "AlreadyExists",
                format!("{} \"{name}\" already exists", kind.plural),
            ));
        }
        inner.uid += 1;
        let uid = format!("00000000-0000-4000-8000-{:012x}", inner.uid);
        let meta = object["metadata"]
            .as_object_mut()
            .expect("metadata was made an object above. This is a bug.");
        meta.insert("name".into(), json!(name));
        meta.remove("generateName");
        if kind.namespaced {
            meta.insert("namespace".into(), json!(ns));
        }
        meta.insert("uid".into(), json!(uid));
        meta.insert("creationTimestamp".into(), json!(now()));
        meta.insert("generation".into(), json!(1));
        meta.remove("deletionTimestamp");
        object["apiVersion"] = json!(kind.api_version());
        object["kind"] = json!(kind.kind);
        if kind.status_subresource
            && !kind.group.is_empty()
            && kind.plural != "customresourcedefinitions"
        {
            object.as_object_mut().map(|o| o.remove("status"));
        }
        if kind.plural == "pods" && kind.group.is_empty() {
            object["status"] = json!({"phase": "Pending"});
        }
        check_schema(&kind, &name, &object)?;
        if kind.plural == "pods" && kind.group.is_empty() {
            let objects = &inner.objects;
            let lookup = |plural: &str, ns: &str, name: &str| {
                objects.get(&(
                    ResourceKey::new("/api/v1", plural),
                    ns.to_owned(),
                    name.to_owned(),
                ))
            };
            crate::admission::pod(&lookup, &ns, &object)?;
        }
        if kind.plural == "customresourcedefinitions" {
            object["status"] = json!({"conditions": [{"type": "Established", "status": "True", "reason": "InitialNamesAccepted", "message": "the initial names have been accepted"}], "acceptedNames": object["spec"]["names"].clone()});
            for new in kinds::from_crd(&object) {
                inner
                    .kinds
                    .retain(|k| !(k.api_path() == new.api_path() && k.plural == new.plural));
                inner.kinds.push(new);
            }
        }
        Self::bump(&mut inner, &mut object);
        inner.objects.insert(id, object.clone());
        Self::record(&mut inner, key, "ADDED", object.clone());
        let rv = inner.rv;
        drop(inner);
        self.notify(rv);
        Ok(object)
    }

    /// PUT (of the object, or of its `status` subresource).
    pub fn replace(
        &self,
        key: &ResourceKey,
        ns: &str,
        name: &str,
        object: Value,
        status_only: bool,
    ) -> Result<Value, ApiError> {
        self.update(key, ns, name, status_only, |_| Ok(object))
    }

    /// PATCH.
    pub fn patch(
        &self,
        key: &ResourceKey,
        ns: &str,
        name: &str,
        kind: PatchKind,
        patch: Value,
        status_only: bool,
    ) -> Result<Value, ApiError> {
        if kind == PatchKind::Apply && self.get(key, ns, name).is_none() {
            let mut object = patch;
            object["metadata"]["name"] = json!(name);
            return self.create(key, ns, object);
        }
        self.update(key, ns, name, status_only, |current| {
            let mut next = current.clone();
            match kind {
                PatchKind::Merge | PatchKind::Apply => merge(&mut next, &patch),
                PatchKind::Json => {
                    let ops: json_patch::Patch =
                        serde_json::from_value(patch.clone()).map_err(|e| {
                            ApiError::new(400, "BadRequest", format!("invalid JSON patch: {e}"))
                        })?;
                    json_patch::patch(&mut next, &ops).map_err(|e| {
                        ApiError::new(422, "Invalid", format!("the JSON patch failed: {e}"))
                    })?;
                }
            }
            // A merge patch may carry a resourceVersion precondition; otherwise it applies to the current one.
            if patch["metadata"]["resourceVersion"].is_null() || kind == PatchKind::Json {
                next["metadata"]["resourceVersion"] =
                    current["metadata"]["resourceVersion"].clone();
            }
            Ok(next)
        })
    }

    fn update(
        &self,
        key: &ResourceKey,
        ns: &str,
        name: &str,
        status_only: bool,
        change: impl FnOnce(&Value) -> Result<Value, ApiError>,
    ) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let (kind, id, current) = Self::locate(&inner, key, ns, name)?;
        let mut next = change(&current)?;
        let wanted = next["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if !wanted.is_empty()
            && wanted
                != current["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap_or_default()
        {
            return Err(ApiError::new(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
                    kind.plural
                ),
            ));
        }
        // Identity and system fields are the server's.
        for field in [
            "uid",
            "creationTimestamp",
            "namespace",
            "name",
            "deletionTimestamp",
            "generation",
        ] {
            match current["metadata"].get(field) {
                Some(value) => next["metadata"][field] = value.clone(),
                None => {
                    next["metadata"].as_object_mut().map(|m| m.remove(field));
                }
            }
        }
        next["apiVersion"] = current["apiVersion"].clone();
        next["kind"] = current["kind"].clone();
        if status_only {
            let status = next["status"].clone();
            next = current.clone();
            next["status"] = status;
        } else if kind.status_subresource {
            match current.get("status") {
                Some(status) => next["status"] = status.clone(),
                None => {
                    next.as_object_mut().map(|o| o.remove("status"));
                }
            }
        }
        let spec_changed =
            without(&current, &["metadata", "status"]) != without(&next, &["metadata", "status"]);
        if spec_changed && !status_only {
            let generation = current["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
            next["metadata"]["generation"] = json!(generation);
        }
        if next == current {
            return Ok(current);
        }
        check_schema(&kind, name, &next)?;
        Self::bump(&mut inner, &mut next);
        let finalized = next["metadata"]["deletionTimestamp"].is_string()
            && next["metadata"]["finalizers"]
                .as_array()
                .is_none_or(Vec::is_empty);
        if finalized {
            Self::remove_in(&mut inner, &id, &next);
        } else {
            inner.objects.insert(id, next.clone());
            Self::record(&mut inner, key, "MODIFIED", next.clone());
        }
        let rv = inner.rv;
        drop(inner);
        self.notify(rv);
        Ok(next)
    }

    /// An existing object, with its kind and id (the namespace is dropped for cluster kinds).
    fn locate(
        inner: &Inner,
        key: &ResourceKey,
        ns: &str,
        name: &str,
    ) -> Result<(Kind, ObjectId, Value), ApiError> {
        let kind = Self::kind_in(inner, key)?;
        let ns = if kind.namespaced {
            ns.to_owned()
        } else {
            String::new()
        };
        let id = (key.clone(), ns, name.to_owned());
        match inner.objects.get(&id) {
            Some(object) => Ok((kind, id, object.clone())),
            None => Err(ApiError::new(
                404,
                "NotFound",
                format!("{} \"{name}\" not found", kind.plural),
            )),
        }
    }

    /// DELETE: marks objects with finalizers, removes the rest and collects their dependants.
    pub fn delete(&self, key: &ResourceKey, ns: &str, name: &str) -> Result<Value, ApiError> {
        let mut inner = self.lock();
        let (_, id, object) = Self::locate(&inner, key, ns, name)?;
        let object = Self::delete_in(&mut inner, &id, object);
        let rv = inner.rv;
        drop(inner);
        self.notify(rv);
        Ok(object)
    }

    /// Deletes (or marks, if they have finalizers) every object owned by `owner`, recursively.
    fn collect_garbage(inner: &mut Inner, owner: &Value) {
        let Some(uid) = owner["metadata"]["uid"].as_str().map(str::to_owned) else {
            return;
        };
        let owned: Vec<_> = inner
            .objects
            .iter()
            .filter(|(_, v)| {
                v["metadata"]["ownerReferences"]
                    .as_array()
                    .is_some_and(|refs| refs.iter().any(|r| r["uid"] == uid))
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in owned {
            if let Some(object) = inner.objects.get(&id).cloned() {
                Self::delete_in(inner, &id, object);
            }
        }
    }

    /// Deletes one object: marks it when finalizers hold it, else removes it.
    fn delete_in(inner: &mut Inner, id: &ObjectId, mut object: Value) -> Value {
        let held = object["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        if !held {
            Self::bump(inner, &mut object);
            Self::remove_in(inner, id, &object);
        } else if !object["metadata"]["deletionTimestamp"].is_string() {
            object["metadata"]["deletionTimestamp"] = json!(now());
            object["metadata"]["deletionGracePeriodSeconds"] = json!(0);
            Self::bump(inner, &mut object);
            inner.objects.insert(id.clone(), object.clone());
            Self::record(inner, &id.0, "MODIFIED", object.clone());
        }
        object
    }

    /// Removes an object (already at its final resourceVersion) and collects its dependants.
    fn remove_in(inner: &mut Inner, id: &ObjectId, object: &Value) {
        inner.objects.remove(id);
        Self::record(inner, &id.0, "DELETED", object.clone());
        Self::collect_garbage(inner, object);
    }

    /// Changes an object's status in place, as a kubelet does (no precondition).
    pub fn set_status(
        &self,
        key: &ResourceKey,
        ns: &str,
        name: &str,
        change: impl FnOnce(&mut Value),
    ) -> bool {
        let result = self.update(key, ns, name, true, |current| {
            let mut next = current.clone();
            change(&mut next["status"]);
            Ok(next)
        });
        result.is_ok()
    }
}

fn without(object: &Value, fields: &[&str]) -> Value {
    let mut copy = object.clone();
    if let Some(map) = copy.as_object_mut() {
        for field in fields {
            map.remove(*field);
        }
    }
    copy
}

/// RFC 7386 merge.
pub fn merge(target: &mut Value, patch: &Value) {
    let Some(patch) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let map = target
        .as_object_mut()
        .expect("target was made an object above. This is a bug.");
    for (key, value) in patch {
        if value.is_null() {
            map.remove(key);
        } else {
            merge(map.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// Whether `object` matches a label selector (`a=b,c!=d,e,!f`) and a field selector
/// (`metadata.name=x`).
pub fn matches(object: &Value, labels: Option<&str>, fields: Option<&str>) -> bool {
    let label = |k: &str| object["metadata"]["labels"][k].as_str().map(str::to_owned);
    let field = |path: &str| {
        path.split('.')
            .fold(object, |v, p| &v[p])
            .as_str()
            .map(str::to_owned)
    };
    let terms = |selector: Option<&str>| {
        selector
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let check = |term: &str, get: &dyn Fn(&str) -> Option<String>| {
        if let Some((k, v)) = term.split_once("!=") {
            get(k.trim()).as_deref() != Some(v.trim())
        } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
            get(k.trim()).as_deref() == Some(v.trim())
        } else if let Some(k) = term.strip_prefix('!') {
            get(k).is_none()
        } else {
            get(term).is_some()
        }
    };
    terms(labels).iter().all(|t| check(t, &label)) && terms(fields).iter().all(|t| check(t, &field))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pods() -> ResourceKey {
        ResourceKey::new("/api/v1", "pods")
    }

    #[test]
    fn a_stale_resource_version_is_refused_with_409() {
        let store = Store::new();
        let pod = store
            .create(
                &pods(),
                "default",
                json!({"metadata": {"name": "p"}, "spec": {}}),
            )
            .unwrap();
        let mut stale = pod.clone();
        store
            .patch(
                &pods(),
                "default",
                "p",
                PatchKind::Merge,
                json!({"metadata": {"labels": {"a": "b"}}}),
                false,
            )
            .unwrap();
        stale["metadata"]["labels"] = json!({"c": "d"});
        assert_eq!(
            store
                .replace(&pods(), "default", "p", stale, false)
                .unwrap_err()
                .code,
            409
        );
    }

    #[test]
    fn finalizers_hold_a_deleted_object_until_removed_and_owners_collect_dependants() {
        let store = Store::new();
        let owner = store
            .create(
                &pods(),
                "default",
                json!({"metadata": {"name": "owner", "finalizers": ["x"]}}),
            )
            .unwrap();
        let uid = owner["metadata"]["uid"].clone();
        store.create(&pods(), "default", json!({"metadata": {"name": "child", "ownerReferences": [{"uid": uid, "name": "owner", "kind": "Pod", "apiVersion": "v1"}]}})).unwrap();
        let marked = store.delete(&pods(), "default", "owner").unwrap();
        assert!(marked["metadata"]["deletionTimestamp"].is_string());
        assert!(store.get(&pods(), "default", "child").is_some());
        store
            .patch(
                &pods(),
                "default",
                "owner",
                PatchKind::Merge,
                json!({"metadata": {"finalizers": null}}),
                false,
            )
            .unwrap();
        assert!(store.get(&pods(), "default", "owner").is_none());
        assert!(
            store.get(&pods(), "default", "child").is_none(),
            "the dependant is garbage collected"
        );
    }

    #[test]
    fn spec_changes_bump_the_generation_and_status_writes_do_not() {
        let store = Store::new();
        let key = ResourceKey::new("/apis/apps/v1", "deployments");
        store
            .create(
                &key,
                "default",
                json!({"metadata": {"name": "d"}, "spec": {"replicas": 1}}),
            )
            .unwrap();
        let after_spec = store
            .patch(
                &key,
                "default",
                "d",
                PatchKind::Merge,
                json!({"spec": {"replicas": 2}}),
                false,
            )
            .unwrap();
        assert_eq!(after_spec["metadata"]["generation"], 2);
        let after_status = store
            .patch(
                &key,
                "default",
                "d",
                PatchKind::Merge,
                json!({"status": {"ready": 1}, "spec": {"replicas": 9}}),
                true,
            )
            .unwrap();
        assert_eq!(after_status["metadata"]["generation"], 2);
        assert_eq!(
            after_status["spec"]["replicas"], 2,
            "a status write leaves the spec alone"
        );
        assert!(matches(&after_status, None, Some("metadata.name=d")));
        assert!(!matches(&after_status, Some("app=x"), None));
    }
}
