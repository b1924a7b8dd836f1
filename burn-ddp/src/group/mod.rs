//! Process groups: the collectives every rank calls together.
//!
//! - [`ProcessGroup`]: the trait (PyTorch's `ProcessGroup`): all-reduce, broadcast, all-gather,
//!   reduce-scatter and barrier over host buffers.
//! - [`call`]: one collective call's description (operation, element type, kind, sequence
//!   number), shared with the errors that name it.
//! - [`ring`]: the pure plan of the bandwidth-optimal ring algorithms (which chunk goes where at
//!   each step); no I/O, tested by simulation.
//! - [`wire`]: the pure encoding of the ring's hello and per-collective header.
//! - [`netif`]: which interface carries an address (for the set-up log).
//! - `poll`: `poll(2)` entries and a bounded wait, for the rings, the greeting and shared memory.
//! - `rendezvous`: how the ranks of a new group find each other through the store (rank claims,
//!   world size, missing ranks, the first-cause abort), shared by the TCP and NCCL groups; each
//!   group's keys live in its own namespace of the store ([`crate::store::PrefixStore`]).
//! - `postmortem`: after a failed collective, which rank died without reporting (the root cause
//!   that every survivor names, instead of the neighbour whose closed link reached it).
//! - `stall`: the stall reporter (who has not arrived), shared by the TCP and NCCL groups.
//! - `liveness`: peer heartbeats, so a collective names a dead, frozen or cut-off peer within
//!   the failure detection time.
//! - [`shm`]: the shared-memory byte channel of same-host ring links.
//! - [`staging`]: the work around an all-reduce or reduce-scatter (pack, round, check, scale,
//!   unpack) cut into the ring's pieces, so that a group can do it while its pieces are on the
//!   wire.
//! - [`tcp`]: [`TcpProcessGroup`], the ring over TCP sockets (or shared memory between
//!   neighbours on one host), for CPUs and for any device whose tensors are staged through the
//!   host.
//! - `nccl` (feature `cuda`): `NcclProcessGroup`, NCCL on one GPU per process.
//!
//! The contract every collective shares (same calls in the same order on every rank, deadline,
//! abort on error, identical results) is stated once, on [`ProcessGroup`].

pub use crate::call;
#[cfg(test)]
mod conformance;
pub(crate) mod greeting;
pub(crate) mod liveness;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod netif;
pub(crate) mod poll;
pub(crate) mod postmortem;
pub(crate) mod rendezvous;
pub mod ring;
pub mod shm;
pub mod staging;
pub(crate) mod stall;
pub mod tcp;
pub mod wire;

mod call_log;
pub(crate) mod check;
mod collective;
mod element;
mod process_group;

pub use call::{CollectiveDesc, CollectiveKind, DataType, ReduceOp};
pub use collective::{layout_fingerprint, Checked, Collective, Membership};
pub use element::Element;
pub use postmortem::DEFAULT_FAILURE_DETECTION;
pub use process_group::ProcessGroup;
pub use staging::PieceStaging;
pub use tcp::{TcpGroupOptions, TcpProcessGroup};
