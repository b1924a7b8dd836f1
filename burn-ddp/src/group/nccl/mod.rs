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
//!
//! | file | owns |
//! |---|---|
//! | [`group`] | [`NcclProcessGroup`]: its state, forming it, the device-buffer collectives and the [`ProcessGroup`](super::ProcessGroup) ones |
//! | [`options`] | [`NcclGroupOptions`] |
//! | [`setup`] | set-up steps 3 and 4: the unique id, the non-blocking communicator |
//! | [`collective`] | one collective: checks, the NCCL call, the abort on failure |
//! | [`watchdog`] | waiting on NCCL with a deadline, abort checks and stall warnings |
//! | [`staging`] | host buffers through the group's device buffer |
//! | [`shutdown`] | the abort after a failure; the graceful shutdown on drop |
//! | [`fault`] | why a call failed, before it becomes a [`CollectiveError`] |
//! | [`ffi`] | the NCCL and CUDA calls, wrapped |
//!
//! [`CollectiveError`]: crate::error::CollectiveError
//! [`CollectiveError::Aborted`]: crate::error::CollectiveError::Aborted
//! [`CollectiveError::Timeout`]: crate::error::CollectiveError::Timeout

mod collective;
mod fault;
mod ffi;
mod group;
mod options;
mod setup;
mod shutdown;
mod staging;
mod watchdog;

pub use group::NcclProcessGroup;
pub use options::{NcclGroupOptions, DEFAULT_STORE_PREFIX};
