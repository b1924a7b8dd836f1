//! Host buffers through device memory: the group's staging buffer (grown in steps, kept
//! between calls) and the copies in and out of it on the group's stream.

use cudarc::driver::{result as cu, sys as cu_sys};

use super::fault::Fault;
use super::group::NcclProcessGroup;
use crate::cuda::driver_error_text;

/// Host buffers are staged through device memory allocated in steps of this size, so a
/// training loop whose buffers vary a little does not reallocate each step.
const SCRATCH_GRANULE: usize = 2 << 20;

impl NcclProcessGroup {
    /// A device staging buffer of at least `bytes` bytes.
    pub(super) fn scratch_for(&mut self, bytes: usize) -> Result<cu_sys::CUdeviceptr, Fault> {
        let want = bytes.max(256);
        if self.scratch_bytes >= want {
            return Ok(self.scratch);
        }
        let new_bytes = want.next_multiple_of(SCRATCH_GRANULE);
        if self.scratch != 0 {
            // SAFETY: the buffer came from cuMemAlloc in this group's context (bound by `run`);
            // its only user is the group's stream, which is idle between the steps of a
            // collective and between collectives (every step waits for it).
            unsafe { cu::free_sync(self.scratch) }.map_err(|e| {
                Fault::Failed(format!(
                    "freeing the staging buffer failed: {}",
                    driver_error_text(e)
                ))
            })?;
            self.scratch = 0;
            self.scratch_bytes = 0;
        }
        // SAFETY: a plain allocation in the context bound by `run`; the memory is only used
        // through offsets below `new_bytes`.
        self.scratch = unsafe { cu::malloc_sync(new_bytes) }.map_err(|e| {
            Fault::Failed(format!(
                "cannot allocate {new_bytes} bytes of staging memory: {}",
                driver_error_text(e)
            ))
        })?;
        self.scratch_bytes = new_bytes;
        Ok(self.scratch)
    }

    /// Copies `src` to device address `dst` on the group's stream (ordered before the NCCL call
    /// that follows).
    pub(super) fn copy_in<T: bytemuck::Pod>(
        &self,
        dst: cu_sys::CUdeviceptr,
        src: &[T],
    ) -> Result<(), Fault> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst .. dst + size_of_val(src)` lies inside the staging buffer (callers size it
        // with `scratch_for` first). `src` is a live host slice: from pageable memory the driver
        // stages the bytes before returning; from pinned memory the copy runs before anything
        // later on the stream, and the collective waits for the stream (or an abort drains it)
        // before `src`'s borrow ends.
        unsafe { cu::memcpy_htod_async(dst, src, self.stream) }.map_err(|e| {
            Fault::Failed(format!(
                "host-to-device copy failed: {}",
                driver_error_text(e)
            ))
        })
    }

    /// Copies device address `src` into `dst` once the stream has finished the collective.
    pub(super) fn copy_out<T: bytemuck::Pod>(
        &self,
        dst: &mut [T],
        src: cu_sys::CUdeviceptr,
    ) -> Result<(), Fault> {
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `src .. src + size_of_val(dst)` lies inside the staging buffer; `dst` is a live,
        // exclusively borrowed host slice, and the stream synchronisation below completes the
        // copy before the borrow ends.
        unsafe { cu::memcpy_dtoh_async(dst, src, self.stream) }.map_err(|e| {
            Fault::Failed(format!(
                "device-to-host copy failed: {}",
                driver_error_text(e)
            ))
        })?;
        // A blocking wait is safe here: the collective has completed, so the stream holds only
        // this copy, which depends on no other rank. And it must finish before `dst` is handed
        // back, whatever the deadline says.
        // SAFETY: the group's live stream, in the bound context.
        unsafe { cu::stream::synchronize(self.stream) }.map_err(|e| {
            Fault::Failed(format!(
                "device-to-host copy failed: {}",
                driver_error_text(e)
            ))
        })
    }
}
