//! [`TcpProcessGroup`]: the ring collectives over TCP.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | the group: options, forming it, the [`ProcessGroup`] methods |
//! | [`setup`] | forming the ring: rendezvous, shared-memory ends, connections and hellos |
//! | [`exchange`] | one collective: the event loop that moves a ring plan's pieces |
//! | [`transport`] | how a link moves data: its socket, or shared memory |
//!
//! # Set-up (through the store, in the group's namespace `options.store_prefix`)
//! 1. The shared rendezvous ([`super::rendezvous`]): each rank claims its rank number (a second
//!    claim is an error: two processes were given the same `RANK`), publishes its world size,
//!    and waits (with the group timeout) until every rank has joined with the same world size; a
//!    rank that never arrives is named in the error. A rank that fails anywhere in the set-up
//!    publishes an abort (the first cause wins), so the others stop at once instead of waiting
//!    out the timeout.
//! 2. Each rank listens on an OS-chosen port on the address that routes to the store, publishes
//!    `ip:port` (and, before it, its shared-memory directory), and waits for everyone's.
//! 3. Each rank connects to its successor and sends a hello (rank, world size, job token), and
//!    accepts its predecessor's connection; connections with a wrong hello are refused and
//!    logged, and the rank keeps waiting for the right one.
//! 4. A barrier over the new ring proves that every link works.
//!
//! # One collective
//! All I/O is non-blocking and driven by one thread with `poll(2)`: the rank writes the
//! collective's header to both neighbours, then streams pieces to its successor as the plan
//! ([`super::ring`]) allows while it receives and reduces pieces from its predecessor. One thread
//! per rank keeps the two cores of a small machine for two ranks' copies and reductions instead of
//! four threads contending for them. Received headers are checked before any data is used.
//!
//! # A failed collective
//! The rank closes both ring connections, so its neighbours fail at once too, and the group is
//! aborted. A rank that lost a peer's connection finds the root cause through the store
//! ([`super::postmortem`]): every failing rank reports under `failed/{rank}`, and a rank that
//! others lost but that never reported within a couple of seconds died; every survivor then
//! names it ([`CollectiveError::PeerGone`]) instead of the neighbour whose closed link reached
//! it first. A store that fails too (its host died) leaves the error as it was, saying so
//! ([`CollectiveError::PeerLostStoreGone`]).
//!
//! # Same-host neighbours: shared memory
//! When a neighbour runs on the same host (same kernel and network namespace, see
//! [`shm::host_identity`](super::shm::host_identity)), and `options.shared_memory` says so, the
//! data of that link goes through a shared-memory ring buffer ([`super::shm`]) instead of the
//! socket: no copies into and out of the kernel, no TCP stack. The TCP connection stays for the
//! set-up, the per-collective headers (so mismatch checks are the same) and as the other half of
//! liveness. The group itself never reads the environment: [`crate::init::Distributed::init`]
//! turns shared memory on for a job unless `BURN_DDP_SHM=0`.

mod exchange;
mod options;
mod setup;
pub(crate) mod transport;

use std::net::Shutdown;
use std::sync::Arc;
use std::time::Instant;

use self::exchange::Call;
pub use self::options::{TcpGroupOptions, DEFAULT_STORE_PREFIX};
use self::setup::Ring;
use super::call_log::CallLog;
use super::collective::{Checked, Collective, Membership};
use super::element::Element;
use super::liveness::{start_beating, PeerLiveness};
use super::postmortem::{post_mortem, Report, Verdict};
use super::process_group::ProcessGroup;
use super::rendezvous::{check_member, Rendezvous};
use super::ring::{self, RingPlan};
use super::staging::{self, PieceSchedule, PieceStaging, StagedBuffer};
use super::stall::StallReporter;
use crate::call::{CollectiveDesc, CollectiveKind, ReduceOp};
use crate::error::CollectiveError;
use crate::store::heartbeat::Heartbeat;
use crate::store::{PrefixStore, Store};

/// A process group whose collectives run over a TCP ring. See the module docs.
pub struct TcpProcessGroup {
    member: Membership,
    /// The group's namespace of the store (stall reports).
    store: PrefixStore,
    ring: Option<Ring>,
    options: TcpGroupOptions,
    calls: CallLog,
    /// Receive buffer for pieces that are reduced (u64 words so any element type is aligned).
    scratch: Vec<u64>,
    /// This rank's heartbeat, with [`TcpGroupOptions::peer_heartbeats`] (`super::liveness`).
    _heartbeat: Option<Heartbeat>,
}

impl TcpProcessGroup {
    /// Forms the group: rendezvous through `store`, ring connections, then a barrier.
    ///
    /// Collective: every rank of the group calls it with its own `rank` and the same
    /// `world_size` and options. Fails with a message naming the rank(s) at fault when world
    /// sizes disagree, a rank number is claimed twice, or a rank does not arrive within
    /// `options.timeout`; a rank that fails tells the others through the store, and they stop
    /// within a second. A group of one touches neither the store nor the network.
    pub fn new(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        options: TcpGroupOptions,
    ) -> Result<Self, CollectiveError> {
        check_member(rank, world_size)?;
        let mut group = Self {
            member: Membership { rank, world_size },
            store: PrefixStore::new(options.store_prefix.clone(), store),
            ring: None,
            options,
            calls: CallLog::new(rank),
            scratch: Vec::new(),
            _heartbeat: None,
        };
        if world_size > 1 {
            group.connect()?;
            if group.options.peer_heartbeats {
                let store: Arc<dyn Store> = Arc::new(group.store.clone());
                let detection = group.options.failure_detection;
                group._heartbeat = Some(start_beating(store, rank, detection));
            }
        }
        tracing::debug!(rank, world_size, "process group ready");
        Ok(group)
    }

    /// Makes every rank that forms a group through `store` with `options` (in
    /// [`new`](Self::new)) fail within a second with `why`, as if rank `rank` had failed its
    /// set-up: for a party that knows the group cannot form (a member it waits for died).
    /// Not collective; store failures are ignored (the set-up's deadline still holds).
    pub fn abort_forming(
        store: Arc<dyn Store>,
        options: &TcpGroupOptions,
        rank: usize,
        why: &dyn std::fmt::Display,
    ) {
        let store = PrefixStore::new(options.store_prefix.clone(), store);
        crate::group::rendezvous::publish_abort(&store, rank, why);
    }

    /// The group's namespace of the store, where its ranks beat their heartbeats
    /// ([`TcpGroupOptions::peer_heartbeats`]; [`crate::group::liveness`]).
    pub(crate) fn heartbeat_store(&self) -> Arc<dyn Store> {
        Arc::new(self.store.clone())
    }

    /// The options the group was formed with (resolved: token, address, shared memory), so a
    /// second group of the same job can be formed alike under another
    /// [`store_prefix`](TcpGroupOptions::store_prefix).
    pub fn options(&self) -> &TcpGroupOptions {
        &self.options
    }

    /// Set-up steps 1–4 (module docs). On failure, tells the other ranks through the store, so
    /// they fail now rather than at their timeout.
    fn connect(&mut self) -> Result<(), CollectiveError> {
        let Membership {
            rank,
            world_size: world,
        } = self.member;
        let rdv = Rendezvous::new(self.store.clone(), rank, world, self.options.timeout);
        let result =
            setup::connect_ring(&rdv, &self.options, rank, world).and_then(|(ring, dir)| {
                self.ring = Some(ring);
                self.barrier()?;
                Ok(dir)
            });
        match result {
            // Both neighbours have entered the barrier, so they have opened our files.
            Ok(shm_dir) => drop(shm_dir),
            Err(e) => {
                rdv.abort(&e);
                return Err(e);
            }
        }
        if let Some(ring) = &mut self.ring {
            ring.data_out.go_live();
            ring.data_in.go_live();
        }
        // After the barrier: every link of the ring has carried data (tests wait for this).
        tracing::info!(rank, world, "process group ready");
        Ok(())
    }

    /// How the links move data (`""`: socket, `" (shared memory)"`): to the successor, from the
    /// predecessor. `None` for a group of one.
    #[cfg(test)]
    pub(crate) fn link_labels(&self) -> Option<(&'static str, &'static str)> {
        self.ring
            .as_ref()
            .map(|r| (r.data_out.label(), r.data_in.label()))
    }

    /// Fails the group with `why`: publishes this rank's failure report, closes the ring so the
    /// neighbours fail fast (they find the report already there) and, when it lost a peer,
    /// turns `why` into the root cause the reports show ([`post_mortem`], bounded by `deadline`,
    /// the collective's); then refuses every later call. Returns the error to give the caller.
    fn fail(&mut self, why: CollectiveError, deadline: Instant) -> CollectiveError {
        let Some(ring) = self.ring.take() else {
            // A group of one, or an already aborted one: nothing to close or report.
            self.calls.abort(&why);
            return why;
        };
        let lost = match &why {
            CollectiveError::PeerLost {
                peer, peer_addr, ..
            } => Some((*peer, peer_addr.clone())),
            _ => None,
        };
        let report = Report {
            lost,
            message: why.to_string(),
        };
        let Membership { rank, world_size } = self.member;
        let window = (deadline, self.options.failure_detection);
        let verdict = post_mortem(&self.store, (rank, world_size), report, window, || {
            let _ = ring.next.stream.shutdown(Shutdown::Both);
            let _ = ring.prev.stream.shutdown(Shutdown::Both);
            drop(ring);
        });
        let why = match (verdict, why) {
            (
                Verdict::Gone(gone),
                CollectiveError::PeerLost {
                    rank,
                    peer,
                    peer_addr,
                    desc,
                    source,
                },
            ) => CollectiveError::PeerGone {
                rank,
                desc,
                gone,
                peer,
                peer_addr,
                source,
            },
            (
                Verdict::StoreFailed(store),
                CollectiveError::PeerLost {
                    rank,
                    peer,
                    peer_addr,
                    desc,
                    source,
                },
            ) => CollectiveError::PeerLostStoreGone {
                rank,
                peer,
                peer_addr,
                desc,
                source,
                store: Box::new(store),
            },
            (_, why) => why,
        };
        self.calls.abort(&why);
        why
    }

    /// Runs one collective: checks, then the event loop over the plan; aborts the group on error.
    fn run<T: Element>(
        &mut self,
        kind: CollectiveKind,
        len: usize,
        buffer: &mut [T],
        plan: impl FnOnce(usize) -> RingPlan,
        op: ReduceOp,
        precheck: Option<String>,
    ) -> Result<(), CollectiveError> {
        let piece_elems = self.piece_elems::<T>();
        let plan = (self.member.world_size > 1).then(|| plan(piece_elems));
        self.run_plan(kind, len, buffer, plan.as_ref(), op, precheck, None)
    }

    /// Runs a staged collective: the staging driven along `call.plan` inside the event loop
    /// when `call.interleave` holds and the plan cuts the buffer into pieces; otherwise the
    /// whole buffer filled, `plain` run, `call.result` drained.
    fn run_staged<T: Element>(
        &mut self,
        call: StagedCall<'_>,
        buffer: &mut [T],
        staging: &mut dyn PieceStaging<T>,
        plain: impl FnOnce(&mut Self, &mut [T]) -> Result<(), CollectiveError>,
    ) -> Result<(), CollectiveError> {
        let len = buffer.len();
        let schedule = call
            .interleave
            .then(|| PieceSchedule::new(call.plan, len))
            .flatten();
        let Some(schedule) = schedule else {
            return staging::staged_whole(buffer, staging, call.result, |b| plain(self, b));
        };
        let mut staged = StagedBuffer::new(schedule, staging).draining_only(call.result);
        let plan = Some(call.plan);
        self.run_plan(
            call.kind,
            len,
            buffer,
            plan,
            call.op,
            None,
            Some(&mut staged),
        )?;
        staged.finish(buffer);
        Ok(())
    }

    fn piece_elems<T>(&self) -> usize {
        (self.options.piece_bytes / std::mem::size_of::<T>()).max(1)
    }

    /// [`run`](Self::run) with the plan made (`None` for a group of one) and, for a staged
    /// all-reduce, the staging driven along it.
    #[allow(clippy::too_many_arguments)]
    fn run_plan<T: Element>(
        &mut self,
        kind: CollectiveKind,
        len: usize,
        buffer: &mut [T],
        plan: Option<&RingPlan>,
        op: ReduceOp,
        precheck: Option<String>,
        staged: Option<&mut StagedBuffer<'_, T>>,
    ) -> Result<(), CollectiveError> {
        let deadline = Instant::now() + self.options.timeout;
        let desc = match self.calls.begin(kind, T::DTYPE, len, precheck) {
            Ok(desc) => desc,
            Err(err) => return Err(self.fail(err, deadline)),
        };
        let Some(plan) = plan else {
            return Ok(());
        };
        self.exchange(&desc, buffer, plan, op, staged)
            .map_err(|e| self.fail(e, deadline))
    }

    fn exchange<T: Element>(
        &mut self,
        desc: &CollectiveDesc,
        buffer: &mut [T],
        plan: &RingPlan,
        op: ReduceOp,
        staged: Option<&mut StagedBuffer<'_, T>>,
    ) -> Result<(), CollectiveError> {
        let largest = plan
            .recvs
            .iter()
            .map(|r| r.range.len() * std::mem::size_of::<T>())
            .max()
            .unwrap_or(0);
        if self.scratch.len() * 8 < largest {
            self.scratch.resize(largest.div_ceil(8), 0);
        }
        let Some(ring) = self.ring.as_mut() else {
            return Err(CollectiveError::Aborted {
                rank: self.member.rank,
                first_error: "the ring is not connected".into(),
            });
        };
        let call = Call {
            desc,
            plan,
            op,
            rank: self.member.rank,
            timeout: self.options.timeout,
        };
        let stall = StallReporter::new(
            &self.store,
            self.member.rank,
            self.member.world_size,
            self.options.stall_warning,
            Instant::now(),
        );
        let liveness = self._heartbeat.is_some().then(|| {
            PeerLiveness::new(
                &self.store,
                (self.member.rank, self.member.world_size),
                self.options.failure_detection,
                Instant::now(),
            )
        });
        let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut self.scratch[..]);
        exchange::exchange(ring, &call, buffer, scratch, (stall, liveness), staged)
    }
}

/// A staged collective's plan and what it stages (see [`TcpProcessGroup::run_staged`]).
struct StagedCall<'p> {
    kind: CollectiveKind,
    plan: &'p RingPlan,
    op: ReduceOp,
    /// The part of the buffer that holds the result and is drained.
    result: std::ops::Range<usize>,
    /// Whether the staging may be interleaved with the plan (else: around the plain call).
    interleave: bool,
}

impl ProcessGroup for TcpProcessGroup {
    fn membership(&self) -> Membership {
        self.member
    }

    /// The ring all-reduce with the staging done inside its event loop ([`super::staging`]):
    /// each piece filled just before the ring first needs it, drained after its last receive,
    /// and the rest whenever the sockets leave the thread nothing to do. `Avg` (its division
    /// touches the buffer after the ring) and a group of one stage the whole buffer around the
    /// plain all-reduce.
    fn all_reduce_staged<T: Element>(
        &mut self,
        buffer: &mut [T],
        op: ReduceOp,
        staging: &mut dyn PieceStaging<T>,
    ) -> Result<(), CollectiveError> {
        let Membership { rank, world_size } = self.member;
        let len = buffer.len();
        let plan = ring::all_reduce_plan(world_size, rank, len, self.piece_elems::<T>());
        let call = StagedCall {
            kind: CollectiveKind::AllReduce(op),
            plan: &plan,
            op,
            result: 0..len,
            interleave: world_size > 1 && op != ReduceOp::Avg,
        };
        self.run_staged(call, buffer, staging, |g, b| g.all_reduce(b, op))
    }

    /// The ring reduce-scatter-v with the staging inside its event loop, as
    /// [`all_reduce_staged`](Self::all_reduce_staged); only the own block is drained. `Avg`,
    /// a group of one and arguments that fail the checks go the plain way (which reports them).
    fn reduce_scatter_v_staged<T: Element>(
        &mut self,
        buffer: &mut [T],
        counts: &[usize],
        op: ReduceOp,
        staging: &mut dyn PieceStaging<T>,
    ) -> Result<(), CollectiveError> {
        let Membership { rank, world_size } = self.member;
        let valid = super::check::blocks(world_size, counts, buffer.len()).is_none();
        let plan = ring::reduce_scatter_v_plan(rank, counts, self.piece_elems::<T>());
        let call = StagedCall {
            kind: CollectiveKind::ReduceScatterV {
                op,
                layout: super::collective::layout_fingerprint(counts),
            },
            plan: &plan,
            op,
            result: ring::block_range(counts, rank),
            interleave: valid && world_size > 1 && op != ReduceOp::Avg,
        };
        self.run_staged(call, buffer, staging, |g, b| {
            g.reduce_scatter_v(b, counts, op)
        })
    }

    /// One pass of the collective's ring plan over a host buffer (module docs).
    fn collective<T: Element>(&mut self, call: Checked<'_, T>) -> Result<(), CollectiveError> {
        let Checked { call, precheck } = call;
        let Membership {
            rank,
            world_size: world,
        } = self.member;
        let (kind, len) = (call.kind(), call.elements_per_rank());
        match call {
            Collective::AllReduce { buffer, op } => {
                let plan = |piece| ring::all_reduce_plan(world, rank, len, piece);
                self.run(kind, len, buffer, plan, op, precheck)?;
                divide_if_average(buffer, op, world);
            }
            Collective::Broadcast { buffer, root } => {
                // `root` may be out of range only when the precheck fails, before any plan.
                let root = root.min(world - 1);
                let plan = |piece| ring::broadcast_plan(world, rank, root, len, piece);
                self.run(kind, len, buffer, plan, ReduceOp::Sum, precheck)?;
            }
            Collective::AllGather { input, output } => {
                if precheck.is_none() {
                    output[rank * len..(rank + 1) * len].copy_from_slice(input);
                }
                let plan = |piece| ring::all_gather_plan(world, rank, len, piece);
                self.run(kind, len, output, plan, ReduceOp::Sum, precheck)?;
            }
            Collective::ReduceScatter { input, output, op } => {
                let mut work = input.to_vec();
                let plan = |piece| ring::reduce_scatter_plan(world, rank, len, piece);
                self.run(kind, len, &mut work, plan, op, precheck)?;
                output.copy_from_slice(&work[rank * len..(rank + 1) * len]);
                divide_if_average(output, op, world);
            }
            Collective::ReduceScatterV { buffer, counts, op } => {
                let plan = |piece| ring::reduce_scatter_v_plan(rank, counts, piece);
                self.run(kind, len, buffer, plan, op, precheck)?;
                let own = ring::block_ranges(counts)[rank].clone();
                divide_if_average(&mut buffer[own], op, world);
            }
            Collective::AllGatherV { buffer, counts } => {
                let plan = |piece| ring::all_gather_v_plan(rank, counts, piece);
                self.run(kind, len, buffer, plan, ReduceOp::Sum, precheck)?;
            }
            Collective::Barrier => {
                let mut token = [1i64];
                let plan = |piece| ring::all_reduce_plan(world, rank, 1, piece);
                self.run(kind, 1, &mut token, plan, ReduceOp::Sum, precheck)?;
                debug_assert_eq!(token[0], world as i64);
            }
        }
        Ok(())
    }
}

/// The ring sums for [`ReduceOp::Avg`]; the division by the world size happens once, at the end.
fn divide_if_average<T: Element>(buffer: &mut [T], op: ReduceOp, world: usize) {
    if op == ReduceOp::Avg {
        buffer.iter_mut().for_each(|x| *x = x.div_world(world));
    }
}

#[cfg(test)]
mod tests;
