//! The `harvester` binary: argument parsing and logging set-up; the work is in the library.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use harvest_core::{HarvestPlan, LayerSelection, RawPlan};
use harvester::gguf::OutputDtype;
use harvester::pipeline::progress::ProgressMode;
use harvester::pipeline::{RunOptions, result::termination_message};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Harvest residual-stream activations from Llama-family models"
)]
struct Cli {
    /// Worker threads for the CPU backend (default: all cores).
    #[arg(long, env = "HARVEST_THREADS", global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a harvest job: shards, statistics and a manifest in a directory or s3:// prefix.
    ///
    /// Exit status: 0 done, 2 bad input (fix the plan), 3 infrastructure failure (retry; a
    /// rerun resumes), 70 internal error.
    Run(RunArgs),
    /// Convert a llama-architecture GGUF into a Hugging Face checkpoint directory.
    ImportGguf {
        /// The .gguf file.
        file: PathBuf,
        /// The directory to write (created if needed).
        #[arg(long)]
        out: PathBuf,
        /// dtype of model.safetensors.
        #[arg(long, value_enum, default_value_t = OutputDtype::Bf16)]
        dtype: OutputDtype,
    },
    /// Print what a finished local harvest holds: manifest summary and each tensor's shape.
    Inspect {
        /// The output directory of a harvest.
        dir: PathBuf,
    },
    /// Capture one prompt and print each kept layer's token norms.
    Probe {
        /// Checkpoint directory.
        #[arg(long)]
        model: PathBuf,
        /// Layers to keep: a list such as 7,15,22, all, or quartiles.
        #[arg(long, default_value = "all")]
        layers: LayerSelection,
        /// Tokenize the text verbatim, adding no BOS.
        #[arg(long)]
        no_special_tokens: bool,
        /// The prompt.
        text: String,
    },
    /// Measure forward-pass throughput on a JSON file of token-id lists; prints JSON.
    Bench {
        /// Checkpoint directory.
        #[arg(long)]
        model: PathBuf,
        /// JSON file: a list of lists of token ids.
        #[arg(long, required_unless_present = "prompts", conflicts_with = "prompts")]
        ids: Option<PathBuf>,
        /// A prompts file (.jsonl, .json or .txt), tokenized with the model's tokenizer.
        #[arg(long)]
        prompts: Option<PathBuf>,
        /// Layers to keep: a list such as 7,15,22,29, or all.
        #[arg(long, default_value = "all")]
        layers: LayerSelection,
        /// Tokens per forward batch.
        #[arg(long, default_value_t = 4096)]
        batch_tokens: usize,
        /// The engine: cpu, cuda or cuda:N (auto picks the CPU, as `run` does).
        #[arg(long, default_value = "cpu")]
        device: harvester::backend::cuda::DeviceChoice,
        /// Project onto this many seeded random directions instead of keeping activations.
        #[arg(long)]
        directions: Option<usize>,
    },
    /// Write a Llama checkpoint of a named shape with seeded random bf16 weights, for benchmarks
    /// and backend checks where a real checkpoint cannot be brought.
    SynthModel {
        /// The shape: llama-8b or smollm2-135m.
        #[arg(long)]
        shape: String,
        /// The checkpoint directory to write.
        #[arg(long)]
        out: PathBuf,
        /// The seed of the weights.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Copy tokenizer.json and tokenizer_config.json from this checkpoint, so `run` can
        /// tokenize prompts (the vocabularies must match).
        #[arg(long)]
        tokenizer_from: Option<PathBuf>,
    },
    /// Compare two local harvests of the same plan: token ids, and each token row's relative
    /// error; prints JSON, and fails when ids differ or an error exceeds --max-relative-error.
    Compare {
        /// The reference output directory (say, the CPU run).
        reference: PathBuf,
        /// The output directory to check.
        candidate: PathBuf,
        /// The largest per-token relative error allowed.
        #[arg(long, default_value_t = 1e-2)]
        max_relative_error: f64,
    },
}

#[derive(Debug, Args)]
struct RunArgs {
    /// A JSON plan (as the API and the operator write it); the flags below are ignored.
    #[arg(long, conflicts_with_all = ["model", "prompts", "out", "plan_json"])]
    plan: Option<PathBuf>,
    /// The same JSON plan inline (how the operator passes it in a Pod's args).
    #[arg(long, conflicts_with_all = ["model", "prompts", "out"])]
    plan_json: Option<String>,
    /// Checkpoint directory.
    #[arg(long, required_unless_present_any = ["plan", "plan_json"])]
    model: Option<String>,
    /// Prompts: .jsonl ({"text": ...} per line), .json (list of strings) or .txt; path or s3://.
    #[arg(long, required_unless_present_any = ["plan", "plan_json"])]
    prompts: Option<String>,
    /// Layers to keep: a list such as 8,16,24, all, or quartiles (the default).
    #[arg(long, default_value = "quartiles")]
    layers: LayerSelection,
    /// Prompts per shard.
    #[arg(long, default_value_t = harvest_core::plan::DEFAULT_SHARD_SIZE)]
    shard_size: usize,
    /// Tokens per forward batch.
    #[arg(long, default_value_t = harvest_core::plan::DEFAULT_BATCH_TOKENS)]
    batch_tokens: usize,
    /// Project onto these directions ([n, hidden] in .npy or .safetensors; path or s3://).
    #[arg(long)]
    project_onto: Option<String>,
    /// Tokenize verbatim: add no BOS or other special tokens.
    #[arg(long)]
    no_special_tokens: bool,
    /// Output directory or s3://bucket/prefix.
    #[arg(long, required_unless_present_any = ["plan", "plan_json"])]
    out: Option<String>,
    /// The model's name in the manifest (default: the checkpoint directory's name).
    #[arg(long)]
    model_name: Option<String>,
    /// Progress display.
    #[arg(long, value_enum, default_value_t = ProgressMode::Auto)]
    progress: ProgressMode,
    /// Write a summary of at most 4 KiB here at exit (a Kubernetes termination message).
    #[arg(long)]
    termination_log: Option<PathBuf>,
    /// Where the forward pass runs: auto, cpu, cuda or cuda:N. `auto` runs on the CPU until the
    /// CUDA backend has passed its GPU check; `cuda` runs it.
    #[arg(long, default_value = "auto")]
    device: harvester::backend::cuda::DeviceChoice,
}

impl RunArgs {
    fn raw_plan(&self) -> anyhow::Result<RawPlan> {
        if let Some(path) = &self.plan {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading plan {}", path.display()))?;
            return serde_json::from_str(&text)
                .with_context(|| format!("invalid plan {}", path.display()));
        }
        if let Some(text) = &self.plan_json {
            return serde_json::from_str(text).context("invalid --plan-json");
        }
        Ok(RawPlan {
            model: self.model.clone().unwrap_or_default(),
            prompts: self.prompts.clone().unwrap_or_default(),
            layers: self.layers.clone(),
            shard_size: self.shard_size,
            add_special_tokens: !self.no_special_tokens,
            project_onto: self.project_onto.clone(),
            output: self.out.clone().unwrap_or_default(),
            batch_tokens: self.batch_tokens,
        })
    }
}

/// Runs a harvest and maps its outcome to the documented exit status.
fn run_job(args: &RunArgs) -> ExitCode {
    let outcome = args
        .raw_plan()
        .map_err(|e| (harvester::error::EXIT_BAD_INPUT, format!("{e:#}"), None))
        .and_then(|raw| {
            harvester::backend::cuda::select(args.device)
                .and_then(|device| {
                    let plan = HarvestPlan::try_from(raw)?;
                    let options = RunOptions {
                        progress: args.progress,
                        model_name: args.model_name.clone(),
                        device,
                    };
                    harvester::pipeline::run(&plan, &options)
                })
                .map_err(|e| (e.exit_code(), e.to_string(), Some(e)))
        });
    let message = match &outcome {
        Ok(result) => termination_message(Ok(result)),
        Err((_, _, Some(error))) => termination_message(Err(error)),
        Err((code, text, None)) => {
            serde_json::json!({"error": text, "exit_code": code, "kind": "bad_input"}).to_string()
        }
    };
    if let Some(path) = &args.termination_log
        && let Err(e) = std::fs::write(path, &message)
    {
        tracing::warn!(path = %path.display(), error = %e, "could not write the termination log");
    }
    match outcome {
        Ok(result) => {
            print_out(&format!(
                "{}\n",
                serde_json::to_string_pretty(&result).unwrap_or_default()
            ));
            ExitCode::SUCCESS
        }
        Err((code, text, _)) => {
            tracing::error!(exit_code = code, "harvest failed: {text}");
            ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
    }
}

/// Writes to stdout, ignoring a closed pipe (`harvester inspect DIR | head` is fine).
fn print_out(text: &str) {
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Some(threads) = cli.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global()
            .context("setting up the worker threads")?;
    }
    match cli.command {
        Command::Run(args) => return Ok(run_job(&args)),
        Command::ImportGguf { file, out, dtype } => {
            let summary = harvester::gguf::import_gguf(&file, &out, dtype)
                .with_context(|| format!("importing {}", file.display()))?;
            tracing::info!(
                out = %summary.out_dir.display(),
                tensors = summary.tensors,
                parameters = summary.parameters,
                layers = summary.num_layers,
                "imported GGUF"
            );
        }
        Command::Inspect { dir } => {
            let summary = harvester::pipeline::inspect(&dir)
                .with_context(|| format!("inspecting {}", dir.display()))?;
            print_out(&summary);
        }
        Command::Probe {
            model,
            layers,
            no_special_tokens,
            text,
        } => {
            let report = harvester::probe::run(&model, &text, &layers, !no_special_tokens)
                .with_context(|| format!("probing {}", model.display()))?;
            print_out(&report.to_string());
        }
        Command::Bench {
            model,
            ids,
            prompts,
            layers,
            batch_tokens,
            device,
            directions,
        } => {
            let device = harvester::backend::cuda::select(device)?;
            let prompts = match (ids, prompts) {
                (Some(ids), _) => {
                    let text = std::fs::read_to_string(&ids)
                        .with_context(|| format!("reading {}", ids.display()))?;
                    serde_json::from_str(&text).with_context(|| {
                        format!(
                            "{} must be a JSON list of lists of token ids",
                            ids.display()
                        )
                    })?
                }
                (None, Some(path)) => harvester::bench::tokenize_prompts_file(&model, &path)?,
                (None, None) => anyhow::bail!("give --ids or --prompts"),
            };
            let report = harvester::bench::run(harvester::bench::BenchConfig {
                model: &model,
                prompts,
                layers,
                batch_tokens,
                device,
                directions,
            })?;
            print_out(&format!("{}\n", serde_json::to_string(&report)?));
        }
        Command::SynthModel {
            shape,
            out,
            seed,
            tokenizer_from,
        } => {
            let Some(preset) = harvester::synth::Shape::named(&shape) else {
                anyhow::bail!("unknown shape {shape:?}: use llama-8b or smollm2-135m");
            };
            let bytes = harvester::synth::write(preset, &out, seed)?;
            if let Some(from) = tokenizer_from {
                for name in ["tokenizer.json", "tokenizer_config.json"] {
                    std::fs::copy(from.join(name), out.join(name))
                        .with_context(|| format!("copying {name} from {}", from.display()))?;
                }
            }
            print_out(&format!(
                "{}\n",
                serde_json::json!({"model": out, "shape": shape, "weight_bytes": bytes})
            ));
        }
        Command::Compare {
            reference,
            candidate,
            max_relative_error,
        } => {
            let report = harvester::compare::compare(&reference, &candidate)?;
            print_out(&format!("{}\n", serde_json::to_string(&report)?));
            if report.prompts == 0 {
                anyhow::bail!("{} holds no shards to compare", reference.display());
            }
            if report.token_mismatches > 0
                || report.non_finite_rows > 0
                || report.max_relative_error > max_relative_error
            {
                anyhow::bail!(
                    "the harvests differ: {} prompt(s) with other token ids, {} row(s) with NaN or infinity, largest relative error {:.3e} (allowed {max_relative_error:.0e})",
                    report.token_mismatches,
                    report.non_finite_rows,
                    report.max_relative_error
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
