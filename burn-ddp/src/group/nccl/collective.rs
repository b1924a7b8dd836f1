//! One collective on the communicator (module docs of [`super`], steps 1, 2, 4 and 5): the
//! sequence number and the checks, the optional cross-rank comparison of the call, the NCCL
//! call enqueued on the group's stream and waited for, and the abort on any failure.

use std::ffi::c_void;
use std::time::Instant;

use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::fault::Fault;
use super::ffi::{nccl_dtype, nccl_error_text, nccl_op, nccl_state, stream_state};
use super::group::{NcclProcessGroup, UNEVEN_ON_NCCL};
use super::watchdog::{Clock, Waiting};
use crate::call::{CollectiveDesc, CollectiveKind, DataType, ReduceOp};
use crate::cuda::driver_error_text;
use crate::error::CollectiveError;
use crate::group::wire::{self, HEADER_LEN};

impl NcclProcessGroup {
    /// Runs one collective: sequence number, abort and argument checks, the optional
    /// cross-rank check, then `body`; aborts the group on any failure (module docs of
    /// [`super`]).
    pub(super) fn run(
        &mut self,
        kind: CollectiveKind,
        dtype: DataType,
        len: usize,
        precheck: Option<String>,
        body: impl FnOnce(&mut Self, &Clock, &CollectiveDesc) -> Result<(), Fault>,
    ) -> Result<(), CollectiveError> {
        let desc = match self.calls.begin(kind, dtype, len, precheck) {
            Ok(desc) => desc,
            Err(err @ CollectiveError::Aborted { .. }) => return Err(err),
            Err(err) => {
                // The other ranks are entering this collective and would wait for this one until
                // their timeout; aborting publishes the error so they stop within a second.
                self.abort(&err);
                return Err(err);
            }
        };
        let clock = Clock::until(Instant::now() + self.options.timeout);
        let result = self
            .ctx
            .bind_to_thread()
            .map_err(|e| {
                Fault::Failed(format!(
                    "cannot bind the CUDA context: {}",
                    driver_error_text(e)
                ))
            })
            .and_then(|()| {
                if self.options.check_collectives {
                    self.check_matches(&desc, &clock)?;
                }
                body(self, &clock, &desc)
            });
        result.map_err(|fault| {
            let err = self.fault_error(fault, &desc, &clock);
            self.abort(&err);
            err
        })
    }

    /// `fault` as the error of the collective `desc`, with this rank and the time it took.
    fn fault_error(&self, fault: Fault, desc: &CollectiveDesc, clock: &Clock) -> CollectiveError {
        let rank = self.member.rank;
        match fault {
            Fault::Timeout { waiting_on } => CollectiveError::Timeout {
                rank,
                desc: *desc,
                elapsed: clock.start.elapsed(),
                timeout: self.options.timeout,
                waiting_on,
            },
            // No variant of CollectiveError describes a backend failure in a collective; the
            // group is aborted by it, so it is reported as the abort's first error.
            Fault::Failed(message) => CollectiveError::Aborted {
                rank,
                first_error: format!("{desc} failed on CUDA device {}: {message}", self.device),
            },
            Fault::Mismatch { peer, theirs } => CollectiveError::Mismatch {
                rank,
                peer,
                ours: *desc,
                theirs,
            },
            Fault::Protocol { peer, source } => CollectiveError::Protocol {
                rank,
                peer,
                desc: *desc,
                source,
            },
        }
    }

    /// The live communicator, or the reason there is none.
    fn live_comm(&self) -> Result<nccl_sys::ncclComm_t, Fault> {
        self.comm
            .ok_or_else(|| Fault::Failed("the NCCL communicator is not initialised".into()))
    }

    /// Enqueues one NCCL call on the group's stream and waits until it has run (step 4–5).
    fn launch(
        &self,
        clock: &Clock,
        desc: &CollectiveDesc,
        what: &str,
        call: impl FnOnce(
            nccl_sys::ncclComm_t,
            nccl_sys::cudaStream_t,
        ) -> Result<nccl::NcclStatus, nccl::NcclError>,
    ) -> Result<(), Fault> {
        let comm = self.live_comm()?;
        let stream = self.stream;
        call(comm, stream as nccl_sys::cudaStream_t)
            .map_err(|e| Fault::Failed(format!("{what}: {}", nccl_error_text(e.0))))?;
        self.poll(clock, Waiting::Collective { desc, what }, || {
            // Until NCCL reports success, it may still be enqueuing on its own thread, and an
            // empty stream would look finished.
            Ok(nccl_state(comm)? && stream_state(stream)?)
        })
    }

    /// Runs the collective `desc` in place on the device buffer at `ptr` and waits for it:
    /// `desc.len` elements of `desc.dtype` per rank, in NCCL's in-place layouts (all-gather takes
    /// its input from this rank's block of the output, reduce-scatter leaves its result there).
    ///
    /// # Safety
    /// `ptr` must be a device address of this group's device, valid for the call's buffer
    /// (`world_size * len` elements for all-gather and reduce-scatter, `len` otherwise), that
    /// nothing else reads or writes until this returns; a broadcast's root must be a rank.
    pub(super) unsafe fn launch_in_place(
        &self,
        clock: &Clock,
        desc: &CollectiveDesc,
        ptr: u64,
    ) -> Result<(), Fault> {
        let (count, dtype) = (desc.len as usize, nccl_dtype(desc.dtype));
        if matches!(
            desc.kind,
            CollectiveKind::ReduceScatterV { .. } | CollectiveKind::AllGatherV { .. }
        ) {
            // `collective` refuses them before any launch; see there.
            return Err(Fault::Failed(UNEVEN_ON_NCCL.to_string()));
        }
        let (src, dst) = (ptr as *const c_void, ptr as *mut c_void);
        // This rank's block of an all-gather's output or a reduce-scatter's input.
        let own = ptr + (self.member.rank * count * desc.dtype.size()) as u64;
        let what = match desc.kind {
            CollectiveKind::AllReduce(_) => "all_reduce",
            CollectiveKind::Broadcast { .. } => "broadcast",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter(_) => "reduce_scatter",
            CollectiveKind::Barrier => "barrier",
            CollectiveKind::ReduceScatterV { .. } => "reduce_scatter_v",
            CollectiveKind::AllGatherV { .. } => "all_gather_v",
        };
        self.launch(clock, desc, what, |comm, stream| {
            // SAFETY: the caller guarantees the buffer at `ptr` and the root (above).
            unsafe {
                match desc.kind {
                    CollectiveKind::AllReduce(op) => {
                        nccl::all_reduce(src, dst, count, dtype, nccl_op(op), comm, stream)
                    }
                    CollectiveKind::Broadcast { root } => {
                        nccl::broadcast(src, dst, count, dtype, root as i32, comm, stream)
                    }
                    CollectiveKind::AllGather => {
                        nccl::all_gather(own as *const c_void, dst, count, dtype, comm, stream)
                    }
                    CollectiveKind::ReduceScatter(op) => {
                        let own = own as *mut c_void;
                        nccl::reduce_scatter(src, own, count, dtype, nccl_op(op), comm, stream)
                    }
                    // Completes on a rank only once every rank has contributed, i.e. entered
                    // the barrier; the value does not matter. (The uneven kinds were refused
                    // above and never get here.)
                    CollectiveKind::Barrier
                    | CollectiveKind::ReduceScatterV { .. }
                    | CollectiveKind::AllGatherV { .. } => {
                        let sum = nccl_op(ReduceOp::Sum);
                        nccl::all_reduce(src, dst, count, dtype, sum, comm, stream)
                    }
                }
            }
        })
    }

    /// Step 2 of a collective: every rank's description of the call, all-gathered and compared.
    fn check_matches(&mut self, desc: &CollectiveDesc, clock: &Clock) -> Result<(), Fault> {
        let (rank, world) = (self.member.rank, self.member.world_size);
        let mut all = vec![0u8; world * HEADER_LEN];
        let mine = rank * HEADER_LEN;
        all[mine..mine + HEADER_LEN].copy_from_slice(&wire::encode_header(desc));
        let dev = self.scratch_for(all.len())?;
        let slot = dev + mine as u64;
        self.copy_in(slot, &all[mine..mine + HEADER_LEN])?;
        self.launch(
            clock,
            desc,
            "collective check (all_gather of call descriptions)",
            |comm, stream| {
                // SAFETY: in-place all-gather: `slot` is rank's block of `dev`, which holds
                // `world * HEADER_LEN` bytes; both live on the group's device.
                unsafe {
                    nccl::all_gather(
                        slot as *const c_void,
                        dev as *mut c_void,
                        HEADER_LEN,
                        nccl_sys::ncclDataType_t::ncclUint8,
                        comm,
                        stream,
                    )
                }
            },
        )?;
        self.copy_out(&mut all, dev)?;
        for peer in (0..world).filter(|&p| p != rank) {
            let mut bytes = [0u8; HEADER_LEN];
            bytes.copy_from_slice(&all[peer * HEADER_LEN..(peer + 1) * HEADER_LEN]);
            let theirs =
                wire::decode_header(&bytes).map_err(|source| Fault::Protocol { peer, source })?;
            if theirs != *desc {
                return Err(Fault::Mismatch { peer, theirs });
            }
        }
        Ok(())
    }
}
