//! The operator's configuration file (a ConfigMap in the cluster): the model catalogue with the
//! Pod shape of each model, lane capacities, and timings. Parsed strictly, validated once.

use std::collections::BTreeMap;
use std::path::Path;

use harvest_core::quota::Lane;
use harvest_core::{ModelShape, ServedModel};
use k8s_openapi::api::core::v1::{
    LocalObjectReference, ResourceRequirements, Toleration, Volume, VolumeMount,
};
use serde::Deserialize;

use crate::error::Error;

/// One model of the catalogue and the Pod that runs it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CatalogueEntry {
    /// The name jobs use.
    pub name: String,
    /// The checkpoint directory inside the image (or a mounted volume).
    pub path: String,
    /// Decoder blocks, for validating `layers` before anything runs.
    pub num_layers: usize,
    /// Residual-stream width (the checkpoint's `hidden_size`), as the API's catalogue reads it.
    pub hidden_size: usize,
    /// For a mixture-of-experts model, its routing (`firstSparseLayer`, `experts`,
    /// `expertsPerToken`), for validating the `router` site before anything runs.
    #[serde(default)]
    pub moe: Option<harvest_core::model::MoeShape>,
    /// Its concurrency lane.
    pub lane: Lane,
    /// The harvester image; left out, the configuration's `workerImage`.
    #[serde(default)]
    pub image: String,
    /// GPUs per Pod, requested as `nvidia.com/gpu`. 0 runs on the CPU.
    #[serde(default)]
    pub gpus: u32,
    /// Where the Pod may run.
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    /// Taints the Pod tolerates.
    #[serde(default)]
    pub tolerations: Vec<Toleration>,
    /// CPU and memory; the GPU count is added to the limits.
    #[serde(default)]
    pub resources: ResourceRequirements,
    /// The harvester's `--device` (`cuda` for GPU models, `cpu`; default `auto`).
    #[serde(default)]
    pub device: Option<String>,
    /// Volumes of the worker Pod (the weights, usually a read-only PersistentVolumeClaim).
    #[serde(default)]
    pub volumes: Vec<Volume>,
    /// Where the harvester container mounts them.
    #[serde(default)]
    pub volume_mounts: Vec<VolumeMount>,
    /// Secrets for pulling `image` from a private registry.
    #[serde(default)]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// The RuntimeClass (`nvidia` on clusters whose GPU runtime is not the default).
    #[serde(default)]
    pub runtime_class_name: Option<String>,
    /// The PriorityClass of worker Pods.
    #[serde(default)]
    pub priority_class_name: Option<String>,
    /// How long an attempt's Pod may take, once scheduled, to start running (image pull,
    /// volumes), before the job fails and frees its slot. The wait for a node has no limit of
    /// its own (the job's `activeDeadlineSeconds` bounds it), as a batch Job's has none.
    #[serde(default = "default_start_timeout")]
    pub start_timeout_seconds: u64,
    /// Most workers one job of this model may be split over (`spec.parallelism`); 1 runs
    /// every job as one Pod.
    #[serde(default = "default_max_parallelism")]
    pub max_parallelism: u32,
    /// The token budget per worker the operator aims at when a job does not set
    /// `spec.parallelism`: a job gets `ceil(tokenBudget / tokensPerPart)` parts, at most
    /// `maxParallelism`. Unset: such jobs run as one Pod.
    #[serde(default)]
    pub tokens_per_part: Option<u64>,
    /// Most worker Pods of this model at once, over every job: parts (and one-Pod jobs) past
    /// it wait, first come first served. Unset: no cap beyond the lanes. Finalize Pods, which
    /// take no GPU, are not counted.
    #[serde(default)]
    pub max_pods: Option<u32>,
    /// The Kueue LocalQueue (in the namespace the workers run in) that admits this model's
    /// worker Pods, on clusters where Kueue owns the GPUs; an account's `localQueue` is taken
    /// over it. Unset: the Pods go straight to the scheduler. See `docs/operator.md`.
    #[serde(default)]
    pub local_queue: Option<String>,
    /// The Kueue WorkloadPriorityClass of the Pods that queue (the label
    /// `kueue.x-k8s.io/priority-class`). A queued Pod does not carry `priorityClassName`:
    /// Kueue would take its value as the Workload's priority and might preempt other teams'
    /// workloads with it. Unset: Kueue's default priority, as other teams' jobs get.
    #[serde(default)]
    pub workload_priority_class: Option<String>,
}

fn default_start_timeout() -> u64 {
    1200
}

fn default_max_parallelism() -> u32 {
    1
}

/// The largest `maxParallelism` a catalogue entry may set, as the CRD schema bounds
/// `spec.parallelism`.
pub const PARALLELISM_LIMIT: u32 = 256;

const DEVICES: [&str; 3] = ["auto", "cpu", "cuda"];

/// Whether `queue` can name a Kueue LocalQueue: it becomes the value of the Pods'
/// `kueue.x-k8s.io/queue-name` label, so it must be a DNS-1123 label.
pub fn check_local_queue(queue: &str) -> Result<(), String> {
    let label = !queue.is_empty()
        && queue.len() <= 63
        && queue
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !queue.starts_with('-')
        && !queue.ends_with('-');
    if label {
        Ok(())
    } else {
        Err(format!(
            "localQueue {queue:?} is not a LocalQueue name: use at most 63 lowercase letters, digits and '-', starting and ending with a letter or digit"
        ))
    }
}

impl CatalogueEntry {
    /// Whether this entry makes a Pod a real apiserver accepts; the error names the field.
    fn check(&self) -> Result<(), String> {
        let name = &self.name;
        if let Some(device) = &self.device {
            let known = DEVICES.contains(&device.as_str())
                || device
                    .strip_prefix("cuda:")
                    .is_some_and(|i| i.parse::<u32>().is_ok());
            if !known {
                return Err(format!(
                    "model {name:?}: device {device:?} is not auto, cpu, cuda or cuda:N"
                ));
            }
        }
        let sources = |v: &Volume| {
            let value = serde_json::to_value(v).unwrap_or_default();
            value
                .as_object()
                .map_or(0, |o| o.keys().filter(|k| *k != "name").count())
        };
        for volume in &self.volumes {
            if sources(volume) != 1 {
                return Err(format!(
                    "model {name:?}: volume {:?} needs exactly one known source (persistentVolumeClaim, hostPath, configMap, secret, emptyDir, csi, nfs, ...)",
                    volume.name
                ));
            }
        }
        for mount in &self.volume_mounts {
            if !self.volumes.iter().any(|v| v.name == mount.name) {
                return Err(format!(
                    "model {name:?}: volumeMount {:?} names no volume of the entry",
                    mount.name
                ));
            }
        }
        if let Some(queue) = &self.local_queue {
            check_local_queue(queue).map_err(|why| format!("model {name:?}: {why}"))?;
        }
        if let Some(class) = &self.workload_priority_class {
            let label = !class.is_empty()
                && class.len() <= 63
                && class.starts_with(|c: char| c.is_ascii_alphanumeric())
                && class.ends_with(|c: char| c.is_ascii_alphanumeric())
                && class
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
            if !label {
                return Err(format!(
                    "model {name:?}: workloadPriorityClass {class:?} cannot be a label value: name a WorkloadPriorityClass of at most 63 letters, digits, '-', '_' and '.'"
                ));
            }
        }
        let quantities = [&self.resources.requests, &self.resources.limits];
        for (resource, quantity) in quantities.into_iter().flatten().flatten() {
            if !is_quantity(&quantity.0) {
                return Err(format!(
                    "model {name:?}: {resource} quantity {:?} is not a Kubernetes quantity (like 500m, 4, 16Gi)",
                    quantity.0
                ));
            }
        }
        if !(1..=PARALLELISM_LIMIT).contains(&self.max_parallelism) {
            return Err(format!(
                "model {name:?}: maxParallelism {} is not from 1 to {PARALLELISM_LIMIT}",
                self.max_parallelism
            ));
        }
        if self.tokens_per_part == Some(0) || self.max_pods == Some(0) {
            return Err(format!(
                "model {name:?}: tokensPerPart and maxPods must be at least 1 (leave them out for no target or no cap)"
            ));
        }
        if self.start_timeout_seconds == 0 {
            return Err(format!(
                "model {name:?}: startTimeoutSeconds is 0: give the seconds a Pod may take to start (default 1200)"
            ));
        }
        Ok(())
    }
}

/// A Kubernetes resource quantity: a decimal number with an optional suffix.
fn is_quantity(text: &str) -> bool {
    const SUFFIXES: [&str; 15] = [
        "", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "n",
    ];
    let digits = text.trim_start_matches(['+', '-']);
    let end = digits
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(digits.len());
    let (number, suffix) = digits.split_at(end);
    let exponent = suffix.strip_prefix(['e', 'E']).is_some_and(|e| {
        !e.is_empty()
            && e.trim_start_matches(['+', '-'])
                .chars()
                .all(|c| c.is_ascii_digit())
    });
    !number.is_empty()
        && number != "."
        && number.matches('.').count() <= 1
        && (SUFFIXES.contains(&suffix) || exponent || suffix == "u")
}

impl CatalogueEntry {
    /// The workers a job of this model runs in: its `spec.parallelism` within
    /// `maxParallelism`, or else one per `tokensPerPart` of its budget, at most
    /// `maxParallelism` (and 1 for a norm filter, whose median spans the corpus in order).
    pub fn parallelism(
        &self,
        spec: &harvest_crds::HarvestJobSpec,
    ) -> Result<u32, harvest_crds::SpecError> {
        let norm_filter = spec.harvest.max_norm_multiple.is_some();
        match spec.parallelism {
            Some(wanted) if wanted > self.max_parallelism => {
                Err(harvest_crds::SpecError::Parallelism {
                    wanted,
                    cap: self.max_parallelism,
                    model: self.name.clone(),
                })
            }
            Some(wanted) if wanted > 1 && norm_filter => {
                Err(harvest_crds::SpecError::PartsWithNormFilter { wanted })
            }
            Some(wanted) => Ok(wanted.max(1)),
            None if norm_filter => Ok(1),
            None => Ok(self.tokens_per_part.map_or(1, |per_part| {
                let parts = spec.token_budget.div_ceil(per_part.max(1));
                u32::try_from(parts)
                    .unwrap_or(u32::MAX)
                    .clamp(1, self.max_parallelism)
            })),
        }
    }

    /// The model as every component describes it; spec validation resolves layers with it.
    pub fn served(&self) -> ServedModel {
        ServedModel {
            name: self.name.clone(),
            shape: ModelShape {
                num_layers: self.num_layers,
                hidden_size: self.hidden_size,
                moe: self.moe,
            },
            lane: self.lane,
        }
    }
}

/// How many admitted jobs may run at once in each lane.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct LaneCapacity {
    /// Single-GPU jobs.
    pub small: u32,
    /// Multi-GPU jobs.
    pub large: u32,
}

impl LaneCapacity {
    /// The capacity of `lane`.
    pub fn of(self, lane: Lane) -> u32 {
        match lane {
            Lane::Small => self.small,
            Lane::Large => self.large,
        }
    }
}

/// The configuration file.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OperatorConfig {
    /// The models jobs may name.
    pub models: Vec<CatalogueEntry>,
    /// Lane capacities, cluster-wide.
    pub lanes: LaneCapacity,
    /// The namespace the REST API creates jobs in. Only there does a job's
    /// `harvest.dev/account` label choose its account; unset, every job is charged by namespace.
    #[serde(default)]
    pub api_namespace: Option<String>,
    /// Where every worker Pod runs: a namespace the operator owns and tenants cannot write to
    /// (the manifests use harvest-system). Tenants then need no ServiceAccount, models claim or
    /// storage Secret of their own, and never hold the storage credentials; a worker there is
    /// known by its `harvest.dev/job-uid` label, since Kubernetes has no owner references
    /// across namespaces. Unset, each job's Pods run in the job's own namespace.
    #[serde(default)]
    pub worker_namespace: Option<String>,
    /// The harvester image of every catalogue entry that names none. The manifests keep it
    /// in its own ConfigMap key, which kustomize's `images:` retags, and hand it to the
    /// operator as `HARVEST_WORKER_IMAGE`, which overrides this.
    #[serde(default)]
    pub worker_image: Option<String>,
    /// The service account harvester Pods run as.
    #[serde(default = "default_service_account")]
    pub worker_service_account: String,
    /// A Secret whose keys become the worker's environment (S3 credentials).
    #[serde(default)]
    pub worker_env_secret: Option<String>,
    /// A ConfigMap whose keys also become the worker's environment: the S3 endpoint, region
    /// and `AWS_ALLOW_HTTP`, which the API and the operator read from the same ConfigMap, so
    /// an overlay sets them in one place. Optional: a missing ConfigMap is no error.
    #[serde(default)]
    pub worker_env_config_map: Option<String>,
    /// The StorageClass of the shuffled layout's scratch space (the spill of every token the
    /// budget allows: terabytes for a large job), as a volume made for each Pod and deleted
    /// with it. Unset: an emptyDir on the node's disk, requested as ephemeral storage, which a
    /// large job's Pod finds on no node.
    #[serde(default)]
    pub scratch_storage_class: Option<String>,
    /// The keys of the file this release does not know (a newer release's, or misspelt),
    /// as paths (`models.0.futureKey`); ignored, and named in a warning at start.
    #[serde(skip)]
    pub unknown_keys: Vec<String>,
    /// Extra arguments for the harvester (`--threads 8`, say).
    #[serde(default)]
    pub worker_extra_args: Vec<String>,
    /// Seconds before a failed attempt is retried; doubles per counted failure, capped at 300.
    #[serde(default = "default_retry_base")]
    pub retry_base_seconds: u64,
    /// Infrastructure failures (evictions, lost nodes) retried before the job fails.
    #[serde(default = "default_infra_retries")]
    pub max_infrastructure_retries: u32,
    /// Seconds a waiting job sleeps between admission checks.
    #[serde(default = "default_admission_poll")]
    pub admission_poll_seconds: u64,
    /// Seconds between reads of a running job's progress from its worker's log.
    #[serde(default = "default_progress_refresh")]
    pub progress_refresh_seconds: u64,
    /// Seconds the output-cleanup finalizer may try before it gives up and lets the job go.
    #[serde(default = "default_cleanup_timeout")]
    pub cleanup_timeout_seconds: u64,
    /// Seconds past its grace period a deleted Pod may stay Terminating before its attempt is
    /// taken for lost and retried (its node stopped answering; no kubelet will remove it).
    #[serde(default = "default_pod_lost_after")]
    pub pod_lost_after_seconds: u64,
    /// Seconds between sweeps of the `workerNamespace` for workers whose job is gone.
    #[serde(default = "default_worker_sweep")]
    pub worker_sweep_seconds: u64,
}

fn default_pod_lost_after() -> u64 {
    120
}

fn default_worker_sweep() -> u64 {
    30
}

fn default_service_account() -> String {
    "harvest-worker".into()
}
fn default_retry_base() -> u64 {
    10
}
fn default_infra_retries() -> u32 {
    10
}
fn default_progress_refresh() -> u64 {
    5
}
fn default_admission_poll() -> u64 {
    5
}
fn default_cleanup_timeout() -> u64 {
    300
}

impl OperatorConfig {
    /// The namespace `job`'s worker Pods run in.
    pub fn pod_namespace(&self, job: &harvest_crds::HarvestJob) -> String {
        self.worker_namespace
            .clone()
            .unwrap_or_else(|| kube::ResourceExt::namespace(job).unwrap_or_default())
    }

    /// Reads and checks a YAML or JSON file; `worker_image`, when given, is the image of
    /// every catalogue entry that names none (over the file's `workerImage`).
    pub fn load(path: &Path, worker_image: Option<String>) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Config {
            path: path.display().to_string(),
            reason: source.to_string(),
        })?;
        Self::parse_with(&text, worker_image).map_err(|reason| Error::Config {
            path: path.display().to_string(),
            reason,
        })
    }

    /// Parses and checks the configuration text (YAML is a superset of JSON).
    pub fn parse(text: &str) -> Result<Self, String> {
        Self::parse_with(text, None)
    }

    /// [`Self::parse`], with the worker image given apart from the text.
    pub fn parse_with(text: &str, worker_image: Option<String>) -> Result<Self, String> {
        // Keys this release does not know are set aside, not refused: a newer release's
        // configuration must not stop the previous operator after a rollback. They are named
        // at start (`unknown_keys`), as a misspelt key should be.
        let mut unknown = Vec::new();
        let mut config: Self =
            serde_ignored::deserialize(serde_yaml::Deserializer::from_str(text), |path| {
                unknown.push(path.to_string());
            })
            .map_err(|e| e.to_string())?;
        config.unknown_keys = unknown;
        if let Some(image) = worker_image.filter(|i| !i.trim().is_empty()) {
            config.worker_image = Some(image);
        }
        for model in &mut config.models {
            if model.image.trim().is_empty() {
                model.image = config.worker_image.clone().ok_or_else(|| {
                    format!(
                        "model {:?} names no image, and the configuration sets no workerImage: give it an image, or set workerImage (HARVEST_WORKER_IMAGE)",
                        model.name
                    )
                })?;
            }
        }
        let mut names = std::collections::BTreeSet::new();
        for model in &config.models {
            if !names.insert(model.name.as_str()) {
                return Err(format!(
                    "model {:?} is listed twice: give each catalogue entry its own name",
                    model.name
                ));
            }
            model.check()?;
            if model.num_layers == 0 || model.hidden_size == 0 {
                return Err(format!(
                    "model {:?} has numLayers {} and hiddenSize {}: give its decoder block count and residual width (config.json's num_hidden_layers and hidden_size)",
                    model.name, model.num_layers, model.hidden_size
                ));
            }
        }
        if config.models.is_empty() {
            return Err("the catalogue is empty: list at least one model under models".into());
        }
        Ok(config)
    }

    /// The catalogue entry named `name`.
    pub fn model(&self, name: &str) -> Option<&CatalogueEntry> {
        self.models.iter().find(|m| m.name == name)
    }

    /// The names in the catalogue.
    pub fn model_names(&self) -> Vec<String> {
        self.models.iter().map(|m| m.name.clone()).collect()
    }
}

/// Resolves once one of `files` reads as something other than what it held when loaded (an
/// edited ConfigMap, which the kubelet swaps in atomically), looking every `every`. A file
/// that cannot be read meanwhile (mid-swap) is looked at again.
pub async fn changed(files: Vec<(std::path::PathBuf, Vec<u8>)>, every: std::time::Duration) {
    loop {
        tokio::time::sleep(every).await;
        for (path, loaded) in &files {
            if let Ok(now) = tokio::fs::read(path).await
                && &now != loaded
            {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
models:
  - name: smollm2-135m
    path: /models/smollm2-135m
    numLayers: 30
    hiddenSize: 576
    lane: small
    image: ghcr.io/harvest/harvester:0.1.0
    gpus: 1
    nodeSelector: {nvidia.com/gpu.product: NVIDIA-H200}
lanes: {small: 2, large: 1}
"#;

    #[test]
    fn an_entry_without_an_image_takes_the_worker_image_which_the_environment_overrides() {
        let text = EXAMPLE.replace("    image: ghcr.io/harvest/harvester:0.1.0\n", "")
            + "workerImage: ghcr.io/harvest/harvester:0.1.0\n";
        let from_file = OperatorConfig::parse(&text).unwrap();
        assert_eq!(from_file.models[0].image, "ghcr.io/harvest/harvester:0.1.0");
        let retagged = OperatorConfig::parse_with(&text, Some("registry.example.org/h:2".into()));
        assert_eq!(
            retagged.unwrap().models[0].image,
            "registry.example.org/h:2"
        );
        let own = OperatorConfig::parse_with(EXAMPLE, Some("registry.example.org/h:2".into()));
        assert_eq!(
            own.unwrap().models[0].image,
            "ghcr.io/harvest/harvester:0.1.0"
        );
        let none = EXAMPLE.replace("    image: ghcr.io/harvest/harvester:0.1.0\n", "");
        let message = OperatorConfig::parse(&none).unwrap_err();
        assert!(
            message.contains("\"smollm2-135m\" names no image"),
            "{message}"
        );
    }

    #[tokio::test]
    async fn an_edit_of_the_configuration_file_is_noticed_and_a_rewrite_of_the_same_text_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, EXAMPLE).unwrap();
        let every = std::time::Duration::from_millis(10);
        let watch = tokio::spawn(changed(vec![(path.clone(), EXAMPLE.into())], every));
        // The same text written again (a resync of an unchanged ConfigMap) is no change.
        std::fs::write(&path, EXAMPLE).unwrap();
        let unchanged = tokio::time::timeout(std::time::Duration::from_millis(200), async {
            while !watch.is_finished() {
                tokio::time::sleep(every).await;
            }
        })
        .await;
        assert!(unchanged.is_err(), "resolved on an unchanged file");
        std::fs::write(&path, EXAMPLE.replace("small: 2", "small: 3")).unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(30), watch)
            .await
            .expect("the edit is noticed")
            .unwrap();
    }

    #[test]
    fn a_catalogue_parses_with_defaults() {
        let config = OperatorConfig::parse(EXAMPLE).unwrap();
        assert_eq!(config.model("smollm2-135m").unwrap().gpus, 1);
        assert_eq!(config.worker_service_account, "harvest-worker");
        assert_eq!(config.retry_base_seconds, 10, "the default retry base");
    }

    #[test]
    fn a_newer_releases_keys_are_set_aside_and_named_so_a_rolled_back_operator_starts() {
        let newer = EXAMPLE
            .replacen("lanes:", "futureSetting: {on: true}\nlanes:", 1)
            .replacen("    gpus: 1\n", "    gpus: 1\n    futureField: 3\n", 1);
        let config = OperatorConfig::parse(&newer).unwrap();
        assert_eq!(
            config.unknown_keys,
            ["models.0.futureField", "futureSetting"]
        );
        assert_eq!(
            config.models,
            OperatorConfig::parse(EXAMPLE).unwrap().models,
            "the rest is read as before"
        );
    }

    #[test]
    fn a_missing_required_key_and_duplicate_models_are_refused_by_name() {
        // `lane:` for `lanes:` leaves the required lanes unset.
        let typo = EXAMPLE.replace("lanes:", "lane:");
        assert!(OperatorConfig::parse(&typo).unwrap_err().contains("lanes"));
        let twice = format!("{EXAMPLE}\n").replace(
            "lanes:",
            "  - {name: smollm2-135m, path: /m, numLayers: 1, hiddenSize: 8, lane: small, image: i}\nlanes:",
        );
        assert!(
            OperatorConfig::parse(&twice)
                .unwrap_err()
                .contains("listed twice"),
            "{}",
            OperatorConfig::parse(&twice).unwrap_err()
        );
    }

    #[test]
    fn a_catalogue_entry_that_cannot_make_a_valid_pod_is_refused_naming_the_entry() {
        let with = |extra: &str| {
            OperatorConfig::parse(
                &EXAMPLE.replace("    gpus: 1\n", &format!("    gpus: 1\n{extra}")),
            )
        };
        let unknown_volume =
            with("    volumes: [{name: weights, lustre: {path: /x}}]\n").unwrap_err();
        assert!(
            unknown_volume.contains("\"smollm2-135m\"") && unknown_volume.contains("\"weights\""),
            "{unknown_volume}"
        );
        let bad_quantity = with("    resources: {limits: {memory: 16GB}}\n").unwrap_err();
        assert!(bad_quantity.contains("\"16GB\""), "{bad_quantity}");
        let dangling = with("    volumeMounts: [{name: nope, mountPath: /m}]\n").unwrap_err();
        assert!(dangling.contains("\"nope\""), "{dangling}");
        assert!(with("    device: tpu\n").unwrap_err().contains("\"tpu\""));
        let good = with(
            "    device: cuda\n    volumes: [{name: w, persistentVolumeClaim: {claimName: m, readOnly: true}}]\n    volumeMounts: [{name: w, mountPath: /models, readOnly: true}]\n    resources: {requests: {cpu: 500m, memory: 1.5Gi}}\n",
        );
        assert_eq!(good.unwrap().models[0].start_timeout_seconds, 1200);
    }
}

#[cfg(test)]
mod shipped {
    use super::*;

    /// `config.yaml` and `workerImage` of the harvest-operator ConfigMap in
    /// `manifests/base/operator.yaml`.
    fn shipped_config() -> (String, String) {
        let manifest = include_str!("../../manifests/base/operator.yaml");
        for document in serde_yaml::Deserializer::from_str(manifest) {
            let value = serde_yaml::Value::deserialize(document).unwrap();
            if value["kind"] == "ConfigMap" && value["metadata"]["name"] == "harvest-operator" {
                let key = |k: &str| value["data"][k].as_str().unwrap().to_owned();
                return (key("config.yaml"), key("workerImage"));
            }
        }
        panic!("manifests/base/operator.yaml has no harvest-operator ConfigMap");
    }

    #[test]
    fn the_shipped_catalogue_parses_and_serves_the_seeds_three_models_in_their_lanes() {
        let (text, worker_image) = shipped_config();
        let config = OperatorConfig::parse_with(&text, Some(worker_image.clone())).unwrap();
        assert!(
            config.models.iter().all(|m| m.image == worker_image),
            "every shipped entry runs the one worker image, which kustomize retags"
        );
        let entry = |name: &str| config.models.iter().find(|m| m.name == name).unwrap();
        for (name, lane, gpus, layers) in [
            ("llama-8b", Lane::Small, 1, 32),
            ("llama-405b", Lane::Large, 8, 126),
            ("trinity-truebase", Lane::Large, 8, 60),
        ] {
            let model = entry(name);
            assert_eq!(
                (model.lane, model.gpus, model.num_layers),
                (lane, gpus, layers),
                "{name}"
            );
        }
        // The MoE model's routing, which the router site is checked against; the dense ones
        // refuse it.
        let trinity = entry("trinity-truebase").served();
        let moe = trinity.shape.moe.expect("trinity-truebase's experts");
        assert_eq!(
            (moe.first_sparse_layer, moe.experts, moe.experts_per_token),
            (6, 256, 4)
        );
        assert!(entry("llama-8b").served().shape.moe.is_none());
    }

    #[test]
    fn shipped_gpu_workers_are_placed_by_their_gpu_request_so_a_pool_can_scale_from_zero() {
        let (text, worker_image) = shipped_config();
        let config = OperatorConfig::parse_with(&text, Some(worker_image)).unwrap();
        for model in config.models.iter().filter(|m| m.gpus > 0) {
            assert!(
                model.node_selector.is_empty(),
                "{}: an autoscaler cannot know a label such as nvidia.com/gpu.present before the node exists: {:?}",
                model.name,
                model.node_selector
            );
            assert!(
                model
                    .tolerations
                    .iter()
                    .any(|t| t.key.as_deref() == Some("nvidia.com/gpu")),
                "{}: GPU nodes' taint is tolerated",
                model.name
            );
        }
    }
}
