//! [`NcclProcessGroup`]: collectives with NCCL, one process per GPU.
//!
//! # Set-up (through the store), bounded by the group's timeout
//! 1. Local checks first, so a machine without a driver or NCCL fails with a clear message
//!    instead of a panic inside cudarc: [`crate::cuda::check_cuda_available`] and
//!    [`crate::cuda::check_nccl_available`].
//! 2. The device's primary context (the one CubeCL uses) is retained and bound to this thread;
//!    the group creates its own non-blocking stream on it.
//! 3. The shared rendezvous ([`super::rendezvous`]) in the group's namespace
//!    (`options.store_prefix`): each rank claims its rank number (a second claim is an error),
//!    and every rank waits until all have joined with the same world size; ranks that never
//!    arrive are named. Rank 0 then creates the NCCL unique id and publishes it under
//!    `unique_id/0`; the others wait for it, checking for a published abort every second.
//! 4. Each rank starts `ncclCommInitRankConfig` with a **non-blocking** config
//!    (`blocking = 0`): the call returns at once and NCCL connects the ranks on its own thread.
//!    This thread polls `ncclCommGetAsyncError` until it reports success, an error, or the
//!    deadline passes; on an error or the deadline the communicator is aborted.
//!
//! A rank whose set-up fails publishes an abort (`abort` in the namespace; the first cause
//! wins), so the others fail within a second instead of at their timeout.
//!
//! # One collective
//! 1. If the group is aborted, fail at once with [`CollectiveError::Aborted`].
//! 2. With [`NcclGroupOptions::check_collectives`], all-gather every rank's 32-byte description
//!    of the call ([`super::wire::encode_header`]) and compare: NCCL itself cannot tell that two
//!    ranks called different collectives; it reduces garbage or hangs.
//! 3. Host buffers are copied into a device staging buffer; device buffers are used in place.
//! 4. The NCCL call is enqueued on the group's stream. On a non-blocking communicator it may
//!    return `ncclInProgress`: NCCL finishes enqueuing on its own thread.
//! 5. Poll until done, like PyTorch's NCCL watchdog: `ncclCommGetAsyncError` (still enqueuing?
//!    a remote or network error?), then `cuStreamQuery` (has the kernel finished?). Polls spin
//!    briefly, then sleep a little longer each time (at most 1 ms); after a second they also
//!    check the store for an abort published by another rank.
//! 6. Host buffers are copied back.
//!
//! # Cost of the non-blocking communicator
//! A blocking communicator could hang without a deadline inside an NCCL call: NCCL connects
//! peers lazily, in the first collective of each kind, and waits for them there. A non-blocking
//! one never blocks the caller, which is what lets every wait here have a deadline. The price:
//! NCCL launches each call from a helper thread it starts per call (tens of microseconds),
//! which matters for many tiny collectives, not for a few gradient buckets per step.
//!
//! # Errors and timeouts
//! Any failure aborts the group, as in the TCP group: the communicator is aborted with
//! `ncclCommAbort` (which also stops kernels still running), an abort is published so
//! that the other ranks stop waiting, and every later call fails with
//! [`CollectiveError::Aborted`]. A call that does not finish within the timeout fails with
//! [`CollectiveError::Timeout`], whose message says which ranks have reported being stuck in the
//! same call and which were not seen in it. NCCL and CUDA errors during a collective are reported
//! as [`CollectiveError::Aborted`] carrying the NCCL/CUDA error text.

use std::ffi::{c_char, c_void, CStr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result as cu, sys as cu_sys, CudaContext};
use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::call_log::CallLog;
use super::check;
use super::collective::{Checked, Collective, Membership};
use super::element::Element;
use super::process_group::ProcessGroup;
use super::rendezvous::{self, check_member, Rendezvous, ABORT_CHECK_EVERY};
use super::stall::{self, StallReporter};
use super::wire::{self, HEADER_LEN};
use crate::call::{CollectiveDesc, CollectiveKind, DataType, ReduceOp};
use crate::cuda::{self, driver_error_text, NcclVersion};
use crate::error::{CollectiveError, WireError};
use crate::store::backoff::Backoff;
use crate::store::{PrefixStore, Store};

/// Settings of an [`NcclProcessGroup`]. Every rank must use the same values.
#[derive(Debug, Clone)]
pub struct NcclGroupOptions {
    /// Deadline of set-up and of each collective (PyTorch's NCCL default is 10 min; 5 min here,
    /// as for the TCP group).
    pub timeout: Duration,
    /// After this long in one call, log which ranks are stuck in it too (Horovod's stall
    /// warning). Repeats every such interval until the timeout.
    pub stall_warning: Duration,
    /// Before each collective, all-gather every rank's description of it (kind, element type,
    /// length, reduce op, root, sequence number) and fail with [`CollectiveError::Mismatch`] when
    /// two ranks disagree. Costs one extra NCCL all-gather of `32 × world_size` bytes plus two
    /// small host↔device copies and a stream synchronisation per collective: tens of
    /// microseconds on one node, more across nodes — noticeable for many small buckets, negligible
    /// for a few large ones. Off by default, like PyTorch's `TORCH_DISTRIBUTED_DEBUG=DETAIL`.
    /// Must be the same on every rank (the check is itself a collective).
    pub check_collectives: bool,
    /// The group's namespace in the store ([`PrefixStore`]). A second NCCL group formed
    /// through the same store at the same time needs another prefix.
    pub store_prefix: String,
}

impl Default for NcclGroupOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            stall_warning: Duration::from_secs(60),
            check_collectives: false,
            store_prefix: DEFAULT_STORE_PREFIX.into(),
        }
    }
}

/// The namespace of an NCCL group's keys in the store unless its options name another.
pub const DEFAULT_STORE_PREFIX: &str = "pg/nccl";

/// Host buffers are staged through device memory allocated in steps of this size, so a
/// training loop whose buffers vary a little does not reallocate each step.
const SCRATCH_GRANULE: usize = 2 << 20;
/// How long polls spin (yield) before they start sleeping: collectives on one node often finish
/// within this, and a sleep would add its whole length to their latency.
const SPIN: Duration = Duration::from_micros(200);
/// Longest sleep between two polls.
const MAX_PAUSE: Duration = Duration::from_millis(1);
/// How long an abort waits for the group's stream to drain (aborted kernels to exit).
const ABORT_DRAIN: Duration = Duration::from_secs(10);
/// Longest graceful shutdown (`ncclCommFinalize`) in `Drop` before falling back to an abort.
const DESTROY_GRACE: Duration = Duration::from_secs(10);

/// A process group whose collectives run with NCCL on one GPU per process. See the module docs.
///
/// The [`ProcessGroup`] methods take host buffers and stage them through device memory; the
/// gradient path uses [`NcclProcessGroup::all_reduce_device`] and
/// [`NcclProcessGroup::broadcast_device`] on device buffers directly. Both kinds are
/// collectives of the same group: every rank must make the same sequence of calls.
pub struct NcclProcessGroup {
    member: Membership,
    device: usize,
    device_name: String,
    nccl_version: NcclVersion,
    options: NcclGroupOptions,
    /// The group's namespace of the store (aborts, stall reports).
    store: PrefixStore,
    /// `None` before the communicator is ready and after it was aborted or destroyed.
    comm: Option<nccl_sys::ncclComm_t>,
    /// The group's own non-blocking stream: NCCL and the staging copies run on it, apart from
    /// Burn's streams, so the ordering contract is explicit (see `all_reduce_device`).
    stream: cu_sys::CUstream,
    /// Device staging buffer for host-buffer collectives and collective checks (0: none yet).
    scratch: cu_sys::CUdeviceptr,
    scratch_bytes: usize,
    /// False only when an abort left work on the stream that did not drain: the staging
    /// buffer is then leaked rather than freed under a running kernel.
    stream_idle: bool,
    calls: CallLog,
    /// Dropped last (fields drop after `Drop::drop`): it releases the primary context that the
    /// stream, the staging buffer and the communicator live in.
    ctx: Arc<CudaContext>,
}

// SAFETY: the raw handles (communicator, stream, device memory) are owned by this value and used
// only through `&mut self` or in `Drop`, so never from two threads at once. Every method binds the
// device's context to the calling thread before using them, and NCCL allows a communicator to be
// used from any thread as long as calls do not overlap.
unsafe impl Send for NcclProcessGroup {}

/// Deadline of one call.
struct Clock {
    start: Instant,
    deadline: Instant,
}

impl Clock {
    fn until(deadline: Instant) -> Self {
        Self {
            start: Instant::now(),
            deadline,
        }
    }
}

/// What a wait is waiting for, for stall and timeout messages.
enum Waiting<'a> {
    Init,
    Collective {
        desc: &'a CollectiveDesc,
        what: &'a str,
    },
}

impl std::fmt::Display for Waiting<'_> {
    /// The call, as the stall warning names it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Waiting::Init => write!(f, "NCCL set-up"),
            Waiting::Collective { desc, .. } => write!(f, "{desc}"),
        }
    }
}

/// Why a collective failed, before it is turned into a [`CollectiveError`] with its context.
#[derive(Debug)]
enum Fault {
    Timeout {
        waiting_on: String,
    },
    /// An NCCL or CUDA error, or another rank's published abort.
    Failed(String),
    Mismatch {
        peer: usize,
        theirs: CollectiveDesc,
    },
    Protocol {
        peer: usize,
        source: WireError,
    },
}

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
    /// (module docs). `device_ordinal` is this process's GPU among the visible ones (see
    /// [`crate::cuda::local_device`]).
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

    fn setup_error(&self, message: String) -> CollectiveError {
        CollectiveError::Setup {
            rank: self.member.rank,
            message,
        }
    }

    /// Step 3 of the set-up: the rendezvous, then the unique id from rank 0 (module docs).
    fn exchange_unique_id(
        &self,
        rdv: &Rendezvous,
    ) -> Result<nccl_sys::ncclUniqueId, CollectiveError> {
        rdv.join()?;
        rdv.wait_joined()?;
        if self.member.rank == 0 {
            let id = nccl::get_uniqueid().map_err(|e| {
                self.setup_error(format!("ncclGetUniqueId failed: {}", nccl_error_text(e.0)))
            })?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            rdv.publish("unique_id", &bytes)?;
            return Ok(id);
        }
        let value = rdv.published("unique_id", 0)?;
        let mut id = nccl_sys::ncclUniqueId { internal: [0; 128] };
        if value.len() != id.internal.len() {
            return Err(self.setup_error(format!(
                "the NCCL unique id under {:?} has {} bytes, expected {}: is another program using this store?",
                rdv.store().full_key("unique_id/0"),
                value.len(),
                id.internal.len()
            )));
        }
        for (dst, &src) in id.internal.iter_mut().zip(&value) {
            *dst = src as c_char;
        }
        Ok(id)
    }

    /// Step 4 of the set-up: non-blocking communicator init, polled until ready (module docs).
    fn init_comm(
        &mut self,
        id: nccl_sys::ncclUniqueId,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let mut config = nonblocking_config();
        let mut comm: nccl_sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` are valid, writable locals for the whole call, and `config`
        // is initialised as NCCL_CONFIG_INITIALIZER would (see `nonblocking_config`). NCCL picks
        // the device from the calling thread's current context, which is this group's device
        // (bound in `form`). Rank and world size were checked to fit in an i32.
        let started = unsafe {
            nccl::comm_init_rank_config(
                &mut comm,
                self.member.world_size as i32,
                id,
                self.member.rank as i32,
                &mut config,
            )
        };
        if let Err(e) = started {
            let text = nccl_error_text(e.0);
            abort_comm(comm);
            return Err(self.setup_error(format!("ncclCommInitRankConfig failed: {text}")));
        }
        if comm.is_null() {
            return Err(self.setup_error("ncclCommInitRankConfig returned no communicator".into()));
        }
        let clock = Clock::until(deadline);
        match self.poll(&clock, Waiting::Init, || nccl_state(comm)) {
            Ok(()) => {
                self.comm = Some(comm);
                Ok(())
            }
            Err(fault) => {
                abort_comm(comm);
                Err(self.setup_error(match fault {
                    Fault::Timeout { waiting_on } => format!(
                        "NCCL communicator set-up timed out after {:?}: {waiting_on}",
                        self.options.timeout
                    ),
                    other => format!("NCCL communicator set-up failed: {}", other.describe()),
                }))
            }
        }
    }

    /// Polls `done` until it returns true, fails, or the clock's deadline passes (module docs,
    /// step 5). Spins for [`SPIN`], then sleeps with doubling pauses up to [`MAX_PAUSE`]; checks
    /// the store for another rank's abort every [`ABORT_CHECK_EVERY`] and logs a stall warning
    /// every `options.stall_warning`.
    fn poll(
        &self,
        clock: &Clock,
        waiting: Waiting<'_>,
        mut done: impl FnMut() -> Result<bool, Fault>,
    ) -> Result<(), Fault> {
        let mut next_store_check = clock.start + ABORT_CHECK_EVERY;
        let mut stall = StallReporter::new(
            &self.store,
            self.member.rank,
            self.member.world_size,
            self.options.stall_warning,
            clock.start,
        );
        let mut backoff = Backoff::new(Duration::from_micros(10), MAX_PAUSE);
        loop {
            if done()? {
                return Ok(());
            }
            let now = Instant::now();
            if now >= clock.deadline {
                return Err(Fault::Timeout {
                    waiting_on: self.waiting_on(&waiting),
                });
            }
            if now >= next_store_check {
                if let Some(why) = rendezvous::published_abort(&self.store) {
                    return Err(Fault::Failed(format!(
                        "another rank aborted the group: {why}"
                    )));
                }
                next_store_check = now + ABORT_CHECK_EVERY;
            }
            stall.warn_if_due(now, &waiting, None, || self.waiting_on(&waiting));
            if now - clock.start < SPIN {
                std::thread::yield_now();
            } else {
                backoff.sleep(clock.deadline);
            }
        }
    }

    /// What a stalled wait is waiting for, with what the store knows about the other ranks.
    fn waiting_on(&self, waiting: &Waiting<'_>) -> String {
        match waiting {
            // The rendezvous saw every rank arrive before NCCL's set-up started.
            Waiting::Init => "every rank joined the rendezvous, but NCCL's own connection set-up has not finished: check that the ranks can reach each other over TCP (set NCCL_SOCKET_IFNAME to the right interface) and rerun with NCCL_DEBUG=INFO".into(),
            Waiting::Collective { desc, what } => format!(
                "NCCL {what} on device {} to complete (every rank must enter this call). {}",
                self.device,
                stall::positions(&self.store, self.member.rank, self.member.world_size, desc.seq)
            ),
        }
    }

    /// Runs one collective: sequence number, abort and argument checks, the optional
    /// cross-rank check, then `body`; aborts the group on any failure (module docs).
    fn run(
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

    /// Breaks the group after `why`: publishes it for the other ranks, aborts the communicator
    /// (which stops kernels still running) and waits a bounded time for the stream to drain.
    fn abort(&mut self, why: &CollectiveError) {
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
    unsafe fn launch_in_place(
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

    /// A device staging buffer of at least `bytes` bytes.
    fn scratch_for(&mut self, bytes: usize) -> Result<cu_sys::CUdeviceptr, Fault> {
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
    fn copy_in<T: bytemuck::Pod>(&self, dst: cu_sys::CUdeviceptr, src: &[T]) -> Result<(), Fault> {
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
    fn copy_out<T: bytemuck::Pod>(
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
const UNEVEN_ON_NCCL: &str = "reduce_scatter_v and all_gather_v are not implemented on the NCCL group; run them on the TCP group";

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

impl Fault {
    fn describe(&self) -> String {
        match self {
            Fault::Timeout { waiting_on } => format!("timed out waiting for {waiting_on}"),
            Fault::Failed(message) => message.clone(),
            Fault::Mismatch { peer, theirs } => format!("rank {peer} called {theirs}"),
            Fault::Protocol { peer, source } => {
                format!("malformed data from rank {peer}: {source}")
            }
        }
    }
}

/// An `ncclConfig_t` as `NCCL_CONFIG_INITIALIZER` makes it, with `blocking = 0`.
///
/// Every field NCCL should default must hold `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`) or null — zero
/// is a real value that NCCL rejects for some fields. `size` and `version` describe the layout
/// of cudarc's bindings (NCCL 2.30.0); NCCL copies at most its own `sizeof(ncclConfig_t)` and
/// only reads fields that the version says exist, so older and newer libraries read it right.
fn nonblocking_config() -> nccl_sys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    const NCCL_API_MAGIC: u32 = 0xcafe_beef;
    // NCCL_VERSION(2, 30, 0): the release whose ncclConfig_t layout cudarc's bindings describe.
    const BINDINGS_VERSION: u32 = 2 * 10_000 + 30 * 100;
    nccl_sys::ncclConfig_t {
        size: std::mem::size_of::<nccl_sys::ncclConfig_t>(),
        magic: NCCL_API_MAGIC,
        version: BINDINGS_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

fn nccl_dtype(dtype: DataType) -> nccl_sys::ncclDataType_t {
    use nccl_sys::ncclDataType_t as T;
    match dtype {
        DataType::F32 => T::ncclFloat32,
        DataType::F64 => T::ncclFloat64,
        DataType::I32 => T::ncclInt32,
        DataType::I64 => T::ncclInt64,
        DataType::U8 => T::ncclUint8,
        DataType::BF16 => T::ncclBfloat16,
        DataType::F16 => T::ncclFloat16,
    }
}

/// `Avg` is NCCL's `ncclAvg` (NCCL ≥ 2.10; integer types divide after summing, like the TCP
/// group).
fn nccl_op(op: ReduceOp) -> nccl_sys::ncclRedOp_t {
    use nccl_sys::ncclRedOp_t as O;
    match op {
        ReduceOp::Sum => O::ncclSum,
        ReduceOp::Avg => O::ncclAvg,
        ReduceOp::Max => O::ncclMax,
        ReduceOp::Min => O::ncclMin,
    }
}

/// NCCL's state of `comm`: `Ok(true)` when nothing is pending, `Ok(false)` while NCCL is still
/// working on a call on its own thread (`ncclInProgress`), `Err` on an error.
fn nccl_state(comm: nccl_sys::ncclComm_t) -> Result<bool, Fault> {
    let mut state = nccl_sys::ncclResult_t::ncclSuccess;
    // SAFETY: `comm` is a live communicator (callers take it from `self.comm` or just created
    // it); `state` is a valid, writable ncclResult_t.
    let rc = unsafe { nccl_sys::ncclCommGetAsyncError(comm, &mut state) };
    if rc != nccl_sys::ncclResult_t::ncclSuccess {
        return Err(Fault::Failed(format!(
            "ncclCommGetAsyncError: {}",
            nccl_error_text(rc)
        )));
    }
    match state {
        nccl_sys::ncclResult_t::ncclSuccess => Ok(true),
        nccl_sys::ncclResult_t::ncclInProgress => Ok(false),
        error => Err(Fault::Failed(nccl_error_text(error))),
    }
}

/// Whether every piece of work on `stream` has finished.
fn stream_state(stream: cu_sys::CUstream) -> Result<bool, Fault> {
    // SAFETY: `stream` is the group's live stream, in the context bound by the caller.
    match unsafe { cu_sys::cuStreamQuery(stream) } {
        cu_sys::CUresult::CUDA_SUCCESS => Ok(true),
        cu_sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        error => Err(Fault::Failed(format!(
            "cuStreamQuery: {}",
            driver_error_text(cu::DriverError(error))
        ))),
    }
}

/// Aborts `comm` (null is allowed): NCCL stops its kernels and frees it; never use it again.
fn abort_comm(comm: nccl_sys::ncclComm_t) {
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

/// "ncclRemoteError: <NCCL's description> (<hint>); NCCL's last warning: <...>".
fn nccl_error_text(code: nccl_sys::ncclResult_t) -> String {
    use nccl_sys::ncclResult_t as R;
    // SAFETY: ncclGetErrorString returns null or a static NUL-terminated string for any code.
    let description = unsafe { c_str(nccl_sys::ncclGetErrorString(code)) };
    // SAFETY: ncclGetLastError ignores its argument and returns NCCL's global NUL-terminated
    // last-warning buffer.
    let last = unsafe { c_str(nccl_sys::ncclGetLastError(std::ptr::null_mut())) };
    let hint = match code {
        R::ncclRemoteError | R::ncclSystemError => {
            " (a peer probably exited or crashed, or the network failed: look at the other ranks' logs)"
        }
        R::ncclUnhandledCudaError => " (a CUDA call inside NCCL failed)",
        R::ncclInvalidUsage => {
            " (e.g. two ranks on one GPU, or ranks that called different collectives)"
        }
        _ => "",
    };
    let mut text = format!("{code:?}: {description}{hint}");
    if !last.is_empty() {
        text.push_str("; NCCL's last warning: ");
        text.push_str(&last);
    }
    text
}

/// # Safety
/// `ptr` is null or points to a NUL-terminated string that stays valid during the call.
unsafe fn c_str(ptr: *const c_char) -> String {
    if ptr.is_null() {
        String::new()
    } else {
        // SAFETY: non-null and NUL-terminated (the caller's contract).
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
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

    #[test]
    fn config_is_nccl_config_initializer_with_blocking_off() {
        let c = nonblocking_config();
        assert_eq!(c.size, std::mem::size_of::<nccl_sys::ncclConfig_t>());
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.version, 23000);
        assert_eq!(c.blocking, 0);
        assert_eq!(
            (c.minCTAs, c.maxCTAs, c.cgaClusterSize),
            (i32::MIN, i32::MIN, i32::MIN)
        );
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn element_types_and_ops_map_to_nccl() {
        use nccl_sys::{ncclDataType_t as T, ncclRedOp_t as O};
        assert_eq!(nccl_dtype(f32::DTYPE), T::ncclFloat32);
        assert_eq!(nccl_dtype(f64::DTYPE), T::ncclFloat64);
        assert_eq!(nccl_dtype(i32::DTYPE), T::ncclInt32);
        assert_eq!(nccl_dtype(i64::DTYPE), T::ncclInt64);
        assert_eq!(nccl_dtype(u8::DTYPE), T::ncclUint8);
        assert_eq!(nccl_dtype(half::bf16::DTYPE), T::ncclBfloat16);
        assert_eq!(nccl_dtype(half::f16::DTYPE), T::ncclFloat16);
        assert_eq!(nccl_op(ReduceOp::Avg), O::ncclAvg);
        assert_eq!(nccl_op(ReduceOp::Sum), O::ncclSum);
        assert_eq!(nccl_op(ReduceOp::Max), O::ncclMax);
        assert_eq!(nccl_op(ReduceOp::Min), O::ncclMin);
    }
}
