//! The `harvester` binary: argument parsing and logging set-up; the work is in the library.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use harvest_core::LayerSelection;
use harvester::gguf::OutputDtype;

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
        #[arg(long)]
        ids: PathBuf,
        /// Layers to keep: a list such as 7,15,22,29, or all.
        #[arg(long, default_value = "all")]
        layers: LayerSelection,
        /// Tokens per forward batch.
        #[arg(long, default_value_t = 4096)]
        batch_tokens: usize,
    },
}

fn main() -> anyhow::Result<()> {
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
        Command::Probe {
            model,
            layers,
            no_special_tokens,
            text,
        } => {
            let report = harvester::probe::run(&model, &text, &layers, !no_special_tokens)
                .with_context(|| format!("probing {}", model.display()))?;
            #[allow(clippy::print_stdout)]
            {
                print!("{report}");
            }
        }
        Command::Bench {
            model,
            ids,
            layers,
            batch_tokens,
        } => {
            let text = std::fs::read_to_string(&ids)
                .with_context(|| format!("reading {}", ids.display()))?;
            let prompts: Vec<Vec<u32>> = serde_json::from_str(&text).with_context(|| {
                format!(
                    "{} must be a JSON list of lists of token ids",
                    ids.display()
                )
            })?;
            let report = harvester::bench::run(harvester::bench::BenchConfig {
                model: &model,
                prompts,
                layers,
                batch_tokens,
            })?;
            #[allow(clippy::print_stdout)]
            {
                println!("{}", serde_json::to_string(&report)?);
            }
        }
    }
    Ok(())
}
