//! Whether a model fits this machine's memory, decided before anything is loaded, so a run is
//! refused with the figures instead of being OOM-killed halfway through loading.

use crate::error::{Error, Result};

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

/// The memory this machine can give a new process now (`MemAvailable`), where the kernel says.
pub fn available_bytes() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .as_deref()
        .and_then(parse_mem_available)
}

/// Refuses a run that needs more than `available` (when it is known).
pub fn check(needed: Needed, available: Option<u64>) -> Result<()> {
    match available {
        Some(available) if needed.total() > available => Err(Error::InsufficientMemory {
            needed: needed.total(),
            weights: needed.weights,
            working: needed.working,
            available,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_mem_available(text), Some(20_000_000 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
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
