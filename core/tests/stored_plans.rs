//! Plans written before `JobOptions` existed (by the API, the operator, or a user's script)
//! still read, and a worker writes them back unchanged.

use harvest_core::{HarvestPlan, ModelShape, RawPlan};

const SMOLLM: ModelShape = ModelShape {
    num_layers: 30,
    hidden_size: 576,
    moe: None,
};

fn round_trip(text: &str) -> serde_json::Value {
    let raw: RawPlan = serde_json::from_str(text).expect("the stored plan parses");
    let plan = HarvestPlan::try_from(raw).expect("the stored plan is valid");
    let resolved = plan.resolve(&SMOLLM).expect("its layers resolve");
    serde_json::to_value(resolved.to_raw()).expect("a plan serializes")
}

#[test]
fn a_plan_with_every_option_reads_and_writes_back_byte_for_byte() {
    let stored = include_str!("fixtures/plan-every-option.json");
    let raw: RawPlan = serde_json::from_str(stored).unwrap();
    let resolved = HarvestPlan::try_from(raw)
        .unwrap()
        .resolve(&SMOLLM)
        .unwrap();
    let written = serde_json::to_string_pretty(&resolved.to_raw()).unwrap();
    assert_eq!(written, stored.trim_end());
}

#[test]
fn a_plan_of_the_first_release_reads_with_its_defaults() {
    let stored = include_str!("fixtures/plan-first-release.json");
    let value: serde_json::Value = serde_json::from_str(stored).unwrap();
    assert_eq!(round_trip(stored), value);
}
