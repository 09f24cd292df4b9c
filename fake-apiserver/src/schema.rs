//! Structural-schema checks of custom resources on write, as the apiserver makes them before
//! anything is stored: types, `nullable`, `required`, `enum`, `minimum`/`maximum`,
//! `minLength`/`maxLength`, `minItems`/`maxItems`, through properties, items and
//! `additionalProperties`. Messages follow the apiserver's wording, with the field path.
//! Not checked: formats, CEL rules (`crds/tests/cel.rs` checks those with kube's validator),
//! pruning of unknown fields.

use serde_json::Value;

/// One violation: the field's path and the apiserver-style message.
pub type Violation = (String, String);

/// The violations of `object` (a whole custom resource) against its version's
/// `openAPIV3Schema`. `metadata`, `apiVersion` and `kind` are the server's to check.
pub fn validate(schema: &Value, object: &Value) -> Vec<Violation> {
    let mut out = Vec::new();
    let Some(properties) = schema["properties"].as_object() else {
        return out;
    };
    for (name, property) in properties {
        if ["metadata", "apiVersion", "kind"].contains(&name.as_str()) {
            continue;
        }
        match object.get(name) {
            Some(value) => check(property, value, name, &mut out),
            None => required(schema, name, name, &mut out),
        }
    }
    out
}

fn required(schema: &Value, name: &str, path: &str, out: &mut Vec<Violation>) {
    let listed = schema["required"]
        .as_array()
        .is_some_and(|r| r.iter().any(|n| n == name));
    if listed {
        out.push((path.to_owned(), format!("{path}: Required value")));
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn matches_type(wanted: &str, value: &Value) -> bool {
    match (wanted, type_name(value)) {
        ("number", "integer") => true,
        (wanted, actual) => wanted == actual,
    }
}

fn check(schema: &Value, value: &Value, path: &str, out: &mut Vec<Violation>) {
    if value.is_null() {
        if !schema["nullable"].as_bool().unwrap_or(false) && schema.get("type").is_some() {
            out.push((
                path.to_owned(),
                format!(
                    "{path}: Invalid value: \"null\": {path} in body must be of type {}: \"null\"",
                    schema["type"].as_str().unwrap_or("object")
                ),
            ));
        }
        return;
    }
    if let Some(wanted) = schema["type"].as_str()
        && !matches_type(wanted, value)
    {
        out.push((
            path.to_owned(),
            format!(
                "{path}: Invalid value: \"{}\": {path} in body must be of type {wanted}: \"{}\"",
                type_name(value),
                type_name(value)
            ),
        ));
        return;
    }
    if let Some(allowed) = schema["enum"].as_array()
        && !allowed.contains(value)
    {
        let choices: Vec<String> = allowed.iter().map(Value::to_string).collect();
        out.push((
            path.to_owned(),
            format!(
                "{path}: Unsupported value: {value}: supported values: {}",
                choices.join(", ")
            ),
        ));
    }
    bounds(schema, value, path, out);
    match value {
        Value::Object(fields) => {
            if let Some(properties) = schema["properties"].as_object() {
                for (name, property) in properties {
                    let child = format!("{path}.{name}");
                    match fields.get(name) {
                        Some(v) => check(property, v, &child, out),
                        None => required(schema, name, &child, out),
                    }
                }
            }
            if schema["additionalProperties"].is_object() {
                for (name, v) in fields {
                    check(
                        &schema["additionalProperties"],
                        v,
                        &format!("{path}.{name}"),
                        out,
                    );
                }
            }
        }
        Value::Array(items) if schema["items"].is_object() => {
            for (i, item) in items.iter().enumerate() {
                check(&schema["items"], item, &format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

fn bounds(schema: &Value, value: &Value, path: &str, out: &mut Vec<Violation>) {
    let mut fail = |message: String| out.push((path.to_owned(), message));
    if let Some(number) = value.as_f64() {
        if let Some(max) = schema["maximum"].as_f64()
            && number > max
        {
            fail(format!(
                "{path}: Invalid value: {value}: {path} in body should be less than or equal to {max}"
            ));
        }
        if let Some(min) = schema["minimum"].as_f64()
            && number < min
        {
            fail(format!(
                "{path}: Invalid value: {value}: {path} in body should be greater than or equal to {min}"
            ));
        }
    }
    if let Some(text) = value.as_str() {
        let length = text.chars().count() as u64;
        if let Some(max) = schema["maxLength"].as_u64()
            && length > max
        {
            fail(format!(
                "{path}: Too long: may not be more than {max} bytes"
            ));
        }
        if let Some(min) = schema["minLength"].as_u64()
            && length < min
        {
            fail(format!(
                "{path}: Invalid value: {value}: {path} in body should be at least {min} chars long"
            ));
        }
    }
    if let Some(items) = value.as_array() {
        let count = items.len() as u64;
        if let Some(max) = schema["maxItems"].as_u64()
            && count > max
        {
            fail(format!(
                "{path}: Too many: {count}: must have at most {max} items"
            ));
        }
        if let Some(min) = schema["minItems"].as_u64()
            && count < min
        {
            fail(format!(
                "{path}: Invalid value: {count}: {path} in body should have at least {min} items"
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn schema() -> Value {
        json!({"type": "object", "required": ["spec"], "properties": {
            "spec": {"type": "object", "required": ["model"], "properties": {
                "model": {"type": "string", "minLength": 1},
                "shardSize": {"type": "integer", "minimum": 1.0, "maximum": 4096.0},
                "layers": {"type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0.0, "maximum": 4294967295.0}},
                "mode": {"type": "string", "enum": ["a", "b"]},
                "limits": {"type": "object", "additionalProperties": {"type": "integer", "maximum": 10.0}},
                "note": {"type": "string", "nullable": true}
            }}
        }})
    }

    #[test]
    fn a_valid_object_passes_and_each_violation_is_named_by_its_path() {
        let good = json!({"metadata": {"name": "x"}, "spec": {"model": "m", "shardSize": 32, "layers": [1], "note": null}});
        assert!(validate(&schema(), &good).is_empty());
        let bad = json!({"spec": {"shardSize": 5000, "layers": [4294967296_u64, 1, 2, 3], "mode": "c", "limits": {"k": 11}}});
        let mut fields: Vec<String> = validate(&schema(), &bad)
            .into_iter()
            .map(|(f, _)| f)
            .collect();
        fields.sort();
        assert_eq!(
            fields,
            [
                "spec.layers",
                "spec.layers[0]",
                "spec.limits.k",
                "spec.mode",
                "spec.model",
                "spec.shardSize"
            ]
        );
        let messages: Vec<String> = validate(&schema(), &bad)
            .into_iter()
            .map(|(_, m)| m)
            .collect();
        assert!(messages.contains(&"spec.shardSize: Invalid value: 5000: spec.shardSize in body should be less than or equal to 4096".to_owned()), "{messages:?}");
        assert!(messages.contains(&"spec.model: Required value".to_owned()));
        let wrong_type = json!({"spec": {"model": 7}});
        assert!(
            validate(&schema(), &wrong_type)[0]
                .1
                .contains("must be of type string")
        );
        assert_eq!(validate(&schema(), &json!({}))[0].1, "spec: Required value");
    }
}
