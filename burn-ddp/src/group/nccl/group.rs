//! [`NcclProcessGroup`]: the group's state, how it is formed, and what it offers: the
//! collectives on device buffers and the [`ProcessGroup`] ones on host buffers, staged through
//! the device.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{result as cu, sys as cu_sys, CudaContext};
use cudarc::nccl::sys as nccl_sys;

use super::options::NcclGroupOptions;
use crate::call::{CollectiveKind, DataType, ReduceOp};
use crate::cuda::{self, driver_error_text, NcclVersion};
use crate::error::CollectiveError;
use crate::group::call_log::CallLog;
use crate::group::check;
use crate::group::collective::{Checked, Collective, Membership};
use crate::group::element::Element;
use crate::group::process_group::ProcessGroup;
use crate::group::rendezvous::{check_member, Rendezvous};
use crate::store::{PrefixStore, Store};

/// A process group whose collectives run with NCCL on one GPU per process. See the module docs
/// of [`super`].
///
/// The [`ProcessGroup`] methods take host buffers and stage them through device memory; the
/// gradient path uses [`NcclProcessGroup::all_reduce_device`] and
/// [`NcclProcessGroup::broadcast_device`] on device buffers directly. Both kinds are
/// collectives of the same group: every rank must make the same sequence of calls.
pub struct NcclProcessGroup {
    pub(super) member: Membership,
    pub(super) device: usize,
    pub(super) device_name: String,
    pub(super) nccl_version: NcclVersion,
    pub(super) options: NcclGroupOptions,
    /// The group's namespace of the store (aborts, stall reports).
    pub(super) store: PrefixStore,
    /// `None` before the communicator is ready and after it was aborted or destroyed.
    pub(super) comm: Option<nccl_sys::ncclComm_t>,
    /// The group's own non-blocking stream: NCCL and the staging copies run on it, apart from
    /// Burn's streams, so the ordering contract is explicit (see `all_reduce_device`).
    pub(super) stream: cu_sys::CUstream,
    /// Device staging buffer for host-buffer collectives and collective checks (0: none yet).
    pub(super) scratch: cu_sys::CUdeviceptr,
    pub(super) scratch_bytes: usize,
    /// False only when an abort left work on the stream that did not drain: the staging
    /// buffer is then leaked rather than freed under a running kernel.
    pub(super) stream_idle: bool,
    pub(super) calls: CallLog,
    /// Dropped last (fields drop after `Drop::drop`): it releases the primary context that the
    /// stream, the staging buffer and the communicator live in.
    pub(super) ctx: Arc<CudaContext>,
}

// SAFETY: the raw handles (communicator, stream, device memory) are owned by this value and used
// only through `&mut self` or in `Drop`, so never from two threads at once. Every method binds the
// device's context to the calling thread before using them, and NCCL allows a communicator to be
// used from any thread as long as calls do not overlap.
unsafe impl Send for NcclProcessGroup {}

impl NcclProcessGroup {
    /// Forms the group with default options and `timeout`. See
    /// [`NcclProcessGroup::with_options`].
    pub fn new(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        device_ordinal: usize,
        timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        Self::with_options(
            store,
            rank,
            world_size,
            device_ordinal,
            NcclGroupOptions {
                timeout,
                ..Default::default()
            },
        )
    }

    /// Forms the group: local checks, rendezvous through `store`, then the NCCL communicator
    /// (module docs of [`super`]). `device_ordinal` is this process's GPU among the visible
    /// ones (see [`crate::cuda::local_device`]).
    ///
    /// Collective: every rank of the job calls it with its own `rank` and the same
    /// `world_size` and `options`. Every wait for another rank or for NCCL is bounded by
    /// `options.timeout`. Fails with [`CollectiveError::Setup`] naming the missing library or
    /// device on this machine, a world-size mismatch, a rank claimed twice, the ranks that never
    /// joined, or the NCCL error; with [`CollectiveError::Store`] when the store fails. A rank
    /// that fails publishes why, and the others stop within a second. The one-rank group goes
    /// through the same steps as larger ones.
    pub fn with_options(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        device_ordinal: usize,
        options: NcclGroupOptions,
    ) -> Result<Self, CollectiveError> {
        check_member(rank, world_size)?;
        if i32::try_from(world_size).is_err() {
            let message = format!("world size {world_size} is larger than NCCL's limit (i32)");
            return Err(CollectiveError::Setup { rank, message });
        }
        let namespace = PrefixStore::new(options.store_prefix.clone(), store);
        let rdv = Rendezvous::new(namespace, rank, world_size, options.timeout);
        let result = Self::form(&rdv, rank, world_size, device_ordinal, options);
        if let Err(e) = &result {
            // Tell the other ranks, so they fail now rather than at their timeout.
            rdv.abort(e);
        }
        result
    }

    fn form(
        rdv: &Rendezvous,
        rank: usize,
        world_size: usize,
        device: usize,
        options: NcclGroupOptions,
    ) -> Result<Self, CollectiveError> {
        let setup = |message: String| CollectiveError::Setup { rank, message };
        let info = cuda::check_cuda_available(device).map_err(|e| setup(e.to_string()))?;
        let nccl_version = cuda::check_nccl_available().map_err(|e| setup(e.to_string()))?;
        // The checks above found the driver and every symbol used here, so cudarc's loader cannot
        // panic from now on.
        let ctx = CudaContext::new(device).map_err(|e| {
            setup(format!(
                "cannot use CUDA device {device} ({}): creating its context failed: {}",
                info.name,
                driver_error_text(e)
            ))
        })?;
        // CudaContext::new bound the context to this thread, so the stream is created in it.
        // Non-blocking: no implicit synchronisation with the legacy default stream.
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(|e| {
            setup(format!(
                "cannot create a CUDA stream on device {device}: {}",
                driver_error_text(e)
            ))
        })?;
        // From here on, Drop releases whatever has been created.
        let mut group = Self {
            member: Membership { rank, world_size },
            device,
            device_name: info.name,
            nccl_version,
            options,
            store: rdv.store().clone(),
            comm: None,
            stream,
            scratch: 0,
            scratch_bytes: 0,
            stream_idle: true,
            calls: CallLog::new(rank),
            ctx,
        };
        let id = group.exchange_unique_id(rdv)?;
        group.init_comm(id, rdv.deadline())?;
        tracing::info!(
            rank,
            world_size,
            device,
            device_name = %group.device_name,
            nccl = %group.nccl_version,
            "NCCL process group ready"
        );
        Ok(group)
    }

    /// This process's device ordinal.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The NCCL library in use.
    pub fn nccl_version(&self) -> &NcclVersion {
        &self.nccl_version
    }

    /// All-reduces `count` elements of `dtype` at device address `ptr`, in place, with `op`.
    ///
    /// Collective, like [`ProcessGroup::all_reduce`]: every rank calls it in the same position
    /// of the sequence of this group's calls, with the same `count`, `dtype` and `op`.
    ///
    /// # Ordering contract
    /// - **Before**: the bytes at `ptr` must be final. Burn/CubeCL write them on their own
    ///   streams, which this group's stream does not wait for: synchronise Burn's stream first
    ///   (`Device::sync`, or the backend's `sync`, which also drains Fusion's queue).
    /// - **After `Ok`**: the result is in the buffer and this group's stream has finished with
    ///   it (this call waits for its stream before returning), so Burn may read or write the
    ///   buffer right away.
    /// - **On error** (timeout included) the group is aborted, which also tells a kernel still
    ///   running to stop; the buffer's contents are then unspecified.
    ///
    /// # Safety
    /// `ptr` must be a device address of this group's device (the primary context of
    /// `device()`), valid for `count * dtype size` bytes for the whole call, and nothing else may
    /// read or write those bytes until it returns.
    pub unsafe fn all_reduce_device(
        &mut self,
        ptr: u64,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let precheck = (ptr == 0 && count > 0).then(|| "null device pointer".to_string());
        let kind = CollectiveKind::AllReduce(op);
        self.run(kind, dtype, count, precheck, |g, clock, desc| {
            // SAFETY: the caller guarantees `ptr` holds `count` elements of `dtype` on this
            // device and that nothing else touches them during the call.
            unsafe { g.launch_in_place(clock, desc, ptr) }
        })
    }

    /// Copies `root`'s `count` elements of `dtype` at device address `ptr` into every other
    /// rank's buffer at its `ptr`, in place.
    ///
    /// Collective, like [`ProcessGroup::broadcast`]: every rank calls it in the same position
    /// of the sequence, with the same `count`, `dtype` and `root`. The ordering contract, the
    /// behaviour on error and the safety requirements are those of
    /// [`NcclProcessGroup::all_reduce_device`].
    ///
    /// # Safety
    /// As for [`NcclProcessGroup::all_reduce_device`].
    pub unsafe fn broadcast_device(
        &mut self,
        ptr: u64,
        count: usize,
        dtype: DataType,
        root: usize,
    ) -> Result<(), CollectiveError> {
        let precheck = check::root(root, self.member.world_size);
        let kind = CollectiveKind::Broadcast { root };
        self.run(kind, dtype, count, precheck, |g, clock, desc| {
            // SAFETY: as in `all_reduce_device`; `run` checked `root` to be a rank.
            unsafe { g.launch_in_place(clock, desc, ptr) }
        })
    }
}

/// Why the uneven collectives fail on NCCL (which has no variable-count reduce-scatter): ZeRO
/// stage 1 runs them over the host ring, the TCP group every job has.
pub(super) const UNEVEN_ON_NCCL: &str = "reduce_scatter_v and all_gather_v are not implemented on the NCCL group; run them on the TCP group";

impl ProcessGroup for NcclProcessGroup {
    fn membership(&self) -> Membership {
        self.member
    }

    /// Host buffers are staged through the group's device buffer: copied in, the NCCL
    /// collective run in place on it, copied out.
    fn collective<T: Element>(&mut self, call: Checked<'_, T>) -> Result<(), CollectiveError> {
        let Checked { call, mut precheck } = call;
        let rank = self.member.rank;
        let (kind, len) = (call.kind(), call.elements_per_rank());
        if matches!(
            call,
            Collective::ReduceScatterV { .. } | Collective::AllGatherV { .. }
        ) {
            precheck = precheck.or_else(|| Some(UNEVEN_ON_NCCL.to_string()));
        }
        let dtype = match call {
            Collective::Barrier => DataType::I32,
            _ => T::DTYPE,
        };
        self.run(kind, dtype, len, precheck, |g, clock, desc| {
            // This rank's block of the staging buffer (bytes from its start): all-gather takes
            // its input there, reduce-scatter leaves its result there.
            let own = (rank * len * std::mem::size_of::<T>()) as u64;
            // The staging buffer's size, and what is copied in (offset, host slice).
            let (bytes, input): (usize, Option<(u64, &[T])>) = match &call {
                Collective::AllReduce { buffer, .. } => {
                    (std::mem::size_of_val(*buffer), Some((0, &**buffer)))
                }
                Collective::Broadcast { buffer, root } => (
                    std::mem::size_of_val(*buffer),
                    (rank == *root).then_some((0, &**buffer)),
                ),
                Collective::AllGather { input, output } => {
                    (std::mem::size_of_val(*output), Some((own, *input)))
                }
                Collective::ReduceScatter { input, .. } => {
                    (std::mem::size_of_val(*input), Some((0, *input)))
                }
                Collective::Barrier
                | Collective::ReduceScatterV { .. }
                | Collective::AllGatherV { .. } => (std::mem::size_of::<i32>(), None),
            };
            let dev = g.scratch_for(bytes)?;
            if let Some((at, input)) = input {
                g.copy_in(dev + at, input)?;
            }
            // SAFETY: the staging buffer holds the call's whole buffer (`world_size` blocks of
            // `len` elements for all-gather and reduce-scatter: the precheck passed), and `root`
            // was checked to be a rank.
            unsafe { g.launch_in_place(clock, desc, dev) }?;
            // Where the result is copied out to (offset, host slice).
            let output: Option<(u64, &mut [T])> = match call {
                Collective::AllReduce { buffer, .. } => Some((0, buffer)),
                Collective::Broadcast { buffer, root } => (rank != root).then_some((0, buffer)),
                Collective::AllGather { output, .. } => Some((0, output)),
                Collective::ReduceScatter { output, .. } => Some((own, output)),
                Collective::Barrier
                | Collective::ReduceScatterV { .. }
                | Collective::AllGatherV { .. } => None,
            };
            match output {
                Some((at, output)) => g.copy_out(output, dev + at),
                None => Ok(()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    //! Without a GPU only the failure paths can run here: forming a group must return a clear
    //! error, never panic. Collectives on a real GPU (world size 1, then N) run on hardware.
    use super::*;
    use crate::cuda::{check_cuda_available, check_nccl_available};
    use crate::store::MemoryStore;

    #[test]
    fn forming_a_group_without_cuda_or_nccl_is_a_clear_error() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let cuda = check_cuda_available(0);
        let nccl = check_nccl_available();
        let result = NcclProcessGroup::new(store.clone(), 0, 1, 0, Duration::from_secs(5));
        match (&cuda, &nccl) {
            (Err(reason), _) => {
                let err = result.err().expect("no CUDA driver, so no group");
                assert!(
                    matches!(err, CollectiveError::Setup { rank: 0, .. }),
                    "{err}"
                );
                let msg = err.to_string();
                assert!(msg.contains(&reason.to_string()), "{msg}");
                if matches!(reason, cuda::CudaUnavailable::DriverNotFound { .. }) {
                    assert!(msg.contains("libcuda.so.1"), "{msg}");
                }
                // The other ranks are told through the store.
                let abort = store.get("pg/nccl/abort", Duration::from_secs(1)).unwrap();
                assert!(String::from_utf8_lossy(&abort).contains("rank 0"));
            }
            (Ok(_), Err(reason)) => {
                let err = result.err().expect("no NCCL, so no group");
                let msg = err.to_string();
                assert!(msg.contains(&reason.to_string()), "{msg}");
                assert!(msg.contains("libnccl"), "{msg}");
            }
            // A machine with a GPU and NCCL: a group of one forms and works.
            (Ok(_), Ok(_)) => {
                let mut g = result.expect("a group of one on a GPU with NCCL");
                let mut v = [1.5f32, -2.0];
                g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                assert_eq!(v, [1.5, -2.0]);
                g.barrier().unwrap();
            }
        }
    }

    #[test]
    fn invalid_ranks_are_refused_before_touching_cuda() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        for (rank, world) in [(0, 0), (2, 2)] {
            let err = NcclProcessGroup::new(store.clone(), rank, world, 0, Duration::from_secs(1))
                .err()
                .expect("invalid rank");
            assert!(
                err.to_string()
                    .contains(&format!("rank {rank} is not in 0..{world}")),
                "{err}"
            );
        }
    }
}
