//! One harvester process as a backend starts it: the typed call the embedded server's workers
//! and the operator's Pods both write ([`Invocation::to_args`]) and the harvester's command
//! line reads, so the flags are spelled in one place (the harvester's tests parse what
//! `to_args` writes).

/// What the process does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Task {
    /// `harvester run`: the whole job.
    Run,
    /// `harvester run --part I/N`: part `index` (from 1) of `count`.
    Part {
        /// This part, from 1.
        index: usize,
        /// Parts in all.
        count: usize,
    },
    /// `harvester finalize`: closes a job run in parts.
    Finalize,
    /// `harvester cleanup`: deletes what the job with this UID wrote under `output`.
    Cleanup {
        /// The job's output: a directory or `s3://bucket/prefix`.
        output: String,
    },
}

/// Where the plan is: a file, or its JSON inline (how a Pod's args carry it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanArg {
    /// `--plan PATH`.
    File(String),
    /// `--plan-json JSON`.
    Json(String),
}

/// A harvester process's arguments, typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    /// What it does.
    pub task: Task,
    /// The plan (not for cleanup).
    pub plan: Option<PlanArg>,
    /// `--device`: `cpu`, `cuda:N`, `auto`, ...; `None` leaves the harvester's default.
    pub device: Option<String>,
    /// `--pipeline-stages`: the model split over this many stages.
    pub pipeline_stages: Option<usize>,
    /// `--stage-devices`: each stage's GPU.
    pub stage_devices: Option<Vec<u32>>,
    /// `--model-name`: the model's name in the manifest.
    pub model_name: Option<String>,
    /// `--token-budget`: the most tokens the corpus may have.
    pub token_budget: Option<u64>,
    /// `--job-uid`: the Kubernetes HarvestJob's UID.
    pub job_uid: Option<String>,
    /// `--termination-log`: where the process leaves its last word.
    pub termination_log: Option<String>,
    /// `--progress json`: progress as JSON lines on stderr (what a supervisor reads).
    pub progress_json: bool,
    /// `--spill-dir`: scratch space of the shuffled layout.
    pub spill_dir: Option<String>,
}

impl Invocation {
    /// A call of `task` with nothing else set.
    pub fn new(task: Task) -> Self {
        Self {
            task,
            plan: None,
            device: None,
            pipeline_stages: None,
            stage_devices: None,
            model_name: None,
            token_budget: None,
            job_uid: None,
            termination_log: None,
            progress_json: false,
            spill_dir: None,
        }
    }

    /// The process's arguments, subcommand first.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = Vec::with_capacity(24);
        let mut flag = |name: &str, value: String| {
            args.push(format!("--{name}"));
            args.push(value);
        };
        let subcommand = match &self.task {
            Task::Run | Task::Part { .. } => "run",
            Task::Finalize => "finalize",
            Task::Cleanup { .. } => "cleanup",
        };
        let mut head = vec![subcommand.to_owned()];
        match &self.task {
            Task::Part { index, count } => {
                head.extend(["--part".to_owned(), format!("{index}/{count}")]);
            }
            Task::Cleanup { output } => head.extend(["--output".to_owned(), output.clone()]),
            Task::Run | Task::Finalize => {}
        }
        match &self.plan {
            Some(PlanArg::File(path)) => flag("plan", path.clone()),
            Some(PlanArg::Json(json)) => flag("plan-json", json.clone()),
            None => {}
        }
        if let Some(device) = &self.device {
            flag("device", device.clone());
        }
        if let Some(stages) = self.pipeline_stages {
            flag("pipeline-stages", stages.to_string());
        }
        if let Some(gpus) = &self.stage_devices {
            let listed: Vec<String> = gpus.iter().map(u32::to_string).collect();
            flag("stage-devices", listed.join(","));
        }
        if let Some(name) = &self.model_name {
            flag("model-name", name.clone());
        }
        if let Some(budget) = self.token_budget {
            flag("token-budget", budget.to_string());
        }
        if let Some(uid) = &self.job_uid {
            flag("job-uid", uid.clone());
        }
        if let Some(log) = &self.termination_log {
            flag("termination-log", log.clone());
        }
        if self.progress_json {
            flag("progress", "json".to_owned());
        }
        if let Some(dir) = &self.spill_dir {
            flag("spill-dir", dir.clone());
        }
        head.extend(args);
        head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_is_written_as_run_with_its_part_and_each_set_flag_once() {
        let call = Invocation {
            plan: Some(PlanArg::File("/jobs/7/plan.json".into())),
            device: Some("cuda:2".into()),
            pipeline_stages: Some(2),
            stage_devices: Some(vec![2, 3]),
            progress_json: true,
            ..Invocation::new(Task::Part { index: 1, count: 3 })
        };
        assert_eq!(
            call.to_args(),
            [
                "run",
                "--part",
                "1/3",
                "--plan",
                "/jobs/7/plan.json",
                "--device",
                "cuda:2",
                "--pipeline-stages",
                "2",
                "--stage-devices",
                "2,3",
                "--progress",
                "json"
            ]
        );
        let cleanup = Invocation {
            job_uid: Some("u-1".into()),
            ..Invocation::new(Task::Cleanup {
                output: "s3://b/p".into(),
            })
        };
        assert_eq!(
            cleanup.to_args(),
            ["cleanup", "--output", "s3://b/p", "--job-uid", "u-1"]
        );
    }
}
