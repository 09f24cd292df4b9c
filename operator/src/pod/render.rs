//! Rendering an attempt's Pod from the job, its validated plan and the catalogue.

use std::collections::BTreeMap;

use harvest_core::ResolvedPlan;
use harvest_core::invocation::{Invocation, PlanArg, Task};
use harvest_core::layout::{Layout, SHUFFLE_BUCKET_BYTES, spill_bytes, train_file_data_bytes};
use harvest_core::plan::MAX_DIRECTIONS;
use harvest_crds::{HarvestAccount, HarvestAccountSpec, HarvestJob, ValidJob};
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapEnvSource, Container, EmptyDirVolumeSource, EnvFromSource, EnvVar,
    EphemeralVolumeSource, PersistentVolumeClaimSpec, PersistentVolumeClaimTemplate, Pod,
    PodSecurityContext, PodSpec, ResourceRequirements, SeccompProfile, SecretEnvSource,
    SecurityContext, Volume, VolumeMount, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Resource, ResourceExt};

use super::{
    ACCOUNT_LABEL, Attempt, CONTAINER, JOB_LABEL, JOB_NAME_ANNOTATION, JOB_NAMESPACE_ANNOTATION,
    JOB_UID_LABEL, KUEUE_PRIORITY_LABEL, KUEUE_QUEUE_LABEL, MANAGED_BY, PART_ENV, PART_LABEL, Role,
    TENANT_LABEL, TERMINATION_LOG, cleanup_pod_name, job_label, role_pod_name,
};
use crate::config::{CatalogueEntry, OperatorConfig};
use crate::error::{Error, Result};

/// Builds `attempt`'s Pod. `account` is the paying account, when it has one: its name labels
/// the Pod, its own storage Secret is used over the catalogue's `workerEnvSecret`, and its
/// `localQueue` over the entry's.
pub fn render(
    job: &HarvestJob,
    valid: &ValidJob,
    model: &CatalogueEntry,
    config: &OperatorConfig,
    attempt: &Attempt,
    account: Option<&HarvestAccount>,
) -> Result<Pod> {
    let paying = account.map(ResourceExt::name_any);
    let account = account.map(|a| &a.spec);
    let credentials = account.and_then(|a| a.storage.as_ref()?.credentials_secret.as_deref());
    let Queueing {
        queue,
        priority_class_name,
        workload_priority,
    } = queueing(account, model, attempt.role);
    let (role, deadline_seconds, attempt) =
        (attempt.role, attempt.deadline_seconds, attempt.number);
    let scratch = scratch_bytes(valid, model, role);
    let args = worker_args(job, valid, model, config, (role, scratch.is_some()))?;
    let mut resources = match role {
        Role::Finalize => finalize_resources(&valid.plan, model),
        Role::Whole | Role::Part { .. } => resources(model),
    };
    let (mut volumes, mut volume_mounts) = (model.volumes.clone(), model.volume_mounts.clone());
    if let Some(bytes) = scratch {
        let class = config.scratch_storage_class.as_deref();
        add_scratch(
            bytes,
            class,
            (&mut volumes, &mut volume_mounts),
            &mut resources,
        );
    }
    // The finalize step never runs the model: it goes wherever CPU and memory are, not to the
    // catalogue's GPU nodes (their selector, tolerations and runtime class).
    let on_gpu_nodes = role != Role::Finalize;
    let secret = credentials.or(config.worker_env_secret.as_deref());
    let (env, env_from) = environment(job, secret, config.worker_env_config_map.as_deref(), role);
    Ok(Pod {
        metadata: metadata(
            job,
            config,
            (role, attempt),
            (queue, workload_priority),
            paying.as_deref(),
        )?,
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            service_account_name: Some(config.worker_service_account.clone()),
            // The worker talks to storage only; its progress is read from its log.
            automount_service_account_token: Some(false),
            active_deadline_seconds: deadline_seconds,
            node_selector: (on_gpu_nodes && !model.node_selector.is_empty())
                .then(|| model.node_selector.clone()),
            tolerations: (on_gpu_nodes && !model.tolerations.is_empty())
                .then(|| model.tolerations.clone()),
            volumes: (!volumes.is_empty()).then_some(volumes),
            image_pull_secrets: (!model.image_pull_secrets.is_empty())
                .then(|| model.image_pull_secrets.clone()),
            runtime_class_name: model.runtime_class_name.clone().filter(|_| on_gpu_nodes),
            priority_class_name,
            security_context: Some(restricted_pod()),
            containers: vec![Container {
                name: CONTAINER.into(),
                image: Some(worker_image(job, model)),
                args: Some(args),
                env: Some(env),
                env_from,
                resources: (resources != ResourceRequirements::default()).then_some(resources),
                termination_message_path: Some(TERMINATION_LOG.into()),
                termination_message_policy: Some("FallbackToLogsOnError".into()),
                volume_mounts: (!volume_mounts.is_empty()).then_some(volume_mounts),
                security_context: Some(restricted_container()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    })
}

/// The image the job's workers run: the one its first worker ran (`status.workerImage`), else
/// the catalogue's now.
fn worker_image(job: &HarvestJob, model: &CatalogueEntry) -> String {
    job.status
        .as_ref()
        .and_then(|s| s.worker_image.clone())
        .unwrap_or_else(|| model.image.clone())
}

/// Whether a Pod queues in Kueue, and the priority it carries either way.
struct Queueing<'a> {
    /// The LocalQueue.
    queue: Option<&'a str>,
    /// The scheduler's PriorityClass, for a Pod that does not queue.
    priority_class_name: Option<String>,
    /// Kueue's WorkloadPriorityClass, for a Pod that does.
    workload_priority: Option<&'a str>,
}

/// Only the Pods that run the model take GPUs, so only they queue (the account's LocalQueue
/// over the entry's); the finalize step goes straight to the scheduler. A queued Pod's
/// priority is Kueue's: its priorityClassName would become the Workload's priority and could
/// preempt other teams' workloads.
fn queueing<'a>(
    account: Option<&'a HarvestAccountSpec>,
    model: &'a CatalogueEntry,
    role: Role,
) -> Queueing<'a> {
    let queue = account
        .and_then(|a| a.local_queue.as_deref())
        .or(model.local_queue.as_deref())
        .filter(|_| role != Role::Finalize);
    Queueing {
        queue,
        priority_class_name: model
            .priority_class_name
            .clone()
            .filter(|_| queue.is_none()),
        workload_priority: model
            .workload_priority_class
            .as_deref()
            .filter(|_| queue.is_some()),
    }
}

/// The Pod's name, namespace, labels and annotations, and its owner when it can have one.
fn metadata(
    job: &HarvestJob,
    config: &OperatorConfig,
    (role, attempt): (Role, u32),
    (queue, workload_priority): (Option<&str>, Option<&str>),
    account: Option<&str>,
) -> Result<ObjectMeta> {
    let owner = job
        .controller_owner_ref(&())
        .ok_or_else(|| Error::MissingUid {
            job: job.name_any(),
        })?;
    let namespace = config.pod_namespace(job);
    // Owner references cannot cross namespaces: a worker elsewhere is the job's by its UID
    // label, and the job's finalizer deletes it.
    let owners = (job.namespace().as_ref() == Some(&namespace)).then(|| vec![owner.clone()]);
    let mut labels = labels(job, &owner.uid, attempt, role);
    if let Some(account) = account {
        // An account's name may be a 253-character DNS subdomain; a label value holds 63.
        labels.insert(ACCOUNT_LABEL.to_owned(), job_label(account));
    }
    if let Some(queue) = queue {
        labels.insert(KUEUE_QUEUE_LABEL.to_owned(), queue.to_owned());
    }
    if let Some(class) = workload_priority {
        labels.insert(KUEUE_PRIORITY_LABEL.to_owned(), class.to_owned());
    }
    let annotations = BTreeMap::from([
        (
            JOB_NAMESPACE_ANNOTATION.to_owned(),
            job.namespace().unwrap_or_default(),
        ),
        (JOB_NAME_ANNOTATION.to_owned(), job.name_any()),
    ]);
    Ok(ObjectMeta {
        name: Some(role_pod_name(
            &job.name_any(),
            job.uid().as_deref(),
            role,
            attempt,
        )),
        namespace: Some(namespace),
        labels: Some(labels),
        annotations: Some(annotations),
        owner_references: owners,
        ..ObjectMeta::default()
    })
}

/// The Pod that deletes the local outputs of the deleted job `job` under `output`
/// (`harvester cleanup`): the model's image and volumes, where its workers wrote them, and
/// nothing of its GPU placement. The operator reads its answer from the termination message.
pub fn render_cleanup(
    job: &HarvestJob,
    output: &str,
    model: &CatalogueEntry,
    config: &OperatorConfig,
) -> Result<Pod> {
    let uid = job.uid().ok_or_else(|| Error::MissingUid {
        job: job.name_any(),
    })?;
    let mut labels = labels(job, &uid, 1, Role::Finalize);
    labels.insert(PART_LABEL.to_owned(), "cleanup".to_owned());
    let annotations = BTreeMap::from([
        (
            JOB_NAMESPACE_ANNOTATION.to_owned(),
            job.namespace().unwrap_or_default(),
        ),
        (JOB_NAME_ANNOTATION.to_owned(), job.name_any()),
    ]);
    let memory = Quantity("256Mi".into());
    let resources = ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_owned(), Quantity("100m".into())),
            ("memory".to_owned(), memory.clone()),
        ])),
        limits: Some(BTreeMap::from([("memory".to_owned(), memory)])),
        ..ResourceRequirements::default()
    };
    let args = Invocation {
        job_uid: Some(uid.clone()),
        termination_log: Some(TERMINATION_LOG.to_owned()),
        ..Invocation::new(Task::Cleanup {
            output: output.to_owned(),
        })
    }
    .to_args();
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(cleanup_pod_name(&job.name_any(), Some(&uid))),
            namespace: Some(config.pod_namespace(job)),
            labels: Some(labels),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            restart_policy: Some("Never".into()),
            service_account_name: Some(config.worker_service_account.clone()),
            automount_service_account_token: Some(false),
            volumes: (!model.volumes.is_empty()).then(|| model.volumes.clone()),
            image_pull_secrets: (!model.image_pull_secrets.is_empty())
                .then(|| model.image_pull_secrets.clone()),
            priority_class_name: model.priority_class_name.clone(),
            security_context: Some(restricted_pod()),
            containers: vec![Container {
                name: CONTAINER.into(),
                image: Some(worker_image(job, model)),
                args: Some(args),
                resources: Some(resources),
                termination_message_path: Some(TERMINATION_LOG.into()),
                termination_message_policy: Some("FallbackToLogsOnError".into()),
                volume_mounts: (!model.volume_mounts.is_empty())
                    .then(|| model.volume_mounts.clone()),
                security_context: Some(restricted_container()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    })
}

/// Who manages the Pod, its job by name and UID, the job's namespace, its attempt, and a
/// part's index.
fn labels(job: &HarvestJob, uid: &str, attempt: u32, role: Role) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::from([
        (MANAGED_BY.0.to_owned(), MANAGED_BY.1.to_owned()),
        (JOB_LABEL.to_owned(), job_label(&job.name_any())),
        (JOB_UID_LABEL.to_owned(), uid.to_owned()),
        ("harvest.dev/attempt".to_owned(), attempt.to_string()),
    ]);
    if let Some(namespace) = job.namespace() {
        labels.insert(TENANT_LABEL.to_owned(), namespace);
    }
    match role {
        Role::Whole => {}
        Role::Part { index, .. } => {
            labels.insert(PART_LABEL.to_owned(), index.to_string());
        }
        Role::Finalize => {
            labels.insert(PART_LABEL.to_owned(), "finalize".to_owned());
        }
    }
    labels
}

/// The job's name and namespace, a part's `INDEX/COUNT`, and the storage Secret as the
/// environment.
fn environment(
    job: &HarvestJob,
    secret: Option<&str>,
    config_map: Option<&str>,
    role: Role,
) -> (Vec<EnvVar>, Option<Vec<EnvFromSource>>) {
    let mut env = vec![
        EnvVar {
            name: "HARVEST_JOB_NAME".into(),
            value: Some(job.name_any()),
            ..EnvVar::default()
        },
        EnvVar {
            name: "HARVEST_JOB_NAMESPACE".into(),
            value: job.namespace(),
            ..EnvVar::default()
        },
    ];
    if let Role::Part { index, count } = role {
        env.push(EnvVar {
            name: PART_ENV.into(),
            value: Some(format!("{index}/{count}")),
            ..EnvVar::default()
        });
    }
    let settings = config_map.map(|name| EnvFromSource {
        config_map_ref: Some(ConfigMapEnvSource {
            name: name.to_owned(),
            optional: Some(true),
        }),
        ..EnvFromSource::default()
    });
    let credentials = secret.map(|name| EnvFromSource {
        secret_ref: Some(SecretEnvSource {
            name: name.to_owned(),
            optional: Some(false),
        }),
        ..EnvFromSource::default()
    });
    let env_from: Vec<EnvFromSource> = settings.into_iter().chain(credentials).collect();
    (env, (!env_from.is_empty()).then_some(env_from))
}

/// The "restricted" Pod Security Standard, so that worker namespaces may enforce it.
fn restricted_pod() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..SeccompProfile::default()
        }),
        ..PodSecurityContext::default()
    }
}

/// The container's half of the "restricted" standard.
fn restricted_container() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Capabilities::default()
        }),
        ..SecurityContext::default()
    }
}

/// The harvester's arguments: `run` (a part reads its range from `HARVEST_PART`) or
/// `finalize`, the resolved plan inline, the model's name, the job's token budget and UID
/// (the same for every part and the finalize step, which the byte identity needs), the
/// termination log, JSON progress and the scratch space where the layout `spills`, then the
/// configuration's extra arguments.
fn worker_args(
    job: &HarvestJob,
    valid: &ValidJob,
    model: &CatalogueEntry,
    config: &OperatorConfig,
    (role, spills): (Role, bool),
) -> Result<Vec<String>> {
    let plan = serde_json::to_string(&valid.plan.to_raw()).map_err(|source| Error::Encode {
        what: "the harvester plan",
        source,
    })?;
    // A part reads its range from `HARVEST_PART`, so every part's Pod has the same arguments.
    let task = match role {
        Role::Whole | Role::Part { .. } => Task::Run,
        Role::Finalize => Task::Finalize,
    };
    let invocation = Invocation {
        plan: Some(PlanArg::Json(plan)),
        device: model.device.clone(),
        // One pipeline stage a GPU: the Pod's GPUs are its cuda:0 to cuda:N-1.
        pipeline_stages: (model.gpus > 1 && !matches!(role, Role::Finalize))
            .then_some(model.gpus as usize),
        model_name: Some(model.name.clone()),
        token_budget: Some(valid.token_budget),
        job_uid: Some(job.uid().unwrap_or_default()),
        termination_log: Some(TERMINATION_LOG.to_owned()),
        progress_json: true,
        spill_dir: spills.then(|| SCRATCH_PATH.to_owned()),
        ..Invocation::new(task)
    };
    let mut args = invocation.to_args();
    args.extend(config.worker_extra_args.iter().cloned());
    Ok(args)
}

/// The catalogue's CPU and memory, with the model's GPUs requested and limited.
fn resources(model: &CatalogueEntry) -> ResourceRequirements {
    let mut resources = model.resources.clone();
    if model.gpus > 0 {
        let gpus = Quantity(model.gpus.to_string());
        resources
            .limits
            .get_or_insert_with(BTreeMap::new)
            .insert("nvidia.com/gpu".into(), gpus.clone());
        resources
            .requests
            .get_or_insert_with(BTreeMap::new)
            .insert("nvidia.com/gpu".into(), gpus);
    }
    resources
}

/// The values of a row: the residual width in bf16, or at most [`MAX_DIRECTIONS`]
/// projections in f32.
fn row_values(plan: &ResolvedPlan, model: &CatalogueEntry) -> (usize, usize) {
    match plan.project_onto {
        Some(_) => (MAX_DIRECTIONS, 4),
        None => (model.hidden_size, 2),
    }
}

/// The spill's emptyDir of `size`, asked for up front: not the container's writable layer,
/// where it would meet DiskPressure evictions.
/// Mounts `bytes` of scratch space at [`SCRATCH_PATH`]: a claim of `class`, or node disk that
/// the Pod asks for up front as ephemeral storage.
fn add_scratch(
    bytes: u64,
    class: Option<&str>,
    (volumes, mounts): (&mut Vec<Volume>, &mut Vec<VolumeMount>),
    resources: &mut ResourceRequirements,
) {
    let size = Quantity(bytes.to_string());
    volumes.push(scratch_volume(&size, class));
    mounts.push(VolumeMount {
        name: SCRATCH_VOLUME.into(),
        mount_path: SCRATCH_PATH.into(),
        ..VolumeMount::default()
    });
    if class.is_none() {
        resources
            .requests
            .get_or_insert_with(BTreeMap::new)
            .insert("ephemeral-storage".into(), size);
    }
}

/// The scratch volume of `size`: a claim of `class` made for the Pod and deleted with it (a
/// generic ephemeral volume), or else an emptyDir on the node's disk.
fn scratch_volume(size: &Quantity, class: Option<&str>) -> Volume {
    let Some(class) = class else {
        return Volume {
            name: SCRATCH_VOLUME.into(),
            empty_dir: Some(EmptyDirVolumeSource {
                size_limit: Some(size.clone()),
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        };
    };
    let claim = PersistentVolumeClaimSpec {
        access_modes: Some(vec!["ReadWriteOnce".into()]),
        storage_class_name: Some(class.to_owned()),
        resources: Some(VolumeResourceRequirements {
            requests: Some(BTreeMap::from([("storage".to_owned(), size.clone())])),
            ..VolumeResourceRequirements::default()
        }),
        ..PersistentVolumeClaimSpec::default()
    };
    Volume {
        name: SCRATCH_VOLUME.into(),
        ephemeral: Some(EphemeralVolumeSource {
            volume_claim_template: Some(PersistentVolumeClaimTemplate {
                metadata: None,
                spec: claim,
            }),
        }),
        ..Volume::default()
    }
}

/// The emptyDir the shuffle spills into.
const SCRATCH_VOLUME: &str = "harvest-scratch";
/// Where the Pod mounts it.
const SCRATCH_PATH: &str = "/scratch";

/// The scratch space of the Pod that writes a shuffled job's training files (a one-Pod job's
/// worker, or the finalize Pod): the spill of every token the budget allows, and one bucket
/// more. `None` for every other Pod.
fn scratch_bytes(valid: &ValidJob, model: &CatalogueEntry, role: Role) -> Option<u64> {
    let plan = &valid.plan;
    let shuffles = matches!(plan.options.layout, Layout::Shuffled { .. })
        && matches!(role, Role::Whole | Role::Finalize);
    shuffles.then(|| {
        let (width, itemsize) = row_values(plan, model);
        let slots = plan.options.layers.len() * plan.options.sites.len();
        spill_bytes(valid.token_budget, slots, width, itemsize) + SHUFFLE_BUCKET_BYTES
    })
}

/// Memory the finalize step takes besides what it holds for the shuffled layout: the
/// records' exact statistics, the manifest and the process.
pub const FINALIZE_BASE_BYTES: u64 = 1 << 30;

/// The finalize step's CPU and memory, from its plan: one CPU, and as memory the base plus,
/// for the shuffled layout, one spill bucket and one training file. No GPU, whatever the
/// catalogue gives the model's workers.
fn finalize_resources(plan: &ResolvedPlan, model: &CatalogueEntry) -> ResourceRequirements {
    let (width, itemsize) = row_values(plan, model);
    let shuffle = match plan.options.layout {
        Layout::ByPrompt => 0,
        Layout::Shuffled { rows_per_file, .. } => {
            let slots = plan.options.layers.len() * plan.options.sites.len();
            SHUFFLE_BUCKET_BYTES
                + train_file_data_bytes(rows_per_file.get(), slots, width, itemsize)
        }
    };
    let memory = Quantity((FINALIZE_BASE_BYTES + shuffle).to_string());
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_owned(), Quantity("1".into())),
            ("memory".to_owned(), memory.clone()),
        ])),
        limits: Some(BTreeMap::from([("memory".to_owned(), memory)])),
        ..ResourceRequirements::default()
    }
}
