//! One collective call with its buffers ([`Collective`]), checked ([`Checked`]), and a rank's
//! place in its group ([`Membership`]).

use super::check;
use crate::call::{CollectiveKind, ReduceOp};

/// Which rank a process is in its group, and how many ranks the group has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Membership {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the group.
    pub world_size: usize,
}

/// One call of a collective with its buffers: what the [`ProcessGroup`] methods hand to
/// [`ProcessGroup::collective`].
#[derive(Debug)]
pub enum Collective<'a, T> {
    /// See [`ProcessGroup::all_reduce`].
    AllReduce { buffer: &'a mut [T], op: ReduceOp },
    /// See [`ProcessGroup::broadcast`].
    Broadcast { buffer: &'a mut [T], root: usize },
    /// See [`ProcessGroup::all_gather`].
    AllGather { input: &'a [T], output: &'a mut [T] },
    /// See [`ProcessGroup::reduce_scatter`].
    ReduceScatter {
        input: &'a [T],
        output: &'a mut [T],
        op: ReduceOp,
    },
    /// See [`ProcessGroup::reduce_scatter_v`].
    ReduceScatterV {
        buffer: &'a mut [T],
        counts: &'a [usize],
        op: ReduceOp,
    },
    /// See [`ProcessGroup::all_gather_v`].
    AllGatherV {
        buffer: &'a mut [T],
        counts: &'a [usize],
    },
    /// See [`ProcessGroup::barrier`]. Carries no buffer: its `T` is unused.
    Barrier,
}

impl<'a, T> Collective<'a, T> {
    /// The collective and the arguments that must agree across ranks.
    pub fn kind(&self) -> CollectiveKind {
        match self {
            Self::AllReduce { op, .. } => CollectiveKind::AllReduce(*op),
            Self::Broadcast { root, .. } => CollectiveKind::Broadcast { root: *root },
            Self::AllGather { .. } => CollectiveKind::AllGather,
            Self::ReduceScatter { op, .. } => CollectiveKind::ReduceScatter(*op),
            Self::ReduceScatterV { op, counts, .. } => CollectiveKind::ReduceScatterV {
                op: *op,
                layout: layout_fingerprint(counts),
            },
            Self::AllGatherV { counts, .. } => CollectiveKind::AllGatherV {
                layout: layout_fingerprint(counts),
            },
            Self::Barrier => CollectiveKind::Barrier,
        }
    }

    /// Elements per rank, as carried in [`CollectiveDesc::len`]: the buffer's length, the
    /// input's for all-gather, the output's for reduce-scatter, the whole buffer's for the
    /// uneven ones, 1 for the barrier.
    pub fn elements_per_rank(&self) -> usize {
        match self {
            Self::AllReduce { buffer, .. }
            | Self::Broadcast { buffer, .. }
            | Self::ReduceScatterV { buffer, .. }
            | Self::AllGatherV { buffer, .. } => buffer.len(),
            Self::AllGather { input, .. } => input.len(),
            Self::ReduceScatter { output, .. } => output.len(),
            Self::Barrier => 1,
        }
    }

    /// Makes the argument checks of this call on a rank of a group of `world_size` ranks.
    pub fn check(self, world_size: usize) -> Checked<'a, T> {
        let precheck = match &self {
            Self::Broadcast { root, .. } => check::root(*root, world_size),
            Self::AllGather { input, output } => {
                check::all_gather(world_size, input.len(), output.len())
            }
            Self::ReduceScatter { input, output, .. } => {
                check::reduce_scatter(world_size, input.len(), output.len())
            }
            Self::ReduceScatterV { buffer, counts, .. } | Self::AllGatherV { buffer, counts } => {
                check::blocks(world_size, counts, buffer.len())
            }
            Self::AllReduce { .. } | Self::Barrier => None,
        };
        Checked {
            call: self,
            precheck,
        }
    }
}

/// A [`Collective`] with the result of its argument checks on this rank ([`Collective::check`]):
/// what [`ProcessGroup::collective`] runs.
#[derive(Debug)]
pub struct Checked<'a, T> {
    pub call: Collective<'a, T>,
    /// `Some(message)` when the call is wrong on this rank alone (a root that is not a rank,
    /// sizes that do not fit the world size); `None` when the buffers fit the call.
    pub precheck: Option<String>,
}

/// A 32-bit fingerprint of uneven block sizes (the low half of their FNV-1a 64), carried in
/// the call's header so that ranks with different layouts fail with a mismatch instead of
/// exchanging wrong ranges.
pub fn layout_fingerprint(counts: &[usize]) -> u32 {
    let mut hash = crate::hash::Fnv1a64::new();
    for &n in counts {
        hash.write(&(n as u64).to_le_bytes());
    }
    hash.finish() as u32
}
