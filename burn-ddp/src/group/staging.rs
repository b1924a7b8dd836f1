//! Staged all-reduce and reduce-scatter: the work before and after a collective, done piece
//! by piece while the collective's own pieces are on the wire.
//!
//! A data-parallel step does more than the ring: it packs gradients into the buffer (and rounds
//! them to 16 bits), checks them for NaN, and afterwards scales, widens and unpacks the sums.
//! Done whole before and after the collective, that work adds to the step; on a slow link the
//! wire sits idle meanwhile. [`PieceStaging`] hands it to the collective instead, one piece of
//! the ring plan at a time: a piece is **filled** just before the ring first sends it or
//! receives into it, and **drained** as soon as no later receive writes it. The TCP ring does
//! the fills and drains that nothing waits for while it would otherwise sleep in `poll(2)`, so
//! on a slow link they cost nothing; on a fast one they cost what they cost before.
//!
//! [`PieceSchedule`] is the pure part: which pieces a plan has, in which order it first needs
//! them, and how many receives still write each. [`StagedBuffer`] drives a [`PieceStaging`]
//! with it; it does no I/O.

use std::collections::VecDeque;
use std::ops::Range;

use super::ring::RingPlan;

/// The work around an all-reduce or a reduce-scatter, done one piece of the buffer at a time
/// ([`ProcessGroup::all_reduce_staged`](super::ProcessGroup::all_reduce_staged),
/// [`ProcessGroup::reduce_scatter_v_staged`](super::ProcessGroup::reduce_scatter_v_staged)).
///
/// Every element of the buffer is filled exactly once, and every element of the result (the
/// whole buffer, or a reduce-scatter's own block) drained exactly once, after its fill; ranges
/// never overlap and come in no set order.
pub trait PieceStaging<T> {
    /// Writes this rank's input for `range` of the buffer into `piece` (`buffer[range]`).
    fn fill(&mut self, range: Range<usize>, piece: &mut [T]);
    /// Takes the result for `range` of the buffer from `piece`, which no longer changes.
    fn drain(&mut self, range: Range<usize>, piece: &[T]);
}

/// The pieces of a ring plan and their order of use. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PieceSchedule {
    /// Disjoint ranges, sorted, covering the buffer.
    pieces: Vec<Range<usize>>,
    /// The piece of each send / receive of the plan (`None`: an empty range).
    send_piece: Vec<Option<usize>>,
    recv_piece: Vec<Option<usize>>,
    /// Piece indices in the order the plan first touches them.
    fill_order: Vec<usize>,
    /// Receives that write each piece.
    writes: Vec<usize>,
}

impl PieceSchedule {
    /// The schedule of `plan` over a buffer of `len` elements, or `None` when the plan's ranges
    /// do not cut the buffer into whole pieces (each range either equal to another or disjoint
    /// from it, together covering `0..len`): then the caller fills before and drains after.
    pub fn new(plan: &RingPlan, len: usize) -> Option<Self> {
        let mut pieces: Vec<Range<usize>> = plan
            .sends
            .iter()
            .map(|s| s.range.clone())
            .chain(plan.recvs.iter().map(|r| r.range.clone()))
            .filter(|r| !r.is_empty())
            .collect();
        pieces.sort_by_key(|r| (r.start, r.end));
        pieces.dedup();
        let mut end = 0;
        for piece in &pieces {
            if piece.start != end {
                return None;
            }
            end = piece.end;
        }
        if end != len || pieces.is_empty() {
            return None;
        }
        let find = |range: &Range<usize>| {
            if range.is_empty() {
                return None;
            }
            pieces.binary_search_by_key(&range.start, |p| p.start).ok()
        };
        let send_piece: Vec<_> = plan.sends.iter().map(|s| find(&s.range)).collect();
        let recv_piece: Vec<_> = plan.recvs.iter().map(|r| find(&r.range)).collect();
        let mut writes = vec![0; pieces.len()];
        for p in recv_piece.iter().flatten() {
            writes[*p] += 1;
        }
        // Sends and receives advance together (a ring step sends and receives as many pieces),
        // so the i-th of each are needed at about the same time.
        let mut fill_order = Vec::with_capacity(pieces.len());
        let mut seen = vec![false; pieces.len()];
        for i in 0..send_piece.len().max(recv_piece.len()) {
            let at = [send_piece.get(i), recv_piece.get(i)];
            for p in at.into_iter().flatten().flatten() {
                if !std::mem::replace(&mut seen[*p], true) {
                    fill_order.push(*p);
                }
            }
        }
        Some(Self {
            pieces,
            send_piece,
            recv_piece,
            fill_order,
            writes,
        })
    }

    /// The pieces, in buffer order.
    pub fn pieces(&self) -> &[Range<usize>] {
        &self.pieces
    }
}

/// A [`PieceStaging`] driven along a [`PieceSchedule`] while a collective runs: the ring calls
/// [`before_send`](Self::before_send) / [`before_recv`](Self::before_recv) /
/// [`after_recv`](Self::after_recv) as it moves the plan's pieces, [`idle`](Self::idle) when
/// its sockets have nothing for it, and [`finish`](Self::finish) when the plan is done.
pub struct StagedBuffer<'s, T> {
    schedule: PieceSchedule,
    staging: &'s mut dyn PieceStaging<T>,
    filled: Vec<bool>,
    /// Position in `schedule.fill_order` of the next piece to fill ahead.
    next_fill: usize,
    writes_left: Vec<usize>,
    /// Pieces whose last write is done, not yet drained.
    ready: VecDeque<usize>,
    drained: Vec<bool>,
}

impl<'s, T> StagedBuffer<'s, T> {
    pub fn new(schedule: PieceSchedule, staging: &'s mut dyn PieceStaging<T>) -> Self {
        let n = schedule.pieces.len();
        let writes_left = schedule.writes.clone();
        Self {
            schedule,
            staging,
            filled: vec![false; n],
            next_fill: 0,
            writes_left,
            ready: VecDeque::new(),
            drained: vec![false; n],
        }
    }

    /// Drains only the pieces inside `range` (a reduce-scatter's own block: the others end
    /// with partial sums).
    pub fn draining_only(mut self, range: Range<usize>) -> Self {
        for (p, piece) in self.schedule.pieces.iter().enumerate() {
            if piece.start < range.start || piece.end > range.end {
                self.drained[p] = true;
            }
        }
        self
    }

    /// Before the plan's send `index` reads the buffer.
    pub fn before_send(&mut self, index: usize, buffer: &mut [T]) {
        if let Some(Some(p)) = self.schedule.send_piece.get(index) {
            self.fill(*p, buffer);
        }
    }

    /// Before the plan's receive `index` writes (or reduces into) the buffer.
    pub fn before_recv(&mut self, index: usize, buffer: &mut [T]) {
        if let Some(Some(p)) = self.schedule.recv_piece.get(index) {
            self.fill(*p, buffer);
        }
    }

    /// After the plan's receive `index` has written the buffer.
    pub fn after_recv(&mut self, index: usize) {
        if let Some(Some(p)) = self.schedule.recv_piece.get(index) {
            self.writes_left[*p] -= 1;
            if self.writes_left[*p] == 0 {
                self.ready.push_back(*p);
            }
        }
    }

    /// Does one piece of work nothing waits for yet — the next fill in the plan's order, else
    /// a ready drain. Returns whether there was any.
    pub fn idle(&mut self, buffer: &mut [T]) -> bool {
        while let Some(&p) = self.schedule.fill_order.get(self.next_fill) {
            self.next_fill += 1;
            if !self.filled[p] {
                self.fill(p, buffer);
                return true;
            }
        }
        while let Some(p) = self.ready.pop_front() {
            if !self.drained[p] {
                self.drain(p, buffer);
                return true;
            }
        }
        false
    }

    /// Once the plan is done: every piece not yet filled or drained (a piece the plan never
    /// wrote is filled and drained as it is).
    pub fn finish(&mut self, buffer: &mut [T]) {
        for p in 0..self.schedule.pieces.len() {
            self.fill(p, buffer);
            self.drain(p, buffer);
        }
    }

    fn fill(&mut self, p: usize, buffer: &mut [T]) {
        if !std::mem::replace(&mut self.filled[p], true) {
            let range = self.schedule.pieces[p].clone();
            self.staging.fill(range.clone(), &mut buffer[range]);
        }
    }

    fn drain(&mut self, p: usize, buffer: &[T]) {
        if !std::mem::replace(&mut self.drained[p], true) {
            let range = self.schedule.pieces[p].clone();
            self.staging.drain(range.clone(), &buffer[range]);
        }
    }
}

/// Fills all of `buffer`, runs `collective` on it, drains `result` of it (all of it for an
/// all-reduce, the own block for a reduce-scatter): staging without overlap, for groups (and
/// calls) that do not interleave it.
pub fn staged_whole<T, E>(
    buffer: &mut [T],
    staging: &mut dyn PieceStaging<T>,
    result: Range<usize>,
    collective: impl FnOnce(&mut [T]) -> Result<(), E>,
) -> Result<(), E> {
    staging.fill(0..buffer.len(), buffer);
    collective(buffer)?;
    if let Some(piece) = buffer.get(result.clone()) {
        staging.drain(result, piece);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::ring::{all_reduce_plan, block_ranges, reduce_scatter_v_plan};

    /// Records the calls, and checks each one against what the ring has done so far.
    #[derive(Default)]
    struct Log {
        fills: Vec<Range<usize>>,
        drains: Vec<Range<usize>>,
    }

    impl PieceStaging<u32> for Log {
        fn fill(&mut self, range: Range<usize>, piece: &mut [u32]) {
            for (x, i) in piece.iter_mut().zip(range.clone()) {
                *x = i as u32;
            }
            self.fills.push(range);
        }
        fn drain(&mut self, range: Range<usize>, _piece: &[u32]) {
            self.drains.push(range);
        }
    }

    fn covered_once(ranges: &[Range<usize>], len: usize) -> bool {
        let mut count = vec![0; len];
        for r in ranges {
            r.clone().for_each(|i| count[i] += 1);
        }
        count.iter().all(|&c| c == 1)
    }

    #[test]
    fn all_reduce_plans_cut_the_buffer_into_pieces() {
        for world in 2..6 {
            for rank in 0..world {
                for (len, piece) in [(1000, 64), (7, 2), (3, 1), (5, 100), (1, 1)] {
                    let plan = all_reduce_plan(world, rank, len, piece);
                    let schedule = PieceSchedule::new(&plan, len).expect("a partition");
                    assert!(covered_once(schedule.pieces(), len));
                    let mut order = schedule.fill_order.clone();
                    order.sort_unstable();
                    assert_eq!(order, (0..schedule.pieces.len()).collect::<Vec<_>>());
                    // Every piece is written at least once by an all-reduce.
                    assert!(
                        schedule.writes.iter().all(|&w| w >= 1),
                        "{world} {rank} {len}"
                    );
                }
            }
        }
    }

    #[test]
    fn ranges_that_overlap_partly_or_leave_gaps_are_not_a_schedule() {
        let mut plan = all_reduce_plan(2, 0, 10, 5);
        plan.sends[0].range = 0..3;
        assert_eq!(PieceSchedule::new(&plan, 10), None);
        let plan = all_reduce_plan(2, 0, 10, 5);
        assert_eq!(PieceSchedule::new(&plan, 11), None);
        assert_eq!(PieceSchedule::new(&RingPlan::default(), 0), None);
    }

    /// Walks a plan as the ring would (sends and receives interleaved, sends only once their
    /// receives are done), with idle work in between: fills come before the first use, drains
    /// after the last write, each piece once.
    #[test]
    fn fills_precede_use_and_drains_follow_the_last_write() {
        for world in 2..5 {
            for rank in 0..world {
                let len = 103;
                let plan = all_reduce_plan(world, rank, len, 8);
                let schedule = PieceSchedule::new(&plan, len).unwrap();
                let pieces = schedule.pieces().to_vec();
                let mut log = Log::default();
                let mut buffer = vec![u32::MAX; len];
                let mut staged = StagedBuffer::new(schedule, &mut log);
                let (mut s, mut r, mut turn) = (0, 0, 0usize);
                let mut written_after_drain = false;
                while s < plan.sends.len() || r < plan.recvs.len() {
                    turn += 1;
                    if s < plan.sends.len() && r >= plan.sends[s].after_recvs {
                        staged.before_send(s, &mut buffer);
                        let range = plan.sends[s].range.clone();
                        assert!(buffer[range].iter().all(|&x| x != u32::MAX), "filled");
                        s += 1;
                    } else if r < plan.recvs.len() {
                        staged.before_recv(r, &mut buffer);
                        let range = plan.recvs[r].range.clone();
                        assert!(buffer[range.clone()].iter().all(|&x| x != u32::MAX));
                        written_after_drain |= staged.drained.iter().enumerate().any(|(p, &d)| {
                            d && pieces[p].start < range.end && range.start < pieces[p].end
                        });
                        staged.after_recv(r);
                        r += 1;
                    }
                    if turn % 3 == 0 {
                        staged.idle(&mut buffer);
                    }
                }
                staged.finish(&mut buffer);
                assert!(
                    !written_after_drain,
                    "a piece was drained before its last write"
                );
                assert!(covered_once(&log.fills, len));
                assert!(covered_once(&log.drains, len));
            }
        }
    }

    /// A reduce-scatter drains its own block only, each piece once, after its last write.
    #[test]
    fn a_reduce_scatter_drains_only_the_own_block() {
        let counts = [30, 0, 50];
        for rank in 0..3 {
            let plan = reduce_scatter_v_plan(rank, &counts, 8);
            let schedule = PieceSchedule::new(&plan, 80).expect("a partition");
            let own = block_ranges(&counts)[rank].clone();
            let mut log = Log::default();
            let mut buffer = vec![0u32; 80];
            let mut staged = StagedBuffer::new(schedule, &mut log).draining_only(own.clone());
            for r in 0..plan.recvs.len() {
                staged.before_recv(r, &mut buffer);
                staged.after_recv(r);
                staged.idle(&mut buffer);
            }
            staged.finish(&mut buffer);
            assert!(covered_once(&log.fills, 80));
            let mut drained: Vec<usize> = log.drains.iter().flat_map(|r| r.clone()).collect();
            drained.sort_unstable();
            assert_eq!(drained, own.collect::<Vec<_>>(), "rank {rank}");
        }
    }

    #[test]
    fn idle_work_fills_ahead_then_drains_what_is_ready() {
        let plan = all_reduce_plan(2, 0, 40, 10);
        let schedule = PieceSchedule::new(&plan, 40).unwrap();
        let n = schedule.pieces().len();
        let mut log = Log::default();
        let mut buffer = vec![0u32; 40];
        let mut staged = StagedBuffer::new(schedule, &mut log);
        let mut idle_units = 0;
        while staged.idle(&mut buffer) {
            idle_units += 1;
        }
        assert_eq!(
            idle_units, n,
            "every piece filled ahead, nothing ready to drain"
        );
        for r in 0..plan.recvs.len() {
            staged.after_recv(r);
        }
        let mut drained = 0;
        while staged.idle(&mut buffer) {
            drained += 1;
        }
        assert_eq!(drained, n, "every piece drained once written");
        staged.finish(&mut buffer);
        assert!(covered_once(&log.fills, 40));
        assert!(covered_once(&log.drains, 40), "finish drains nothing twice");
    }
}
