//! Re-forming a handle's groups among the ranks that carry on: a planned resize, or the
//! survivors of a failure (the agreement is [`crate::elastic`]'s).

use super::handle::DataParallel;
use crate::ddp::options::zero_stage::ZeroStage;
use crate::ddp::sync_batch_norm::sync_group;
use crate::elastic::{agree_on_survivors, AgreementOptions, Survivors};
use crate::error::DdpError;

impl DataParallel {
    /// Re-forms every group of this handle (the job's ring, the gradient path and its overlap
    /// thread, synchronised BatchNorm's) among `members`, ranks of the current group listed in
    /// the new group's rank order, at a step boundary: the others left (a planned resize) or
    /// died ([`regroup_after_failure`](Self::regroup_after_failure)). The model and the
    /// optimizer state stay as they are: at a step boundary the replicas are equal, and the
    /// next [`step`](Self::step) averages over the new world. The first step after it learns
    /// its bucket plan again.
    ///
    /// Collective over `members`, which every member passes alike; the set-up's deadline is
    /// the options' timeout. On an error the handle keeps its broken group (every collective
    /// fails).
    ///
    /// # Errors
    /// [`DdpError::Membership`] under ZeRO stages 1 to 3 (a rank's shard of the training
    /// state is nowhere else but in a checkpoint: restart every rank from it) and when this
    /// rank is not in `members`; what forming the groups reports.
    pub fn regroup(&mut self, members: &[usize]) -> Result<(), DdpError> {
        let rank = self.rank();
        let Some(new_rank) = members.iter().position(|&m| m == rank) else {
            return Err(DdpError::Membership(format!(
                "rank {rank} is not among the ranks that carry on ({members:?})"
            )));
        };
        self.next_generation(new_rank, members.len())
    }

    /// Forms the job's next generation, in which this rank is `rank` of `world`, and every
    /// part of the handle over it. Collective over the new generation.
    pub(super) fn next_generation(&mut self, rank: usize, world: usize) -> Result<(), DdpError> {
        let stage = self.zero_stage();
        if stage != ZeroStage::Off {
            return Err(DdpError::Membership(format!(
                "cannot re-form the job at ZeRO stage {stage}: each rank holds the only live copy of its shard of the training state, so a lost rank's shard is only in the newest checkpoint; restart every rank from it (the launcher's --max-restarts)"
            )));
        }
        self.dist.regroup(rank, world)?;
        self.joins.regrouped();
        self.form_again()
    }

    /// The gradient path, the sharding and synchronised BatchNorm's recipe over the current
    /// group (after it changed).
    pub(super) fn form_again(&mut self) -> Result<(), DdpError> {
        // The old group's synchronised-BatchNorm recipe goes first, so that the new one
        // takes its place instead of replacing another handle's.
        drop(std::mem::replace(
            &mut self._sync_batch_norm,
            sync_group::install_none(),
        ));
        let (sync, sharding, sync_batch_norm) =
            Self::form_parts(&self.dist, &self.options, &self.device)?;
        self.sync = sync;
        self.sharding = sharding;
        self._sync_batch_norm = sync_batch_norm;
        Ok(())
    }

    /// After a collective of this handle failed because peers died or stopped answering
    /// ([`crate::elastic::failed_peers`] of the error gives `known_gone`): agrees with the
    /// other survivors, through the job's store, on who carries on (every rank of the group
    /// that announces itself within `options`' window) and from which step (this rank applied
    /// `step` optimizer steps), then [`regroup`](Self::regroup)s among them. Returns the
    /// agreement (the old ranks that carry on, the ranks lost, those one step
    /// [`behind`](Survivors::behind), which must then take the new rank 0's state: the weights
    /// by [`prepare`](Self::prepare), the rest by [`broadcast_bytes`](Self::broadcast_bytes));
    /// the new rank and world size are the handle's. Collective over the survivors; bounded by
    /// `options` and the set-up's deadline.
    ///
    /// # Errors
    /// [`DdpError::Membership`] when this rank was left out, the survivors stand more than a
    /// step apart, or [`regroup`](Self::regroup) refuses; a store failure.
    pub fn regroup_after_failure(
        &mut self,
        known_gone: &[usize],
        step: u64,
        options: &AgreementOptions,
    ) -> Result<Survivors, DdpError> {
        let survivors = agree_on_survivors(
            self.dist.store.as_ref(),
            self.rank(),
            self.world_size(),
            step,
            known_gone,
            options,
        )?;
        self.regroup(&survivors.members)?;
        Ok(survivors)
    }
}
