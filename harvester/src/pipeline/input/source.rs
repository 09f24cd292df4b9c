//! Where a run's plan comes from (a file, inline JSON, flags) and how its outcome becomes the
//! worker protocol's termination.

use harvest_core::{HarvestPlan, RawPlan};

use crate::backend::cuda::{DeviceChoice, JobFeatures, select};
use crate::error::{Error, Result};
use crate::model::ModelConfig;
use crate::pipeline::output::result;
use crate::pipeline::output::result::Termination;
use crate::pipeline::{RunOptions, finalize, run, run_part};
use harvest_core::plan::Precision;

/// Where `harvester run` takes its plan from.
#[derive(Debug, Clone)]
pub enum PlanSource {
    /// A JSON plan file, as the API writes it.
    File(std::path::PathBuf),
    /// The same JSON inline, as the operator passes it in a Pod's args.
    Json(String),
    /// A plan built from command-line flags.
    Given(Box<RawPlan>),
}

impl PlanSource {
    pub(in crate::pipeline) fn read(&self) -> std::result::Result<RawPlan, String> {
        match self {
            Self::File(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("reading plan {}: {e}", path.display()))?;
                serde_json::from_str(&text)
                    .map_err(|e| format!("invalid plan {}: {e}", path.display()))
            }
            Self::Json(text) => {
                serde_json::from_str(text).map_err(|e| format!("invalid --plan-json: {e}"))
            }
            Self::Given(raw) => Ok((**raw).clone()),
        }
    }
}

/// `harvester run` as a supervisor sees it: reads and validates the plan, picks the device, runs
/// the harvest, and answers what the worker protocol says the process reports.
pub fn run_source(source: &PlanSource, options: &RunOptions) -> Termination {
    with_plan(source, options, |plan, options| match options.part {
        Some(part) => run_part(plan, options, part).map(Termination::Part),
        None => run(plan, options).map(Termination::Done),
    })
}

/// `harvester finalize` as a supervisor sees it (see [`finalize`]).
pub fn finalize_source(source: &PlanSource, options: &RunOptions) -> Termination {
    // The device only decides the arithmetic the plan's fingerprint records: finalize never
    // runs the model, so it probes nothing and runs where no GPU is (the operator's finalize
    // Pod takes none).
    let options = RunOptions {
        device: match options.device {
            DeviceChoice::Cuda(device) => DeviceChoice::Cuda(device),
            DeviceChoice::CudaReplay => DeviceChoice::CudaReplay,
            DeviceChoice::Auto | DeviceChoice::Cpu => DeviceChoice::Cpu,
        },
        ..options.clone()
    };
    let raw = match source.read() {
        Ok(raw) => raw,
        Err(message) => return result::bad_input(&message),
    };
    let outcome = HarvestPlan::try_from(raw)
        .map_err(Error::from)
        .and_then(|plan| finalize(&plan, &options).map(Termination::Done));
    result::termination(outcome)
}

/// What `plan` asks of the CUDA backend that `--device auto` weighs: an AFMoE model (read off
/// its `config.json`; one that cannot be read is left to the load to refuse), the f32 mode
/// named, pipeline stages.
fn job_features(plan: &HarvestPlan, options: &RunOptions) -> JobFeatures {
    let afmoe = ModelConfig::from_file(&plan.model.join("config.json"))
        .is_ok_and(|config| config.afmoe.is_some());
    JobFeatures {
        afmoe,
        f32: plan.options.precision == Some(Precision::F32),
        stages: options.pipeline_stages.is_some_and(|stages| stages > 1),
    }
}

/// Reads and validates the plan, picks the device, and turns `act`'s outcome into the worker
/// protocol's termination.
fn with_plan(
    source: &PlanSource,
    options: &RunOptions,
    act: impl FnOnce(&HarvestPlan, &RunOptions) -> Result<Termination>,
) -> Termination {
    let raw = match source.read() {
        Ok(raw) => raw,
        Err(message) => return result::bad_input(&message),
    };
    let outcome = HarvestPlan::try_from(raw)
        .map_err(Error::from)
        .and_then(|plan| {
            let tried = |variable: &str| options.tried_on_gpu.contains(&variable);
            let (device, device_reason) =
                select(options.device, job_features(&plan, options), &tried)?;
            let options = RunOptions {
                device,
                device_reason,
                ..options.clone()
            };
            act(&plan, &options)
        });
    result::termination(outcome)
}
