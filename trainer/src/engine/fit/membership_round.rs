//! The loop's one membership entry point: [`TrainingLoop::membership_round`], held at every
//! step boundary and after a failed step. From its cause and the job's state it finds the one
//! change due now — a scripted leave, the survivors of a failure (with the roll-forward of
//! those one step behind), joiners to admit (and, when one dies on its way in, the members
//! carrying on without it) — has the step kind carry it out, and applies it to the loop in
//! one place ([`after_regroup`](TrainingLoop::after_regroup)): the epoch re-sharded, the
//! plan and the schedule planned again from the position, as a resume at the new world size
//! would.

use std::time::Instant;

use burn_ddp::elastic::PlannedJoin;

use super::events::{Event, EventSink};
use super::membership::{peer_failure, LoopState, MembershipChange, Regrouped, Round, RoundCause};
use super::step_kind::StepKind;
use super::training_loop::{plan, TrainingLoop};
use crate::engine::fault_injection;
use crate::engine::schedule::Schedule;
use crate::error::UsageError;

/// The change a step boundary asks for, before the step kind carries it out.
enum BoundaryChange {
    /// This rank leaves (the scripted resize).
    Leave,
    /// These ranks (of the current group) leave; this one stays.
    Resize(Vec<usize>),
    /// These processes join now.
    Admit(PlannedJoin),
}

impl<K: StepKind, E: EventSink> TrainingLoop<'_, K, E> {
    /// The membership round: what `cause` and the job ask for, carried out by the step kind
    /// and applied to the loop; `module` holds the weights to go on from (after a failure in
    /// a step, the ones it started from). Returns the module and what the round did.
    /// `step_started`: when the step began (a failure's recovery counts from there).
    /// Collective over the ranks that go on.
    pub(super) fn membership_round(
        &mut self,
        module: K::Module,
        cause: RoundCause,
        step_started: Instant,
    ) -> anyhow::Result<(K::Module, Round)> {
        let (change, started) = match cause {
            RoundCause::Failure { error, dropped } => {
                return self.carry_on_after(error, module, dropped, step_started);
            }
            RoundCause::Boundary => (self.boundary_change()?, Instant::now()),
        };
        let (module, regrouped) = match change {
            None => return Ok((module, Round::Unchanged)),
            Some(BoundaryChange::Leave) => {
                self.left = true;
                return Ok((module, Round::Left));
            }
            Some(BoundaryChange::Resize(leaving)) => {
                let planned = MembershipChange::Planned { leaving: &leaving };
                (module, self.kind.regroup(planned)?)
            }
            Some(BoundaryChange::Admit(plan)) => {
                let schedule = self.schedule_state()?;
                let state = self.loop_state(schedule).to_bytes()?;
                // The weights to carry on from if a joiner dies while rank 0 hands them over.
                let before = module.clone();
                match self.kind.admit(module, &plan, state) {
                    Ok(admitted) => admitted,
                    Err(error) => {
                        return self.carry_on_after(error, before, None, started);
                    }
                }
            }
        };
        if regrouped.joined.is_empty() && regrouped.lost.is_empty() {
            return Ok((module, Round::Unchanged));
        }
        let schedule = self.schedule_state()?;
        self.after_regroup(regrouped, schedule, started)?;
        Ok((module, Round::Regrouped))
    }

    /// What this step boundary asks for: the scripted resize (every rank reads the same
    /// fault plan), else, when the survivors of a failure carry on, the joiners due now.
    fn boundary_change(&mut self) -> anyhow::Result<Option<BoundaryChange>> {
        let (rank, step) = (self.kind.rank(), self.position.step);
        if let Some(leaving) = fault_injection::plan().leaving_after(step) {
            if leaving.contains(&rank) {
                tracing::info!("rank {rank} leaves the job after step {step} (scripted resize)");
                return Ok(Some(BoundaryChange::Leave));
            }
            return Ok(Some(BoundaryChange::Resize(leaving.to_vec())));
        }
        if !self.settings.survivors_continue {
            return Ok(None);
        }
        Ok(self.kind.joiners_due(step)?.map(BoundaryChange::Admit))
    }

    /// A failure that the survivors survive (`fault_tolerance`): the step kind re-forms the
    /// group with the ranks that carry on, from `module` (the weights at the boundary); when
    /// some of them had finished one more step than others, every member takes the new rank
    /// 0's state ([`roll_forward`](Self::roll_forward)); then
    /// [`after_regroup`](Self::after_regroup). `dropped`: the schedule's state before the step
    /// in flight, when the failure came during it (the step is dropped). Any other error, one
    /// while re-forming, or any error when the survivors do not carry on, ends the run.
    /// Collective over the survivors.
    fn carry_on_after(
        &mut self,
        error: anyhow::Error,
        module: K::Module,
        dropped: Option<Vec<u8>>,
        started: Instant,
    ) -> anyhow::Result<(K::Module, Round)> {
        let in_step = dropped.is_some();
        let known_gone = match peer_failure(&error) {
            Some(gone) if self.settings.survivors_continue => gone,
            _ => return Err(error),
        };
        let step = self.position.step;
        tracing::warn!(
            "rank {}: {error:#}; the survivors re-form the job (fault_tolerance.on_rank_failure = \"continue\")",
            self.kind.rank()
        );
        let change = MembershipChange::Failure {
            known_gone: &known_gone,
            step,
            in_step,
        };
        let regrouped = self
            .kind
            .regroup(change)
            .map_err(|e| e.context(format!("carrying on after step {step} failed: {error:#}")))?;
        if in_step {
            self.membership.dropped_steps += 1;
        }
        let schedule = match dropped {
            Some(before) => before,
            None => self.schedule_state()?,
        };
        let (module, schedule) = match regrouped.roll_forward {
            Some(receiving) => self.roll_forward(module, schedule, receiving)?,
            None => (module, schedule),
        };
        self.after_regroup(regrouped, schedule, started)?;
        Ok((module, Round::Regrouped))
    }

    /// The survivors stood one step apart: rank 0 of the re-formed group (which finished the
    /// step) hands every member its module, its step kind's state and the loop's
    /// ([`LoopState`]); a member `receiving` (it was behind) goes on from them. Returns the
    /// module and the schedule's state to go on with. Collective.
    fn roll_forward(
        &mut self,
        module: K::Module,
        schedule: Vec<u8>,
        receiving: bool,
    ) -> anyhow::Result<(K::Module, Vec<u8>)> {
        let ours = self.loop_state(schedule.clone());
        let (module, theirs) = self.kind.catch_up(module, ours.to_bytes()?, receiving)?;
        if !receiving {
            return Ok((module, schedule));
        }
        let theirs = LoopState::from_bytes(&theirs)?;
        tracing::warn!(
            "rank {}: at step {}, one behind the others, it goes on from rank 0's state at step {}",
            self.kind.rank(),
            self.position.step,
            theirs.position.step
        );
        self.position = theirs.position;
        (self.last_saved, self.skipped) = (theirs.last_saved, theirs.skipped);
        Ok((module, theirs.schedule))
    }

    /// What a rank hands over of the loop (to a joiner, or to a survivor one step behind),
    /// with the schedule's state `schedule`.
    fn loop_state(&self, schedule: Vec<u8>) -> LoopState {
        LoopState {
            position: self.position,
            schedule,
            last_saved: self.last_saved,
            skipped: self.skipped,
        }
    }

    /// The one place a change of members is applied to the loop: the rest of the run at the
    /// new world size, from the position (the epoch re-sharded over the ranks there, the plan
    /// and the schedule's length planned again, the schedule going on from `schedule`, its
    /// state at the position), as a resume at this world size would; the `Regrouped` event.
    /// Fewer ranks than `fault_tolerance.min_world_size` stop the run (exit code 2).
    fn after_regroup(
        &mut self,
        regrouped: Regrouped,
        schedule: Vec<u8>,
        started: Instant,
    ) -> anyhow::Result<()> {
        let (rank, world) = (self.kind.rank(), self.kind.data_parallel_size());
        let min = self.settings.fault_tolerance.min_world_size;
        if world < min {
            return Err(UsageError(format!(
                "only {world} of {} ranks are left after step {} (lost ranks {:?}), fewer than fault_tolerance.min_world_size = {min} (or the launcher's --nnodes MIN times --nproc-per-node, when larger): stopping; the newest checkpoint resumes the run",
                regrouped.previous_world, self.position.step, regrouped.lost
            ))
            .into());
        }
        self.sampler = self.sampler.resharded(world, rank);
        self.plan = plan(&*self.kind, self.settings, &self.sampler, self.position);
        self.schedule = Schedule::new(&self.settings.optimizer, world, self.plan.total_steps)?
            .load_bytes(schedule)
            .map_err(|e| anyhow::anyhow!("the learning-rate schedule: {e}"))?;
        // Kept out of the step times and the rate, as validation is.
        let recovery = started.elapsed();
        self.clock.exclude(recovery);
        self.window.exclude(recovery);
        let recovery_secs = recovery.as_secs_f64();
        if regrouped.joined.is_empty() {
            self.membership.regroups += 1;
            self.membership.recovery_secs += recovery_secs;
        } else {
            self.membership.joins += 1;
            self.membership.join_secs += recovery_secs;
        }
        self.events.on(Event::Regrouped {
            position: self.position,
            rank,
            world_size: world,
            previous_world_size: regrouped.previous_world,
            lost: &regrouped.lost,
            joined: &regrouped.joined,
            dropped_steps: self.membership.dropped_steps,
            recovery_secs,
            total_steps: self.plan.total_steps,
        })?;
        Ok(())
    }
}
