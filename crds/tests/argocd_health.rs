//! The Argo CD health check (`manifests/argocd/health.lua`) run in Lua 5.4 against the cases of
//! `health_test.yaml`, the layout Argo CD's own resource-customization tests use.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use mlua::{Lua, LuaSerdeExt};
use serde::Deserialize;

#[derive(Deserialize)]
struct Cases {
    tests: Vec<Case>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Case {
    health_status: Health,
    input_path: String,
}

#[derive(Deserialize, Debug, PartialEq)]
struct Health {
    status: String,
    message: String,
}

#[test]
fn the_health_check_maps_every_job_state_to_the_expected_argo_status() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../manifests/argocd");
    let script = std::fs::read_to_string(dir.join("health.lua")).unwrap();
    let cases: Cases =
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("health_test.yaml")).unwrap())
            .unwrap();
    assert!(cases.tests.len() >= 6);
    for case in cases.tests {
        let object: serde_json::Value =
            serde_yaml::from_str(&std::fs::read_to_string(dir.join(&case.input_path)).unwrap())
                .unwrap();
        let lua = Lua::new();
        lua.globals()
            .set("obj", lua.to_value(&object).unwrap())
            .unwrap();
        let result: mlua::Value = lua.load(&script).eval().unwrap();
        let health: Health = lua.from_value(result).unwrap();
        assert_eq!(health, case.health_status, "{}", case.input_path);
    }
}
