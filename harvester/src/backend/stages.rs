//! How a model's blocks split into pipeline stages, one per device, and what each stage holds,
//! decided from the checkpoint's header before any weight is read. Pure.
//!
//! The blocks a job runs, up to its deepest kept one, are split over every stage asked for,
//! balanced by bytes, so a job that keeps only shallow layers still uses every GPU it was given
//! (a 405B job whose deepest layer is 40 runs 41 blocks over 8 GPUs, not over the 3 whose
//! share of all 126 blocks holds them). Blocks past the deepest kept one are never loaded. Any
//! split writes the same bytes, so it need not be the same from job to job.

use std::ops::Range;

use crate::error::{Error, InputError, MachineError, Result};

/// Splits blocks `0..=deepest` into `stages` contiguous ranges, one per GPU, so that the
/// largest stage's weight bytes are as small as possible (blocks after the deepest kept one
/// are never run, so never loaded). `block_bytes[b]` is block `b`'s weights.
pub fn split_stages(block_bytes: &[u64], deepest: usize, stages: usize) -> Vec<Range<usize>> {
    let blocks = &block_bytes[..=deepest.min(block_bytes.len().saturating_sub(1))];
    let stages = stages.clamp(1, blocks.len().max(1));
    // The smallest cap for which a greedy cut needs at most `stages` stages.
    let fits = |cap: u64| {
        let (mut used, mut count) = (0u64, 1usize);
        for &b in blocks {
            if b > cap {
                return false;
            }
            if used + b > cap {
                count += 1;
                used = 0;
            }
            used += b;
        }
        count <= stages
    };
    let (mut low, mut high) = (
        blocks.iter().copied().max().unwrap_or(0),
        blocks.iter().sum::<u64>(),
    );
    while low < high {
        let mid = low + (high - low) / 2;
        if fits(mid) {
            high = mid;
        } else {
            low = mid + 1;
        }
    }
    let mut ranges = Vec::with_capacity(stages);
    let (mut start, mut used) = (0usize, 0u64);
    for (b, &bytes) in blocks.iter().enumerate() {
        // Cut when the cap would be passed, or when the blocks left are just enough to give
        // every remaining stage one.
        let stages_left = stages - ranges.len();
        let blocks_left = blocks.len() - b;
        if b > start && (used + bytes > low || blocks_left < stages_left) {
            ranges.push(start..b);
            start = b;
            used = 0;
        }
        used += bytes;
    }
    ranges.push(start..blocks.len());
    ranges
}

/// One stage of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageShare {
    /// The blocks it holds and runs (cut at the deepest kept block).
    pub blocks: Range<usize>,
    /// Bytes of their weights (and of the embedding, for the first stage).
    pub weight_bytes: u64,
    /// Bytes of one batch's activations and captures while it runs them (filled in by the
    /// backend once it knows the stage's weights).
    pub working_bytes: u64,
}

impl StageShare {
    /// Weights and working bytes together.
    pub fn total(&self) -> u64 {
        self.weight_bytes + self.working_bytes
    }
}

/// Which stages a job runs, and each one's memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagePlan {
    /// The stages that run, in order.
    pub running: Vec<StageShare>,
    /// How many stages run: those asked for, or one a block where the job runs fewer blocks.
    pub stages: usize,
}

/// Splits the blocks a job whose deepest kept block is `deepest` runs (`block_bytes[b]` each)
/// into `stages`, or one a block where there are fewer blocks. `embed_bytes` go to the first
/// stage.
pub fn plan_stages(
    block_bytes: &[u64],
    embed_bytes: u64,
    deepest: usize,
    stages: usize,
) -> Result<StagePlan> {
    let blocks = block_bytes.len();
    if stages == 0 || stages > blocks {
        return Err(Error::Input(InputError::BadStages {
            reason: format!(
                "--pipeline-stages {stages} must be between 1 and the model's {blocks} blocks"
            ),
        }));
    }
    let deepest = deepest.min(blocks - 1);
    let split = split_stages(block_bytes, deepest, stages);
    let running: Vec<StageShare> = split
        .into_iter()
        .map(|blocks| {
            let weights: u64 = block_bytes[blocks.clone()].iter().sum();
            let embed = if blocks.start == 0 { embed_bytes } else { 0 };
            StageShare {
                working_bytes: 0,
                weight_bytes: weights + embed,
                blocks,
            }
        })
        .collect();
    Ok(StagePlan {
        stages: running.len(),
        running,
    })
}

/// Checks every running stage against the memory of its device: `capacity[i]` for stage `i`,
/// or, with one shared pool (CPU stages on one machine), what the stages before it left.
/// Refuses naming the first stage that does not fit.
pub fn check_stage_memory(plan: &StagePlan, capacity: &Capacity) -> Result<()> {
    let mut left = match capacity {
        Capacity::Shared(bytes) => *bytes,
        Capacity::PerDevice(_) => 0,
    };
    for (i, stage) in plan.running.iter().enumerate() {
        let available = match capacity {
            Capacity::Shared(_) => left,
            Capacity::PerDevice(each) => each.get(i).copied().unwrap_or(0),
        };
        if stage.total() > available {
            return Err(Error::Machine(MachineError::StageMemory {
                stage: i + 1,
                stages: plan.stages,
                first: stage.blocks.start,
                last: stage.blocks.end - 1,
                needed: stage.total(),
                weights: stage.weight_bytes,
                available,
            }));
        }
        left = left.saturating_sub(stage.total());
    }
    Ok(())
}

/// The GPU of each of `stages` stages: `listed` (`--stage-devices`, one per stage, a GPU
/// named more than once holding several), or `first`, `first + 1`, ... (the GPUs a job's Pod
/// or the embedded server gives it, from the one `--device cuda:N` names).
pub fn stage_devices(first: usize, stages: usize, listed: Option<&[usize]>) -> Result<Vec<usize>> {
    match listed {
        None => Ok((first..first + stages).collect()),
        Some(list) if list.len() == stages => Ok(list.to_vec()),
        Some(list) => Err(Error::Input(InputError::BadStages {
            reason: format!(
                "--stage-devices lists {} GPUs for {stages} stages: give one per stage, e.g. {}",
                list.len(),
                (0..stages)
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        })),
    }
}

/// The environment variable that lets CUDA stages run before a GPU has checked them.
pub const CUDA_STAGES_VARIABLE: &str = "HARVEST_CUDA_STAGES";

/// CUDA stages have run only replayed on the CPU, so they run only when asked for by
/// [`CUDA_STAGES_VARIABLE`]` = try` (its value here), as the GPU window does to check them.
pub fn check_cuda_stages_allowed(value: Option<&str>) -> Result<()> {
    let reason = match value.map(str::trim) {
        Some("try") => return Ok(()),
        None => format!(
            "CUDA pipeline stages have run only replayed on the CPU (--device cuda-replay), not yet on a GPU: set {CUDA_STAGES_VARIABLE}=try to run them anyway, or run CPU stages with --device cpu"
        ),
        Some(other) => {
            format!("{CUDA_STAGES_VARIABLE} is {other:?}: the one value it takes is \"try\"")
        }
    };
    Err(Error::Input(InputError::BadStages { reason }))
}

/// Refuses stages placed on GPUs this machine lacks (it has `available`), naming the stage
/// count, the first missing GPU and the GPUs there are.
pub fn check_stage_devices(devices: &[usize], available: usize) -> Result<()> {
    let Some((stage, gpu)) = devices
        .iter()
        .enumerate()
        .find(|&(_, &gpu)| gpu >= available)
    else {
        return Ok(());
    };
    let gpus = match available {
        0 => "no GPU".to_owned(),
        1 => "1 GPU (cuda:0)".to_owned(),
        n => format!("{n} GPUs (cuda:0 to cuda:{})", n - 1),
    };
    Err(Error::Input(InputError::BadStages {
        reason: format!(
            "--pipeline-stages {} puts stage {} on cuda:{gpu}, but this machine has {gpus}: use fewer stages, or name each stage's GPU with --stage-devices",
            devices.len(),
            stage + 1
        ),
    }))
}

/// What each running stage may use on its GPU (`devices[i]` for stage `i`): the device's free
/// bytes (`free(device)`, read once per device) less what the stages before it on the same
/// device take.
pub fn device_capacity(
    plan: &StagePlan,
    devices: &[usize],
    mut free: impl FnMut(usize) -> Result<u64>,
) -> Result<Capacity> {
    let mut left = std::collections::BTreeMap::new();
    let mut each = Vec::with_capacity(plan.running.len());
    for (stage, &device) in plan.running.iter().zip(devices) {
        let bytes = match left.get(&device) {
            Some(&bytes) => bytes,
            None => free(device)?,
        };
        each.push(bytes);
        left.insert(device, bytes.saturating_sub(stage.total()));
    }
    Ok(Capacity::PerDevice(each))
}

/// The memory stages draw on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Capacity {
    /// One pool for every stage, in bytes.
    Shared(u64),
    /// Each stage's own device, in bytes.
    PerDevice(Vec<u64>),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_run_on_consecutive_gpus_or_the_listed_ones_and_a_wrong_count_is_named() {
        assert_eq!(stage_devices(0, 3, None).unwrap(), [0, 1, 2]);
        assert_eq!(stage_devices(2, 2, None).unwrap(), [2, 3]);
        assert_eq!(stage_devices(0, 2, Some(&[0, 0])).unwrap(), [0, 0]);
        let error = stage_devices(0, 3, Some(&[0, 1])).unwrap_err().to_string();
        assert!(
            error.contains("lists 2 GPUs for 3 stages") && error.contains("0,1,2"),
            "{error}"
        );
    }

    #[test]
    fn cuda_stages_run_only_when_asked_for_until_a_gpu_has_checked_them() {
        check_cuda_stages_allowed(Some("try")).unwrap();
        let refused = check_cuda_stages_allowed(None).unwrap_err().to_string();
        assert!(
            refused.contains("HARVEST_CUDA_STAGES=try") && refused.contains("--device cpu"),
            "{refused}"
        );
        let odd = check_cuda_stages_allowed(Some("yes"))
            .unwrap_err()
            .to_string();
        assert!(odd.contains("\"yes\"") && odd.contains("\"try\""), "{odd}");
    }

    #[test]
    fn more_stages_than_the_gpus_given_are_refused_naming_both_numbers() {
        check_stage_devices(&[0, 1, 2, 3], 4).unwrap();
        check_stage_devices(&[0, 0], 1).unwrap();
        let error = check_stage_devices(&[0, 1, 2, 3, 4, 5, 6, 7], 4)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--pipeline-stages 8 puts stage 5 on cuda:4")
                && error.contains("4 GPUs (cuda:0 to cuda:3)")
                && error.contains("--stage-devices"),
            "{error}"
        );
        let one = check_stage_devices(&[1, 2], 2).unwrap_err().to_string();
        assert!(
            one.contains("stage 2 on cuda:2") && one.contains("2 GPUs"),
            "{one}"
        );
    }

    #[test]
    fn stages_sharing_a_gpu_share_its_free_memory_and_each_gpu_is_asked_once() {
        let share = |blocks: Range<usize>, bytes| StageShare {
            blocks,
            weight_bytes: bytes,
            working_bytes: 10,
        };
        let plan = StagePlan {
            running: vec![share(0..2, 100), share(2..4, 200), share(4..6, 300)],
            stages: 3,
        };
        let mut asked = Vec::new();
        let capacity = device_capacity(&plan, &[0, 0, 1], |device| {
            asked.push(device);
            Ok(1000 + device as u64)
        })
        .unwrap();
        assert_eq!(capacity, Capacity::PerDevice(vec![1000, 890, 1001]));
        assert_eq!(asked, [0, 1]);
        // The second stage on GPU 0 is the one refused, by name.
        let full = device_capacity(&plan, &[0, 0, 1], |_| Ok(300)).unwrap();
        let error = check_stage_memory(&plan, &full).unwrap_err().to_string();
        assert!(error.contains("stage 2"), "{error}");
    }

    #[test]
    fn stages_are_contiguous_cover_the_blocks_up_to_the_deepest_and_balance_bytes() {
        let blocks = vec![10u64; 32];
        let stages = split_stages(&blocks, 31, 8);
        assert_eq!(stages.len(), 8);
        assert!(stages.iter().all(|r| r.len() == 4), "{stages:?}");
        let partial = split_stages(&blocks, 14, 2);
        assert_eq!(
            partial,
            [0..8, 8..15],
            "blocks past the deepest kept one are not loaded"
        );
        let uneven = split_stages(&[50, 10, 10, 10, 10, 10], 5, 2);
        assert_eq!(uneven, [0..1, 1..6]);
        // A two-stage split on one device (the single-GPU pipeline test) and more GPUs than
        // blocks.
        assert_eq!(split_stages(&[1, 1, 1], 2, 2).len(), 2);
        assert_eq!(split_stages(&[1, 1], 1, 8), [0..1, 1..2]);
        for deepest in 0..32 {
            for gpus in 1..=8 {
                let stages = split_stages(&blocks, deepest, gpus);
                assert_eq!(stages.first().map(|r| r.start), Some(0));
                assert_eq!(stages.last().map(|r| r.end), Some(deepest + 1));
                assert!(
                    stages
                        .windows(2)
                        .all(|w| w[0].end == w[1].start && !w[1].is_empty())
                );
                assert_eq!(stages.len(), gpus.min(deepest + 1));
            }
        }
    }

    #[test]
    fn a_job_splits_the_blocks_up_to_its_deepest_over_every_stage_asked_for() {
        let blocks = vec![10u64; 9];
        let full = plan_stages(&blocks, 5, 8, 3).unwrap();
        let ranges: Vec<_> = full.running.iter().map(|s| s.blocks.clone()).collect();
        assert_eq!(ranges, [0..3, 3..6, 6..9]);
        assert_eq!(
            full.running[0].weight_bytes, 35,
            "the embedding is the first stage's"
        );
        // Deepest block 5 of 9: its 6 blocks over all 3 stages, not over the first 2.
        let shallow = plan_stages(&blocks, 5, 5, 3).unwrap();
        let ranges: Vec<_> = shallow.running.iter().map(|s| s.blocks.clone()).collect();
        assert_eq!(ranges, [0..2, 2..4, 4..6]);
        assert_eq!(shallow.stages, 3);
        // Fewer blocks to run than stages: one a block.
        let two = plan_stages(&blocks, 5, 1, 3).unwrap();
        let ranges: Vec<_> = two.running.iter().map(|s| s.blocks.clone()).collect();
        assert_eq!((ranges, two.stages), (vec![0..1, 1..2], 2));
        // A 405B-shaped job whose deepest layer is 40, on 8 GPUs: every GPU runs some of its
        // 41 blocks and none more than 6 (the pipeline's pace), where a split of all 126
        // blocks put 16 on each of the 3 GPUs that ran.
        let llama_405b = plan_stages(&vec![7u64; 126], 3, 40, 8).unwrap();
        let sizes: Vec<usize> = llama_405b.running.iter().map(|s| s.blocks.len()).collect();
        assert_eq!(sizes.len(), 8, "{sizes:?}");
        assert_eq!(sizes.iter().max(), Some(&6), "{sizes:?}");
        assert_eq!(sizes.iter().sum::<usize>(), 41);
        assert_eq!(llama_405b.running.last().unwrap().blocks.end, 41);
    }

    #[test]
    fn zero_stages_or_more_stages_than_blocks_are_refused_with_the_bounds() {
        for stages in [0, 4] {
            let error = plan_stages(&[1, 1, 1], 0, 2, stages)
                .unwrap_err()
                .to_string();
            assert!(
                error.contains(&format!("--pipeline-stages {stages}"))
                    && error.contains("3 blocks"),
                "{error}"
            );
        }
    }

    #[test]
    fn the_first_stage_that_does_not_fit_is_named_with_its_blocks() {
        let mut plan = plan_stages(&[10; 6], 0, 5, 3).unwrap();
        plan.running.iter_mut().for_each(|s| s.working_bytes = 1);
        // Each stage needs 21: a shared 50 fits two, and the third is refused.
        let error = check_stage_memory(&plan, &Capacity::Shared(50))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("stage 3 of 3") && error.contains("blocks 4-5"),
            "{error}"
        );
        check_stage_memory(&plan, &Capacity::Shared(63)).unwrap();
        let error = check_stage_memory(&plan, &Capacity::PerDevice(vec![30, 20, 30]))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("stage 2 of 3") && error.contains("20 bytes"),
            "{error}"
        );
    }
}
