//! `harvester run` end to end on the real SmolLM2 checkpoint: file layout, checksums, tokens,
//! statistics, projections, resume after a kill, and exit codes for bad input.

#![allow(clippy::unwrap_used, clippy::print_stdout)]

mod common;

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Reference, fixtures, smollm2_dir, worst_relative_error};
use harvest_core::JobOptions;
use harvest_core::format::{Contents, Manifest};
use harvest_core::layout::{Layout, LayoutName};
use harvest_core::selection::RawSelection;
use harvest_core::{HarvestPlan, LayerSelection, Location, Sites};
use harvester::backend::cpu::CpuBackend;
use harvester::backend::{Backend, Batch, Captured};
use harvester::pipeline::{self, RunOptions, progress::ProgressMode};
use harvester::projection::Directions;
use harvester::tokenizer::PromptTokenizer;
use safetensors::{Dtype, SafeTensors};

const PROMPTS: [&str; 5] = [
    "The quick brown fox jumps over the lazy dog.",
    "Interpretability research reads the residual stream.",
    "<|im_start|>user\nHi<|im_end|>",
    "Digits 0123456789 and code: fn main() {}",
    "One more",
];

fn write_prompts(dir: &Path, prompts: &[String]) -> PathBuf {
    let path = dir.join("prompts.jsonl");
    let lines: Vec<String> = prompts
        .iter()
        .map(|p| serde_json::json!({ "text": p }).to_string())
        .collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

fn plan(prompts: &Path, out: &Path, layers: Vec<i64>, shard_size: usize) -> HarvestPlan {
    HarvestPlan {
        model: smollm2_dir(),
        prompts: Location::Local(prompts.to_owned()),
        project_onto: None,
        output: Location::Local(out.to_owned()),
        batch_tokens: NonZeroUsize::new(4096).unwrap(),
        options: JobOptions {
            layers: LayerSelection::Explicit(layers),
            shard_size: NonZeroUsize::new(shard_size).unwrap(),
            ..JobOptions::default()
        },
    }
}

fn options() -> RunOptions {
    RunOptions {
        progress: ProgressMode::Off,
        model_name: None,
        device: harvester::backend::cuda::DeviceChoice::Cpu,
        s3: Default::default(),
        spill_dir: None,
        temp_dir: Some(std::env::temp_dir()),
        pipeline_stages: None,
        stage_devices: None,
        part: None,
        token_budget: None,
        job_uid: None,
        tried_on_gpu: Vec::new(),
        device_reason: None,
    }
}

fn manifest(out: &Path) -> Manifest {
    serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn a_run_writes_shards_in_prompt_order_with_the_tokenizers_ids_and_checksums() {
    let dir = tempfile::tempdir().unwrap();
    let prompts: Vec<String> = PROMPTS.iter().map(|s| (*s).to_owned()).collect();
    let out = dir.path().join("out");
    let plan = plan(&write_prompts(dir.path(), &prompts), &out, vec![29, 0], 2);
    let result = pipeline::run(&plan, &options()).unwrap();
    assert_eq!(result.n_shards, 3);
    assert_eq!(result.layer_indices, [0, 29]);
    assert_eq!(result.contents, Contents::Activations);

    let manifest = manifest(&out);
    let tokenizer = PromptTokenizer::from_dir(&smollm2_dir(), 8192).unwrap();
    assert_eq!(manifest.n_prompts, 5);
    assert_eq!(
        manifest
            .shards
            .iter()
            .map(|s| s.first_prompt)
            .collect::<Vec<_>>(),
        [0, 2, 4]
    );
    assert!(manifest.truncated_prompts.is_empty());
    let mut total = 0;
    for entry in &manifest.shards {
        let bytes = std::fs::read(out.join(&entry.file)).unwrap();
        assert_eq!(bytes.len() as u64, entry.bytes);
        assert_eq!(pipeline::shard::sha256_hex(&bytes), entry.sha256);
        let shard = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(
            shard.len(),
            2 * entry.token_counts.len(),
            "exactly prompt_i and tokens_i per prompt"
        );
        let first = entry.first_prompt;
        assert_eq!(
            entry.prompts,
            (first..first + entry.token_counts.len()).collect::<Vec<_>>()
        );
        assert_eq!(
            entry.tensors.len(),
            shard.len(),
            "the manifest lists every tensor"
        );
        for listed in &entry.tensors {
            let tensor = shard.tensor(&listed.name).unwrap();
            assert_eq!(tensor.shape(), listed.shape.as_slice(), "{}", listed.name);
            let dtype = match tensor.dtype() {
                Dtype::BF16 => "bfloat16",
                Dtype::F32 => "float32",
                Dtype::I32 => "int32",
                other => panic!("{other:?}"),
            };
            assert_eq!(dtype, listed.dtype, "{}", listed.name);
        }
        for (k, &count) in entry.token_counts.iter().enumerate() {
            let i = entry.first_prompt + k;
            let ids = tokenizer.encode(i, &prompts[i], true).unwrap().ids;
            assert_eq!(count, ids.len());
            total += count as u64;
            let tokens = shard.tensor(&format!("tokens_{i}")).unwrap();
            assert_eq!(tokens.dtype(), Dtype::I32);
            let got: Vec<u32> = tokens
                .data()
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as u32)
                .collect();
            assert_eq!(got, ids, "tokens_{i}");
            let values = shard.tensor(&format!("prompt_{i}")).unwrap();
            assert_eq!(values.dtype(), Dtype::BF16);
            assert_eq!(values.shape(), [2, ids.len(), 576]);
        }
    }
    assert_eq!(manifest.total_tokens, total);
    assert_eq!(
        manifest.stats_tokens,
        total - 1,
        "prompt 2 starts with <|im_start|>, the BOS"
    );
    assert!(
        !out.join("partial").exists(),
        "partial records are removed once the manifest is written"
    );

    let again = pipeline::run(&plan, &options()).unwrap();
    assert_eq!(again.bytes_written, result.bytes_written);
    // A rerun would have measured its own forward time; the stored one comes back instead.
    assert!(
        (again.timings.forward_s - result.timings.forward_s).abs() < 1e-9,
        "a finished plan is not run again: {again:?} vs {result:?}"
    );
}

/// bf16 little-endian bytes as f32.
fn bf16s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect()
}

#[test]
fn shard_values_equal_the_transformers_forward_pass_of_the_same_prompts() {
    let reference = Reference::open(&fixtures().join("smollm2_reference.safetensors"));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let layers = reference.layers.iter().map(|&l| l as i64).collect();
    let plan = plan(
        &write_prompts(dir.path(), &reference.prompts),
        &out,
        layers,
        2,
    );
    pipeline::run(&plan, &options()).unwrap();
    let mut compared = 0;
    for entry in &manifest(&out).shards {
        let bytes = std::fs::read(out.join(&entry.file)).unwrap();
        let shard = SafeTensors::deserialize(&bytes).unwrap();
        for k in 0..entry.token_counts.len() {
            let i = entry.first_prompt + k;
            let expected_ids = reference.ids(i, true);
            if expected_ids.len() > reference.truncate_at {
                // The reference cut this prompt shorter than the model's context does.
                continue;
            }
            let view = shard.tensor(&format!("prompt_{i}")).unwrap();
            let (shape, expected) = reference.residual(i);
            assert_eq!(view.shape(), shape.as_slice(), "prompt {i}");
            let error = worst_relative_error(&bf16s(view.data()), &expected, shape[2]);
            assert!(
                error <= 1e-2,
                "prompt {i}: worst relative error {error:.3e}"
            );
            compared += 1;
        }
    }
    assert!(compared >= 2, "only {compared} prompts compared");
}

#[test]
fn projections_equal_raw_activations_times_unit_directions_and_stats_describe_them() {
    let dir = tempfile::tempdir().unwrap();
    let prompts: Vec<String> = PROMPTS.iter().map(|s| (*s).to_owned()).collect();
    let values: Vec<f32> = (0..3 * 576)
        .map(|i| ((i * 7919 % 101) as f32 - 50.0) / 7.0)
        .collect();
    let npy = harvest_core::npy::f32_matrix(3, 576, &values);
    std::fs::write(dir.path().join("directions.npy"), npy).unwrap();
    let out = dir.path().join("out");
    let mut plan = plan(&write_prompts(dir.path(), &prompts), &out, vec![7, 22], 32);
    plan.project_onto = Some(Location::Local(dir.path().join("directions.npy")));
    pipeline::run(&plan, &options()).unwrap();
    let manifest = manifest(&out);
    assert_eq!(manifest.contents, Contents::Projections);
    assert_eq!(manifest.dtype, "float32");
    assert!(manifest.projection.as_ref().unwrap().normalized);
    assert!(manifest.statistics.contains("projections"));

    let tokenizer = PromptTokenizer::from_dir(&smollm2_dir(), 8192).unwrap();
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| tokenizer.encode(i, p, true).unwrap().ids)
        .collect();
    let mut backend = CpuBackend::load(
        &smollm2_dir(),
        &LayerSelection::Explicit(vec![7, 22]),
        Sites::default(),
        None,
    )
    .unwrap();
    let mut raw = Captured::default();
    backend
        .capture(&Batch::from_sequences(&ids), &mut raw)
        .unwrap();
    let units = Directions::new(&values, 3, 576, 576).unwrap();

    let shard_bytes = std::fs::read(out.join("shard_00000.safetensors")).unwrap();
    let shard = SafeTensors::deserialize(&shard_bytes).unwrap();
    let (mut sum, mut sum_sq, mut count) = (vec![0.0f64; 6], vec![0.0f64; 6], 0.0);
    let mut offset = 0;
    for (i, prompt_ids) in ids.iter().enumerate() {
        let projected = f32s(shard.tensor(&format!("prompt_{i}")).unwrap().data());
        assert_eq!(projected.len(), 2 * prompt_ids.len() * 3);
        for layer in 0..2 {
            for t in 0..prompt_ids.len() {
                let row = &raw.rows(layer, offset + t..offset + t + 1);
                for d in 0..3 {
                    let unit = &units.unit_vectors()[d * 576..(d + 1) * 576];
                    let expected: f64 = row
                        .iter()
                        .zip(unit)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum();
                    let got = f64::from(projected[(layer * prompt_ids.len() + t) * 3 + d]);
                    let norm: f64 = row
                        .iter()
                        .map(|v| f64::from(*v).powi(2))
                        .sum::<f64>()
                        .sqrt();
                    assert!(
                        (got - expected).abs() <= 1e-5 * norm,
                        "prompt {i} layer {layer} token {t} dir {d}: {got} vs {expected}"
                    );
                    if !(t == 0 && prompt_ids[0] == 1) {
                        sum[layer * 3 + d] += got;
                        sum_sq[layer * 3 + d] += got * got;
                    }
                }
            }
        }
        count += (prompt_ids.len() - usize::from(prompt_ids[0] == 1)) as f64;
        offset += prompt_ids.len();
    }
    let stats_bytes = std::fs::read(out.join("stats.safetensors")).unwrap();
    let stats = SafeTensors::deserialize(&stats_bytes).unwrap();
    let (mean, std) = (
        f32s(stats.tensor("mean").unwrap().data()),
        f32s(stats.tensor("std").unwrap().data()),
    );
    assert_eq!(stats.tensor("mean").unwrap().shape(), [2, 3]);
    for k in 0..6 {
        let m = sum[k] / count;
        let s = (sum_sq[k] / count - m * m).sqrt();
        assert!(
            (f64::from(mean[k]) - m).abs() <= 1e-4 * s.max(1.0),
            "mean {k}: {} vs {m}",
            mean[k]
        );
        assert!(
            (f64::from(std[k]) - s).abs() <= 1e-4 * s.max(1.0),
            "std {k}: {} vs {s}",
            std[k]
        );
    }
    assert_eq!(manifest.stats_tokens as f64, count);
}

fn harvester() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_harvester"));
    cmd.env("RUST_LOG", "warn");
    cmd
}

fn run_args_with(prompts: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    [
        "run",
        "--model",
        smollm2_dir().to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--layers",
        "3,29",
        "--shard-size",
        "4",
        "--batch-tokens",
        "96",
        "--progress",
        "off",
    ]
    .iter()
    .chain(extra)
    .map(|s| (*s).to_owned())
    .collect()
}

/// Every output file but result.json (whose timings differ), with its sha256.
fn output_files(out: &Path) -> Vec<(String, String)> {
    let mut files: Vec<(String, String)> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && p.file_name().unwrap() != "result.json")
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (
                name,
                pipeline::shard::sha256_hex(&std::fs::read(&p).unwrap()),
            )
        })
        .collect();
    files.sort();
    files
}

/// Runs the harvester with `args` and checks that it succeeded.
fn run_ok<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> std::process::Output {
    let output = harvester().args(args).output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Waits until the run `child` writes into `out` has recorded `records` shards, while it still
/// runs.
fn wait_for_records(child: &mut std::process::Child, out: &Path, records: usize) {
    // Only whole records: the object store writes each one to a staging file beside it
    // (`<name>#<n>`) and renames it, so counting every entry could stop a run mid-write.
    let whole = |entry: &std::fs::DirEntry| {
        entry
            .file_name()
            .to_str()
            .is_some_and(|name| name.ends_with(".record.safetensors"))
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::read_dir(out.join("partial")).map_or(0, |d| d.flatten().filter(whole).count())
        < records
    {
        assert!(Instant::now() < deadline, "no shard was recorded in time");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run finished before it could be stopped"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The arguments of `harvester finalize` for the job `run_args_with` describes.
fn finalize_args(prompts: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = run_args_with(prompts, out, extra);
    args[0] = "finalize".into();
    args
}

#[test]
fn max_prompt_tokens_cuts_each_prompt_to_its_first_tokens_and_the_manifest_lists_the_cut() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = [
        "Hi.",
        "A much longer prompt about the residual stream, block by block.",
    ];
    let prompts_path = write_prompts(dir.path(), &prompts.map(String::from));
    let out = dir.path().join("out");
    run_ok(&run_args_with(
        &prompts_path,
        &out,
        &["--max-prompt-tokens", "5"],
    ));
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["tokenizer"]["max_tokens"], 5);
    let cut = manifest["truncated_prompts"].as_array().unwrap();
    assert_eq!(cut.len(), 1, "{cut:?}");
    assert_eq!(
        (cut[0]["prompt"].as_u64(), cut[0]["kept_tokens"].as_u64()),
        (Some(1), Some(5))
    );
    assert!(cut[0]["original_tokens"].as_u64().unwrap() > 5);
    let bytes = std::fs::read(out.join(manifest["shards"][0]["file"].as_str().unwrap())).unwrap();
    let shard = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(shard.tensor("tokens_1").unwrap().shape(), [5]);
    assert_eq!(shard.tensor("prompt_1").unwrap().shape()[1], 5);
}

#[test]
fn a_killed_run_resumes_and_ends_with_files_identical_to_an_uninterrupted_run() {
    killed_and_resumed(&[]);
}

#[test]
fn a_killed_shuffled_run_resumes_to_the_same_training_files() {
    killed_and_resumed(&[
        "--layout",
        "shuffled",
        "--rows-per-file",
        "50",
        "--seed",
        "3",
    ]);
}

#[test]
fn a_killed_run_that_selects_tokens_by_norm_resumes_to_the_same_files() {
    // The norm filter's running median spans shards, so a resumed run must rebuild it from the
    // finished shards' records to decide as the uninterrupted run did.
    killed_and_resumed(&[
        "--max-norm-multiple",
        "1.05",
        "--sample-rate",
        "0.8",
        "--seed",
        "5",
        "--positions",
        "1:60",
    ]);
}

fn killed_and_resumed(extra: &[&str]) {
    let run_args = |prompts: &Path, out: &Path| run_args_with(prompts, out, extra);
    let dir = tempfile::tempdir().unwrap();
    let prompts: Vec<String> = (0..24)
        .map(|i| format!("Prompt number {i} talks about the residual stream of a language model, block by block, {}", "and more ".repeat(i % 5)))
        .collect();
    let prompts_path = write_prompts(dir.path(), &prompts);
    let (reference, resumed) = (dir.path().join("reference"), dir.path().join("resumed"));

    run_ok(&run_args(&prompts_path, &reference));

    let mut child = harvester()
        .args(run_args(&prompts_path, &resumed))
        .spawn()
        .unwrap();
    wait_for_records(&mut child, &resumed, 2);
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        !resumed.join("manifest.json").exists(),
        "a killed run has no manifest"
    );

    let second = run_ok(&run_args(&prompts_path, &resumed));
    let result: serde_json::Value = serde_json::from_slice(&second.stdout).unwrap();
    let resumed_shards = result["resumed_shards"].as_u64().unwrap();
    assert!(
        (2..6).contains(&resumed_shards),
        "resumed {resumed_shards} of 6 shards"
    );
    assert_eq!(output_files(&resumed), output_files(&reference));
}

#[test]
fn selected_tokens_are_the_full_runs_rows_at_the_listed_positions_and_the_counts_add_up() {
    let dir = tempfile::tempdir().unwrap();
    let prompts: Vec<String> = (0..6)
        .map(|i| {
            format!(
                "<|im_start|>user\n{} {}<|im_end|>",
                PROMPTS[i % PROMPTS.len()],
                "more ".repeat(i)
            )
        })
        .collect();
    let prompts_path = write_prompts(dir.path(), &prompts);
    let full_out = dir.path().join("full");
    let full = plan(&prompts_path, &full_out, vec![2, 9], 4);
    pipeline::run(&full, &options()).unwrap();
    let selected_out = dir.path().join("selected");
    let mut selected = plan(&prompts_path, &selected_out, vec![2, 9], 4);
    selected.options.selection = RawSelection {
        exclude_special_tokens: Some(true),
        positions: Some(vec![0, 12]),
        roles: None,
        sample_rate: Some(0.75),
        seed: Some(11),
        max_norm_multiple: Some(1.2),
    }
    .validate()
    .unwrap();
    pipeline::run(&selected, &options()).unwrap();
    let tokenizer = PromptTokenizer::from_dir(&smollm2_dir(), 8192).unwrap();
    let special = tokenizer.special_ids();
    let full_manifest = manifest(&full_out);
    let manifest = manifest(&selected_out);
    let info = manifest.selection.clone().expect("a selection block");
    assert_eq!(info.norm_layer, Some(9));
    assert_eq!(
        info.kept_tokens + info.dropped.total(),
        manifest.total_tokens
    );
    assert!(info.dropped.special > 0 && info.dropped.positions > 0 && info.dropped.sampled > 0);
    assert!(
        info.dropped.norm > 0,
        "a multiple of 1.2 drops some: {info:?}"
    );
    let (mut kept_total, mut sampled_out) = (0, 0);
    for (entry, full_entry) in manifest.shards.iter().zip(&full_manifest.shards) {
        let ours = std::fs::read(selected_out.join(&entry.file)).unwrap();
        let theirs = std::fs::read(full_out.join(&full_entry.file)).unwrap();
        let (ours, theirs) = (
            SafeTensors::deserialize(&ours).unwrap(),
            SafeTensors::deserialize(&theirs).unwrap(),
        );
        for &i in &entry.prompts {
            let ids = ours.tensor(&format!("tokens_{i}")).unwrap();
            assert_eq!(
                ids.data(),
                theirs.tensor(&format!("tokens_{i}")).unwrap().data(),
                "tokens_i keeps every id"
            );
            let ids: Vec<i32> = ids
                .data()
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let positions: Vec<usize> = ours
                .tensor(&format!("positions_{i}"))
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()) as usize)
                .collect();
            let rows = ours.tensor(&format!("prompt_{i}")).unwrap();
            assert_eq!(rows.shape(), [2, positions.len(), 576]);
            let all = theirs.tensor(&format!("prompt_{i}")).unwrap();
            for (row, &position) in positions.iter().enumerate() {
                assert!(position < 12, "prompt {i} position {position}");
                assert!(
                    special.binary_search(&(ids[position] as u32)).is_err(),
                    "special id kept"
                );
                assert!(
                    selected
                        .options
                        .selection
                        .pre_norm(i, position, false, None)
                        .is_none()
                );
                for layer in 0..2 {
                    let at = |data: &[u8], tokens: usize, t: usize| {
                        data[((layer * tokens + t) * 576) * 2..][..576 * 2].to_vec()
                    };
                    assert_eq!(
                        at(rows.data(), positions.len(), row),
                        at(all.data(), ids.len(), position),
                        "prompt {i} row {row}"
                    );
                }
            }
            kept_total += positions.len() as u64;
            sampled_out += (0..ids.len().min(12))
                .filter(|&p| {
                    selected
                        .options
                        .selection
                        .pre_norm(i, p, false, None)
                        .is_some()
                })
                .count();
        }
    }
    assert_eq!(kept_total, info.kept_tokens);
    assert!(sampled_out > 0);
    assert_eq!(
        manifest.stats_tokens, kept_total,
        "no kept token is a leading BOS here"
    );
}

/// The chi-square statistic of `observed` counts against `expected` proportions.
fn chi_square(observed: &[f64], expected: &[f64]) -> f64 {
    let n: f64 = observed.iter().sum();
    observed
        .iter()
        .zip(expected)
        .map(|(&o, &e)| (o - n * e).powi(2) / (n * e))
        .sum()
}

#[test]
fn a_shuffled_job_holds_every_kept_token_once_in_a_uniform_order_with_the_by_prompt_values() {
    let dir = tempfile::tempdir().unwrap();
    let prompts: Vec<String> = (0..280)
        .map(|i| {
            format!(
                "{} {}",
                PROMPTS[i % PROMPTS.len()],
                "word ".repeat(40 + i % 60)
            )
        })
        .collect();
    let prompts_path = write_prompts(dir.path(), &prompts);
    let sites = Sites::parse(&["attn_out", "resid_post"]).unwrap();
    let by_prompt_out = dir.path().join("by_prompt");
    let mut by_prompt = plan(&prompts_path, &by_prompt_out, vec![1], 64);
    by_prompt.options.sites = sites.clone();
    pipeline::run(&by_prompt, &options()).unwrap();
    let shuffled_out = dir.path().join("shuffled");
    let mut shuffled = by_prompt.clone();
    shuffled.output = Location::Local(shuffled_out.clone());
    shuffled.options.layout = Layout::new(LayoutName::Shuffled, Some(4096), 7).unwrap();
    let scratch = dir.path().join("scratch");
    let spill = RunOptions {
        spill_dir: Some(scratch.clone()),
        ..options()
    };
    pipeline::run(&shuffled, &spill).unwrap();
    assert_eq!(
        std::fs::read_dir(&scratch).unwrap().count(),
        0,
        "the spill files are gone"
    );
    assert!(!shuffled_out.join(".shuffle").exists());

    let reference = manifest(&by_prompt_out);
    let counts: Vec<usize> = reference
        .shards
        .iter()
        .flat_map(|s| s.token_counts.clone())
        .collect();
    let total: usize = counts.iter().sum();
    assert!(total > 20_000, "{total} rows make two windows of 10,000");
    let ours = manifest(&shuffled_out);
    let train = ours.train.clone().expect("a train block");
    assert!(ours.shards.is_empty() && !shuffled_out.join("shard_00000.safetensors").exists());
    assert_eq!(train.rows as usize, total);
    assert_eq!(train.tensors, ["attn_out.1", "resid_post.1", "index"]);
    assert_eq!(
        ours.stats_file.as_ref().unwrap().sha256,
        reference.stats_file.as_ref().unwrap().sha256,
        "the same statistics"
    );

    let shard_files: Vec<Vec<u8>> = reference
        .shards
        .iter()
        .map(|s| std::fs::read(by_prompt_out.join(&s.file)).unwrap())
        .collect();
    let shards: Vec<SafeTensors<'_>> = shard_files
        .iter()
        .map(|b| SafeTensors::deserialize(b).unwrap())
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut order = Vec::with_capacity(total);
    for (n, entry) in train.files.iter().enumerate() {
        let bytes = std::fs::read(shuffled_out.join(&entry.file)).unwrap();
        assert_eq!(pipeline::shard::sha256_hex(&bytes), entry.sha256);
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let index: Vec<i32> = file
            .tensor("index")
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(index.len(), 2 * entry.rows);
        assert!(n + 1 == train.files.len() || entry.rows == 4096);
        for (site, name) in [("attn_out", "attn_out.1"), ("prompt", "resid_post.1")] {
            let values = file.tensor(name).unwrap();
            assert_eq!(values.shape(), [entry.rows, 576]);
            for (row, pair) in index.chunks_exact(2).enumerate().step_by(97) {
                let (p, position) = (pair[0] as usize, pair[1] as usize);
                let shard = &shards[p / 64];
                let source = shard.tensor(&format!("{site}_{p}")).unwrap();
                let expected = &source.data()[position * 1152..(position + 1) * 1152];
                assert_eq!(
                    &values.data()[row * 1152..(row + 1) * 1152],
                    expected,
                    "{name} row {row} of {}",
                    entry.file
                );
            }
        }
        for pair in index.chunks_exact(2) {
            assert!(
                seen.insert((pair[0], pair[1])),
                "({}, {}) twice",
                pair[0],
                pair[1]
            );
            order.push(pair[0] as usize);
        }
    }
    assert_eq!(seen.len(), total, "every token once");
    // Prompt indices in each window of 10,000 rows against their share of the tokens, in 20
    // groups of 14 prompts: 19 degrees of freedom, whose 1% critical value is 36.19.
    let share: Vec<f64> = counts
        .chunks(14)
        .map(|c| c.iter().sum::<usize>() as f64 / total as f64)
        .collect();
    for window in order.chunks_exact(10_000) {
        let mut observed = vec![0.0; share.len()];
        for &p in window {
            observed[p / 14] += 1.0;
        }
        let statistic = chi_square(&observed, &share);
        println!("window of 10,000 rows: chi-square {statistic:.1} (19 degrees of freedom)");
        assert!(
            statistic < 36.19,
            "chi-square {statistic:.1} over 19 degrees of freedom"
        );
    }
    // The by-prompt order would fail the same test: it is what the shuffle has to undo.
    let by_prompt_order: Vec<usize> = counts
        .iter()
        .enumerate()
        .flat_map(|(p, &n)| std::iter::repeat_n(p, n))
        .collect();
    let mut first = vec![0.0; share.len()];
    for &p in &by_prompt_order[..10_000] {
        first[p / 14] += 1.0;
    }
    assert!(chi_square(&first, &share) > 36.19);
    check_prediction_of(
        &shuffled_out,
        &counts,
        shuffled.options.layout,
        &[1],
        &sites,
        Contents::Activations,
        576,
    );
}

#[test]
fn a_bf16_run_records_its_precision_and_writes_the_same_bytes_twice() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = write_prompts(dir.path(), &PROMPTS.map(str::to_owned));
    let mut plan = plan(&prompts, &dir.path().join("one"), vec![4, 20], 2);
    plan.options.precision = Some(harvest_core::plan::Precision::Bf16);
    pipeline::run(&plan, &options()).unwrap();
    let mut again = plan.clone();
    again.output = Location::Local(dir.path().join("two"));
    pipeline::run(&again, &options()).unwrap();
    assert_eq!(
        output_files(&dir.path().join("one")),
        output_files(&dir.path().join("two"))
    );
    let manifest = manifest(&dir.path().join("one"));
    assert_eq!(manifest.precision, harvest_core::plan::Precision::Bf16);
    check_prediction(
        &dir.path().join("one"),
        &[4, 20],
        &Sites::default(),
        Contents::Activations,
        576,
    );
}

/// `harvester run --model <model> --prompts <prompts> --out <out> <extra…>`.
fn run_exit(model: &str, prompts: &Path, out: &str, extra: &[&str]) -> (i32, String) {
    let mut args = vec![
        "run",
        "--model",
        model,
        "--prompts",
        prompts.to_str().unwrap(),
        "--out",
        out,
    ];
    args.extend_from_slice(extra);
    exit_of(&args)
}

fn exit_of(args: &[&str]) -> (i32, String) {
    let output = harvester().args(args).output().unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[test]
fn bad_input_exits_2_with_a_named_cause_and_no_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let model = smollm2_dir();
    let model = model.to_str().unwrap();
    let out = dir.path().join("out");
    let out = out.to_str().unwrap();
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "\n").unwrap();
    let (code, stderr) = run_exit(model, &empty, out, &[]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("empty"), "{stderr}");

    let malformed = dir.path().join("bad.jsonl");
    std::fs::write(&malformed, "{\"text\": \"fine\"}\n{\"text\": 3}\n").unwrap();
    let (code, stderr) = run_exit(model, &malformed, out, &[]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("line 2"), "{stderr}");

    let plan = dir.path().join("plan.json");
    std::fs::write(
        &plan,
        format!(
            r#"{{"model": "{model}", "prompts": "p.jsonl", "output": "{out}", "layerz": [1]}}"#
        ),
    )
    .unwrap();
    let log = dir.path().join("termination.log");
    let (code, stderr) = exit_of(&[
        "run",
        "--plan",
        plan.to_str().unwrap(),
        "--termination-log",
        log.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("layerz"), "{stderr}");
    let message: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&log).unwrap()).unwrap();
    assert_eq!(message["exit_code"], 2);

    let fine = write_prompts(dir.path(), &["hello".to_owned()]);
    let (code, stderr) = run_exit(model, &fine, out, &["--layers", "30"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("layer 30"), "{stderr}");
    assert!(!Path::new(out).join("manifest.json").exists());
}

#[test]
fn a_corpus_over_its_token_budget_exits_2_naming_its_count_and_runs_at_exactly_that_budget() {
    let dir = tempfile::tempdir().unwrap();
    let model = smollm2_dir();
    let model = model.to_str().unwrap();
    let out = dir.path().join("out");
    let out = out.to_str().unwrap();
    let prompts = write_prompts(dir.path(), &["hello there".to_owned(), "a cat".to_owned()]);
    let (code, stderr) = run_exit(
        model,
        &prompts,
        out,
        &["--layers", "1", "--token-budget", "1"],
    );
    assert_eq!(code, 2, "{stderr}");
    let needed: u64 = stderr
        .split("tokenizes to ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no token count in {stderr}"));
    assert!(stderr.contains("token budget of 1"), "{stderr}");
    assert!(!Path::new(out).join("manifest.json").exists());

    let budget = needed.to_string();
    let (code, stderr) = run_exit(
        model,
        &prompts,
        out,
        &["--layers", "1", "--token-budget", &budget],
    );
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(manifest(Path::new(out)).total_tokens, needed);
}

#[test]
fn an_output_that_cannot_be_written_exits_3() {
    let dir = tempfile::tempdir().unwrap();
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, "not a directory").unwrap();
    let prompts = write_prompts(dir.path(), &["hello".to_owned()]);
    let out = blocker.join("out");
    let (code, stderr) = run_exit(
        smollm2_dir().to_str().unwrap(),
        &prompts,
        out.to_str().unwrap(),
        &[],
    );
    assert_eq!(code, 3, "{stderr}");
    assert!(stderr.contains(out.to_str().unwrap()), "{stderr}");
}

#[test]
fn a_different_plan_into_a_finished_output_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let prompts = write_prompts(dir.path(), &["hello there".to_owned()]);
    pipeline::run(&plan(&prompts, &out, vec![1], 2), &options()).unwrap();
    let err = pipeline::run(&plan(&prompts, &out, vec![2], 2), &options()).unwrap_err();
    assert!(err.to_string().contains("different harvest"), "{err}");
    assert_eq!(err.exit_status().code(), 2);
}

/// The sizes `harvest_core::estimate` predicts from the token counts alone, against what a run
/// writes: shards and statistics to the byte, the manifest within a few bytes per layer.
fn check_prediction(out: &Path, layers: &[usize], sites: &Sites, contents: Contents, width: usize) {
    let counts: Vec<usize> = manifest(out)
        .shards
        .iter()
        .flat_map(|s| s.token_counts.clone())
        .collect();
    check_prediction_of(
        out,
        &counts,
        Layout::ByPrompt,
        layers,
        sites,
        contents,
        width,
    );
}

/// [`check_prediction`] given the prompts' token counts (a shuffled manifest has no shards to
/// read them from).
fn check_prediction_of(
    out: &Path,
    counts: &[usize],
    layout: Layout,
    layers: &[usize],
    sites: &Sites,
    contents: Contents,
    width: usize,
) {
    let manifest = manifest(out);
    // A shuffled manifest lists no shards; a by-prompt run of the same plan beside it does.
    let by_prompt = out.with_file_name("by_prompt");
    let kept: Vec<usize> = match manifest.shards.is_empty() && by_prompt.exists() {
        true => self::manifest(&by_prompt).shards,
        false => manifest.shards.clone(),
    }
    .iter()
    .flat_map(|s| s.kept_counts.clone())
    .collect();
    let selection = manifest
        .selection
        .as_ref()
        .map(|info| harvest_core::estimate::KeptTokens {
            rules: &info.rules,
            kept_counts: &kept,
            dropped: info.dropped,
        });
    let truncated: Vec<(usize, usize)> = manifest
        .truncated_prompts
        .iter()
        .map(|t| (t.prompt, t.original_tokens))
        .collect();
    let shape = harvest_core::estimate::JobShape {
        selection,
        layout,
        precision: manifest.precision,
        token_counts: counts,
        truncated: &truncated,
        shard_size: manifest.shard_size,
        layers,
        sites,
        contents,
        width,
        model: manifest.model.clone(),
        add_special_tokens: manifest.tokenizer.add_special_tokens,
        bos_token_id: manifest.tokenizer.bos_token_id,
        max_tokens: manifest.tokenizer.max_tokens,
        conversations: manifest.roles.is_some(),
        router: manifest.router.as_ref(),
    };
    let predicted = harvest_core::estimate::predict(&shape);
    let actual: Vec<u64> = match &manifest.train {
        None => manifest.shards.iter().map(|s| s.bytes).collect(),
        Some(train) => train.files.iter().map(|f| f.bytes).collect(),
    };
    assert_eq!(predicted.shards, actual, "data files to the byte");
    let stats = std::fs::metadata(out.join("stats.safetensors"))
        .unwrap()
        .len();
    assert_eq!(predicted.stats, stats, "statistics to the byte");
    let written = std::fs::metadata(out.join("manifest.json")).unwrap().len();
    // Only the digits of each mean_token_norm can differ: per layer, per site and at the top.
    let slack = 4 * (layers.len() * (sites.len() + 1)) as u64;
    assert!(
        predicted.manifest.abs_diff(written) <= slack,
        "manifest {written} predicted {}",
        predicted.manifest
    );
}

#[test]
fn the_predicted_file_sizes_are_what_a_run_writes_for_activations_projections_and_sites() {
    let dir = tempfile::tempdir().unwrap();
    let prompts: Vec<String> = (0..7)
        .map(|i| format!("{} {}", PROMPTS[i % PROMPTS.len()], "word ".repeat(i * 3)))
        .collect();
    let out = dir.path().join("out");
    let plan = plan(
        &write_prompts(dir.path(), &prompts),
        &out,
        vec![3, 0, 17],
        3,
    );
    pipeline::run(&plan, &options()).unwrap();
    check_prediction(
        &out,
        &[0, 3, 17],
        &Sites::default(),
        Contents::Activations,
        576,
    );

    let many = Sites::parse(&["attn_out", "resid_mid", "resid_post"]).unwrap();
    let sited = dir.path().join("sited");
    let mut sited_plan = plan.clone();
    sited_plan.output = Location::Local(sited.clone());
    sited_plan.options.sites = many.clone();
    pipeline::run(&sited_plan, &options()).unwrap();
    check_prediction(&sited, &[0, 3, 17], &many, Contents::Activations, 576);

    let directions = dir.path().join("dirs.npy");
    let values: Vec<f32> = (0..4 * 576).map(|i| ((i % 13) as f32) - 6.0).collect();
    std::fs::write(&directions, harvest_core::npy::f32_matrix(4, 576, &values)).unwrap();
    let projected = dir.path().join("projected");
    let mut plan = plan.clone();
    plan.output = Location::Local(projected.clone());
    plan.project_onto = Some(Location::Local(directions));
    plan.options.sites = Sites::parse(&["resid_pre", "mlp_out"]).unwrap();
    pipeline::run(&plan, &options()).unwrap();
    check_prediction(
        &projected,
        &[0, 3, 17],
        &plan.options.sites,
        Contents::Projections,
        4,
    );
}

#[test]
fn one_two_and_three_cpu_pipeline_stages_write_the_bytes_one_backend_writes() {
    let dir = tempfile::tempdir().unwrap();
    let prompts: Vec<String> = (0..10)
        .map(|i| {
            format!(
                "Stage test prompt {i}: {}",
                "tokens flow block by block ".repeat(i % 4)
            )
        })
        .collect();
    let prompts = write_prompts(dir.path(), &prompts);
    let run = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut args = run_args_with(&prompts, &out, extra);
        args.extend(["--sites".into(), "resid_pre,mlp_out,resid_post".into()]);
        run_ok(&args);
        output_files(&out)
    };
    let single = run("single", &[]);
    assert!(single.iter().any(|(name, _)| name == "manifest.json"));
    for stages in ["1", "2", "3"] {
        let staged = run(&format!("stages-{stages}"), &["--pipeline-stages", stages]);
        assert_eq!(staged, single, "{stages} stages");
    }
}

/// Runs `run` (a name for its output, extra arguments) without stages, then with 2 and 3, and
/// checks each staged run wrote the files of the one without.
fn two_and_three_stages_write_the_files_of_one(
    run: impl Fn(&str, &[&str]) -> Vec<(String, String)>,
) {
    let single = run("single", &[]);
    assert!(single.iter().any(|(name, _)| name == "manifest.json"));
    for stages in ["2", "3"] {
        let staged = run(&format!("stages-{stages}"), &["--pipeline-stages", stages]);
        assert_eq!(staged, single, "{stages} stages");
    }
}

#[test]
fn two_and_three_cuda_replay_stages_write_the_bytes_one_replay_writes() {
    // What a CUDA stage does on its GPU, replayed: only the first embeds, each takes the
    // residual stream the one before hands on and keeps the sites of its own blocks.
    let dir = tempfile::tempdir().unwrap();
    let prompts = write_prompts(dir.path(), &PROMPTS.map(String::from));
    let run = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut args = run_args_with(&prompts, &out, &["--device", "cuda-replay"]);
        args.extend(extra.iter().map(|&a| a.to_owned()));
        args.extend(["--sites".into(), "resid_pre,mlp_out,resid_post".into()]);
        run_ok(&args);
        output_files(&out)
    };
    two_and_three_stages_write_the_files_of_one(run);
}

#[test]
fn afmoe_in_two_and_three_cuda_replay_stages_writes_the_bytes_one_replay_writes() {
    // Each stage routes its own sparse blocks' tokens (and keeps their choices); the
    // embedding's muP scale is the first stage's alone.
    let dir = tempfile::tempdir().unwrap();
    let prompts = write_prompts(dir.path(), &PROMPTS.map(String::from));
    let model = fixtures().join("tiny-afmoe-bf16");
    let run = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let args: Vec<String> = [
            "run",
            "--model",
            model.to_str().unwrap(),
            "--prompts",
            prompts.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--layers",
            "all",
            "--sites",
            "attn_out,mlp_out,resid_post,router_logits",
            "--device",
            "cuda-replay",
            "--progress",
            "off",
        ]
        .iter()
        .chain(extra)
        .map(|s| (*s).to_owned())
        .collect();
        run_ok(&args);
        output_files(&out)
    };
    two_and_three_stages_write_the_files_of_one(run);
}

#[test]
fn stage_devices_without_cuda_stages_exit_2_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = write_prompts(dir.path(), &["hello".to_owned()]);
    let out = dir.path().join("out");
    let (code, stderr) = run_exit(
        smollm2_dir().to_str().unwrap(),
        &prompts,
        out.to_str().unwrap(),
        &["--pipeline-stages", "2", "--stage-devices", "0,0"],
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--stage-devices") && stderr.contains("--device cuda"),
        "{stderr}"
    );
    assert!(!out.join("manifest.json").exists());
}

#[test]
fn a_killed_three_stage_run_resumes_to_the_same_files() {
    killed_and_resumed(&["--pipeline-stages", "3"]);
}

#[test]
fn a_job_that_keeps_shallow_layers_splits_only_the_blocks_it_runs_over_every_stage() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = write_prompts(dir.path(), &["Every stage runs a share.".to_owned()]);
    let run = |name: &str, extra: &[&str]| {
        let out = dir.path().join(name);
        let mut args = run_args_with(&prompts, &out, extra);
        let layers = args.iter().position(|a| a == "--layers").unwrap();
        args[layers + 1] = "3".into();
        let output = harvester()
            .env("RUST_LOG", "info")
            .args(args)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        (
            output_files(&out),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (single, _) = run("single", &[]);
    let (staged, log) = run("staged", &["--pipeline-stages", "3"]);
    assert_eq!(staged, single);
    let planned: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("pipeline stage"))
        .collect();
    assert_eq!(planned.len(), 3, "{log}");
    // The job runs SmolLM2's blocks 0-3, split over the three stages (the first holds the
    // embedding too), not the first 10 of its 30 blocks on stage 1 alone.
    let mut covered = Vec::new();
    for (i, line) in planned.iter().enumerate() {
        assert!(line.contains(&format!("stage={} of=3", i + 1)), "{log}");
        let field = |name: &str| -> usize {
            let at = line.find(&format!("{name}=")).unwrap() + name.len() + 1;
            line[at..].split(' ').next().unwrap().parse().unwrap()
        };
        covered.extend(field("first_block")..=field("last_block"));
    }
    assert_eq!(covered, [0, 1, 2, 3], "{log}");
}

#[test]
fn pipeline_stages_of_zero_or_more_than_the_blocks_exit_2_naming_the_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let model = smollm2_dir();
    let prompts = write_prompts(dir.path(), &["hello".to_owned()]);
    for stages in ["0", "31"] {
        let out = dir.path().join(format!("out-{stages}"));
        let (code, stderr) = run_exit(
            model.to_str().unwrap(),
            &prompts,
            out.to_str().unwrap(),
            &["--pipeline-stages", stages],
        );
        assert_eq!(code, 2, "{stderr}");
        assert!(
            stderr.contains(&format!("--pipeline-stages {stages}")) && stderr.contains("30 blocks"),
            "{stderr}"
        );
        assert!(!out.join("manifest.json").exists());
    }
}

#[test]
fn a_run_reports_the_weight_bytes_it_reads_before_its_first_batch() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = write_prompts(dir.path(), &["Loading first, then running.".to_owned()]);
    let out = dir.path().join("out");
    let mut args = run_args_with(&prompts, &out, &[]);
    let mode = args.iter().position(|a| a == "--progress").unwrap();
    args[mode + 1] = "json".into();
    let output = run_ok(&args);
    let events: Vec<harvest_core::worker::ProgressEvent> = String::from_utf8_lossy(&output.stderr)
        .lines()
        .filter_map(harvest_core::worker::ProgressEvent::parse_line)
        .collect();
    use harvest_core::worker::Phase;
    let first_running = events
        .iter()
        .position(|e| e.phase == Phase::Running)
        .unwrap();
    let loading = &events[..first_running];
    assert!(loading.len() >= 2 && loading.iter().all(|e| e.phase == Phase::Loading));
    assert_eq!(loading[0].bytes_loaded, Some(0));
    let total = loading[0].bytes_total.unwrap();
    // SmolLM2's 30 blocks in bf16, the embedding aside: about 212 MB.
    assert!((200_000_000..230_000_000).contains(&total), "{total}");
    assert_eq!(loading.last().unwrap().bytes_loaded, Some(total));
    assert!(
        events[first_running..]
            .iter()
            .all(|e| e.phase == Phase::Running)
    );
}

/// Runs `parts` parts of the job at once, each its own process, then finalizes; returns the
/// finalize's output and the parts' reports.
fn run_in_parts(
    prompts: &Path,
    out: &Path,
    extra: &[&str],
    parts: usize,
) -> Vec<serde_json::Value> {
    let children: Vec<_> = (0..parts)
        .map(|i| {
            let part = format!("{i}/{parts}");
            harvester()
                .args(run_args_with(prompts, out, extra))
                .args(["--part", &part])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let reports = children
        .into_iter()
        .map(|child| {
            let output = child.wait_with_output().unwrap();
            assert!(
                output.status.success(),
                "{}",
                String::from_utf8_lossy(&output.stderr)
            );
            serde_json::from_slice(&output.stdout).unwrap()
        })
        .collect();
    run_ok(&finalize_args(prompts, out, extra));
    reports
}

fn parts_prompts(dir: &Path) -> PathBuf {
    let prompts: Vec<String> = (0..22)
        .map(|i| {
            format!(
                "Part prompt {i}: {}",
                "a residual stream, shard by shard ".repeat(i % 4)
            )
        })
        .collect();
    write_prompts(dir, &prompts)
}

#[test]
fn a_job_run_in_three_parts_at_once_and_finalized_writes_the_bytes_of_one_run() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = parts_prompts(dir.path());
    for (name, extra) in [
        (
            "by-prompt",
            vec!["--sites", "resid_pre,resid_post", "--sample-rate", "0.7"],
        ),
        (
            "shuffled",
            vec![
                "--layout",
                "shuffled",
                "--rows-per-file",
                "64",
                "--seed",
                "9",
            ],
        ),
    ] {
        let whole = dir.path().join(format!("{name}-whole"));
        run_ok(&run_args_with(&prompts, &whole, &extra));
        let parted = dir.path().join(format!("{name}-parts"));
        let reports = run_in_parts(&prompts, &parted, &extra, 3);
        // 22 prompts in shards of 4: 6 shards, two a part.
        let shards: Vec<_> = reports.iter().map(|r| r["shards"].clone()).collect();
        assert_eq!(
            shards,
            [
                serde_json::json!([0, 2]),
                serde_json::json!([2, 4]),
                serde_json::json!([4, 6])
            ]
        );
        assert_eq!(output_files(&parted), output_files(&whole), "{name}");
        let result = |out: &Path| -> serde_json::Value {
            serde_json::from_slice(&std::fs::read(out.join("result.json")).unwrap()).unwrap()
        };
        assert_eq!(result(&parted)["tokens"], result(&whole)["tokens"]);
        // Finalize again: the same answer, nothing rewritten.
        run_ok(&finalize_args(&prompts, &parted, &extra));
        assert_eq!(
            output_files(&parted),
            output_files(&whole),
            "{name} after a second finalize"
        );
    }
}

#[test]
fn a_part_with_no_shard_left_to_run_never_loads_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = parts_prompts(dir.path());
    let out = dir.path().join("parts");
    let part = |part: &str| {
        let mut args = run_args_with(&prompts, &out, &["--part", part]);
        let mode = args.iter().position(|a| a == "--progress").unwrap();
        args[mode + 1] = "json".into();
        let output = run_ok(&args);
        let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        (report, String::from_utf8_lossy(&output.stderr).into_owned())
    };
    // 6 shards over 7 parts: part 0 has one, part 6 none.
    let (first, loaded) = part("0/7");
    assert_eq!(first["shards"], serde_json::json!([0, 1]));
    assert!(loaded.contains("\"loading\""), "{loaded}");
    let (empty, idle) = part("6/7");
    assert_eq!(empty["shards"], serde_json::json!([6, 6]));
    assert_eq!(empty["written"], 0);
    assert!(!idle.contains("\"loading\""), "{idle}");
    // Run again once its shard is recorded, part 0 has nothing left either.
    let (again, rerun) = part("0/7");
    assert_eq!(
        (again["written"].clone(), again["resumed"].clone()),
        (0.into(), 1.into())
    );
    assert!(!rerun.contains("\"loading\""), "{rerun}");
}

#[test]
fn a_killed_part_reruns_from_its_records_and_the_job_finalizes_to_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = parts_prompts(dir.path());
    let whole = dir.path().join("whole");
    run_ok(&run_args_with(&prompts, &whole, &[]));
    let parted = dir.path().join("parts");
    // Part 0 of 2 (shards 0-2) is killed once it has recorded a shard.
    let mut child = harvester()
        .args(run_args_with(&prompts, &parted, &[]))
        .args(["--part", "0/2"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for_records(&mut child, &parted, 1);
    child.kill().unwrap();
    child.wait().unwrap();
    // Finalize now refuses, naming what is missing.
    let early = harvester()
        .args(finalize_args(&prompts, &parted, &[]))
        .output()
        .unwrap();
    assert_eq!(early.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&early.stderr);
    assert!(
        stderr.contains("of the job's 6 shards are not written yet"),
        "{stderr}"
    );
    assert!(!parted.join("manifest.json").exists());
    let reports = run_in_parts(&prompts, &parted, &[], 2);
    assert!(
        reports[0]["resumed"].as_u64().unwrap() >= 1,
        "{:?}",
        reports[0]
    );
    assert_eq!(output_files(&parted), output_files(&whole));
}

#[test]
fn a_run_on_the_cuda_replay_writes_what_a_gpu_run_would_and_says_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = write_prompts(dir.path(), &PROMPTS.map(String::from));
    let (replayed, cpu) = (dir.path().join("replayed"), dir.path().join("cpu"));
    run_ok(&run_args_with(
        &prompts,
        &replayed,
        &["--device", "cuda-replay"],
    ));
    run_ok(&run_args_with(
        &prompts,
        &cpu,
        &["--device", "cpu", "--precision", "bf16"],
    ));
    let (ours, theirs) = (manifest(&replayed), manifest(&cpu));
    // The plan asked for f32; the CUDA pass computes in bf16 and the manifest says what ran.
    assert_eq!(ours.precision, harvest_core::plan::Precision::Bf16);
    assert_eq!(ours.n_prompts, theirs.n_prompts);
    let bytes = |m: &Manifest| m.shards.iter().map(|s| s.bytes).collect::<Vec<_>>();
    assert_eq!(bytes(&ours), bytes(&theirs), "shards of the same shapes");
    assert_ne!(
        output_files(&replayed),
        output_files(&cpu),
        "a different engine"
    );
}

#[test]
fn a_replayed_run_with_the_batch_tail_hidden_writes_the_bytes_of_one_without() {
    // With HARVEST_CUDA_TAIL=overlap the backend hands each batch's capture back one call
    // late, as the CUDA backend does; the run must pair every capture with its own prompts.
    let dir = tempfile::tempdir().unwrap();
    let prompts = write_prompts(dir.path(), &PROMPTS.map(String::from));
    let run = |name: &str, tail: &str| {
        let out = dir.path().join(name);
        let mut args = run_args_with(&prompts, &out, &["--device", "cuda-replay"]);
        // A batch a prompt or two: several hand-backs, and a shard split across batches.
        let budget = args.iter().position(|a| a == "--batch-tokens").unwrap() + 1;
        args[budget] = "24".into();
        let output = harvester()
            .args(&args)
            .env("HARVEST_CUDA_TAIL", tail)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        output_files(&out)
    };
    let hidden = run("hidden", "overlap");
    assert_eq!(hidden, run("waited", "wait"));
    assert!(hidden.iter().any(|(name, _)| name.contains("shard")));
}

#[test]
fn a_run_on_the_cuda_replay_that_names_f32_computes_f32_within_a_shard_bit_of_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = write_prompts(dir.path(), &PROMPTS.map(String::from));
    let (replayed, cpu) = (dir.path().join("replayed"), dir.path().join("cpu"));
    let f32 = ["--precision", "f32"];
    run_ok(&run_args_with(
        &prompts,
        &replayed,
        &["--device", "cuda-replay", f32[0], f32[1]],
    ));
    // The CPU's own precision is f32.
    run_ok(&run_args_with(&prompts, &cpu, &["--device", "cpu"]));
    let (ours, theirs) = (manifest(&replayed), manifest(&cpu));
    assert_eq!(ours.precision, harvest_core::plan::Precision::F32);
    assert_eq!(theirs.precision, harvest_core::plan::Precision::F32);
    // Both keep f32 throughout: the bf16 shards differ by a flipped last bit at most. The
    // replay's own precision, bf16, is outside the same bound.
    let bf16 = dir.path().join("bf16");
    run_ok(&run_args_with(
        &prompts,
        &bf16,
        &["--device", "cuda-replay"],
    ));
    assert_eq!(
        manifest(&bf16).precision,
        harvest_core::plan::Precision::Bf16
    );
    let within = |out: &Path| {
        let compared = harvester()
            .args(["compare", cpu.to_str().unwrap(), out.to_str().unwrap()])
            .args(["--max-relative-error", "5e-3"])
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&compared.stdout).into_owned();
        (compared.status.success(), said)
    };
    let (f32_within, said) = within(&replayed);
    assert!(f32_within, "{said}");
    let (bf16_within, said) = within(&bf16);
    assert!(!bf16_within, "{said}");
}

#[test]
fn parts_on_the_cuda_replay_close_in_its_arithmetic_when_finalize_names_their_device() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = parts_prompts(dir.path());
    let (parted, whole) = (dir.path().join("parted"), dir.path().join("whole"));
    let replay = ["--device", "cuda-replay"];
    run_ok(&run_args_with(&prompts, &whole, &replay));
    run_in_parts(&prompts, &parted, &replay, 2);
    assert_eq!(
        manifest(&parted).precision,
        harvest_core::plan::Precision::Bf16
    );
    assert_eq!(output_files(&parted), output_files(&whole));
    // Finalize on another kind of device resolves another precision, so another plan: it
    // refuses the output rather than rewrite it.
    let output = harvester()
        .args(finalize_args(&prompts, &parted, &["--device", "cpu"]))
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
}

#[test]
fn parts_refuse_the_norm_filter_whose_median_spans_the_whole_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = parts_prompts(dir.path());
    let out = dir.path().join("out");
    let output = harvester()
        .args(run_args_with(&prompts, &out, &["--max-norm-multiple", "2"]))
        .args(["--part", "0/2"])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("max_norm_multiple"));
    let (code, stderr) = exit_of(&["run", "--part", "2/2"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("INDEX/COUNT"), "{stderr}");
}

#[test]
fn sigterm_mid_run_exits_3_at_once_saying_so_and_the_rerun_resumes_to_the_same_files() {
    let dir = tempfile::tempdir().unwrap();
    let prompts: Vec<String> = (0..24)
        .map(|i| {
            format!(
                "Prompt {i} about the residual stream, block by block, {}",
                "and more ".repeat(i % 5)
            )
        })
        .collect();
    let prompts = write_prompts(dir.path(), &prompts);
    let (reference, stopped) = (dir.path().join("reference"), dir.path().join("stopped"));
    run_ok(&run_args_with(&prompts, &reference, &[]));
    let log = dir.path().join("termination.log");
    let mut child = harvester()
        .args(run_args_with(&prompts, &stopped, &[]))
        .arg("--termination-log")
        .arg(&log)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for_records(&mut child, &stopped, 1);
    let sent = Instant::now();
    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code();
        }
        assert!(
            sent.elapsed() < Duration::from_secs(30),
            "SIGTERM did not stop the run"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(
        code,
        Some(3),
        "stopped by SIGTERM is an infrastructure ending"
    );
    let message: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&log).unwrap()).unwrap();
    assert_eq!(message["kind"], "infrastructure", "{message}");
    assert!(
        message["error"].as_str().unwrap().contains("SIGTERM"),
        "{message}"
    );
    assert!(!stopped.join("manifest.json").exists());
    let rerun = run_ok(&run_args_with(&prompts, &stopped, &[]));
    let result: serde_json::Value = serde_json::from_slice(&rerun.stdout).unwrap();
    assert!(result["resumed_shards"].as_u64().unwrap() >= 1, "{result}");
    assert_eq!(output_files(&stopped), output_files(&reference));
}

/// The int32 or float32 values of tensor `name` of `file`.
fn tensor_values<T>(
    file: &SafeTensors<'_>,
    name: &str,
    decode: fn([u8; 4]) -> T,
) -> (Vec<usize>, Vec<T>) {
    let view = file.tensor(name).unwrap();
    let values = view
        .data()
        .chunks_exact(4)
        .map(|b| decode(b.try_into().unwrap()))
        .collect();
    (view.shape().to_vec(), values)
}

#[test]
fn a_router_job_keeps_transformers_expert_choices_of_the_kept_rows_in_both_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixtures().join("tiny-afmoe-bf16");
    let reference = Reference::open(&model.join("reference.safetensors"));
    let prompts = write_prompts(dir.path(), &reference.prompts);
    let by_prompt_out = dir.path().join("by_prompt");
    let mut by_prompt = plan(&prompts, &by_prompt_out, vec![1, 3, 4], 2);
    by_prompt.model = model.clone();
    by_prompt.options.sites = Sites::parse(&["resid_post", "router_logits"]).unwrap();
    by_prompt.options.max_prompt_tokens = NonZeroUsize::new(reference.truncate_at);
    by_prompt.options.selection = RawSelection {
        positions: Some(vec![2, 30]),
        ..RawSelection::default()
    }
    .validate()
    .unwrap();
    pipeline::run(&by_prompt, &options()).unwrap();
    let written = manifest(&by_prompt_out);
    let router = written.router.clone().expect("a router block");
    assert_eq!(router.layer_indices, [3, 4], "the kept sparse blocks");
    assert_eq!((router.experts, router.experts_per_token), (8, 2));
    let route = |p: usize, name: &str| reference.f32s(&format!("{name}_{p}")).1;
    let mut rows = 0;
    for shard in &written.shards {
        let bytes = std::fs::read(by_prompt_out.join(&shard.file)).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        for &p in &shard.prompts {
            let (_, positions) =
                tensor_values(&file, &format!("positions_{p}"), i32::from_le_bytes);
            let (shape, ids) = tensor_values(&file, &format!("router_ids_{p}"), i32::from_le_bytes);
            let (_, weights) =
                tensor_values(&file, &format!("router_weights_{p}"), f32::from_le_bytes);
            let (logit_shape, _) =
                tensor_values(&file, &format!("router_logits_{p}"), f32::from_le_bytes);
            let n = positions.len();
            assert_eq!((shape, logit_shape), (vec![2, n, 2], vec![2, n, 8]));
            let (their_shape, their_ids) = reference.i32s(&format!("router_ids_{p}"));
            let their_weights = route(p, "router_weights");
            let tokens = their_shape[1];
            for layer in 0..2 {
                for (r, &position) in positions.iter().enumerate() {
                    let ours = (layer * n + r) * 2..(layer * n + r + 1) * 2;
                    let theirs = (layer * tokens + position as usize) * 2;
                    let theirs = theirs..theirs + 2;
                    assert_eq!(ids[ours.clone()], their_ids[theirs.clone()], "prompt {p}");
                    for (a, b) in weights[ours].iter().zip(&their_weights[theirs]) {
                        assert!((a - b).abs() < 1e-4, "prompt {p}: {a} {b}");
                    }
                    rows += 1;
                }
            }
        }
    }
    assert!(rows > 100, "{rows} rows checked");
    let counts: Vec<usize> = written
        .shards
        .iter()
        .flat_map(|s| s.token_counts.clone())
        .collect();
    let sites = by_prompt.options.sites.clone();
    let layers = [1, 3, 4];
    check_prediction_of(
        &by_prompt_out,
        &counts,
        Layout::ByPrompt,
        &layers,
        &sites,
        Contents::Activations,
        64,
    );

    // The shuffled layout carries each row's choices beside its activations.
    let shuffled_out = dir.path().join("shuffled");
    let mut shuffled = by_prompt.clone();
    shuffled.output = Location::Local(shuffled_out.clone());
    shuffled.options.layout = Layout::new(LayoutName::Shuffled, Some(64), 7).unwrap();
    pipeline::run(&shuffled, &options()).unwrap();
    let train = manifest(&shuffled_out).train.unwrap();
    assert_eq!(
        train.tensors[4..],
        [
            "router_ids.3",
            "router_weights.3",
            "router_logits.3",
            "router_ids.4",
            "router_weights.4",
            "router_logits.4"
        ]
    );
    let mut shuffled_rows = 0;
    for entry in &train.files {
        let bytes = std::fs::read(shuffled_out.join(&entry.file)).unwrap();
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let (_, index) = tensor_values(&file, "index", i32::from_le_bytes);
        let (_, ids) = tensor_values(&file, "router_ids.4", i32::from_le_bytes);
        for (row, pair) in index.chunks_exact(2).enumerate() {
            let (p, position) = (pair[0] as usize, pair[1] as usize);
            let (their_shape, their_ids) = reference.i32s(&format!("router_ids_{p}"));
            let theirs = (their_shape[1] + position) * 2;
            assert_eq!(ids[row * 2..row * 2 + 2], their_ids[theirs..theirs + 2]);
            shuffled_rows += 1;
        }
    }
    assert_eq!(shuffled_rows as u64, train.rows);
    let layout = shuffled.options.layout;
    check_prediction_of(
        &shuffled_out,
        &counts,
        layout,
        &layers,
        &sites,
        Contents::Activations,
        64,
    );
}
