//! Which samples each rank takes: [`DistributedSampler`] (PyTorch's `DistributedSampler`
//! semantics, plus resume at a global position and an exact evaluation mode) and
//! [`WeightedDistributedSampler`] for imbalanced classes. Pure functions of their inputs.
//!
//! # Training semantics
//! - Every epoch has one **global order**, identical on every rank: a permutation of `0..len`
//!   seeded by `seed + epoch` (or `0..len` without shuffling). The permutation never depends on
//!   the rank or the world size, so the same order is seen by 1 process or 8.
//! - Rank `r` of `W` takes positions `r, r + W, r + 2W, …` of that order. With a per-rank batch
//!   `b`, the union of the ranks' `k`-th batches is exactly positions `k·b·W .. (k+1)·b·W`: the
//!   `k`-th batch of one process with batch `b·W`. That is what makes N processes train the same
//!   model as one with the same global batch.
//! - So that every rank takes the same number of steps, the order is padded by repeating its
//!   first positions up to a multiple of `W` (or truncated, with `drop_last`) — as in PyTorch.
//!   The sample at global position `p` is `order[p % len]` whatever the resume history.
//! - **Resume**: `consumed` global positions of the epoch can be skipped; the rest is re-sharded
//!   over the current world size, which may differ from the one that consumed the first part.
//!   At the **same** world size the resumed shard is exactly the rest of the uninterrupted
//!   run's shard, padding included (same samples, same ranks, same order), so a resumed run
//!   trains bit for bit like the uninterrupted one. At **another** world size every remaining
//!   sample is seen once, and the padding (fewer than `W` positions) repeats the epoch's first
//!   samples. The trainer advances the epoch itself: there is no `set_epoch` to forget.
//!
//! # Evaluation semantics
//! [`DistributedSampler::eval_indices`] gives every sample to exactly one rank with no padding
//! (ranks may get one sample more than others); metrics must then be summed with their real
//! counts, not averaged per rank — padded duplicates would otherwise skew them.

use crate::rng::SplitMix64;

/// A Fisher–Yates permutation of `0..len` seeded by `seed`.
pub fn permutation(len: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    SplitMix64::new(seed).shuffle(&mut order);
    order
}

/// One sample a rank takes, and whether it is a padding duplicate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Index into the data set.
    pub index: usize,
    /// Position in the epoch's global order (`>= len` for padding).
    pub position: usize,
    pub is_padding: bool,
}

/// Shards data-set indices over the ranks of a job. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    pub len: usize,
    pub world_size: usize,
    pub rank: usize,
    pub shuffle: bool,
    pub seed: u64,
    pub drop_last: bool,
}

impl DistributedSampler {
    /// A shuffling sampler with seed 0 that pads (PyTorch's defaults).
    ///
    /// # Panics
    /// If `world_size == 0` or `rank >= world_size` (a broken invariant of the caller: both come
    /// from a formed process group).
    pub fn new(len: usize, world_size: usize, rank: usize) -> Self {
        assert!(
            world_size > 0 && rank < world_size,
            "rank {rank} of {world_size}"
        );
        Self {
            len,
            world_size,
            rank,
            shuffle: true,
            seed: 0,
            drop_last: false,
        }
    }

    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    pub fn with_shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// The epoch's global order, identical on every rank and for every world size.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        if self.shuffle {
            permutation(self.len, self.seed.wrapping_add(epoch))
        } else {
            (0..self.len).collect()
        }
    }

    /// This rank's samples of `epoch`, skipping the first `consumed` global positions.
    pub fn samples(&self, epoch: u64, consumed: usize) -> Vec<Sample> {
        shard(
            &self.epoch_order(epoch),
            consumed,
            self.world_size,
            self.rank,
            self.drop_last,
        )
    }

    /// This rank's data-set indices of `epoch` after `consumed` global positions.
    pub fn indices(&self, epoch: u64, consumed: usize) -> Vec<usize> {
        self.samples(epoch, consumed)
            .iter()
            .map(|s| s.index)
            .collect()
    }

    /// Global positions consumed once every rank has taken `steps` batches of `batch_size`
    /// after starting at `consumed`; capped at `len` (the epoch is over).
    pub fn advance(&self, consumed: usize, steps: usize, batch_size: usize) -> usize {
        (consumed + steps * batch_size * self.world_size).min(self.len)
    }

    /// Evaluation shard: every index exactly once over all ranks, no padding, no shuffling.
    pub fn eval_indices(&self) -> Vec<usize> {
        (self.rank..self.len).step_by(self.world_size).collect()
    }
}

/// Rank `rank`'s part of the epoch from global position `consumed` on (module docs): positions
/// `consumed + rank`, `consumed + rank + world_size`, …, padded or truncated to a multiple of
/// `world_size`.
///
/// The sample at a position depends on the position alone — `order[position % len]`, so padding
/// repeats the *epoch's* first positions, as PyTorch's `DistributedSampler` pads. That is what
/// makes a resume at the same world size invisible: the uninterrupted run consumes whole global
/// batches, so `consumed` is where one of its steps began, and the resumed shard is its shard's
/// rest to the last padded sample. (Padding taken from the rest of the epoch instead would give
/// the resumed run other duplicates than the uninterrupted one whenever the world size does not
/// divide the data set.)
fn shard(
    order: &[usize],
    consumed: usize,
    world_size: usize,
    rank: usize,
    drop_last: bool,
) -> Vec<Sample> {
    let len = order.len();
    let rest = len.saturating_sub(consumed);
    let total = if drop_last {
        rest / world_size * world_size
    } else {
        rest.div_ceil(world_size) * world_size
    };
    (rank..total)
        .step_by(world_size)
        .map(|i| {
            let position = consumed + i;
            Sample {
                index: order[position % len],
                position,
                is_padding: position >= len,
            }
        })
        .collect()
}

/// Draws `num_samples` indices per epoch with probability proportional to `weights` (with
/// replacement, like PyTorch's `WeightedRandomSampler`), then shards them like
/// [`DistributedSampler`]. Use it to rebalance imbalanced classes.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightedDistributedSampler {
    /// Cumulative weights, normalised to end at 1.
    cumulative: Vec<f64>,
    pub num_samples: usize,
    pub world_size: usize,
    pub rank: usize,
    pub seed: u64,
}

impl WeightedDistributedSampler {
    /// `weights[i]` is the relative probability of drawing sample `i`. Returns `None` when the
    /// weights are empty, negative, not finite, or all zero.
    pub fn new(
        weights: &[f64],
        num_samples: usize,
        world_size: usize,
        rank: usize,
        seed: u64,
    ) -> Option<Self> {
        if world_size == 0
            || rank >= world_size
            || weights.iter().any(|w| !w.is_finite() || *w < 0.0)
        {
            return None;
        }
        let total: f64 = weights.iter().sum();
        if total <= 0.0 {
            return None;
        }
        let mut acc = 0.0;
        let cumulative = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        Some(Self {
            cumulative,
            num_samples,
            world_size,
            rank,
            seed,
        })
    }

    /// The epoch's draws, identical on every rank.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut rng = SplitMix64::new(self.seed.wrapping_add(epoch));
        let last = self.cumulative.len() - 1;
        (0..self.num_samples)
            .map(|_| {
                let u = rng.unit();
                self.cumulative.partition_point(|&c| c <= u).min(last)
            })
            .collect()
    }

    /// This rank's samples of `epoch` after `consumed` global positions (padded).
    pub fn samples(&self, epoch: u64, consumed: usize) -> Vec<Sample> {
        shard(
            &self.epoch_order(epoch),
            consumed,
            self.world_size,
            self.rank,
            false,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn all_ranks(
        len: usize,
        world: usize,
        drop_last: bool,
        epoch: u64,
        consumed: usize,
    ) -> Vec<Vec<Sample>> {
        (0..world)
            .map(|r| {
                DistributedSampler::new(len, world, r)
                    .with_seed(7)
                    .with_drop_last(drop_last)
                    .samples(epoch, consumed)
            })
            .collect()
    }

    #[test]
    fn shards_are_disjoint_cover_the_data_and_have_equal_sizes() {
        for len in [0, 1, 5, 10, 97, 100] {
            for world in 1..6 {
                let shards = all_ranks(len, world, false, 3, 0);
                assert!(
                    shards.iter().all(|s| s.len() == shards[0].len()),
                    "equal steps"
                );
                let mut real: Vec<usize> = shards
                    .iter()
                    .flatten()
                    .filter(|s| !s.is_padding)
                    .map(|s| s.index)
                    .collect();
                real.sort_unstable();
                assert_eq!(
                    real,
                    (0..len).collect::<Vec<_>>(),
                    "len {len} world {world}"
                );
                let padding = shards.iter().flatten().filter(|s| s.is_padding).count();
                assert!(padding < world);

                let dropped = all_ranks(len, world, true, 3, 0);
                let mut seen: Vec<usize> = dropped.iter().flatten().map(|s| s.index).collect();
                assert!(dropped.iter().all(|s| s.len() == len / world));
                seen.sort_unstable();
                seen.dedup();
                assert_eq!(seen.len(), len / world * world, "drop_last never repeats");
            }
        }
    }

    #[test]
    fn permutation_changes_with_epoch_not_with_rank() {
        let s0 = DistributedSampler::new(50, 2, 0).with_seed(1);
        let s1 = DistributedSampler::new(50, 2, 1).with_seed(1);
        assert_eq!(s0.epoch_order(4), s1.epoch_order(4));
        assert_ne!(s0.epoch_order(4), s0.epoch_order(5));
        let mut sorted = s0.epoch_order(4);
        sorted.sort_unstable();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert_eq!(
            DistributedSampler::new(5, 1, 0)
                .with_shuffle(false)
                .indices(9, 0),
            vec![0, 1, 2, 3, 4]
        );
    }

    #[test]
    fn union_of_kth_batches_is_the_single_process_kth_batch() {
        let (len, b) = (64, 4);
        let single = DistributedSampler::new(len, 1, 0)
            .with_seed(3)
            .indices(2, 0);
        for world in [2, 4] {
            let shards: Vec<Vec<usize>> = (0..world)
                .map(|r| {
                    DistributedSampler::new(len, world, r)
                        .with_seed(3)
                        .indices(2, 0)
                })
                .collect();
            for k in 0..len / (b * world) {
                let mut union: Vec<usize> = shards
                    .iter()
                    .flat_map(|s| s[k * b..(k + 1) * b].to_vec())
                    .collect();
                let mut expected = single[k * b * world..(k + 1) * b * world].to_vec();
                union.sort_unstable();
                expected.sort_unstable();
                assert_eq!(union, expected, "world {world} batch {k}");
            }
        }
    }

    #[test]
    fn resume_with_another_world_size_visits_every_sample_once() {
        let (len, b) = (103, 4);
        // Two ranks take 5 steps, then the job resumes on 1 and on 3 ranks.
        let before = all_ranks(len, 2, false, 1, 0);
        let consumed = DistributedSampler::new(len, 2, 0).advance(0, 5, b);
        assert_eq!(consumed, 40);
        for new_world in [1, 3] {
            let mut count: BTreeMap<usize, usize> = BTreeMap::new();
            for shard in &before {
                for s in &shard[..5 * b] {
                    *count.entry(s.index).or_default() += 1;
                }
            }
            for shard in all_ranks(len, new_world, false, 1, consumed) {
                for s in shard.iter().filter(|s| !s.is_padding) {
                    *count.entry(s.index).or_default() += 1;
                }
            }
            assert_eq!(count.len(), len);
            assert!(count.values().all(|&c| c == 1), "world {new_world}");
        }
    }

    /// The uninterrupted run's samples from `consumed` on, and the samples of a run resumed at
    /// `consumed`, are the same list (padding included) at the same world size.
    fn assert_resume_is_the_suffix(
        sampler: &dyn Fn(usize, usize, usize) -> Vec<Sample>,
        len: usize,
        world: usize,
        what: &str,
    ) {
        for b in [1, 3, 7, 8] {
            let steps = sampler(world, 0, 0).len().div_ceil(b);
            for step in 0..=steps {
                let consumed = DistributedSampler::new(len, world, 0).advance(0, step, b);
                for rank in 0..world {
                    let straight = sampler(world, rank, 0);
                    let resumed = sampler(world, rank, consumed);
                    let from = (step * b).min(straight.len());
                    assert_eq!(
                        resumed,
                        straight[from..],
                        "{what}: len {len} world {world} rank {rank} batch {b}, resumed after step {step}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_resume_at_the_same_world_size_continues_the_uninterrupted_shard() {
        for len in [0, 1, 2, 5, 10, 97, 100, 1438] {
            for world in 1..8 {
                for (shuffle, drop_last) in [(true, false), (false, false), (true, true)] {
                    let sampler = |world: usize, rank: usize, consumed: usize| {
                        DistributedSampler::new(len, world, rank)
                            .with_seed(11)
                            .with_shuffle(shuffle)
                            .with_drop_last(drop_last)
                            .samples(4, consumed)
                    };
                    let what = format!("shuffle {shuffle} drop_last {drop_last}");
                    assert_resume_is_the_suffix(&sampler, len, world, &what);
                }
                if len > 0 {
                    let weights: Vec<f64> = (0..len).map(|i| (i % 3) as f64 + 0.5).collect();
                    let weighted = |world: usize, rank: usize, consumed: usize| {
                        WeightedDistributedSampler::new(&weights, len, world, rank, 5)
                            .unwrap()
                            .samples(2, consumed)
                    };
                    assert_resume_is_the_suffix(&weighted, len, world, "weighted");
                }
            }
        }
    }

    #[test]
    fn padding_repeats_the_epochs_first_positions_also_after_a_resume() {
        // 10 samples on 3 ranks: positions 10 and 11 pad with the order's positions 0 and 1,
        // whether the epoch started at 0 or was resumed at 6 (or at 5, by another world size).
        let order = DistributedSampler::new(10, 3, 0)
            .with_seed(2)
            .epoch_order(1);
        for consumed in [0, 6, 5] {
            let padding: Vec<(usize, usize)> = (0..3)
                .flat_map(|r| {
                    DistributedSampler::new(10, 3, r)
                        .with_seed(2)
                        .samples(1, consumed)
                })
                .filter(|s| s.is_padding)
                .map(|s| (s.position, s.index))
                .collect();
            let expected: Vec<(usize, usize)> = if consumed == 5 {
                vec![(10, order[0])]
            } else {
                vec![(10, order[0]), (11, order[1])]
            };
            let mut padding = padding;
            padding.sort_unstable();
            assert_eq!(padding, expected, "resumed at {consumed}");
        }
    }

    #[test]
    fn eval_indices_cover_each_sample_exactly_once() {
        for world in 1..5 {
            let mut all: Vec<usize> = (0..world)
                .flat_map(|r| DistributedSampler::new(10, world, r).eval_indices())
                .collect();
            all.sort_unstable();
            assert_eq!(all, (0..10).collect::<Vec<_>>());
        }
    }

    #[test]
    fn weighted_sampler_follows_the_weights_and_agrees_across_ranks() {
        let weights = [0.0, 1.0, 3.0];
        let s0 = WeightedDistributedSampler::new(&weights, 4000, 2, 0, 5).unwrap();
        let s1 = WeightedDistributedSampler::new(&weights, 4000, 2, 1, 5).unwrap();
        let order = s0.epoch_order(0);
        assert_eq!(order, s1.epoch_order(0));
        let ones = order.iter().filter(|&&i| i == 1).count() as f64;
        let threes = order.iter().filter(|&&i| i == 2).count() as f64;
        assert!(!order.contains(&0), "zero weight is never drawn");
        assert!((threes / ones - 3.0).abs() < 0.4, "{ones} {threes}");
        assert_eq!(s0.samples(0, 0).len(), 2000);
        assert!(WeightedDistributedSampler::new(&[0.0], 1, 1, 0, 0).is_none());
        assert!(WeightedDistributedSampler::new(&[f64::NAN], 1, 1, 0, 0).is_none());
    }
}
