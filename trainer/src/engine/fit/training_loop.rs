//! The training loop, written once for every step kind: restore, set up, then each epoch's
//! optimizer steps (each followed by what the [`StepPlan`] asks for: a `train` line, a replica
//! check, a checkpoint), each complete epoch's validation and checkpoint, and the finish (the
//! time report, the final checkpoint and validation).
//!
//! In code: [`fit`] runs `restore` (the step kind's) → [`TrainingLoop::set_up`] → per epoch
//! `train_epoch`: for each optimizer step `optimizer_step` and `after_step` (`log_train`,
//! checkpoint); then `end_of_epoch` → `finish` (`time_report`). What each becomes on disk or
//! screen is the [`EventSink`]'s business.
//!
//! The job's membership changes in one place, the membership round
//! ([`super::membership_round`]), which the loop holds at every step boundary and after a
//! failed step (`[fault_tolerance] on_rank_failure = "continue"`): ranks leave or die, processes
//! join; the loop then drops the step in flight (its weights are the clone taken before it),
//! re-shards the rest of the epoch over the ranks there and plans the run again from the
//! position, exactly as a resume at that world size would, and goes on: the one loop,
//! re-entered at the same epoch. A joiner's loop starts from rank 0's state
//! ([`LoopState`], `Start::Joined`) where a resumed one starts from a checkpoint.

use std::time::Instant;

use burn_ddp::fault::{self, FaultPoint};
use burn_ddp::sampler::Sample;
use burn_ddp::StepOutcome;

use super::events::{Event, EventSink};
use super::membership::{LoopState, Round, RoundCause};
use super::sampler::EpochSampler;
use super::step_kind::{StepInput, StepKind};
use super::summary::{Membership, NonFiniteGradients, Summary, Validation};
use crate::config::{
    CheckpointConfig, FaultToleranceConfig, OnNonFinite, OptimizerConfig, TrainingConfig,
};
use crate::engine::checkpoint::{self, Checkpoint, TrainPosition};
use crate::engine::loader::BatchStream;
use crate::engine::plan::{PlanInput, StepPlan};
use crate::engine::process_age::process_age_text;
use crate::engine::schedule::Schedule;
use crate::engine::throughput::ThroughputWindow;
use crate::report::timing::PhaseClock;

/// The config tables the loop reads.
#[derive(Debug, Clone, Default)]
pub(crate) struct LoopSettings {
    pub training: TrainingConfig,
    pub checkpoint: CheckpointConfig,
    pub optimizer: OptimizerConfig,
    pub fault_tolerance: FaultToleranceConfig,
    /// Whether the survivors of a failure carry on (`fault_tolerance`, at ZeRO stage 0); they
    /// then also admit processes that ask to join.
    pub survivors_continue: bool,
    /// Whether this rank joined a job that was training (it starts from rank 0's state, not
    /// from a checkpoint).
    pub joining: bool,
}

/// How a rank's training ended.
pub(crate) enum Fitted<M> {
    /// The run's end: the trained module and the summary.
    Done(M, Summary),
    /// This rank left the job after optimizer step `step`, as scripted.
    Left { step: usize },
}

impl<M> Fitted<M> {
    /// The trained module and summary of a run no rank of which may leave.
    pub(crate) fn done(self) -> anyhow::Result<(M, Summary)> {
        match self {
            Self::Done(module, summary) => Ok((module, summary)),
            Self::Left { step } => {
                anyhow::bail!("this rank left the job after step {step}, which this way of stepping cannot do")
            }
        }
    }
}

/// Where a rank's loop starts.
enum Start<'c> {
    /// The run's beginning.
    Fresh,
    /// The newest checkpoint every rank agreed on.
    Resumed(&'c Checkpoint),
    /// Rank 0's state, handed over as this rank joined the job.
    Joined(LoopState),
}

/// Trains `module` with step kind `kind` from the newest checkpoint (or the start) to the end
/// of the plan, reporting to `events`; returns the trained module and the run's summary (or
/// that this rank left the job). Collective over the job (every rank runs it with the same
/// settings).
pub(crate) fn fit<K: StepKind, E: EventSink>(
    kind: &mut K,
    module: K::Module,
    sampler: EpochSampler,
    settings: &LoopSettings,
    events: &mut E,
) -> anyhow::Result<Fitted<K::Module>> {
    let (mut module, mut run) = if settings.joining {
        let (module, state) = kind.join(module)?;
        let start = Start::Joined(LoopState::from_bytes(&state)?);
        (
            module,
            TrainingLoop::set_up(kind, events, settings, sampler, start)?,
        )
    } else {
        let (module, restored) = kind.restore(module)?;
        let start = restored.as_ref().map_or(Start::Fresh, Start::Resumed);
        (
            module,
            TrainingLoop::set_up(kind, events, settings, sampler, start)?,
        )
    };
    while run.plan.more_after(run.position) {
        module = run.train_epoch(module)?;
        if run.left {
            return Ok(Fitted::Left {
                step: run.position.step,
            });
        }
    }
    let summary = run.finish(&module)?;
    Ok(Fitted::Done(module, summary))
}

/// The state of one rank's training between its named steps (see [`fit`]); the membership
/// round ([`super::membership_round`]) changes the plan, the sampler and the schedule.
pub(super) struct TrainingLoop<'r, K: StepKind, E: EventSink> {
    pub(super) kind: &'r mut K,
    pub(super) events: &'r mut E,
    pub(super) settings: &'r LoopSettings,
    pub(super) schedule: Schedule,
    pub(super) plan: StepPlan,
    pub(super) sampler: EpochSampler,
    pub(super) clock: PhaseClock,
    pub(super) window: ThroughputWindow,
    pub(super) position: TrainPosition,
    pub(super) last_saved: Option<usize>,
    pub(super) last_valid: Option<Validation>,
    lr: f64,
    pub(super) skipped: usize,
    /// What re-forming the job cost so far.
    pub(super) membership: Membership,
    /// Whether this rank has left the job (a scripted resize).
    pub(super) left: bool,
    /// A joiner before its first step, which it reports.
    first_step_as_joiner: bool,
}

impl<'r, K: StepKind, E: EventSink> TrainingLoop<'r, K, E> {
    /// The step plan from the start's position, the schedule (restored or handed over), and
    /// the `Started` event.
    fn set_up(
        kind: &'r mut K,
        events: &'r mut E,
        settings: &'r LoopSettings,
        sampler: EpochSampler,
        start: Start<'_>,
    ) -> anyhow::Result<Self> {
        let position = match &start {
            Start::Fresh => TrainPosition::default(),
            Start::Resumed(c) => c.manifest.position,
            Start::Joined(state) => state.position,
        };
        let plan = plan(&*kind, settings, &sampler, position);
        let mut schedule = Schedule::new(
            &settings.optimizer,
            kind.data_parallel_size(),
            plan.total_steps,
        )?;
        let (mut last_saved, mut skipped) = (None, 0);
        match start {
            Start::Fresh => {}
            Start::Resumed(ckpt) => {
                schedule = checkpoint::load_schedule(ckpt, schedule)?;
                last_saved = Some(position.step);
            }
            Start::Joined(state) => {
                schedule = schedule
                    .load_bytes(state.schedule)
                    .map_err(|e| anyhow::anyhow!("the learning-rate schedule: {e}"))?;
                (last_saved, skipped) = (state.last_saved, state.skipped);
            }
        }
        let resumed_from = match settings.joining {
            false => last_saved,
            true => None,
        };
        events.on(Event::Started {
            position,
            total_steps: plan.total_steps,
            world_size: kind.world_size(),
            resumed_from,
        })?;
        Ok(Self {
            kind,
            events,
            settings,
            schedule,
            plan,
            sampler,
            clock: PhaseClock::new(),
            window: ThroughputWindow::new(),
            position,
            last_saved,
            last_valid: None,
            lr: 0.0,
            skipped,
            membership: Membership::default(),
            left: false,
            first_step_as_joiner: settings.joining,
        })
    }

    /// The rest of the current epoch: its optimizer steps (until the plan's last step), then
    /// its end if every sample of it was consumed.
    fn train_epoch(&mut self, mut module: K::Module) -> anyhow::Result<K::Module> {
        let samples = self
            .sampler
            .samples(self.position.epoch as u64, self.position.consumed);
        let epoch_start = self.position.consumed;
        // Each optimizer step's micro-batches, as lists of data-set indices, for the loader.
        let steps: Vec<&[Sample]> = samples.chunks(self.plan.per_step).collect();
        let micro_indices: Vec<Vec<usize>> = steps
            .iter()
            .flat_map(|step| self.plan.micro_batches(step))
            .map(|(micro, _)| micro.iter().map(|s| s.index).collect())
            .collect();
        let workers = self.settings.training.num_workers;
        let mut batches = BatchStream::new(self.kind.train_set(), micro_indices, workers);
        for (k, step_samples) in steps.iter().enumerate() {
            let started = Instant::now();
            // The weights and the schedule the step starts from, to carry on from if a rank
            // dies during it.
            let before = match self.settings.survivors_continue {
                true => Some((module.clone(), self.schedule_state()?)),
                false => None,
            };
            module = match (
                self.optimizer_step(module, &mut batches, step_samples),
                before,
            ) {
                (Ok(stepped), _) => stepped,
                (Err(error), Some((module, before))) => {
                    let dropped = Some(before);
                    let failed = RoundCause::Failure { error, dropped };
                    return Ok(self.membership_round(module, failed, started)?.0);
                }
                (Err(e), None) => return Err(e),
            };
            self.position = self.plan.after_step(self.position, epoch_start, k);
            self.clock.end_step();
            if std::mem::take(&mut self.first_step_as_joiner) {
                // Said on every rank (as a left rank's line is): how fast a restarted rank
                // got back to work.
                eprintln!(
                    "[rank {}] trained its first step in the job (step {}) {} after this process started",
                    self.kind.rank(),
                    self.position.step,
                    process_age_text()
                );
            }
            self.window
                .add(step_samples.len() * self.kind.data_parallel_size());
            let cause = match self.after_step(&module, step_samples) {
                Ok(()) => RoundCause::Boundary,
                Err(error) if self.settings.survivors_continue => RoundCause::Failure {
                    error,
                    dropped: None,
                },
                Err(e) => return Err(e),
            };
            // The step boundary's membership round: who leaves, who died, who joins.
            module = match self.membership_round(module, cause, started)? {
                (module, Round::Unchanged) => module,
                (module, Round::Regrouped | Round::Left) => return Ok(module),
            };
            if self.position.step >= self.plan.total_steps {
                break;
            }
        }
        if self.plan.epoch_complete(self.position, samples.is_empty()) {
            self.end_of_epoch(&module)?;
        }
        Ok(module)
    }

    /// One optimizer step of the step kind at the schedule's next rate; when some rank's
    /// gradients were not finite, stops or skips on every rank alike
    /// (`training.on_nonfinite`). Collective.
    fn optimizer_step(
        &mut self,
        module: K::Module,
        batches: &mut BatchStream<K::Item>,
        step_samples: &[Sample],
    ) -> anyhow::Result<K::Module> {
        self.lr = self.schedule.next_lr();
        let step = StepInput {
            number: self.position.step + 1,
            samples: step_samples,
            micro_batches: self.plan.micro_batches(step_samples),
            // Seeded per step, so dropout masks are the same in a resumed run.
            seed: (self.settings.training.seed).wrapping_add(self.position.step as u64 + 1),
            lr: self.lr,
        };
        let (module, outcome) = self.kind.step(module, batches, &step, &mut self.clock)?;
        if let StepOutcome::Skipped { ranks } = outcome {
            // Every rank has the same outcome: all stop, or all skip, together.
            let failed = NonFiniteGradients {
                step: self.position.step + 1,
                ranks,
                last_checkpoint: self.last_saved,
            };
            match self.settings.training.on_nonfinite {
                OnNonFinite::Stop => return Err(failed.into()),
                OnNonFinite::Skip => {
                    self.skipped += 1;
                    tracing::warn!(
                        "{failed}; skipped on every rank (training.on_nonfinite = \"skip\")"
                    );
                }
            }
        }
        Ok(module)
    }

    /// What the plan asks for after an optimizer step: a metrics line, a replica check, a
    /// checkpoint; then the fault point after the step. Collective.
    fn after_step(&mut self, module: &K::Module, step_samples: &[Sample]) -> anyhow::Result<()> {
        let step = self.position.step;
        self.events.on(Event::Stepped {
            epoch: self.position.epoch,
            samples: step_samples,
        })?;
        if self.plan.log_after(step) {
            self.log_train()?;
        }
        if self.plan.check_replicas_after(step) {
            self.kind.check_replicas(module, step)?;
        }
        if self.plan.checkpoint_after_step(step) {
            self.save_checkpoint(module)?;
        }
        let rank = self.kind.rank();
        fault::point(FaultPoint::AfterStep { rank, step });
        Ok(())
    }

    /// The learning-rate schedule's state (its record), as a checkpoint holds it.
    pub(super) fn schedule_state(&self) -> anyhow::Result<Vec<u8>> {
        self.schedule
            .to_bytes()
            .map_err(|e| anyhow::anyhow!("the learning-rate schedule: {e}"))
    }

    /// A `Trained` event: the metrics of the steps since the last one over the job, the rate,
    /// the step times. Collective.
    fn log_train(&mut self) -> anyhow::Result<()> {
        let position = self.position;
        let metrics = self.kind.train_metrics(position, self.lr)?;
        let samples_per_sec = self.window.rate();
        let (time, _) = self.kind.across_ranks(self.clock.take_window())?;
        self.events.on(Event::Trained {
            position,
            lr: self.lr,
            samples_per_sec,
            world_size: self.kind.world_size(),
            metrics: &metrics,
            time,
        })?;
        self.window = ThroughputWindow::new();
        Ok(())
    }

    /// A complete epoch: the position moves to the next one, then validation (kept out of
    /// the step times and the rate) and, as the plan says, a checkpoint. Collective.
    fn end_of_epoch(&mut self, module: &K::Module) -> anyhow::Result<()> {
        self.position.epoch += 1;
        self.position.consumed = 0;
        let validating = Instant::now();
        let v = self.kind.validate(module, self.position.step)?;
        self.clock.exclude(validating.elapsed());
        self.window.exclude(validating.elapsed());
        if let Some(v) = &v {
            self.events.on(Event::Validated {
                epoch: self.position.epoch - 1,
                validation: v,
                epochs: Some(self.settings.training.epochs),
            })?;
        }
        self.last_valid = v;
        if self.plan.checkpoint_after_epoch(self.position.epoch)
            && self.last_saved != Some(self.position.step)
        {
            self.save_checkpoint(module)?;
        }
        Ok(())
    }

    /// A checkpoint of the current position (the step kind writes it). Collective.
    pub(super) fn save_checkpoint(&mut self, module: &K::Module) -> anyhow::Result<()> {
        let saving = Instant::now();
        self.kind.save(self.position, module, &self.schedule)?;
        self.clock
            .add(crate::report::timing::Phase::Checkpoint, saving.elapsed());
        self.last_saved = Some(self.position.step);
        Ok(())
    }
}

/// The step plan of this rank's shard from `position` (a pipeline's replica is one rank of
/// the sampler).
pub(super) fn plan<K: StepKind>(
    kind: &K,
    settings: &LoopSettings,
    sampler: &EpochSampler,
    position: TrainPosition,
) -> StepPlan {
    let t = &settings.training;
    let c = &settings.checkpoint;
    StepPlan::new(
        PlanInput {
            train_len: kind.train_set().len(),
            world_size: kind.data_parallel_size(),
            batch_size: t.batch_size,
            accumulation_steps: t.accumulation_steps,
            epochs: t.epochs,
            max_steps: t.max_steps,
            log_every: t.log_every,
            checkpoint_every_steps: c.every_steps,
            checkpoint_every_epochs: c.every_epochs,
            check_replicas_every: t.check_replicas_every,
        },
        position,
        sampler.samples(0, 0).len(),
        sampler
            .samples(position.epoch as u64, position.consumed)
            .len(),
    )
}

#[cfg(test)]
mod tests;
