//! The contract of every group: the [`ProcessGroup`] trait.

use super::collective::{Checked, Collective, Membership};
use super::element::Element;
use super::ring;
use super::staging::{self, PieceStaging};
use crate::call::ReduceOp;
use crate::error::CollectiveError;

/// A group of processes that run collectives together (PyTorch's `ProcessGroup`).
///
/// Implementations provide [`membership`](Self::membership) and one method that runs any
/// collective, [`collective`](Self::collective); the named collectives are provided on top of it
/// and make the argument checks every implementation shares.
///
/// # Contract shared by every collective
/// - **Collective**: every rank of the group must call the same collectives in the same order,
///   with the same element type, length (per rank for all-gather/reduce-scatter), reduce op and
///   root. Each call carries a sequence number and these fields; a rank that sees another rank
///   disagree fails with [`CollectiveError::Mismatch`] naming both calls, instead of hanging or
///   reducing garbage.
/// - **Arguments wrong on one rank** (a root that is not a rank, buffer sizes that do not fit
///   the world size) fail on that rank with [`CollectiveError::InvalidArgument`]; the group is
///   aborted, so the other ranks, already inside the collective, fail too instead of waiting.
/// - **Deadline**: a call that does not finish within the group's timeout fails with
///   [`CollectiveError::Timeout`]; a peer that dies makes its neighbours fail with
///   [`CollectiveError::PeerLost`], which propagates to the other ranks. A backend that can
///   tell (TCP, through the store) names the dead rank on every survivor instead:
///   [`CollectiveError::PeerGone`], or [`CollectiveError::PeerLostStoreGone`] when the store
///   went with it.
/// - **After an error** the group is aborted: its connections are closed and every later call
///   fails at once. Create a new group to go on.
/// - **Results are identical on every rank**, bit for bit (each chunk is reduced on one rank, in
///   one order, then copied to the others), so replicas that apply the same update stay equal.
pub trait ProcessGroup {
    /// This process's rank and the group's size.
    fn membership(&self) -> Membership;

    /// Runs one collective (the contract above); callers use the named methods below. When
    /// [`Checked::precheck`] is `Some`, the implementation must not touch the buffers, must fail
    /// with [`CollectiveError::InvalidArgument`] carrying the message (or
    /// [`CollectiveError::Aborted`] if the group already was) and must abort the group so that
    /// the other ranks learn of it.
    fn collective<T: Element>(&mut self, call: Checked<'_, T>) -> Result<(), CollectiveError>;

    /// This process's rank, `0..world_size()`.
    fn rank(&self) -> usize {
        self.membership().rank
    }

    /// Number of processes in the group.
    fn world_size(&self) -> usize {
        self.membership().world_size
    }

    /// Combines `buffer` across ranks with `op`, in place: afterwards every rank holds the result.
    /// `buffer.len()` must be equal on every rank.
    fn all_reduce<T: Element>(
        &mut self,
        buffer: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        checked(self, Collective::AllReduce { buffer, op })
    }

    /// [`all_reduce`](Self::all_reduce) with the work around it cut into pieces: `staging`
    /// [fills](PieceStaging::fill) each piece of `buffer` with this rank's input before the
    /// collective uses it, and [drains](PieceStaging::drain) it once it holds the result. The
    /// contract and the results are those of `all_reduce` over the filled buffer. A group may
    /// do the fills and drains while its pieces are on the wire (the TCP ring does, see
    /// [`staging`]); the default fills all, reduces, drains all. On error, pieces may be left
    /// undrained.
    fn all_reduce_staged<T: Element>(
        &mut self,
        buffer: &mut [T],
        op: ReduceOp,
        staging: &mut dyn PieceStaging<T>,
    ) -> Result<(), CollectiveError> {
        let all = 0..buffer.len();
        staging::staged_whole(buffer, staging, all, |b| self.all_reduce(b, op))
    }

    /// Copies `root`'s `buffer` into every other rank's `buffer`. Lengths must be equal.
    fn broadcast<T: Element>(
        &mut self,
        buffer: &mut [T],
        root: usize,
    ) -> Result<(), CollectiveError> {
        checked(self, Collective::Broadcast { buffer, root })
    }

    /// Concatenates every rank's `input` in rank order into `output`
    /// (`output.len() == world_size * input.len()`).
    fn all_gather<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CollectiveError> {
        checked(self, Collective::AllGather { input, output })
    }

    /// Reduces `input` (`world_size` blocks of `output.len()` elements) across ranks and leaves
    /// block `rank` of the result in `output`.
    fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        checked(self, Collective::ReduceScatter { input, output, op })
    }

    /// Reduce-scatter over blocks of different sizes, in place (MPI's `Reduce_scatter` with
    /// counts): `buffer` is `world_size` consecutive blocks, `counts[r]` elements for rank `r`;
    /// afterwards block `rank` holds the reduced values and the other blocks hold partial
    /// results, which callers must not use. `counts` must be equal on every rank. Each rank
    /// sends the buffer less its own block: with an all-gather-v after it, the bytes of an
    /// all-reduce (ZeRO's reduce-to-owner, then parameters back from their owners).
    fn reduce_scatter_v<T: Element>(
        &mut self,
        buffer: &mut [T],
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        checked(self, Collective::ReduceScatterV { buffer, counts, op })
    }

    /// [`reduce_scatter_v`](Self::reduce_scatter_v) with the work around it cut into pieces,
    /// as [`all_reduce_staged`](Self::all_reduce_staged): `staging` fills every piece of
    /// `buffer` before the collective uses it, and drains the pieces of block `rank` (only
    /// those: the others end with partial sums) once they hold the result. The default fills
    /// all, reduce-scatters, drains the own block; the TCP ring interleaves them.
    fn reduce_scatter_v_staged<T: Element>(
        &mut self,
        buffer: &mut [T],
        counts: &[usize],
        op: ReduceOp,
        staging: &mut dyn PieceStaging<T>,
    ) -> Result<(), CollectiveError> {
        let own = ring::block_range(counts, self.rank());
        staging::staged_whole(buffer, staging, own, |b| {
            self.reduce_scatter_v(b, counts, op)
        })
    }

    /// All-gather over blocks of different sizes, in place (MPI's `Allgatherv`): block `rank`
    /// of `buffer` (laid out as in [`reduce_scatter_v`](Self::reduce_scatter_v)) holds this
    /// rank's input; afterwards every block holds its owner's on every rank.
    fn all_gather_v<T: Element>(
        &mut self,
        buffer: &mut [T],
        counts: &[usize],
    ) -> Result<(), CollectiveError> {
        checked(self, Collective::AllGatherV { buffer, counts })
    }

    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        checked(self, Collective::<u8>::Barrier)
    }
}

/// Runs `call` on `group` with its argument checks.
fn checked<G: ProcessGroup + ?Sized, T: Element>(
    group: &mut G,
    call: Collective<'_, T>,
) -> Result<(), CollectiveError> {
    let world_size = group.world_size();
    group.collective(call.check(world_size))
}
