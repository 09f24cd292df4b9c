//! The errors the fake apiserver answers, as the real one shapes them: a `Status` body.

use serde_json::{Value, json};

use crate::kinds::Kind;

/// An API error, served as a `Status`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub code: u16,
    /// `NotFound`, `AlreadyExists`, `Conflict`, `Invalid`, `BadRequest`, `MethodNotAllowed`.
    pub reason: &'static str,
    /// A sentence.
    pub message: String,
    /// `details` of an `Invalid` status: the object and one cause per field.
    pub details: Option<Value>,
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: String) -> Self {
        Self {
            code,
            reason,
            message,
            details: None,
        }
    }

    /// The 422 of an object that breaks its kind's schema, shaped as the apiserver's.
    pub fn invalid(kind: &Kind, name: &str, violations: &[crate::schema::Violation]) -> Self {
        let messages: Vec<&str> = violations.iter().map(|(_, m)| m.as_str()).collect();
        let listed = match messages.as_slice() {
            [one] => (*one).to_owned(),
            many => format!("[{}]", many.join(", ")),
        };
        let causes: Vec<Value> = violations
            .iter()
            .map(|(field, message)| {
                let text = message
                    .strip_prefix(&format!("{field}: "))
                    .unwrap_or(message);
                json!({"reason": "FieldValueInvalid", "message": text, "field": field})
            })
            .collect();
        Self {
            code: 422,
            reason: "Invalid",
            message: if kind.group.is_empty() {
                format!("{} \"{name}\" is invalid: {listed}", kind.kind)
            } else {
                format!(
                    "{}.{} \"{name}\" is invalid: {listed}",
                    kind.kind, kind.group
                )
            },
            details: Some(
                json!({"name": name, "group": kind.group, "kind": kind.kind, "causes": causes}),
            ),
        }
    }

    /// The `Status` body.
    pub fn status(&self) -> Value {
        let mut status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message, "reason": self.reason, "code": self.code});
        if let Some(details) = &self.details {
            status["details"] = details.clone();
        }
        status
    }
}
