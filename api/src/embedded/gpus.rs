//! The GPUs the embedded workers share (`worker_gpus`). One pool owns them: the harvesters
//! that run a job at once (its one worker, or its parts) take theirs together, first come
//! first served, and give them back when they exit. With fewer GPUs than parts, the parts
//! share the GPUs they got in turn; with no GPUs configured, harvesters run on the CPU.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

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
