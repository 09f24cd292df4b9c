//! When a batch's buffers may be freed or reused. Work is queued on two streams (compute and
//! copies) and runs after the host call that queued it has returned, so a buffer is only done
//! with once the host has waited for both. A batch that succeeds waits for every copy it
//! queued; one that fails part-way may leave copies and kernels queued, and its buffers (the
//! kept slots, the page-locked hand-off) must not be refilled or freed until they ran. So:
//!
//! - a failed batch waits for both streams before its error is returned;
//! - the buffers are replaced only with both streams idle, and the streams are waited for again
//!   after the old ones are dropped, since the stream-ordered allocator returns freed memory to
//!   the device only at a synchronisation (the next batch's fit check counts it as free);
//! - where that wait fails, nothing is known about what still runs: the device refuses every
//!   later batch rather than touch a buffer that may be in use.
//!
//! Decided here over a closure that waits, so the order is tested without a GPU.

use cudarc::driver::DriverError;

use super::CudaError;
use crate::error::Result;

/// What [`Health`] does after a failed wait: what was being waited for.
const WAIT_ACTION: &str = "waiting for the device's queued work after a failed batch";

/// Leaves `buffers` unfreed until the process ends: memory the device may still read or
/// write must not go back to an allocator that hands it to something else.
#[allow(
    clippy::mem_forget,
    reason = "a deliberate leak, only where the device's queued work could not be waited for"
)]
pub(super) fn leave_unfreed<T>(buffers: T) {
    std::mem::forget(buffers);
}

/// Whether the device's queued work is known to have finished after every batch so far.
#[derive(Debug, Default)]
pub(super) struct Health {
    /// Why it is not: the driver's answer to a wait that failed.
    broken: Option<String>,
}

impl Health {
    /// Refuses a batch once a wait has failed.
    pub(super) fn check(&self) -> Result<()> {
        match &self.broken {
            None => Ok(()),
            Some(reason) => Err(CudaError::Fault {
                action: "running a batch after the device's queued work could not be waited for",
                reason: reason.clone(),
            }
            .into()),
        }
    }

    /// A batch's `result`, returned once `idle` has waited for the queued work where it failed.
    /// A failed wait is kept (every later batch is refused) and not returned: the batch's own
    /// error, which caused it, is the one to report.
    pub(super) fn settle<T>(
        &mut self,
        result: Result<T>,
        idle: impl FnOnce() -> std::result::Result<(), DriverError>,
    ) -> Result<T> {
        if result.is_err()
            && let Err(error) = idle()
        {
            self.broken = Some(format!("{:?}", error.0));
        }
        result
    }

    /// Replaces `buffers` with those `make` allocates: the old ones are dropped only once
    /// `idle` has waited for the work that may use them, and `idle` runs again after, so their
    /// memory is back on the device before `make` measures what is free.
    pub(super) fn replace<B>(
        &mut self,
        buffers: &mut Option<B>,
        idle: impl Fn() -> std::result::Result<(), DriverError>,
        make: impl FnOnce() -> Result<B>,
    ) -> Result<()> {
        self.check()?;
        if buffers.is_some() {
            let wait = |health: &mut Self| {
                idle().map_err(|error| {
                    health.broken = Some(format!("{:?}", error.0));
                    crate::Error::from(CudaError::from_driver(WAIT_ACTION, error))
                })
            };
            wait(self)?;
            *buffers = None;
            wait(self)?;
        }
        *buffers = Some(make()?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;
    use std::cell::RefCell;

    /// A batch's buffers that note when they are dropped.
    struct Buffers<'a> {
        log: &'a RefCell<Vec<&'static str>>,
        name: &'static str,
    }

    impl Drop for Buffers<'_> {
        fn drop(&mut self) {
            self.log.borrow_mut().push(self.name);
        }
    }

    fn fault() -> crate::Error {
        CudaError::Fault {
            action: "running a kernel",
            reason: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
        }
        .into()
    }

    #[test]
    fn old_buffers_are_freed_between_two_waits_and_the_new_ones_made_after() {
        let log = RefCell::new(Vec::new());
        let mut health = Health::default();
        let mut buffers = Some(Buffers {
            log: &log,
            name: "old dropped",
        });
        let idle = || {
            log.borrow_mut().push("waited");
            Ok(())
        };
        health
            .replace(&mut buffers, idle, || {
                log.borrow_mut().push("new made");
                Ok(Buffers {
                    log: &log,
                    name: "new dropped",
                })
            })
            .unwrap();
        assert_eq!(
            *log.borrow(),
            ["waited", "old dropped", "waited", "new made"]
        );
        // The first buffers need no wait: nothing was queued on them.
        let mut none: Option<Buffers<'_>> = None;
        log.borrow_mut().clear();
        health
            .replace(&mut none, idle, || {
                Ok(Buffers {
                    log: &log,
                    name: "first dropped",
                })
            })
            .unwrap();
        assert!(log.borrow().is_empty(), "{:?}", log.borrow());
        drop(none);
    }

    #[test]
    fn a_failed_batch_waits_for_the_queued_work_and_returns_its_own_error() {
        let waits = RefCell::new(0);
        let mut health = Health::default();
        let idle = || {
            *waits.borrow_mut() += 1;
            Ok(())
        };
        health.settle(Ok(()), idle).unwrap();
        assert_eq!(*waits.borrow(), 0, "a batch that succeeded waited already");
        let error = health.settle::<()>(Err(fault()), idle).unwrap_err();
        assert_eq!(*waits.borrow(), 1);
        assert!(error.to_string().contains("ILLEGAL_ADDRESS"), "{error}");
        health.check().unwrap();
    }

    #[test]
    fn after_a_wait_fails_no_batch_runs_and_no_buffer_is_freed() {
        let mut health = Health::default();
        let failing = || Err(DriverError(CUresult::CUDA_ERROR_LAUNCH_FAILED));
        let error = health.settle::<()>(Err(fault()), failing).unwrap_err();
        assert!(error.to_string().contains("ILLEGAL_ADDRESS"), "{error}");
        let refused = health.check().unwrap_err().to_string();
        assert!(refused.contains("CUDA_ERROR_LAUNCH_FAILED"), "{refused}");

        let log = RefCell::new(Vec::new());
        let mut buffers = Some(Buffers {
            log: &log,
            name: "old dropped",
        });
        let made = RefCell::new(false);
        let refused = health
            .replace(
                &mut buffers,
                || Ok(()),
                || {
                    *made.borrow_mut() = true;
                    Ok(Buffers {
                        log: &log,
                        name: "new dropped",
                    })
                },
            )
            .unwrap_err();
        assert!(refused.to_string().contains("LAUNCH_FAILED"), "{refused}");
        assert!(log.borrow().is_empty() && !*made.borrow());
        assert!(buffers.is_some());
    }

    #[test]
    fn a_failed_wait_before_freeing_keeps_the_buffers_and_breaks_the_device() {
        let log = RefCell::new(Vec::new());
        let mut health = Health::default();
        let mut buffers = Some(Buffers {
            log: &log,
            name: "old dropped",
        });
        let error = health
            .replace(
                &mut buffers,
                || Err(DriverError(CUresult::CUDA_ERROR_ILLEGAL_ADDRESS)),
                || -> Result<Buffers<'_>> { unreachable!("no new buffers after a failed wait") },
            )
            .unwrap_err();
        assert!(error.to_string().contains(WAIT_ACTION), "{error}");
        assert!(log.borrow().is_empty() && buffers.is_some());
        assert!(health.check().is_err());
    }
}
