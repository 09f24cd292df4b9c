//! The `harvester` binary: argument parsing and logging set-up; the work is in the library.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use harvest_core::{LayerSelection, RawPlan};
use harvester::gguf::OutputDtype;
use harvester::pipeline::progress::ProgressMode;
use harvester::pipeline::result::Termination;
use harvester::pipeline::store::S3Config;
use harvester::pipeline::{PlanSource, RunOptions};

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
    Run(Box<RunArgs>),
    /// Close a job run in parts (`run --part I/N`): statistics, manifest and result from every
    /// part's records, exactly as one run writes them. Give it the job's plan and the parts'
    /// --device. Idempotent; refuses while shards are missing (exit 3).
    Finalize(Box<RunArgs>),
    /// Delete what one HarvestJob wrote under its output (the operator's cleanup Pod, for
    /// `outputRetention: Delete`): the files its manifest lists and its partial/ records, only
    /// when that manifest names the job's UID. Prints {"deleted":N} or {"kept":"why"}.
    ///
    /// Exit status: 0 (deleted or kept), 2 bad input, 3 the store failed (retry).
    Cleanup {
        /// The job's output: a directory or s3://bucket/prefix.
        #[arg(long)]
        output: String,
        /// The HarvestJob's UID, which its manifest must name.
        #[arg(long)]
        job_uid: String,
        /// Write the answer here too (a Kubernetes termination message).
        #[arg(long)]
        termination_log: Option<PathBuf>,
    },
    /// Convert a llama-architecture GGUF into a Hugging Face checkpoint directory.
    ImportGguf {
        /// The .gguf file.
        file: PathBuf,
        /// The directory to write (created if needed).
        #[arg(long)]
        out: PathBuf,
        /// dtype of model.safetensors.
        #[arg(long, default_value_t = OutputDtype::Bf16)]
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
    Bench(BenchArgs),
    /// Write a checkpoint of a named shape with seeded random bf16 weights, for benchmarks and
    /// backend checks where a real checkpoint cannot be brought.
    SynthModel {
        /// The shape: llama-8b, llama-405b, smollm2-135m, a small one a GPU must check
        /// (window-128: 128-wide heads with a sliding window; heads-256; attention-bias), or
        /// afmoe (an AfmoeForCausalLM of 2.75B parameters, large enough to time).
        #[arg(long)]
        shape: String,
        /// Write only the first N blocks (a 405B-shaped model cut to a few, say).
        #[arg(long)]
        blocks: Option<usize>,
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
    /// Report what the CUDA backend finds here: the driver's CUDA version, the device, which
    /// cuBLAS and NVRTC it loaded (from where, and why), and whether the kernels build for the
    /// device's architecture, load and run as a cubin and as PTX; prints JSON, and fails when
    /// no form runs. With --compile-only, needs no GPU: compiles every kernel for each --arch
    /// and prints NVRTC's report (exit 0 when all compiled). With --list, lists the GPUs.
    CudaInfo {
        /// The GPU: cuda or cuda:N.
        #[arg(long, default_value = "cuda")]
        device: harvester::backend::cuda::DeviceChoice,
        /// Compile only, for the architectures of --arch; no GPU is needed.
        #[arg(long, conflicts_with = "list")]
        compile_only: bool,
        /// Architectures to compile for with --compile-only (sm_80, 8.0 or 80; comma-separated),
        /// or `listed` for every generation CI checks (sm_80, 86, 89, 90, 100, 120).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "listed",
            requires = "compile_only"
        )]
        arch: Vec<String>,
        /// List this machine's GPUs and whether each is usable; prints JSON, exit 0.
        #[arg(long)]
        list: bool,
    },
    /// Report the CPU backend's kernel levels here: the CPU's highest, the one the kernels run
    /// at (HARVEST_CPU_LEVEL caps it), and what the CPU lacks for each; prints JSON.
    CpuInfo,
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
struct BenchArgs {
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
    /// Hook sites to keep, comma-separated. Other than resid_post alone, the report also
    /// times resid_post alone on the same corpus, in alternating rounds (`baseline`).
    #[arg(long, default_value = "resid_post")]
    sites: harvest_core::Sites,
    /// f32 or bf16 (default: the device's own, f32 on the CPU and bf16 on a GPU).
    #[arg(long)]
    precision: Option<harvest_core::plan::Precision>,
    /// Tokens per forward batch.
    #[arg(long, default_value_t = 4096)]
    batch_tokens: usize,
    /// The engine: auto, cpu, cuda or cuda:N (auto takes GPU 0 when one is usable, as `run`
    /// does).
    #[arg(long, default_value = "cpu")]
    device: harvester::backend::cuda::DeviceChoice,
    /// Project onto this many seeded random directions instead of keeping activations.
    #[arg(long)]
    directions: Option<usize>,
    /// Time the forward pass alone, without the GEMM rates and compute ceilings measured after
    /// it: for a pass whose peak memory is the engine's own (their buffers would add to it).
    #[arg(long)]
    forward_only: bool,
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
    /// Prompts: .jsonl ({"text": ...} per line, or a conversation {"messages": [{"role": ...,
    /// "content": ...}], "add_generation_prompt": false} per line, rendered by the model's chat
    /// template), .json (list of strings) or .txt; path or s3://.
    #[arg(long, required_unless_present_any = ["plan", "plan_json"])]
    prompts: Option<String>,
    /// Layers to keep: a list such as 8,16,24, all, or quartiles (the default).
    #[arg(long, default_value = "quartiles")]
    layers: LayerSelection,
    /// Hook sites to keep of each kept layer, comma-separated: resid_pre, attn_out, resid_mid,
    /// mlp_out, resid_post (the default); on a mixture-of-experts model, router (or
    /// router_logits) adds each token's expert choices at the kept sparse blocks.
    #[arg(long, default_value = "resid_post")]
    sites: harvest_core::Sites,
    /// Prompts per shard.
    #[arg(long, default_value_t = harvest_core::plan::DEFAULT_SHARD_SIZE)]
    shard_size: usize,
    /// Tokens per forward batch.
    #[arg(long, default_value_t = harvest_core::plan::DEFAULT_BATCH_TOKENS)]
    batch_tokens: usize,
    /// Drop every token the tokenizer marks special (tokens_i still lists them).
    #[arg(long)]
    exclude_special_tokens: bool,
    /// Keep positions START to END (exclusive) of each prompt, e.g. 1:512.
    #[arg(long, value_parser = parse_slice)]
    positions: Option<Slice>,
    /// Keep only the tokens of these roles of a conversation, comma-separated: template,
    /// system, user, assistant, tool (e.g. assistant).
    #[arg(long, value_delimiter = ',')]
    roles: Option<Vec<String>>,
    /// Keep each token with this probability, decided by a hash seeded with --seed.
    #[arg(long)]
    sample_rate: Option<f64>,
    /// The seed of --sample-rate and of --layout shuffled (default 0).
    #[arg(long)]
    seed: Option<u64>,
    /// Drop tokens whose resid_post norm at the deepest kept layer exceeds this multiple of the
    /// running median.
    #[arg(long)]
    max_norm_multiple: Option<f64>,
    /// by_prompt (the seed's shards) or shuffled (train_NNNNN.safetensors, rows permuted over
    /// the whole job with --seed).
    #[arg(long, default_value = "by_prompt")]
    layout: harvest_core::layout::LayoutName,
    /// Rows per training file of --layout shuffled (default 65536).
    #[arg(long)]
    rows_per_file: Option<usize>,
    /// f32 or bf16: bf16 matrix-product inputs with f32 accumulation, on vdpbf16ps where the
    /// CPU has AVX512-BF16. Default: the device's own, f32 on the CPU and bf16 for the CUDA
    /// backend (cuda, cuda-replay).
    #[arg(long)]
    precision: Option<harvest_core::plan::Precision>,
    /// Cut each prompt to its first N tokens (special tokens included) before the forward pass;
    /// the manifest lists each cut prompt. The model's context window cuts it in any case.
    #[arg(long)]
    max_prompt_tokens: Option<usize>,
    /// Scratch space for --layout shuffled (about the job's size): default .shuffle/ in a local
    /// output, the system's temp dir for s3://.
    #[arg(long)]
    spill_dir: Option<PathBuf>,
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
    #[arg(long, default_value = "auto")]
    progress: ProgressMode,
    /// Write a summary of at most 4 KiB here at exit (a Kubernetes termination message).
    #[arg(long)]
    termination_log: Option<PathBuf>,
    /// Where the forward pass runs: auto, cpu, cuda or cuda:N. `auto` runs on GPU 0 when one
    /// is usable and the job needs nothing that has not yet run on a GPU (AFMoE, the f32 mode
    /// named, pipeline stages), else on the CPU, and logs which and why. `cuda-replay` runs the
    /// CUDA backend's forward pass on the CPU, its kernels' arithmetic replayed: slow, for tests.
    #[arg(long, default_value = "auto")]
    device: harvester::backend::cuda::DeviceChoice,
    /// Run only part INDEX/COUNT of the job's shards (INDEX from 0), for several workers on one
    /// job; `harvester finalize` closes it once every part has run. The operator's part Pods
    /// set it through HARVEST_PART, as an Indexed Job's Pods get their index.
    #[arg(long, env = "HARVEST_PART")]
    part: Option<harvest_core::plan::Part>,
    /// Split the model's blocks into N contiguous pipeline stages, balanced by bytes, each
    /// owned by its own thread, with batches flowing between them: on the CPU, or with
    /// `--device cuda:N` one GPU a stage (cuda:N, cuda:N+1, ...). Only the blocks up to the
    /// deepest kept layer are split (over all N) and loaded.
    #[arg(long)]
    pipeline_stages: Option<usize>,
    /// The GPU of each pipeline stage, comma-separated (e.g. 0,0 runs two stages on cuda:0);
    /// with --device cuda and --pipeline-stages.
    #[arg(long, value_delimiter = ',')]
    stage_devices: Option<Vec<usize>>,
    /// Refuse, before the model loads, a corpus that tokenizes to more than this many tokens
    /// (the operator passes the job's tokenBudget).
    #[arg(long)]
    token_budget: Option<u64>,
    /// The Kubernetes HarvestJob's UID, recorded in the manifest so that the job's cleanup
    /// deletes only files written for it (the operator passes it).
    #[arg(long)]
    job_uid: Option<String>,
}

impl RunArgs {
    fn plan_source(&self) -> PlanSource {
        if let Some(path) = &self.plan {
            return PlanSource::File(path.clone());
        }
        if let Some(text) = &self.plan_json {
            return PlanSource::Json(text.clone());
        }
        PlanSource::Given(Box::new(RawPlan {
            model: self.model.clone().unwrap_or_default(),
            prompts: self.prompts.clone().unwrap_or_default(),
            layers: self.layers.clone(),
            sites: self.sites.clone(),
            shard_size: self.shard_size,
            add_special_tokens: !self.no_special_tokens,
            project_onto: self.project_onto.clone(),
            output: self.out.clone().unwrap_or_default(),
            batch_tokens: self.batch_tokens,
            exclude_special_tokens: self.exclude_special_tokens,
            positions: self.positions.map(|Slice(start, end)| vec![start, end]),
            roles: self.roles.clone(),
            sample_rate: self.sample_rate,
            seed: self.seed,
            max_norm_multiple: self.max_norm_multiple,
            layout: self.layout,
            rows_per_file: self.rows_per_file,
            precision: self.precision,
            max_prompt_tokens: self.max_prompt_tokens,
        }))
    }
}

/// A slice of positions, `START:END`.
#[derive(Debug, Clone, Copy)]
struct Slice(u64, u64);

/// `START:END` as `--positions` takes it (the plan checks that it is not empty).
fn parse_slice(text: &str) -> Result<Slice, String> {
    let parse = |part: &str| part.trim().parse::<u64>().ok();
    match text.split_once(':').map(|(a, b)| (parse(a), parse(b))) {
        Some((Some(start), Some(end))) => Ok(Slice(start, end)),
        _ => Err(format!(
            "{text:?} is not a slice: write START:END, e.g. 1:512"
        )),
    }
}

/// What `run_job` does with the plan.
#[derive(Debug, Clone, Copy)]
enum Job {
    Run,
    Finalize,
}

/// Runs a harvest (or closes one run in parts); the exit status and termination log follow the
/// worker protocol.
fn run_job(args: &RunArgs, job: Job) -> ExitCode {
    exit_on_sigterm(args.termination_log.clone());
    let options = RunOptions {
        progress: args.progress,
        model_name: args.model_name.clone(),
        device: args.device,
        tried_on_gpu: harvester::backend::cuda::tried_variables(|name| std::env::var(name).ok()),
        device_reason: None,
        s3: S3Config::from_vars(|name| std::env::var(name).ok()),
        spill_dir: args.spill_dir.clone(),
        temp_dir: Some(std::env::temp_dir()),
        pipeline_stages: args.pipeline_stages,
        stage_devices: args.stage_devices.clone(),
        part: args.part,
        token_budget: args.token_budget,
        job_uid: args.job_uid.clone(),
    };
    let source = args.plan_source();
    let termination = match job {
        Job::Run => harvester::pipeline::run_source(&source, &options),
        Job::Finalize => harvester::pipeline::finalize_source(&source, &options),
    };
    if let Some(path) = &args.termination_log
        && let Err(e) = std::fs::write(path, termination.to_message())
    {
        tracing::warn!(path = %path.display(), error = %e, "could not write the termination log");
    }
    match &termination {
        Termination::Done(result) => print_out(&format!(
            "{}\n",
            serde_json::to_string_pretty(result).unwrap_or_default()
        )),
        Termination::Part(part) => print_out(&format!(
            "{}\n",
            serde_json::to_string_pretty(part).unwrap_or_default()
        )),
        Termination::Failed(failure) => {
            tracing::error!(
                exit_code = failure.exit_code,
                "harvest failed: {}",
                failure.error
            );
        }
    }
    ExitCode::from(u8::try_from(termination.exit_status().code()).unwrap_or(1))
}

/// Ends the process on SIGTERM, which is how Kubernetes stops a Pod (and, as PID 1, the
/// harvester would otherwise ignore it until SIGKILL). Finished shards and their records are
/// durable and a shard is stored whole or not at all, so abandoning the shard in flight is safe:
/// the termination log says so, and the exit status is infrastructure's (3), so a supervisor
/// runs it again and the rerun resumes.
fn exit_on_sigterm(termination_log: Option<PathBuf>) {
    use harvest_core::worker::{ErrorKind, RunFailure};
    std::thread::spawn(move || {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
        else {
            return;
        };
        runtime.block_on(async {
            let kind = tokio::signal::unix::SignalKind::terminate();
            let Ok(mut terminate) = tokio::signal::unix::signal(kind) else {
                tracing::warn!("cannot watch for SIGTERM; it will not stop this run cleanly");
                return;
            };
            terminate.recv().await;
            let message = "stopped by SIGTERM before it finished: a rerun resumes from the shards already written";
            let stopped = Termination::Failed(RunFailure::new(ErrorKind::Infrastructure, message));
            if let Some(path) = &termination_log {
                let _ = std::fs::write(path, stopped.to_message());
            }
            let code = stopped.exit_status().code();
            tracing::warn!(exit_code = code, "{message}");
            // The binary, not a library, ends here: the main thread is inside the forward pass
            // and has no point at which to notice a stop sooner.
            #[allow(clippy::exit)]
            std::process::exit(code);
        });
    });
}

/// Writes to stdout, ignoring a closed pipe (`harvester inspect DIR | head` is fine).
fn print_out(text: &str) {
    use std::io::Write;
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    // The CPU kernels' level, for the whole process; a refused value is reported where a CPU
    // backend is built (before any work) and by `cpu-info`.
    let forced_level = std::env::var(harvester::backend::cpu::level::LEVEL_VARIABLE).ok();
    let _ = harvester::backend::cpu::level::Level::configure(forced_level.as_deref());
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        // Colour only for a person at a terminal, not in log files or a Pod's log.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    // Where the CUDA backend finds cuBLAS and NVRTC, and keeps its compiled kernels.
    let setup = harvester::backend::cuda::CudaSetup::from_vars(|name| std::env::var(name).ok())
        .map_err(anyhow::Error::msg)?;
    harvester::backend::cuda::configure(setup);
    if let Some(threads) = cli.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global()
            .context("setting up the worker threads")?;
    }
    match cli.command {
        Command::Run(args) => return Ok(run_job(&args, Job::Run)),
        Command::Finalize(args) => return Ok(run_job(&args, Job::Finalize)),
        Command::Cleanup {
            output,
            job_uid,
            termination_log,
        } => return cleanup(&output, &job_uid, termination_log.as_deref()),
        other => tool(other)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// The subcommands other than `run`: each calls one library function and prints its answer.
fn tool(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Run(_) | Command::Finalize(_) | Command::Cleanup { .. } => {
            anyhow::bail!("run, finalize and cleanup are handled in main")
        }
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
        Command::Inspect { dir } => print_out(
            &harvester::pipeline::inspect(&dir)
                .with_context(|| format!("inspecting {}", dir.display()))?,
        ),
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
        Command::Bench(args) => bench(args)?,
        Command::SynthModel {
            shape,
            blocks,
            out,
            seed,
            tokenizer_from,
        } => {
            let bytes = harvester::synth::write_named(
                &shape,
                &out,
                seed,
                (blocks, tokenizer_from.as_deref()),
            )?;
            print_out(&format!(
                "{}\n",
                serde_json::json!({"model": out, "shape": shape, "weight_bytes": bytes})
            ));
        }
        Command::CudaInfo {
            device,
            compile_only,
            arch,
            list,
        } => cuda_info(device, compile_only.then_some(&arch[..]), list)?,
        Command::CpuInfo => {
            let report = harvester::backend::cpu::level::report()?;
            print_out(&format!("{}\n", serde_json::to_string_pretty(&report)?));
        }
        Command::Compare {
            reference,
            candidate,
            max_relative_error,
        } => {
            let report = harvester::compare::compare(&reference, &candidate)?;
            print_out(&format!("{}\n", serde_json::to_string(&report)?));
            if let Some(failure) = report.failure(max_relative_error) {
                anyhow::bail!("{failure}");
            }
        }
    }
    Ok(())
}

/// `harvester cuda-info`: the device's report, the compile report of `compile_only`'s
/// architectures (no GPU), or with `list` the GPUs.
fn cuda_info(
    device: harvester::backend::cuda::DeviceChoice,
    compile_only: Option<&[String]>,
    list: bool,
) -> anyhow::Result<()> {
    if let Some(arch) = compile_only {
        let report = harvester::backend::cuda::info::compile_report(&parse_archs(arch)?)?;
        print_out(&format!("{}\n", serde_json::to_string_pretty(&report)?));
        if !report.succeeded() {
            anyhow::bail!("some kernels did not compile: see the report's errors");
        }
        return Ok(());
    }
    if list {
        let gpus = harvester::backend::cuda::list_gpus();
        print_out(&format!("{}\n", serde_json::to_string_pretty(&gpus)?));
        return Ok(());
    }
    let harvester::backend::cuda::DeviceChoice::Cuda(ordinal) = device else {
        anyhow::bail!("cuda-info takes --device cuda or cuda:N, not {device}");
    };
    let info = harvester::backend::cuda::info::report(ordinal)?;
    print_out(&format!("{}\n", serde_json::to_string_pretty(&info)?));
    if !info.kernels.iter().any(|form| form.ran) {
        anyhow::bail!("no form of the CUDA kernels ran on cuda:{ordinal}");
    }
    Ok(())
}

/// The architectures `--arch` names: `listed` for every generation CI checks.
fn parse_archs(names: &[String]) -> anyhow::Result<Vec<harvester::backend::cuda::kernels::Arch>> {
    use harvester::backend::cuda::kernels::LISTED_ARCHS;
    let mut archs = Vec::new();
    for name in names {
        if name.trim() == "listed" {
            archs.extend(LISTED_ARCHS);
        } else {
            archs.push(name.parse().map_err(anyhow::Error::msg)?);
        }
    }
    archs.dedup();
    Ok(archs)
}

/// `harvester cleanup`: the answer on stdout and in the termination log; the exit status
/// tells bad input (2) from a store that failed (3), as a run's does.
fn cleanup(
    output: &str,
    job_uid: &str,
    termination_log: Option<&Path>,
) -> anyhow::Result<ExitCode> {
    let s3 = S3Config::from_vars(|name| std::env::var(name).ok());
    let answer = harvest_core::Location::parse(output, "output")
        .map_err(harvester::Error::from)
        .and_then(|location| harvester::cleanup::delete_job_outputs(&location, &s3, job_uid));
    let (message, code) = match answer {
        Ok(done) => (serde_json::to_string(&done)?, 0),
        Err(error) => {
            tracing::error!(%error, "cleanup failed");
            let code = harvest_core::worker::ExitStatus::Failed(error.kind()).code();
            (
                serde_json::json!({ "failed": error.to_string() }).to_string(),
                code,
            )
        }
    };
    if let Some(path) = termination_log
        && let Err(e) = std::fs::write(path, &message)
    {
        tracing::warn!(path = %path.display(), error = %e, "could not write the termination log");
    }
    print_out(&format!("{message}\n"));
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}

fn bench(args: BenchArgs) -> anyhow::Result<()> {
    let tried = harvester::backend::cuda::tried_variables(|name| std::env::var(name).ok());
    let features = harvester::backend::cuda::JobFeatures {
        f32: args.precision == Some(harvest_core::plan::Precision::F32),
        ..Default::default()
    };
    let (device, _) = harvester::backend::cuda::select(args.device, features, &|variable| {
        tried.contains(&variable)
    })?;
    let prompts =
        harvester::bench::load_corpus(&args.model, args.ids.as_deref(), args.prompts.as_deref())?;
    let report = harvester::bench::run(harvester::bench::BenchConfig {
        model: &args.model,
        prompts,
        layers: args.layers,
        sites: args.sites,
        precision: harvest_core::plan::Precision::or_device(
            args.precision,
            device.is_cuda_arithmetic(),
        ),
        batch_tokens: args.batch_tokens,
        device,
        directions: args.directions,
        forward_only: args.forward_only,
    })?;
    print_out(&format!("{}\n", serde_json::to_string(&report)?));
    Ok(())
}

#[cfg(test)]
mod tests {
    use harvest_core::invocation::{Invocation, PlanArg, Task};

    use super::*;

    fn parsed(call: &Invocation) -> Command {
        let args = std::iter::once("harvester".to_owned()).chain(call.to_args());
        Cli::try_parse_from(args)
            .unwrap_or_else(|e| panic!("{call:?}: {e}"))
            .command
    }

    #[test]
    fn every_call_a_backend_writes_parses_back_to_what_it_says() {
        let part = Invocation {
            plan: Some(PlanArg::File("/jobs/7/plan.json".into())),
            device: Some("cuda:2".into()),
            pipeline_stages: Some(2),
            stage_devices: Some(vec![2, 3]),
            model_name: Some("llama-8b".into()),
            termination_log: Some("/jobs/7/part-1.log".into()),
            progress_json: true,
            ..Invocation::new(Task::Part { index: 1, count: 3 })
        };
        let Command::Run(run) = parsed(&part) else {
            panic!("not run")
        };
        assert_eq!(run.plan, Some(PathBuf::from("/jobs/7/plan.json")));
        assert_eq!(run.device.to_string(), "cuda:2");
        assert_eq!(
            (run.pipeline_stages, run.stage_devices),
            (Some(2), Some(vec![2, 3]))
        );
        assert_eq!(run.part.map(|p| p.to_string()).as_deref(), Some("1/3"));
        assert_eq!(run.model_name.as_deref(), Some("llama-8b"));
        assert_eq!(
            run.termination_log,
            Some(PathBuf::from("/jobs/7/part-1.log"))
        );
        assert!(matches!(run.progress, ProgressMode::Json));
        let pod = Invocation {
            plan: Some(PlanArg::Json("{\"model\":\"/m\"}".into())),
            token_budget: Some(10_000),
            job_uid: Some("u-1".into()),
            spill_dir: Some("/scratch".into()),
            ..Invocation::new(Task::Finalize)
        };
        let Command::Finalize(finalize) = parsed(&pod) else {
            panic!("not finalize")
        };
        assert_eq!(finalize.plan_json.as_deref(), Some("{\"model\":\"/m\"}"));
        assert_eq!(finalize.token_budget, Some(10_000));
        assert_eq!(finalize.job_uid.as_deref(), Some("u-1"));
        assert_eq!(finalize.spill_dir, Some(PathBuf::from("/scratch")));
        let cleanup = Invocation {
            job_uid: Some("u-1".into()),
            termination_log: Some("/dev/termination-log".into()),
            ..Invocation::new(Task::Cleanup {
                output: "s3://b/p".into(),
            })
        };
        let Command::Cleanup {
            output,
            job_uid,
            termination_log,
        } = parsed(&cleanup)
        else {
            panic!("not cleanup")
        };
        assert_eq!((output.as_str(), job_uid.as_str()), ("s3://b/p", "u-1"));
        assert_eq!(termination_log, Some(PathBuf::from("/dev/termination-log")));
    }
}
