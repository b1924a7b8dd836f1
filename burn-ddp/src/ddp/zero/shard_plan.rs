//! [`ShardPlan`]: which rank owns each parameter's optimizer state under ZeRO stages 1 and 2, and where
//! each parameter sits in the owner-ordered flat buffer the collectives run on (pure).
//!
//! ```text
//!  parameters (visit order):  p0 (400k)  p1 (130k)  p2 (2.5k)  p3 (256)
//!  largest first, each to the least-loaded rank (ties: lower rank), world 2:
//!      p0 -> rank 0 (400k)   p1 -> rank 1 (130k)   p2 -> rank 1   p3 -> rank 1
//!  flat buffer, rank by rank, each rank's parameters in visit order:
//!      [ p0 | p1 p2 p3 ]      counts = [400k, 132.8k]
//! ```
//! A parameter is never split: Burn's optimizers keep one state record per parameter, and the
//! owner must hold the whole of it. The assignment depends only on the parameter sizes and the
//! world size, so every rank computes the same plan, in every run (like PyTorch's
//! `ZeroRedundancyOptimizer` partitioning).

use std::collections::HashMap;
use std::ops::Range;

use burn::module::ParamId;

/// One parameter's place in the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub id: ParamId,
    /// Elements.
    pub numel: usize,
    /// The rank that steps this parameter and holds its optimizer state.
    pub owner: usize,
    /// Where it sits in the flat buffer.
    pub range: Range<usize>,
}

/// The owner of every parameter and the flat layout. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    /// In visit order.
    slots: Vec<Slot>,
    /// Elements owned by each rank: the block sizes of the flat buffer.
    counts: Vec<usize>,
    by_id: HashMap<ParamId, usize>,
}

impl ShardPlan {
    /// Assigns `params` (id and element count, in visit order) to `world` ranks: largest
    /// first, each to the rank with the fewest elements so far (ties to the lower rank; equal
    /// sizes in visit order). Deterministic.
    pub fn new(params: &[(ParamId, usize)], world: usize) -> Self {
        let world = world.max(1);
        let mut by_size: Vec<usize> = (0..params.len()).collect();
        // Stable: equal sizes keep their visit order.
        by_size.sort_by(|&a, &b| params[b].1.cmp(&params[a].1));
        let mut owner = vec![0; params.len()];
        let mut counts = vec![0usize; world];
        for i in by_size {
            let least = (0..world).min_by_key(|&r| (counts[r], r)).unwrap_or(0);
            owner[i] = least;
            counts[least] += params[i].1;
        }
        Self::assigned(params, &owner, world)
    }

    /// The flat layout of `params` (id and element count, in visit order) whose owners are
    /// already chosen (`owners[i]` below `world`): rank by rank, each rank's parameters in
    /// visit order.
    fn assigned(params: &[(ParamId, usize)], owner: &[usize], world: usize) -> Self {
        let mut counts = vec![0usize; world];
        for (&(_, numel), &o) in params.iter().zip(owner) {
            counts[o] += numel;
        }
        let mut starts: Vec<usize> = counts
            .iter()
            .scan(0, |start, &n| {
                let here = *start;
                *start += n;
                Some(here)
            })
            .collect();
        let slots: Vec<Slot> = params
            .iter()
            .zip(owner.iter().copied())
            .map(|(&(id, numel), owner)| {
                let start = starts[owner];
                starts[owner] += numel;
                Slot {
                    id,
                    numel,
                    owner,
                    range: start..start + numel,
                }
            })
            .collect();
        let by_id = slots.iter().enumerate().map(|(i, s)| (s.id, i)).collect();
        Self {
            slots,
            counts,
            by_id,
        }
    }

    /// Elements owned by each rank, in rank order (the block sizes of
    /// `reduce_scatter_v` / `all_gather_v`).
    pub fn counts(&self) -> &[usize] {
        &self.counts
    }

    /// Elements in the flat buffer (every parameter once).
    pub fn len(&self) -> usize {
        self.counts.iter().sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn world_size(&self) -> usize {
        self.counts.len()
    }

    /// The parameter's place, if it is one of the plan's.
    pub fn slot(&self, id: ParamId) -> Option<&Slot> {
        self.by_id.get(&id).map(|&i| &self.slots[i])
    }

    /// Which rank owns the parameter, if it is one of the plan's.
    pub fn owner(&self, id: ParamId) -> Option<usize> {
        self.slot(id).map(|s| s.owner)
    }

    /// Every parameter, in visit order.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    /// The plan cut into consecutive runs of parameters (visit order) of at most `cap`
    /// elements each (a larger parameter alone), each with the same owners and a flat layout
    /// of its own: what a collective over the whole flat buffer can run as, one run at a time,
    /// holding one run's buffer instead of the whole model's. Every parameter is in exactly one
    /// run.
    pub fn segments(&self, cap: usize) -> Vec<ShardPlan> {
        let world = self.counts.len();
        let mut runs = Vec::new();
        let mut params = Vec::new();
        let mut owners = Vec::new();
        let mut len = 0;
        for slot in &self.slots {
            if !params.is_empty() && len + slot.numel > cap {
                runs.push(Self::assigned(&params, &owners, world));
                params.clear();
                owners.clear();
                len = 0;
            }
            params.push((slot.id, slot.numel));
            owners.push(slot.owner);
            len += slot.numel;
        }
        if !params.is_empty() {
            runs.push(Self::assigned(&params, &owners, world));
        }
        runs
    }

    /// The largest block over the even share: 1.0 is a perfect balance.
    pub fn imbalance(&self) -> f64 {
        let world = self.counts.len() as f64;
        let largest = self.counts.iter().copied().max().unwrap_or(0) as f64;
        let total = self.len() as f64;
        if total == 0.0 {
            1.0
        } else {
            largest * world / total
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(sizes: &[usize]) -> Vec<(ParamId, usize)> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (ParamId::from(i as u64 + 1), n))
            .collect()
    }

    #[test]
    fn largest_first_to_the_least_loaded_rank() {
        let plan = ShardPlan::new(&params(&[400, 130, 3, 256]), 2);
        let owners: Vec<usize> = plan.slots().iter().map(|s| s.owner).collect();
        assert_eq!(owners, [0, 1, 1, 1]);
        assert_eq!(plan.counts(), [400, 389]);
        // Rank 1's block lists its parameters in visit order.
        let ranges: Vec<_> = plan.slots().iter().map(|s| s.range.clone()).collect();
        assert_eq!(ranges, [0..400, 400..530, 530..533, 533..789]);
    }

    #[test]
    fn every_parameter_once_and_blocks_tile_the_buffer() {
        for world in 1..6 {
            let sizes: Vec<usize> = (0..23).map(|i| (i * 7919) % 101 + i % 3).collect();
            let plan = ShardPlan::new(&params(&sizes), world);
            assert_eq!(plan.len(), sizes.iter().sum::<usize>());
            let mut covered = vec![0u8; plan.len()];
            for slot in plan.slots() {
                covered[slot.range.clone()].iter_mut().for_each(|c| *c += 1);
                let block = crate::group::ring::block_ranges(plan.counts())[slot.owner].clone();
                assert!(block.start <= slot.range.start && slot.range.end <= block.end);
            }
            assert!(covered.iter().all(|&c| c == 1), "world {world}");
            // The greedy assignment is within one largest parameter of the even share.
            let largest = *sizes.iter().max().unwrap_or(&0);
            let share = plan.len().div_ceil(world);
            assert!(plan.counts().iter().all(|&c| c <= share + largest));
        }
    }

    #[test]
    fn segments_keep_the_owners_and_cover_every_parameter_once() {
        let plan = ShardPlan::new(&params(&[400, 130, 3, 256, 90, 90]), 2);
        let runs = plan.segments(300);
        // 400 alone (over the cap), then 130 + 3 (256 more would pass 300), 256, 90 + 90.
        let sizes: Vec<Vec<usize>> = runs
            .iter()
            .map(|r| r.slots().iter().map(|s| s.numel).collect())
            .collect();
        assert_eq!(sizes, [vec![400], vec![130, 3], vec![256], vec![90, 90]]);
        for run in &runs {
            assert_eq!(run.world_size(), 2);
            assert_eq!(run.len(), run.counts().iter().sum::<usize>());
            for slot in run.slots() {
                assert_eq!(Some(slot.owner), plan.owner(slot.id));
                let block = crate::group::ring::block_ranges(run.counts())[slot.owner].clone();
                assert!(block.start <= slot.range.start && slot.range.end <= block.end);
            }
        }
        let total: usize = runs.iter().map(ShardPlan::len).sum();
        assert_eq!(total, plan.len());
    }

    #[test]
    fn same_sizes_same_plan() {
        let a = ShardPlan::new(&params(&[5, 5, 5, 5, 1]), 3);
        let b = ShardPlan::new(&params(&[5, 5, 5, 5, 1]), 3);
        assert_eq!(a, b);
        assert_eq!(a.owner(ParamId::from(4)), Some(0));
        assert_eq!(a.owner(ParamId::from(99)), None);
    }
}
