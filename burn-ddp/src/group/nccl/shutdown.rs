//! How the group ends: aborted after a failure (the communicator and its kernels stopped, the
//! other ranks told), or shut down gracefully when dropped.

use std::time::{Duration, Instant};

use cudarc::driver::result as cu;
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::ffi::{nccl_error_text, nccl_state, stream_state};
use super::group::NcclProcessGroup;
use super::watchdog::MAX_PAUSE;
use crate::cuda::driver_error_text;
use crate::error::CollectiveError;
use crate::group::rendezvous;

/// How long an abort waits for the group's stream to drain (aborted kernels to exit).
const ABORT_DRAIN: Duration = Duration::from_secs(10);
/// Longest graceful shutdown (`ncclCommFinalize`) in `Drop` before falling back to an abort.
const DESTROY_GRACE: Duration = Duration::from_secs(10);

impl NcclProcessGroup {
    /// Breaks the group after `why`: publishes it for the other ranks, aborts the communicator
    /// (which stops kernels still running) and waits a bounded time for the stream to drain.
    pub(super) fn abort(&mut self, why: &CollectiveError) {
        // An argument error aborts before `run` binds the context; the stream query needs it.
        let _ = self.ctx.bind_to_thread();
        rendezvous::publish_abort(&self.store, self.member.rank, why);
        self.calls.abort(why);
        if let Some(comm) = self.comm.take() {
            abort_comm(comm);
        }
        let deadline = Instant::now() + ABORT_DRAIN;
        self.stream_idle = loop {
            match stream_state(self.stream) {
                Ok(true) => break true,
                Ok(false) if Instant::now() < deadline => std::thread::sleep(MAX_PAUSE),
                Ok(false) => {
                    tracing::warn!(
                        rank = self.member.rank,
                        "device work on the NCCL stream did not stop within {ABORT_DRAIN:?} of the abort"
                    );
                    break false;
                }
                Err(e) => {
                    tracing::warn!(
                        rank = self.member.rank,
                        "NCCL stream after abort: {}",
                        e.describe()
                    );
                    break false;
                }
            }
        };
    }
}

impl Drop for NcclProcessGroup {
    /// Shuts the communicator down gracefully (`ncclCommFinalize`, bounded by
    /// `DESTROY_GRACE`, then `ncclCommDestroy`), or aborts it when that fails; then frees the
    /// staging buffer (unless an abort left kernels running on it) and the stream.
    fn drop(&mut self) {
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::warn!(
                rank = self.member.rank,
                "cannot bind the CUDA context to release the NCCL group: {}",
                driver_error_text(e)
            );
        }
        if let Some(comm) = self.comm.take() {
            close_comm(
                comm,
                self.member.rank,
                self.options.timeout.min(DESTROY_GRACE),
            );
        }
        if self.scratch != 0 {
            if self.stream_idle && matches!(stream_state(self.stream), Ok(true)) {
                // SAFETY: allocated by cuMemAlloc in this context; the stream, its only user, is
                // idle.
                if let Err(e) = unsafe { cu::free_sync(self.scratch) } {
                    tracing::warn!(
                        rank = self.member.rank,
                        "freeing the NCCL staging buffer: {}",
                        driver_error_text(e)
                    );
                }
            } else {
                tracing::warn!(
                    rank = self.member.rank,
                    "leaking {} bytes of device memory still in use by aborted NCCL work",
                    self.scratch_bytes
                );
            }
            self.scratch = 0;
        }
        if !self.stream.is_null() {
            // SAFETY: the stream was created by this group and is destroyed once; work still on
            // it (only after an abort) completes before the driver releases it.
            if let Err(e) = unsafe { cu::stream::destroy(self.stream) } {
                tracing::warn!(
                    rank = self.member.rank,
                    "destroying the NCCL stream: {}",
                    driver_error_text(e)
                );
            }
            self.stream = std::ptr::null_mut();
        }
    }
}

/// Aborts `comm` (null is allowed): NCCL stops its kernels and frees it; never use it again.
pub(super) fn abort_comm(comm: nccl_sys::ncclComm_t) {
    if comm.is_null() {
        return;
    }
    // SAFETY: `comm` was created by ncclCommInitRankConfig and is aborted once (callers drop
    // their handle). ncclCommAbort is blocking even on a non-blocking communicator, so the
    // communicator is gone when it returns.
    if let Err(e) = unsafe { nccl::comm_abort(comm) } {
        tracing::warn!("ncclCommAbort: {}", nccl_error_text(e.0));
    }
}

/// Graceful shutdown of a healthy communicator within `grace`, else abort (see `Drop`).
fn close_comm(comm: nccl_sys::ncclComm_t, rank: usize, grace: Duration) {
    let deadline = Instant::now() + grace;
    // SAFETY: a live, healthy communicator, finalized once. On a non-blocking communicator
    // finalize returns ncclInProgress and completes on NCCL's thread.
    let finalized = match unsafe { nccl::comm_finalize(comm) } {
        Ok(_) => loop {
            match nccl_state(comm) {
                Ok(true) => break true,
                Ok(false) if Instant::now() < deadline => std::thread::sleep(MAX_PAUSE),
                Ok(false) => {
                    tracing::warn!(rank, "ncclCommFinalize did not finish within {grace:?}; aborting the communicator");
                    break false;
                }
                Err(e) => {
                    tracing::warn!(rank, "ncclCommFinalize: {}", e.describe());
                    break false;
                }
            }
        },
        Err(e) => {
            tracing::warn!(rank, "ncclCommFinalize: {}", nccl_error_text(e.0));
            false
        }
    };
    if !finalized {
        abort_comm(comm);
        return;
    }
    // SAFETY: finalized above, destroyed once; after a finalize, destroy only frees local
    // resources and does not block on other ranks.
    if let Err(e) = unsafe { nccl::comm_destroy(comm) } {
        tracing::warn!(rank, "ncclCommDestroy: {}", nccl_error_text(e.0));
    }
}
