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
//! - `rendezvous`: how the ranks of a new group find each other through the store (rank claims,
//!   world size, missing ranks, the first-cause abort), shared by the TCP and NCCL groups; each
//!   group's keys live in its own namespace of the store ([`crate::store::PrefixStore`]).
//! - `postmortem`: after a failed collective, which rank died without reporting (the root cause
//!   that every survivor names, instead of the neighbour whose closed link reached it).
//! - `stall`: the stall reporter (who has not arrived), shared by the TCP and NCCL groups.
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
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod netif;
pub(crate) mod postmortem;
pub(crate) mod rendezvous;
pub mod ring;
pub mod shm;
pub mod staging;
pub(crate) mod stall;
pub mod tcp;
pub mod wire;

use std::fmt;

pub use call::{CollectiveDesc, CollectiveKind, DataType, ReduceOp};
pub use staging::PieceStaging;
pub use tcp::{TcpGroupOptions, TcpProcessGroup};

use crate::error::CollectiveError;

/// A type that collectives can move and reduce: plain old data with a reduction.
pub trait Element: bytemuck::Pod + Send + Sync + PartialOrd + fmt::Debug {
    const DTYPE: DataType;
    /// `self op other` for Sum/Avg (the division happens once, at the end), Max and Min.
    fn combine(self, other: Self, op: ReduceOp) -> Self;
    /// Divides by the world size (for [`ReduceOp::Avg`]).
    fn div_world(self, world_size: usize) -> Self;

    /// `dst[i] = dst[i] op src[i]`. The operation is matched once, outside the loop, so each
    /// loop body is a constant operation the compiler vectorises. The 16-bit floats sum through
    /// [`host16::sum_into`](crate::kernels::host16::sum_into): the same bits as `a + b` element
    /// by element, vectorised.
    fn reduce_into(dst: &mut [Self], src: &[Self], op: ReduceOp) {
        reduce_each(dst, src, op);
    }
}

/// [`Element::reduce_into`] one element at a time through [`Element::combine`].
#[inline(always)]
fn reduce_each<T: Element>(dst: &mut [T], src: &[T], op: ReduceOp) {
    #[inline(always)]
    fn each<T: Element>(dst: &mut [T], src: &[T], op: ReduceOp) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = d.combine(s, op);
        }
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each(dst, src, ReduceOp::Sum),
        ReduceOp::Max => each(dst, src, ReduceOp::Max),
        ReduceOp::Min => each(dst, src, ReduceOp::Min),
    }
}

/// `Element` for `$t`: `$sum` combines two values for Sum/Avg, `$div` divides by the world size.
macro_rules! element {
    ($t:ty, $dtype:ident, sum: |$a:ident, $b:ident| $sum:expr, div: |$x:ident, $n:ident| $div:expr
     $(, sum_slices: $format:expr)?) => {
        impl Element for $t {
            const DTYPE: DataType = DataType::$dtype;
            #[inline(always)]
            fn combine(self, other: Self, op: ReduceOp) -> Self {
                let ($a, $b) = (self, other);
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => $sum,
                    ReduceOp::Max => $a.max($b),
                    ReduceOp::Min => $a.min($b),
                }
            }
            fn div_world(self, world_size: usize) -> Self {
                let ($x, $n) = (self, world_size);
                $div
            }
            $(
            fn reduce_into(dst: &mut [Self], src: &[Self], op: ReduceOp) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => crate::kernels::host16::sum_into(
                        $format,
                        bytemuck::cast_slice_mut(dst),
                        bytemuck::cast_slice(src),
                    ),
                    ReduceOp::Max | ReduceOp::Min => reduce_each(dst, src, op),
                }
            }
            )?
        }
    };
}
element!(f32, F32, sum: |a, b| a + b, div: |x, n| x / n as f32);
element!(f64, F64, sum: |a, b| a + b, div: |x, n| x / n as f64);
element!(i32, I32, sum: |a, b| a.wrapping_add(b), div: |x, n| x / n as i32);
element!(i64, I64, sum: |a, b| a.wrapping_add(b), div: |x, n| x / n as i64);
element!(u8, U8, sum: |a, b| a.wrapping_add(b), div: |x, n| u8::try_from(n).map_or(0, |n| x / n));
// 16-bit floats (compressed gradient buckets) add through `f32` and round back after each
// step, as NCCL does: a sum over N ranks is rounded N - 1 times, once per ring step.
element!(half::bf16, BF16, sum: |a, b| a + b, div: |x, n| half::bf16::from_f32(x.to_f32() / n as f32),
    sum_slices: crate::kernels::HalfFormat::Bf16);
element!(half::f16, F16, sum: |a, b| a + b, div: |x, n| half::f16::from_f32(x.to_f32() / n as f32),
    sum_slices: crate::kernels::HalfFormat::F16);

/// Argument checks every backend makes before a collective; `Some(message)` when the call is
/// wrong on this rank alone (pure).
pub(crate) mod check {
    pub fn root(root: usize, world: usize) -> Option<String> {
        (root >= world)
            .then(|| format!("root {root} is not a rank of this group (world size {world})"))
    }

    pub fn all_gather(world: usize, input: usize, output: usize) -> Option<String> {
        (output != world * input).then(|| {
            format!(
                "output has {output} elements, expected world size x input = {}",
                world * input
            )
        })
    }

    pub fn blocks(world: usize, counts: &[usize], len: usize) -> Option<String> {
        if counts.len() != world {
            return Some(format!(
                "{} block sizes given, expected one per rank (world size {world})",
                counts.len()
            ));
        }
        let total: usize = counts.iter().sum();
        (total != len)
            .then(|| format!("the buffer has {len} elements but the block sizes add up to {total}"))
    }

    pub fn reduce_scatter(world: usize, input: usize, output: usize) -> Option<String> {
        (input != world * output).then(|| {
            format!(
                "input has {input} elements, expected world size x output = {}",
                world * output
            )
        })
    }
}

/// The bookkeeping every backend shares: the sequence number of the next call and whether an
/// earlier error aborted the group.
#[derive(Debug)]
pub(crate) struct CallLog {
    rank: usize,
    seq: u64,
    aborted: Option<String>,
}

impl CallLog {
    pub fn new(rank: usize) -> Self {
        Self {
            rank,
            seq: 0,
            aborted: None,
        }
    }

    /// Numbers the next call. Fails with [`CollectiveError::Aborted`] after an abort, and with
    /// [`CollectiveError::InvalidArgument`] when `precheck` found a problem (the caller must
    /// then abort: the other ranks are entering the collective and would wait for this one).
    pub fn begin(
        &mut self,
        kind: CollectiveKind,
        dtype: DataType,
        len: usize,
        precheck: Option<String>,
    ) -> Result<CollectiveDesc, CollectiveError> {
        let desc = CollectiveDesc {
            seq: self.seq,
            kind,
            dtype,
            len: len as u64,
        };
        self.seq += 1;
        if let Some(first_error) = &self.aborted {
            let err = CollectiveError::Aborted {
                rank: self.rank,
                first_error: first_error.clone(),
            };
            return Err(err);
        }
        match precheck {
            Some(message) => Err(CollectiveError::InvalidArgument {
                rank: self.rank,
                desc,
                message,
            }),
            None => Ok(desc),
        }
    }

    /// Records the error that aborts the group (the first one is kept).
    pub fn abort(&mut self, why: &CollectiveError) {
        if self.aborted.is_none() {
            self.aborted = Some(why.to_string());
        }
    }
}

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

/// Runs `call` on `group` with its argument checks.
fn checked<G: ProcessGroup + ?Sized, T: Element>(
    group: &mut G,
    call: Collective<'_, T>,
) -> Result<(), CollectiveError> {
    let world_size = group.world_size();
    group.collective(call.check(world_size))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 16-bit sums of the ring (vectorised) give the bits of `a + b` element by element.
    #[test]
    fn half_reductions_equal_the_element_by_element_ones() {
        fn check<T: Element>(from_bits: impl Fn(u16) -> T) {
            let mut state = 0x5eed_0019u32;
            let mut next = move || {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                // Finite values of both formats, of similar magnitudes.
                from_bits((state >> 16) as u16 & 0x3fff | 0x2000 | (state as u16 & 0x8000))
            };
            let a: Vec<T> = (0..5000).map(|_| next()).collect();
            let b: Vec<T> = (0..5000).map(|_| next()).collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let (mut fast, mut each) = (a.clone(), a.clone());
                T::reduce_into(&mut fast, &b, op);
                reduce_each(&mut each, &b, op);
                assert_eq!(
                    bytemuck::cast_slice::<T, u16>(&fast),
                    bytemuck::cast_slice::<T, u16>(&each),
                    "{:?} {op:?}",
                    T::DTYPE
                );
            }
        }
        check(half::bf16::from_bits);
        check(half::f16::from_bits);
    }

    #[test]
    fn data_type_sizes_are_the_element_sizes() {
        fn of<T: Element>() -> (DataType, usize) {
            (T::DTYPE, std::mem::size_of::<T>())
        }
        let all = [
            of::<f32>(),
            of::<f64>(),
            of::<i32>(),
            of::<i64>(),
            of::<u8>(),
            of::<half::bf16>(),
            of::<half::f16>(),
        ];
        assert_eq!(all.len(), DataType::ALL.len());
        for (dtype, bytes) in all {
            assert_eq!(dtype.size(), bytes, "{dtype:?}");
        }
    }
}
