//! Whether a model fits this machine's memory, decided before anything is loaded, so a run is
//! refused with the figures instead of being OOM-killed halfway through loading.

use crate::error::{Error, MachineError, Result};

/// What a forward pass holds in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Needed {
    /// The weights of the blocks up to the deepest kept one, as they are resident.
    pub weights: u64,
    /// One batch's activations, captures and scratch.
    pub working: u64,
}

impl Needed {
    /// Both together.
    pub fn total(self) -> u64 {
        self.weights + self.working
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub fn parse_mem_available(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let rest = line.strip_prefix("MemAvailable:")?;
        let kib: u64 = rest.trim().strip_suffix("kB")?.trim().parse().ok()?;
        Some(kib * 1024)
    })
}

/// Limits at or above this are the kernel's way of saying "none" (cgroup v1 writes 2^63 - 4096).
const NO_LIMIT: u64 = 1 << 60;

/// A cgroup memory limit file's value: `max` (v2) or a huge number (v1) is no limit.
pub fn parse_limit(text: &str) -> Option<u64> {
    let limit: u64 = text.trim().parse().ok()?;
    (limit < NO_LIMIT).then_some(limit)
}

/// A field of a cgroup `memory.stat` text.
pub fn parse_stat(stat: &str, key: &str) -> Option<u64> {
    stat.lines().find_map(|line| {
        let (name, value) = line.split_once(' ')?;
        (name == key).then(|| value.trim().parse().ok()).flatten()
    })
}

/// Where this process's memory cgroup is, from `/proc/self/cgroup`: the v1 `memory`
/// controller's directory if there is one, else the v2 unified one.
pub fn cgroup_dir(proc_self_cgroup: &str) -> Option<String> {
    let mut unified = None;
    for line in proc_self_cgroup.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        if controllers.split(',').any(|c| c == "memory") {
            return Some(format!("/sys/fs/cgroup/memory{path}"));
        }
        if controllers.is_empty() {
            unified = Some(format!("/sys/fs/cgroup{path}"));
        }
    }
    unified
}

/// What the cgroup's limit leaves for anonymous memory: the limit less what the group holds
/// other than file cache (which the kernel reclaims before it kills), or `None` without one.
fn cgroup_available(dir: &str) -> Option<u64> {
    let read = |name: &str| std::fs::read_to_string(format!("{dir}/{name}")).ok();
    let stat = read("memory.stat").unwrap_or_default();
    let (limit, held) = match read("memory.max") {
        // v2: `anon` is what cannot be reclaimed without swap.
        Some(max) => (parse_limit(&max)?, parse_stat(&stat, "anon").unwrap_or(0)),
        None => (
            parse_limit(&read("memory.limit_in_bytes")?)?,
            parse_stat(&stat, "total_rss")
                .or_else(|| parse_stat(&stat, "rss"))
                .unwrap_or(0),
        ),
    };
    Some(limit.saturating_sub(held))
}

/// The memory a new pass can use now: `MemAvailable`, or less where this process's cgroup (a
/// container's or a Pod's limit) leaves less.
pub fn available_bytes() -> Option<u64> {
    let machine = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .as_deref()
        .and_then(parse_mem_available);
    let group = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .as_deref()
        .and_then(cgroup_dir)
        .and_then(|dir| cgroup_available(&dir));
    match (machine, group) {
        (Some(m), Some(g)) => Some(m.min(g)),
        (m, g) => m.or(g),
    }
}

/// Refuses a run that needs more than `available` (when it is known).
pub fn check(needed: Needed, available: Option<u64>) -> Result<()> {
    match available {
        Some(available) if needed.total() > available => {
            Err(Error::Machine(MachineError::InsufficientMemory {
                needed: needed.total(),
                weights: needed.weights,
                working: needed.working,
                available,
            }))
        }
        _ => Ok(()),
    }
}

/// Refuses a GPU run whose host buffers (`needed`: the capture buffers in circulation and the
/// shards held) exceed `available` (when it is known): the weights live on the GPU, and the
/// checkpoint's mapped pages are cache the kernel can take back.
pub fn check_host(needed: u64, available: Option<u64>) -> Result<()> {
    match available {
        Some(available) if needed > available => Err(Error::Machine(MachineError::HostMemory {
            needed,
            available,
        })),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_run_whose_host_buffers_do_not_fit_is_refused_naming_both_sizes() {
        check_host(10, Some(10)).unwrap();
        check_host(10, None).unwrap();
        let error = check_host(1_350_000_000_000, Some(100_000_000_000))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("1350000000000 bytes of host memory")
                && error.contains("100000000000 bytes available")
                && error.contains("fewer or shallower layers"),
            "{error}"
        );
    }

    #[test]
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_mem_available(text), Some(20_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn cgroup_limits_and_their_directories_are_read_for_v1_and_v2() {
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("9223372036854771712\n"), None);
        assert_eq!(parse_limit("17179869184\n"), Some(17_179_869_184));
        let v1 = "5:devices:/\n4:memory:/process_api/7252\n0::/\n";
        assert_eq!(
            cgroup_dir(v1).as_deref(),
            Some("/sys/fs/cgroup/memory/process_api/7252")
        );
        assert_eq!(
            cgroup_dir("0::/kubepods/pod1\n").as_deref(),
            Some("/sys/fs/cgroup/kubepods/pod1")
        );
        let stat = "cache 100\nrss 42\ntotal_rss 4096\n";
        assert_eq!(parse_stat(stat, "total_rss"), Some(4096));
        assert_eq!(parse_stat(stat, "rss"), Some(42));
        assert_eq!(parse_stat(stat, "anon"), None);
    }

    #[test]
    fn a_model_larger_than_the_memory_is_refused_naming_both_figures() {
        let needed = Needed {
            weights: 16_060_522_496,
            working: 1_000_000_000,
        };
        let error = check(needed, Some(8_000_000_000)).unwrap_err().to_string();
        assert!(
            error.contains("17060522496") && error.contains("8000000000"),
            "{error}"
        );
        assert!(check(needed, Some(20_000_000_000)).is_ok());
        assert!(
            check(needed, None).is_ok(),
            "unknown memory is not a refusal"
        );
    }
}
