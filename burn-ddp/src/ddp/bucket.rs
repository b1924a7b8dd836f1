//! Bucket assignment (pure): which gradients are all-reduced together.
//!
//! Gradients are packed into buckets of at most `cap` elements so that many small tensors cost
//! one collective, and a huge model is not copied into one giant buffer. Like PyTorch, the plan
//! walks the parameters in **reverse** visit order — roughly the order in which backward
//! produces their gradients — so a future overlap of communication with backward keeps the same
//! plan. A parameter larger than the cap gets a bucket of its own. The plan is a function of the
//! parameter sizes only, hence identical on every rank.

use std::ops::Range;

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
    let mut buckets = Vec::new();
    let mut current = Bucket {
        params: Vec::new(),
        ranges: Vec::new(),
        numel: 0,
    };
    for (index, &n) in numels.iter().enumerate().rev() {
        if n == 0 {
            continue;
        }
        if current.numel > 0 && current.numel + n > cap {
            buckets.push(std::mem::replace(
                &mut current,
                Bucket {
                    params: Vec::new(),
                    ranges: Vec::new(),
                    numel: 0,
                },
            ));
        }
        current.params.push(index);
        current.ranges.push(current.numel..current.numel + n);
        current.numel += n;
    }
    if current.numel > 0 {
        buckets.push(current);
    }
    buckets
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
    fn the_cap_stays_within_what_the_kernels_index() {
        assert_eq!(cap_elements(1.0), 1 << 18);
        assert_eq!(cap_elements(0.0), 1);
        assert_eq!(cap_elements(1e9), crate::kernels::MAX_BUCKET_LEN);
    }
}
