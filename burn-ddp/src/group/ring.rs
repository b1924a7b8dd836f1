//! The ring algorithms as pure plans: which element ranges a rank sends to its successor and
//! receives from its predecessor, in which order, and what each send must wait for.
//!
//! ```text
//!  ranks in a ring (N = 4):   0 ──▶ 1 ──▶ 2 ──▶ 3 ──▶ 0
//!  buffer in N chunks:        [ c0 | c1 | c2 | c3 ]
//!
//!  reduce-scatter, N-1 steps:  at step s, rank r sends chunk (r - s) and receives chunk
//!                              (r - s - 1), which it adds to its own copy. After N-1 steps
//!                              rank r holds the full sum of chunk (r + 1).
//!  all-gather, N-1 steps:      at step t, rank r sends the finished chunk (r + 1 - t) and
//!                              receives the finished chunk (r - t), which it copies.
//! ```
//! Each rank sends `2 (N-1)/N` of the buffer, the lower bound for all-reduce; that is what makes
//! the ring bandwidth-optimal.
//!
//! **Pipelining.** Every chunk is cut into the same number of pieces `P` (at most `piece_elems`
//! elements each). The piece sent at step `s` is the piece received at step `s - 1`, so a send
//! only waits for *that piece*, not the whole step: while piece `k` of step `s` travels, piece
//! `k + 1` of step `s - 1` is still being received and reduced. The plan records this as
//! `after_recvs`: the number of receives that must be complete before a send may start.
//!
//! Broadcast is a pipelined chain from the root around the ring: each rank forwards piece `k` as
//! soon as it has received it.

use std::ops::Range;

/// What to do with a received piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvAction {
    /// Combine with the local values (reduce-scatter phase).
    Reduce,
    /// Overwrite the local values (all-gather phase, broadcast).
    Copy,
}

/// One piece to send to the successor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendItem {
    /// Element range of the buffer.
    pub range: Range<usize>,
    /// Number of receives (from the start of the collective) that must be complete first.
    pub after_recvs: usize,
}

/// One piece to receive from the predecessor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvItem {
    pub range: Range<usize>,
    pub action: RecvAction,
}

/// A rank's whole part in one collective: its sends and receives, each list in wire order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RingPlan {
    pub sends: Vec<SendItem>,
    pub recvs: Vec<RecvItem>,
}

/// Element range of chunk `c` when `len` elements are split into `n` chunks as evenly as
/// possible (the first `len % n` chunks get one element more).
pub fn chunk_range(len: usize, n: usize, c: usize) -> Range<usize> {
    let base = len / n;
    let extra = len % n;
    let start = c * base + c.min(extra);
    start..start + base + usize::from(c < extra)
}

/// Cuts `range` into `pieces` near-equal consecutive parts (some may be empty).
fn piece_ranges(range: &Range<usize>, pieces: usize) -> impl Iterator<Item = Range<usize>> + '_ {
    (0..pieces).map(move |k| {
        let r = chunk_range(range.len(), pieces, k);
        range.start + r.start..range.start + r.end
    })
}

/// Number of pieces per chunk: enough that no piece exceeds `piece_elems`, at least 1.
fn pieces_per_chunk(largest_chunk: usize, piece_elems: usize) -> usize {
    largest_chunk.div_ceil(piece_elems.max(1)).max(1)
}

/// Whether a ring step sends/receives into chunks, and which ones.
struct Step {
    send_chunk: usize,
    recv_chunk: usize,
    action: RecvAction,
}

/// Turns a list of steps into a plan in which step `s`'s piece `k` waits for step `s-1`'s.
fn plan_steps(
    steps: &[Step],
    chunk: impl Fn(usize) -> Range<usize>,
    largest: usize,
    piece_elems: usize,
) -> RingPlan {
    let p = pieces_per_chunk(largest, piece_elems);
    let mut plan = RingPlan::default();
    for (s, step) in steps.iter().enumerate() {
        let send_chunk = chunk(step.send_chunk);
        let recv_chunk = chunk(step.recv_chunk);
        for (k, range) in piece_ranges(&send_chunk, p).enumerate() {
            let after_recvs = if s == 0 { 0 } else { (s - 1) * p + k + 1 };
            plan.sends.push(SendItem { range, after_recvs });
        }
        for range in piece_ranges(&recv_chunk, p) {
            plan.recvs.push(RecvItem {
                range,
                action: step.action,
            });
        }
    }
    plan
}

fn modn(x: isize, n: usize) -> usize {
    x.rem_euclid(n as isize) as usize
}

fn reduce_scatter_steps(world: usize, rank: usize, offset: isize) -> Vec<Step> {
    let r = rank as isize;
    (0..world.saturating_sub(1) as isize)
        .map(|s| Step {
            send_chunk: modn(r - s + offset, world),
            recv_chunk: modn(r - s - 1 + offset, world),
            action: RecvAction::Reduce,
        })
        .collect()
}

fn all_gather_steps(world: usize, owned: usize) -> Vec<Step> {
    let o = owned as isize;
    (0..world.saturating_sub(1) as isize)
        .map(|t| Step {
            send_chunk: modn(o - t, world),
            recv_chunk: modn(o - t - 1, world),
            action: RecvAction::Copy,
        })
        .collect()
}

/// All-reduce of `len` elements: reduce-scatter then all-gather (the result of chunk `c` is
/// reduced on rank `c - 1` and copied from there).
pub fn all_reduce_plan(world: usize, rank: usize, len: usize, piece_elems: usize) -> RingPlan {
    if world <= 1 || len == 0 {
        return RingPlan::default();
    }
    let mut steps = reduce_scatter_steps(world, rank, 0);
    steps.extend(all_gather_steps(world, (rank + 1) % world));
    let largest = chunk_range(len, world, 0).len();
    plan_steps(&steps, |c| chunk_range(len, world, c), largest, piece_elems)
}

/// Reduce-scatter over a buffer of `world` blocks of `block` elements; afterwards rank `r`'s
/// block `r` holds the reduced values (the other blocks hold partial sums).
pub fn reduce_scatter_plan(
    world: usize,
    rank: usize,
    block: usize,
    piece_elems: usize,
) -> RingPlan {
    reduce_scatter_v_plan(rank, &vec![block; world], piece_elems)
}

/// All-gather into a buffer of `world` blocks of `block` elements, where block `rank` already
/// holds this rank's input.
pub fn all_gather_plan(world: usize, rank: usize, block: usize, piece_elems: usize) -> RingPlan {
    all_gather_v_plan(rank, &vec![block; world], piece_elems)
}

/// The element ranges of consecutive blocks of `counts[i]` elements.
pub fn block_ranges(counts: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    counts
        .iter()
        .map(|&n| {
            let range = start..start + n;
            start += n;
            range
        })
        .collect()
}

/// Block `rank`'s element range among consecutive blocks of `counts[i]` elements (empty when
/// there is no such block).
pub fn block_range(counts: &[usize], rank: usize) -> Range<usize> {
    let start: usize = counts.iter().take(rank).sum();
    counts.get(rank).map_or(start..start, |&n| start..start + n)
}

/// Reduce-scatter over consecutive blocks of different sizes (`counts[r]` elements for rank
/// `r`, MPI's `Reduce_scatter` with counts); afterwards block `rank` holds the reduced values.
/// Every piece of a block is cut the same way on every rank, so uneven blocks only change how
/// long each ring step takes: each rank still sends every block but one exactly once.
pub fn reduce_scatter_v_plan(rank: usize, counts: &[usize], piece_elems: usize) -> RingPlan {
    let world = counts.len();
    let largest = counts.iter().copied().max().unwrap_or(0);
    if world <= 1 || largest == 0 {
        return RingPlan::default();
    }
    // Offset -1 makes the chunk a rank finishes its own block (see the module diagram).
    let steps = reduce_scatter_steps(world, rank, -1);
    let blocks = block_ranges(counts);
    plan_steps(&steps, |c| blocks[c].clone(), largest, piece_elems)
}

/// All-gather over consecutive blocks of different sizes (MPI's `Allgatherv`, in place): block
/// `rank` already holds this rank's input; afterwards every block holds its owner's.
pub fn all_gather_v_plan(rank: usize, counts: &[usize], piece_elems: usize) -> RingPlan {
    let world = counts.len();
    let largest = counts.iter().copied().max().unwrap_or(0);
    if world <= 1 || largest == 0 {
        return RingPlan::default();
    }
    let steps = all_gather_steps(world, rank);
    let blocks = block_ranges(counts);
    plan_steps(&steps, |c| blocks[c].clone(), largest, piece_elems)
}

/// Broadcast of `len` elements from `root` along the chain root → root+1 → … → root-1.
pub fn broadcast_plan(
    world: usize,
    rank: usize,
    root: usize,
    len: usize,
    piece_elems: usize,
) -> RingPlan {
    if world <= 1 || len == 0 {
        return RingPlan::default();
    }
    let p = pieces_per_chunk(len, piece_elems);
    let whole = 0..len;
    let is_root = rank == root;
    let is_last = (rank + 1) % world == root;
    let mut plan = RingPlan::default();
    for (k, range) in piece_ranges(&whole, p).enumerate() {
        if !is_root {
            plan.recvs.push(RecvItem {
                range: range.clone(),
                action: RecvAction::Copy,
            });
        }
        if !is_last {
            let after_recvs = if is_root { 0 } else { k + 1 };
            plan.sends.push(SendItem { range, after_recvs });
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// Runs every rank's plan against in-memory queues, sending whatever is ready, until no rank
    /// can move. Checks that a send's piece has the same length as the matching receive.
    fn simulate(plans: &[RingPlan], buffers: &mut [Vec<i64>]) {
        let n = plans.len();
        let mut queues: Vec<VecDeque<Vec<i64>>> = vec![VecDeque::new(); n]; // queue into rank i
        let mut sent = vec![0usize; n];
        let mut recvd = vec![0usize; n];
        loop {
            let mut moved = false;
            for r in 0..n {
                while sent[r] < plans[r].sends.len()
                    && recvd[r] >= plans[r].sends[sent[r]].after_recvs
                {
                    let item = &plans[r].sends[sent[r]];
                    queues[(r + 1) % n].push_back(buffers[r][item.range.clone()].to_vec());
                    sent[r] += 1;
                    moved = true;
                }
                while let Some(data) = queues[r].pop_front() {
                    let item = &plans[r].recvs[recvd[r]];
                    assert_eq!(data.len(), item.range.len(), "rank {r} recv {}", recvd[r]);
                    for (dst, v) in buffers[r][item.range.clone()].iter_mut().zip(data) {
                        match item.action {
                            RecvAction::Reduce => *dst += v,
                            RecvAction::Copy => *dst = v,
                        }
                    }
                    recvd[r] += 1;
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
        for r in 0..n {
            assert_eq!(sent[r], plans[r].sends.len(), "rank {r} stuck sending");
            assert_eq!(recvd[r], plans[r].recvs.len(), "rank {r} stuck receiving");
        }
    }

    fn input(rank: usize, len: usize) -> Vec<i64> {
        (0..len).map(|i| (rank * 1000 + i) as i64).collect()
    }

    const SHAPES: [(usize, usize); 8] = [
        (1, 3),
        (2, 0),
        (2, 1),
        (3, 7),
        (4, 64),
        (5, 3),
        (3, 1000),
        (4, 13),
    ];

    #[test]
    fn chunks_cover_the_buffer() {
        for len in 0..50 {
            for n in 1..7 {
                let mut next = 0;
                for c in 0..n {
                    let r = chunk_range(len, n, c);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn all_reduce_sums_for_every_shape_and_piece_size() {
        for (world, len) in SHAPES {
            for piece in [1, 2, 5, 1 << 20] {
                let plans: Vec<_> = (0..world)
                    .map(|r| all_reduce_plan(world, r, len, piece))
                    .collect();
                let mut bufs: Vec<_> = (0..world).map(|r| input(r, len)).collect();
                simulate(&plans, &mut bufs);
                let expected: Vec<i64> = (0..len)
                    .map(|i| (0..world).map(|r| input(r, len)[i]).sum())
                    .collect();
                for b in &bufs {
                    assert_eq!(b, &expected, "world {world} len {len} piece {piece}");
                }
                // Bandwidth optimality: each rank sends 2(N-1)/N of the buffer (rounded up per chunk).
                if world > 1 {
                    let sent: usize = plans[0].sends.iter().map(|s| s.range.len()).sum();
                    assert!(sent <= 2 * (world - 1) * len.div_ceil(world));
                }
            }
        }
    }

    #[test]
    fn reduce_scatter_and_all_gather() {
        for (world, block) in SHAPES {
            let plans: Vec<_> = (0..world)
                .map(|r| reduce_scatter_plan(world, r, block, 3))
                .collect();
            let mut bufs: Vec<_> = (0..world).map(|r| input(r, world * block)).collect();
            simulate(&plans, &mut bufs);
            for (r, b) in bufs.iter().enumerate() {
                let expected: Vec<i64> = (r * block..(r + 1) * block)
                    .map(|i| (0..world).map(|q| input(q, world * block)[i]).sum())
                    .collect();
                assert_eq!(&b[r * block..(r + 1) * block], &expected[..]);
            }

            let plans: Vec<_> = (0..world)
                .map(|r| all_gather_plan(world, r, block, 3))
                .collect();
            let mut bufs: Vec<Vec<i64>> = (0..world)
                .map(|r| {
                    let mut b = vec![-1; world * block];
                    b[r * block..(r + 1) * block].copy_from_slice(&input(r, block));
                    b
                })
                .collect();
            simulate(&plans, &mut bufs);
            let expected: Vec<i64> = (0..world).flat_map(|r| input(r, block)).collect();
            for b in &bufs {
                assert_eq!(b, &expected);
            }
        }
    }

    #[test]
    fn uneven_blocks_reduce_to_their_owner_and_gather_back() {
        for counts in [
            vec![5, 0, 2],
            vec![0, 0, 4],
            vec![1, 9],
            vec![3, 3, 0, 7],
            vec![4],
        ] {
            let world = counts.len();
            let len: usize = counts.iter().sum();
            let blocks = block_ranges(&counts);
            for (r, block) in blocks.iter().enumerate() {
                assert_eq!(block_range(&counts, r), *block);
            }
            assert_eq!(
                block_range(&counts, world),
                len..len,
                "no such block: empty"
            );
            let plans: Vec<_> = (0..world)
                .map(|r| reduce_scatter_v_plan(r, &counts, 2))
                .collect();
            let mut bufs: Vec<_> = (0..world).map(|r| input(r, len)).collect();
            simulate(&plans, &mut bufs);
            for (r, b) in bufs.iter().enumerate() {
                let expected: Vec<i64> = blocks[r]
                    .clone()
                    .map(|i| (0..world).map(|q| input(q, len)[i]).sum())
                    .collect();
                assert_eq!(&b[blocks[r].clone()], &expected[..], "{counts:?} rank {r}");
            }
            // Bytes: every block but its own, once (the least a reduce-scatter can send).
            for (r, plan) in plans.iter().enumerate() {
                let sent: usize = plan.sends.iter().map(|s| s.range.len()).sum();
                if world > 1 && len > 0 {
                    assert_eq!(sent, len - counts[r], "{counts:?}");
                }
            }

            let plans: Vec<_> = (0..world)
                .map(|r| all_gather_v_plan(r, &counts, 2))
                .collect();
            let expected = input(7, len);
            let mut bufs: Vec<Vec<i64>> = (0..world)
                .map(|r| {
                    let mut b = vec![-1; len];
                    b[blocks[r].clone()].copy_from_slice(&expected[blocks[r].clone()]);
                    b
                })
                .collect();
            simulate(&plans, &mut bufs);
            for b in &bufs {
                assert_eq!(b, &expected, "{counts:?}");
            }
        }
    }

    #[test]
    fn broadcast_from_every_root() {
        for (world, len) in SHAPES {
            for root in 0..world {
                let plans: Vec<_> = (0..world)
                    .map(|r| broadcast_plan(world, r, root, len, 4))
                    .collect();
                let mut bufs: Vec<_> = (0..world).map(|r| input(r, len)).collect();
                simulate(&plans, &mut bufs);
                for b in &bufs {
                    assert_eq!(b, &input(root, len));
                }
            }
        }
    }
}
