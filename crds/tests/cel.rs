//! The CRD's CEL rules, evaluated with kube's client-side CEL validator against the schema that
//! `crdgen` emits: the same rules the apiserver enforces.

use harvest_crds::{HarvestJob, HarvestJobSpec};
use kube::core::cel::{validate_cel, validate_cel_update};

fn job() -> HarvestJob {
    HarvestJob::new(
        "probe",
        HarvestJobSpec {
            active_deadline_seconds: Some(600),
            ..HarvestJobSpec::new(
                "smollm2-135m",
                "s3://in/prompts.jsonl",
                "s3://out/probe",
                10_000,
            )
        },
    )
}

fn messages(result: Result<(), kube::core::cel::ValidationErrors>) -> String {
    match result {
        Ok(()) => String::new(),
        Err(errors) => format!("{errors:?}"),
    }
}

#[test]
fn a_well_formed_job_passes_every_rule() {
    assert_eq!(messages(validate_cel(&job())), "");
}

#[test]
fn a_relative_output_is_refused_at_creation() {
    let mut bad = job();
    bad.spec.output = Some("out/probe".into());
    assert!(
        messages(validate_cel(&bad))
            .contains("output must be s3://bucket/prefix or an absolute path")
    );
}

#[test]
fn layers_and_all_layers_together_are_refused() {
    let mut bad = job();
    bad.spec.harvest.layers = Some(vec![1, 2]);
    bad.spec.harvest.all_layers = true;
    assert!(messages(validate_cel(&bad)).contains("give either layers or allLayers"));
}

#[test]
fn the_model_input_harvest_output_and_budget_cannot_change_after_creation() {
    let old = job();
    type Change = fn(&mut HarvestJob);
    let cases: [(&str, Change); 5] = [
        ("model is immutable", |j| j.spec.model = "other".into()),
        ("input is immutable", |j| {
            j.spec.input.prompts = "s3://in/other.jsonl".into();
        }),
        ("harvest is immutable", |j| j.spec.harvest.shard_size = 7),
        ("output is immutable", |j| {
            j.spec.output = Some("s3://out/other".into());
        }),
        ("tokenBudget is immutable", |j| j.spec.token_budget = 1),
    ];
    for (message, change) in cases {
        let mut new = old.clone();
        change(&mut new);
        assert!(
            messages(validate_cel_update(&new, &old)).contains(message),
            "{message}"
        );
    }
}

#[test]
fn suspend_deadline_and_ttl_may_change_and_cancel_may_only_be_set() {
    let old = job();
    let mut new = old.clone();
    new.spec.suspend = true;
    new.spec.active_deadline_seconds = Some(60);
    new.spec.ttl_seconds_after_finished = Some(30);
    new.spec.cancel = true;
    assert_eq!(messages(validate_cel_update(&new, &old)), "");
    let uncancel = old.clone();
    assert!(messages(validate_cel_update(&uncancel, &new)).contains("cancel cannot be undone"));
}

#[test]
fn each_storage_prefix_of_an_account_must_be_a_bucket_url_or_an_absolute_path() {
    use harvest_crds::{HarvestAccount, HarvestAccountSpec};
    let account = |prefixes: &[&str]| {
        let mut spec = HarvestAccountSpec::for_namespaces(&["team"]);
        spec.storage_prefixes = prefixes.iter().map(|p| (*p).to_owned()).collect();
        HarvestAccount::new("acct", spec)
    };
    assert_eq!(
        messages(validate_cel(&account(&["s3://in/team", "/data/team"]))),
        ""
    );
    assert!(
        messages(validate_cel(&account(&["s3://in/team", "relative/dir"])))
            .contains("each storagePrefixes item must be s3://bucket/prefix or an absolute path")
    );
}
