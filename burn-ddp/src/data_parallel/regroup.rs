//! Re-forming a handle's groups among the ranks that carry on: a planned resize, or the
//! survivors of a failure (the agreement is [`crate::elastic`]'s).

use std::sync::{mpsc, Arc};

use super::handle::DataParallel;
use crate::ddp::sync_batch_norm::sync_group;
use crate::elastic::fencing::fence;
use crate::elastic::{agree_on_survivors, AgreementOptions, Survivors};
use crate::error::DdpError;
use crate::fault::{self, FaultPoint};
use crate::group::liveness::wait_for_silence;
use crate::group::TcpProcessGroup;
use crate::init::Distributed;

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
    /// the options' timeout. With peer heartbeats ([`DdpOptions::peer_heartbeats`](crate::DdpOptions)),
    /// the other members' heartbeats in the current group are watched while the new one forms:
    /// a member that dies then makes the set-up fail on every rank within about twice the
    /// failure detection time, instead of at its deadline. On an error the handle keeps its
    /// broken group (every collective fails).
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
        let watched = members.iter().copied().filter(|&m| m != rank).collect();
        self.next_generation_watching(new_rank, members.len(), watched)
    }

    /// Forms the job's next generation, in which this rank is `rank` of `world`, and every
    /// part of the handle over it, aborting the new group's set-up on every rank when one of
    /// `watched` (ranks of the current group, expected in the new one) stops beating its
    /// heartbeat in the current group: it died while the group formed. Without peer
    /// heartbeats nothing is watched. Collective over the new generation.
    pub(super) fn next_generation_watching(
        &mut self,
        rank: usize,
        world: usize,
        watched: Vec<usize>,
    ) -> Result<(), DdpError> {
        self.sharding.check_regroup()?;
        if watched.is_empty() || !self.options.peer_heartbeats {
            self.dist.regroup(rank, world)?;
        } else {
            let heartbeats = self.dist.group.heartbeat_store();
            let forming = Distributed::generation_store(&self.dist.root, self.dist.generation + 1);
            let tcp = self.dist.group.options().clone();
            let detection = self.options.failure_detection;
            let (done, until_done) = mpsc::channel::<()>();
            std::thread::scope(|scope| {
                scope.spawn(move || {
                    let silent = wait_for_silence(heartbeats.as_ref(), watched, detection, &until_done);
                    if let Some((silent, quiet)) = silent {
                        let why = format!(
                            "rank(s) {silent:?} of the current group stopped beating for {quiet:.1?} while it formed its next one: they died"
                        );
                        TcpProcessGroup::abort_forming(forming, &tcp, rank, &why);
                    }
                });
                let formed = self.dist.regroup(rank, world);
                drop(done);
                formed
            })?;
        }
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
    /// With peer heartbeats ([`DdpOptions::peer_heartbeats`](crate::DdpOptions)), a survivor
    /// that dies while the others form their group is noticed within about twice the failure
    /// detection time: the set-up fails on every rank, and the ranks of the group that could
    /// not form agree again, in its namespace, on who carries on (as many times as ranks die
    /// this way). The agreement returned then names the ranks of the group that failed first.
    ///
    /// The new group's rank 0 asks the launchers to end the lost ranks' processes
    /// ([`crate::elastic::fencing`]), so that one that froze does not hold the job.
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
        let rank = self.rank();
        // The group that failed first, whose ranks every agreement names.
        let failed = Arc::clone(&self.dist.store);
        // Where the round's agreement is held, among how many ranks, this rank's number there,
        // and what the rounds before decided.
        let mut agreed_in = Arc::clone(&self.dist.store);
        let (mut world, mut round_rank) = (self.world_size(), rank);
        let mut gone = known_gone.to_vec();
        let mut before: Option<Survivors> = None;
        let mut rounds_left = self.world_size();
        loop {
            rounds_left -= 1;
            let round =
                agree_on_survivors(agreed_in.as_ref(), round_rank, world, step, &gone, options)?;
            let survivors = match &before {
                Some(before) => before.then(&round),
                None => round,
            };
            if survivors.members.first() == Some(&rank) {
                let why = format!(
                    "the survivors of step {step} carry on without it (fault_tolerance.on_rank_failure = \"continue\")"
                );
                fence(
                    failed.as_ref(),
                    self.dist.root.as_ref(),
                    &survivors.lost,
                    &why,
                );
            }
            fault::point(FaultPoint::Regrouping);
            let generation = self.dist.generation + 1;
            match self.regroup(&survivors.members) {
                Ok(()) => return Ok(survivors),
                // A round fails when a rank died in it: at most one round per rank.
                Err(DdpError::Collective(e)) if self.options.peer_heartbeats && rounds_left > 0 => {
                    tracing::warn!(
                        "rank {rank}: the survivors could not form their next group ({e}); they agree again"
                    );
                    agreed_in = Distributed::generation_store(&self.dist.root, generation);
                    world = survivors.members.len();
                    round_rank = survivors
                        .members
                        .iter()
                        .position(|&m| m == rank)
                        .unwrap_or(world);
                    gone = Vec::new();
                    before = Some(survivors);
                }
                Err(e) => return Err(e),
            }
        }
    }
}
