//! The GPUs the embedded workers share (`worker_gpus`, or, where the configuration names
//! none, every GPU the harvester finds usable: [`detect`]). One pool owns them: the harvesters
//! that run a job at once (its one worker, or its parts) take theirs together, first come
//! first served, and give them back when they exit. With fewer GPUs than parts, the parts
//! share the GPUs they got in turn; with no GPUs, harvesters run on the CPU.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How long `harvester cuda-info --list` may take before the server starts on the CPU.
pub const DETECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// The GPUs the workers run on: `configured` when the configuration names them, else every GPU
/// `harvester cuda-info --list` finds usable. Says which at start, and why.
pub async fn detect(harvester: &std::path::Path, configured: Option<&[u32]>) -> Vec<u32> {
    if let Some(gpus) = configured {
        if gpus.is_empty() {
            tracing::info!("worker_gpus is []: harvesters run on the CPU");
        } else {
            tracing::info!(gpus = ?gpus, "harvesters run on the GPUs worker_gpus lists");
        }
        return gpus.to_vec();
    }
    let listed = tokio::time::timeout(
        DETECT_TIMEOUT,
        tokio::process::Command::new(harvester)
            .args(["cuda-info", "--list"])
            .env("RUST_LOG", "error")
            .kill_on_drop(true)
            .output(),
    )
    .await;
    let answer = match listed {
        Err(_) => Err(format!(
            "`{} cuda-info --list` took over {} s",
            harvester.display(),
            DETECT_TIMEOUT.as_secs()
        )),
        Ok(Err(e)) => Err(format!("`{} cuda-info --list`: {e}", harvester.display())),
        Ok(Ok(output)) if !output.status.success() => Err(format!(
            "`{} cuda-info --list` failed: {}",
            harvester.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        )),
        Ok(Ok(output)) => usable_gpus(&output.stdout),
    };
    match answer {
        Ok((gpus, _)) if gpus.is_empty() => Vec::new(),
        Ok((gpus, described)) => {
            tracing::info!(
                gpus = ?gpus,
                "harvesters run on the GPUs found here ({described}); set worker_gpus to choose others, or [] for the CPU"
            );
            gpus
        }
        Err(why) => {
            tracing::info!("harvesters run on the CPU: {why}");
            Vec::new()
        }
    }
}

/// The usable GPUs of a `cuda-info --list` answer, and the GPUs in words; an error saying why
/// there are none.
pub fn usable_gpus(listing: &[u8]) -> Result<(Vec<u32>, String), String> {
    let listing: serde_json::Value = serde_json::from_slice(listing)
        .map_err(|e| format!("the harvester's GPU list is not JSON ({e})"))?;
    let gpus = listing["gpus"].as_array().cloned().unwrap_or_default();
    let usable: Vec<&serde_json::Value> = gpus.iter().filter(|g| g["usable"] == true).collect();
    if usable.is_empty() {
        let why = listing["none_because"]
            .as_str()
            .map(str::to_owned)
            .or_else(|| {
                gpus.iter()
                    .find_map(|g| g["refusal"].as_str().map(str::to_owned))
            })
            .unwrap_or_else(|| "the harvester found no GPU".to_owned());
        return Err(why);
    }
    let ordinals = usable
        .iter()
        .filter_map(|g| g["ordinal"].as_u64().and_then(|o| u32::try_from(o).ok()))
        .collect();
    let described = usable
        .iter()
        .map(|g| {
            format!(
                "cuda:{} {} ({})",
                g["ordinal"],
                g["name"].as_str().unwrap_or("?"),
                g["compute_capability"].as_str().unwrap_or("?")
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    Ok((ordinals, described))
}

/// The server's GPUs, by CUDA ordinal.
#[derive(Debug)]
pub struct GpuPool {
    free: Mutex<BTreeSet<u32>>,
    permits: Arc<Semaphore>,
    total: usize,
}

/// GPUs held for the harvesters of one run; back in the pool on drop.
#[derive(Debug)]
pub struct GpuLease {
    pool: Arc<GpuPool>,
    gpus: Vec<u32>,
    _permits: OwnedSemaphorePermit,
}

impl GpuPool {
    /// A pool of `gpus` (CUDA ordinals, each once: the configuration checks it).
    pub fn new(gpus: &[u32]) -> Arc<Self> {
        Arc::new(Self {
            free: Mutex::new(gpus.iter().copied().collect()),
            permits: Arc::new(Semaphore::new(gpus.len())),
            total: gpus.len(),
        })
    }

    /// GPUs for `harvesters` processes run at once: one each, or all of the pool's when it has
    /// fewer. Waits until that many are free; `None` when the pool has none (CPU workers).
    pub async fn lease(self: &Arc<Self>, harvesters: usize) -> Option<GpuLease> {
        let wanted = harvesters.clamp(1, self.total.max(1));
        if self.total == 0 {
            return None;
        }
        let count = u32::try_from(wanted).unwrap_or(u32::MAX);
        // The pool is never closed, so acquiring only waits.
        let permits = Arc::clone(&self.permits)
            .acquire_many_owned(count)
            .await
            .ok()?;
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        // The lowest free ordinals: the permits guarantee `wanted` of them.
        let gpus: Vec<u32> = free.iter().copied().take(wanted).collect();
        for gpu in &gpus {
            free.remove(gpu);
        }
        Some(GpuLease {
            pool: Arc::clone(self),
            gpus,
            _permits: permits,
        })
    }
}

impl GpuLease {
    /// The GPUs of the run's harvester `slot` (from 0) when each spans `stages` of them: the
    /// next ones of the lease, in turn (shared when the lease holds fewer).
    pub fn devices_for(&self, slot: usize, stages: usize) -> Vec<u32> {
        (0..stages)
            .map(|stage| self.gpus[(slot * stages + stage) % self.gpus.len()])
            .collect()
    }
}

impl Drop for GpuLease {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock().unwrap_or_else(|e| e.into_inner());
        // Before the permits (a later field) go back, so a waiter always finds its GPUs.
        free.extend(self.gpus.drain(..));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_usable_gpus_of_a_listing_are_taken_and_none_says_why() {
        let listing = serde_json::json!({
            "driver_cuda": "13.0",
            "gpus": [
                {"ordinal": 0, "name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "usable": true, "refusal": null},
                {"ordinal": 1, "name": "Tesla V100", "compute_capability": "7.0", "usable": false, "refusal": "too old"},
                {"ordinal": 2, "name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "usable": true, "refusal": null}
            ],
            "none_because": null
        });
        let (gpus, described) = usable_gpus(listing.to_string().as_bytes()).unwrap();
        assert_eq!(gpus, [0, 2]);
        assert!(
            described.contains("cuda:0 NVIDIA H100 80GB HBM3 (9.0)"),
            "{described}"
        );
        let none = serde_json::json!({
            "driver_cuda": null, "gpus": [],
            "none_because": "no usable GPU: the NVIDIA driver library (libcuda.so.1) is not on this machine"
        });
        let why = usable_gpus(none.to_string().as_bytes()).unwrap_err();
        assert!(why.contains("libcuda.so.1"), "{why}");
        let old =
            serde_json::json!({"gpus": [{"ordinal": 0, "usable": false, "refusal": "too old"}]});
        assert_eq!(
            usable_gpus(old.to_string().as_bytes()).unwrap_err(),
            "too old"
        );
        assert!(usable_gpus(b"not json").unwrap_err().contains("not JSON"));
    }

    #[tokio::test]
    async fn configured_gpus_are_kept_and_a_harvester_that_cannot_list_leaves_the_cpu() {
        assert_eq!(
            detect(std::path::Path::new("/nonexistent"), Some(&[3, 1])).await,
            [3, 1]
        );
        assert!(
            detect(std::path::Path::new("/nonexistent"), Some(&[]))
                .await
                .is_empty()
        );
        assert!(
            detect(std::path::Path::new("/nonexistent/harvester"), None)
                .await
                .is_empty()
        );
    }

    impl GpuLease {
        /// The `--device` of harvester `slot` when each takes one GPU.
        fn device_for(&self, slot: usize) -> String {
            format!("cuda:{}", self.devices_for(slot, 1)[0])
        }
    }

    #[tokio::test]
    async fn each_harvester_of_a_run_gets_its_own_gpu_and_parts_past_the_pool_share_them() {
        let pool = GpuPool::new(&[0, 1, 2]);
        let two = pool.lease(2).await.unwrap();
        assert_eq!(
            (two.device_for(0), two.device_for(1)),
            ("cuda:0".into(), "cuda:1".into())
        );
        let last = pool.lease(1).await.unwrap();
        assert_eq!(last.device_for(0), "cuda:2");
        drop(two);
        drop(last);
        // Five parts on a pool of three take all of it and share it in turn.
        let all = pool.lease(5).await.unwrap();
        let devices: Vec<String> = (0..5).map(|slot| all.device_for(slot)).collect();
        assert_eq!(devices, ["cuda:0", "cuda:1", "cuda:2", "cuda:0", "cuda:1"]);
    }

    #[tokio::test]
    async fn a_run_waits_for_gpus_another_holds_and_gets_them_back_when_it_ends() {
        let pool = GpuPool::new(&[4, 7]);
        let first = pool.lease(2).await.unwrap();
        let waiting = tokio::spawn({
            let pool = Arc::clone(&pool);
            async move { pool.lease(1).await.unwrap().device_for(0) }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "both GPUs are taken");
        drop(first);
        assert_eq!(waiting.await.unwrap(), "cuda:4");
    }

    #[tokio::test]
    async fn a_harvester_spanning_gpus_gets_consecutive_ones_and_shares_a_short_pool() {
        let pool = GpuPool::new(&[0, 1, 2, 3]);
        let both = pool.lease(2 * 2).await.unwrap();
        assert_eq!(
            (both.devices_for(0, 2), both.devices_for(1, 2)),
            (vec![0, 1], vec![2, 3])
        );
        drop(both);
        let short = pool.lease(8).await.unwrap();
        assert_eq!(short.devices_for(0, 8), [0, 1, 2, 3, 0, 1, 2, 3]);
    }

    #[tokio::test]
    async fn with_no_gpus_configured_harvesters_get_no_device() {
        assert!(GpuPool::new(&[]).lease(3).await.is_none());
    }
}
