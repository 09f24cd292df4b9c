//! The configurations we ship, as a user starts from them: `configs/embedded.example.json` and
//! the API ConfigMap of `manifests/base/api.yaml` parse, and list the seed's three models in their
//! lanes with their device counts, optional until their files are there.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use harvest_api::catalogue::Catalogue;
use harvest_api::config::ServerConfig;
use harvest_core::quota::Lane;

fn repository() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn check_seed_models(config: &ServerConfig) {
    for (name, lane, devices) in [
        ("llama-8b", Lane::Small, 1),
        ("llama-405b", Lane::Large, 8),
        ("trinity-truebase", Lane::Large, 8),
    ] {
        let model = config.models.iter().find(|m| m.name == name).unwrap();
        assert_eq!(
            (model.lane, model.devices, model.optional),
            (lane, devices, true),
            "{name}"
        );
    }
}

#[test]
fn the_example_configuration_loads_with_smollm2_served_and_the_seed_models_listed() {
    let config =
        ServerConfig::from_file(&repository().join("configs/embedded.example.json")).unwrap();
    check_seed_models(&config);
    let catalogue = Catalogue::load(&config.models).unwrap();
    let views = catalogue.views();
    let names: Vec<&str> = views.iter().map(|v| v.name.as_str()).collect();
    assert_eq!(
        names,
        ["llama-405b", "llama-8b", "smollm2-135m", "trinity-truebase"]
    );
    for view in &views {
        let dir = config.models.iter().find(|m| m.name == view.name).unwrap();
        let present = dir.path.join("config.json").is_file();
        assert_eq!(view.available, present, "{}", view.name);
    }
    assert!(
        catalogue.get("smollm2-135m").is_some(),
        "scripts/fetch-model.sh put it there"
    );
}

#[test]
fn the_kubernetes_api_configuration_lists_the_seed_models() {
    let manifest = std::fs::read_to_string(repository().join("manifests/base/api.yaml")).unwrap();
    let (_, rest) = manifest.split_once("api.json: |\n").unwrap();
    let json: String = rest
        .lines()
        .take_while(|line| line.starts_with("    ") || line.is_empty())
        .map(|line| format!("{line}\n"))
        .collect();
    let config: ServerConfig = serde_json::from_str(&json).unwrap();
    check_seed_models(&config);
}

#[test]
fn a_newer_releases_keys_are_set_aside_and_named_so_a_rolled_back_server_starts() {
    let mut example: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repository().join("configs/embedded.example.json")).unwrap(),
    )
    .unwrap();
    example["future_setting"] = serde_json::json!({"on": true});
    example["models"][0]["future_field"] = serde_json::json!(3);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("newer.json");
    std::fs::write(&path, example.to_string()).unwrap();
    let config = ServerConfig::from_file(&path).unwrap();
    assert_eq!(
        config.unknown_keys,
        ["future_setting", "models.0.future_field"]
    );
    let shipped =
        ServerConfig::from_file(&repository().join("configs/embedded.example.json")).unwrap();
    assert_eq!(config.models.len(), shipped.models.len());
    assert!(shipped.unknown_keys.is_empty());
}
