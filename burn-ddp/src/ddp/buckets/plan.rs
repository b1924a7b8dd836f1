//! Bucket assignment (pure): which gradients are all-reduced together.
//!
//! Gradients are packed into buckets of at most `cap` elements so that many small tensors cost
//! one collective, and a huge model is not copied into one giant buffer. Like PyTorch, the plan
//! walks the parameters in **reverse** visit order — roughly the order in which backward
//! produces their gradients. Under gradient overlap the plan follows the order in which
//! marked blocks' gradients became ready in the first step (as PyTorch DDP rebuilds its buckets
//! after the first iteration), with a small first bucket so the wire starts early. Where the
//! blocks are known, a bucket closes at the end of a block once it holds at least that first
//! bucket's size, and never earlier than the cap inside one: the cap bounds a bucket, it is no
//! reason to keep a block's ready gradients off the wire until a later block fills it
//! (PyTorch's 25 MiB bucket holds a whole MLP, which then hides nothing), and two buckets ready
//! at the same moment cost a collective's latency more than one. A parameter larger than the
//! cap gets a bucket of its own. The plan is a function of the parameter sizes,
//! that order and the blocks' ends only, hence identical on every rank.

use std::ops::Range;

use crate::error::DdpError;
use crate::kernels::MAX_BUCKET_LEN;

/// One bucket: parameters (indices in visit order) and their element ranges in the bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub params: Vec<usize>,
    pub ranges: Vec<Range<usize>>,
    pub numel: usize,
}

/// The bucket cap in f32 elements for a cap of `bucket_cap_mb` MiB (at least one element).
/// Capped at [`MAX_BUCKET_LEN`](crate::kernels::MAX_BUCKET_LEN), what the bucket kernels index.
pub fn cap_elements(bucket_cap_mb: f64) -> usize {
    let bytes = (bucket_cap_mb.max(0.0) * (1u64 << 20) as f64) as usize;
    (bytes / 4).clamp(1, crate::kernels::MAX_BUCKET_LEN)
}

/// Assigns parameters of the given sizes to buckets of at most `cap` elements (see module docs).
pub fn plan_buckets(numels: &[usize], cap: usize) -> Vec<Bucket> {
    plan_buckets_in_order((0..numels.len()).rev(), numels, &[], cap, cap)
}

/// The first bucket's cap in f32 elements: 1 MiB, PyTorch DDP's `first_bucket_cap_mb`, so
/// that the wire starts early in backward (never above `cap`). Where blocks are marked, the
/// size at which a bucket closes at a block's end instead ([`plan_buckets_in_order`]).
pub fn first_bucket_cap(cap: usize) -> usize {
    cap_elements(1.0).min(cap)
}

/// Assigns parameters (indices into `numels`) to buckets in the given `order`: buckets hold
/// at most `cap` elements, a parameter larger than the cap gets a bucket of its own, and
/// parameters of no elements are skipped. Without blocks (no `block_ends[index]` is `true`)
/// the first bucket holds at most `first_cap` elements; with them, a bucket of at least
/// `first_cap` elements closes after a parameter that ends a block. Every index of `order`
/// must appear once. The order
/// of gradient readiness under overlap ([`ready_order`]); reverse visit order otherwise
/// ([`plan_buckets`]).
pub fn plan_buckets_in_order(
    order: impl IntoIterator<Item = usize>,
    numels: &[usize],
    block_ends: &[bool],
    first_cap: usize,
    cap: usize,
) -> Vec<Bucket> {
    let empty = || Bucket {
        params: Vec::new(),
        ranges: Vec::new(),
        numel: 0,
    };
    let mut buckets = Vec::new();
    let mut current = empty();
    let blocks = block_ends.contains(&true);
    for index in order {
        let n = numels[index];
        if n == 0 {
            continue;
        }
        let limit = if buckets.is_empty() && !blocks {
            first_cap
        } else {
            cap
        };
        if current.numel > 0 && current.numel + n > limit {
            buckets.push(std::mem::replace(&mut current, empty()));
        }
        current.params.push(index);
        current.ranges.push(current.numel..current.numel + n);
        current.numel += n;
        if block_ends.get(index).copied().unwrap_or(false) && current.numel >= first_cap {
            buckets.push(std::mem::replace(&mut current, empty()));
        }
    }
    if current.numel > 0 {
        buckets.push(current);
    }
    buckets
}

/// The order in which gradients are bucketed under overlap (pure): the parameters that
/// became ready in backward, in the order they did (`ready`: indices in visit order, each
/// once), then every other one of `count` parameters in reverse visit order (they are
/// summed after backward).
pub fn ready_order(ready: &[usize], count: usize) -> Vec<usize> {
    let mut seen = vec![false; count];
    let mut order = Vec::with_capacity(count);
    for &index in ready {
        if index < count && !std::mem::replace(&mut seen[index], true) {
            order.push(index);
        }
    }
    order.extend((0..count).rev().filter(|&index| !seen[index]));
    order
}

/// Fails for a bucket longer than the kernels index (32 bits): only a single parameter can
/// exceed the (capped) bucket size. Found before anything is sent, on every rank alike.
pub fn check_bucket_len(bucket: &Bucket) -> Result<(), DdpError> {
    if bucket.numel > MAX_BUCKET_LEN {
        return Err(DdpError::Unsupported(format!(
            "a parameter of {} elements is larger than the {MAX_BUCKET_LEN} elements a \
             gradient bucket can hold (32-bit indexing); split it into smaller tensors",
            bucket.numel
        )));
    }
    Ok(())
}

/// The parts of the parameters laid out at `ranges` (sorted and disjoint, as
/// [`Bucket::ranges`] are)
/// that fall in `piece` of the bucket: `(position in ranges, range in that parameter, range in
/// the piece)`, in bucket order.
pub fn segments<'a>(
    ranges: &'a [Range<usize>],
    piece: Range<usize>,
) -> impl Iterator<Item = (usize, Range<usize>, Range<usize>)> + 'a {
    let first = ranges.partition_point(|r| r.end <= piece.start);
    ranges[first..]
        .iter()
        .enumerate()
        .take_while(move |(_, r)| r.start < piece.end)
        .map(move |(i, r)| {
            let (start, end) = (r.start.max(piece.start), r.end.min(piece.end));
            (
                first + i,
                start - r.start..end - r.start,
                start - piece.start..end - piece.start,
            )
        })
        .filter(|(_, within, _)| !within.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cut_a_piece_at_parameter_boundaries() {
        let ranges = [0..3, 3..3, 3..10, 10..11];
        let all: Vec<_> = segments(&ranges, 2..11).collect();
        assert_eq!(all, vec![(0, 2..3, 0..1), (2, 0..7, 1..8), (3, 0..1, 8..9)]);
        assert_eq!(
            segments(&ranges, 4..6).collect::<Vec<_>>(),
            vec![(2, 1..3, 0..2)]
        );
        assert_eq!(segments(&ranges, 5..5).count(), 0);
        // Every element of the bucket, over any cut into pieces, exactly once.
        for cut in 1..12 {
            let mut seen = vec![0; 11];
            for start in (0..11).step_by(cut) {
                let piece = start..(start + cut).min(11);
                for (p, within, at) in segments(&ranges, piece.clone()) {
                    assert_eq!(within.len(), at.len());
                    for (w, a) in within.zip(at) {
                        assert_eq!(ranges[p].start + w, piece.start + a);
                        seen[piece.start + a] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "cut {cut}: {seen:?}");
        }
    }

    #[test]
    fn buckets_respect_the_cap_and_cover_every_parameter_once() {
        let numels = [10, 0, 300, 5, 5, 120, 7];
        let buckets = plan_buckets(&numels, 128);
        let mut seen: Vec<usize> = buckets.iter().flat_map(|b| b.params.clone()).collect();
        seen.sort_unstable();
        assert_eq!(seen, vec![0, 2, 3, 4, 5, 6]);
        for b in &buckets {
            assert!(b.numel <= 128 || b.params.len() == 1, "{b:?}");
            assert_eq!(b.ranges.last().map(|r| r.end), Some(b.numel));
            for (p, r) in b.params.iter().zip(&b.ranges) {
                assert_eq!(r.len(), numels[*p]);
            }
        }
        assert_eq!(buckets[0].params, vec![6, 5], "reverse visit order");
        assert_eq!(plan_buckets(&numels, usize::MAX).len(), 1);
        assert!(plan_buckets(&[], 10).is_empty());
    }

    #[test]
    fn ready_order_puts_ready_gradients_first_and_the_rest_in_reverse_visit_order() {
        assert_eq!(ready_order(&[3, 1, 3, 9], 5), vec![3, 1, 4, 2, 0]);
        assert_eq!(ready_order(&[], 3), vec![2, 1, 0]);
        let numels = [10, 0, 300, 5, 5, 120, 7];
        assert_eq!(
            plan_buckets_in_order(ready_order(&[], 7), &numels, &[], 128, 128),
            plan_buckets(&numels, 128),
            "with nothing ready: today's plan"
        );
        // A small first bucket, then the cap.
        let buckets = plan_buckets_in_order(ready_order(&[5, 6, 4], 7), &numels, &[], 8, 128);
        let params: Vec<_> = buckets.iter().map(|b| b.params.clone()).collect();
        assert_eq!(params, vec![vec![5], vec![6, 4, 3], vec![2], vec![0]]);
    }

    #[test]
    fn a_bucket_closes_at_a_blocks_end_once_it_holds_the_first_buckets_size() {
        // An MLP's shape: a small output layer, then two big hidden layers, ready in that
        // order; one cap would hold them all.
        let numels = [800, 8, 1000, 10, 40, 2];
        let ends = [false, true, false, true, false, true];
        let params = |buckets: Vec<Bucket>| -> Vec<Vec<usize>> {
            buckets.into_iter().map(|b| b.params).collect()
        };
        let order = || ready_order(&[4, 5, 2, 3, 0, 1], 6);
        assert_eq!(
            params(plan_buckets_in_order(order(), &numels, &ends, 100, 1 << 20)),
            vec![vec![4, 5, 2, 3], vec![0, 1]],
            "each hidden layer goes when backward has passed it, the small output layer with \
             the first"
        );
        assert_eq!(
            params(plan_buckets_in_order(order(), &numels, &[], 100, 1 << 20)),
            vec![vec![4, 5], vec![2, 3, 0, 1]],
            "without blocks, only the caps cut"
        );
        // Blocks smaller than the first bucket's size wait for the next one.
        assert_eq!(
            params(plan_buckets_in_order(
                order(),
                &numels,
                &ends,
                1060,
                1 << 20
            )),
            vec![vec![4, 5, 2, 3, 0, 1]]
        );
        assert_eq!(
            params(plan_buckets_in_order(order(), &numels, &ends, 50, 900)),
            vec![vec![4, 5], vec![2], vec![3, 0, 1]],
            "the caps still cut inside a block"
        );
    }

    #[test]
    fn the_cap_stays_within_what_the_kernels_index() {
        assert_eq!(cap_elements(1.0), 1 << 18);
        assert_eq!(cap_elements(0.0), 1);
        assert_eq!(cap_elements(1e9), crate::kernels::MAX_BUCKET_LEN);
    }
}
