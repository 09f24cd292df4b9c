//! The shards read back with Python's safetensors and numpy, as researchers read them
//! (tests/python/check_output.py). The interpreter, with numpy, safetensors and tokenizers
//! installed by scripts/test.sh, is named by `HARVEST_PYTHON`.

#![allow(clippy::unwrap_used)]

mod common;

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::process::Command;

use common::smollm2_dir;
use harvest_core::{HarvestPlan, LayerSelection, Location};
use harvester::pipeline::{self, RunOptions, progress::ProgressMode};

#[test]
fn python_reads_the_documented_shards_tokens_and_statistics() {
    let python = common::python();
    let dir = tempfile::tempdir().unwrap();
    let prompts = [
        "The quick brown fox jumps over the lazy dog.",
        "<|im_start|>user\nWhat is a residual stream?<|im_end|>",
        "Ünïcödé and digits 0123456789",
        "x",
        "def f(x):\n    return x * 2\n",
    ];
    let lines: Vec<String> = prompts
        .iter()
        .map(|p| serde_json::json!({ "text": p }).to_string())
        .collect();
    let prompts_path = dir.path().join("prompts.jsonl");
    std::fs::write(&prompts_path, lines.join("\n")).unwrap();
    let out = dir.path().join("out");
    let plan = HarvestPlan {
        model: smollm2_dir(),
        prompts: Location::Local(prompts_path.clone()),
        project_onto: None,
        output: Location::Local(out.clone()),
        batch_tokens: NonZeroUsize::new(4096).unwrap(),
        options: harvest_core::JobOptions {
            layers: LayerSelection::Quartiles,
            shard_size: NonZeroUsize::new(2).unwrap(),
            ..Default::default()
        },
    };
    pipeline::run(
        &plan,
        &RunOptions {
            progress: ProgressMode::Off,
            model_name: None,
            device: harvester::backend::cuda::DeviceChoice::Cpu,
            s3: Default::default(),
            spill_dir: None,
            temp_dir: None,
            pipeline_stages: None,
            stage_devices: None,
            part: None,
            token_budget: None,
            job_uid: None,
            tried_on_gpu: Vec::new(),
            device_reason: None,
        },
    )
    .unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/check_output.py");
    let output = Command::new(&python)
        .arg(script)
        .arg(&out)
        .arg(smollm2_dir())
        .arg(&prompts_path)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "python check failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
