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
//! When the job's membership changes at a step boundary (`[fault_tolerance] on_rank_failure =
//! "continue"`: a rank died; or the tests' scripted resize), the step kind re-forms its groups
//! (`regroup`), the loop drops the step in flight (its weights are the clone taken before it),
//! re-shards the rest of the epoch over the ranks left and plans the run again from the
//! position, exactly as a resume at that world size would (`after_regroup`), and goes on: the
//! one loop, re-entered at the same epoch. Processes that ask to join are admitted the same
//! way at a step boundary (`admit_joiners`): the step kind forms the grown group and hands
//! them rank 0's state with the loop's ([`LoopState`]); a joiner's loop starts from it
//! (`Start::Joined`) where a resumed one starts from a checkpoint.

use std::time::Instant;

use burn_ddp::elastic::PlannedJoin;
use burn_ddp::sampler::Sample;
use burn_ddp::StepOutcome;

use super::events::{Event, EventSink, HeldState};
use super::membership::{peer_failure, LoopState, MembershipChange, Regrouped};
use super::sampler::EpochSampler;
use super::step_kind::{StepInput, StepKind};
use super::summary::{Membership, NonFiniteGradients, Summary, Validation};
use crate::config::{
    CheckpointConfig, FaultToleranceConfig, OnNonFinite, OptimizerConfig, TrainingConfig,
};
use crate::engine::checkpoint::{self, Checkpoint, TrainPosition};
use crate::engine::fault_injection;
use crate::engine::loader::BatchStream;
use crate::engine::plan::{PlanInput, StepPlan};
use crate::engine::process_age::process_age_text;
use crate::engine::schedule::Schedule;
use crate::engine::throughput::ThroughputWindow;
use crate::error::UsageError;
use crate::report::timing::{PhaseClock, StepTime};
use burn_ddp::fault::{self, FaultPoint};

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

/// What the end of a step boundary asks of the loop.
enum Boundary {
    /// The next step of the same plan.
    Continue,
    /// The job re-formed its group: plan the rest again.
    Regrouped,
    /// This rank left the job.
    Left,
    /// Processes join the job now.
    Join(PlannedJoin),
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

/// The state of one rank's training between its named steps (see [`fit`]).
struct TrainingLoop<'r, K: StepKind, E: EventSink> {
    kind: &'r mut K,
    events: &'r mut E,
    settings: &'r LoopSettings,
    schedule: Schedule,
    plan: StepPlan,
    sampler: EpochSampler,
    clock: PhaseClock,
    window: ThroughputWindow,
    position: TrainPosition,
    last_saved: Option<usize>,
    last_valid: Option<Validation>,
    lr: f64,
    skipped: usize,
    /// What re-forming the job cost so far.
    membership: Membership,
    /// Whether this rank has left the job (a scripted resize).
    left: bool,
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
                (Err(e), Some((module, schedule))) => {
                    return self.carry_on_after(e, module, Some(schedule), started);
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
            match self.after_step(&module, step_samples) {
                Ok(Boundary::Continue) => {}
                Ok(Boundary::Regrouped | Boundary::Left) => return Ok(module),
                Ok(Boundary::Join(plan)) => return self.admit_joiners(module, &plan),
                Err(e) if self.settings.survivors_continue => {
                    return self.carry_on_after(e, module, None, started);
                }
                Err(e) => return Err(e),
            }
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
    /// checkpoint; then the fault-injection hooks, the last of which is the tests' scripted
    /// resize; then, when the survivors of a failure carry on, whether processes join now.
    fn after_step(
        &mut self,
        module: &K::Module,
        step_samples: &[Sample],
    ) -> anyhow::Result<Boundary> {
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
        match fault_injection::plan()
            .leaving_after(step)
            .map(<[usize]>::to_vec)
        {
            Some(leaving) if leaving.contains(&rank) => {
                tracing::info!("rank {rank} leaves the job after step {step} (scripted resize)");
                self.left = true;
                Ok(Boundary::Left)
            }
            Some(leaving) => {
                let started = Instant::now();
                let regrouped = self
                    .kind
                    .regroup(MembershipChange::Planned { leaving: &leaving })?;
                let schedule = self.schedule_state()?;
                self.after_regroup(regrouped, schedule, started)?;
                Ok(Boundary::Regrouped)
            }
            None if self.settings.survivors_continue => match self.kind.joiners_due(step)? {
                Some(plan) => Ok(Boundary::Join(plan)),
                None => Ok(Boundary::Continue),
            },
            None => Ok(Boundary::Continue),
        }
    }

    /// Admits `plan`'s joiners at this step boundary: the step kind forms the grown group and
    /// hands them rank 0's state and the loop's ([`LoopState`]), then the rest of the run is
    /// planned again at the grown world size ([`after_regroup`](Self::after_regroup)). A
    /// joiner that dies on its way in is lost as a failed rank is: the members carry on
    /// without it from this boundary. Collective over the grown job.
    fn admit_joiners(
        &mut self,
        module: K::Module,
        plan: &PlannedJoin,
    ) -> anyhow::Result<K::Module> {
        let started = Instant::now();
        let schedule = self.schedule_state()?;
        let state = self.loop_state(schedule.clone());
        // The weights to carry on from if a joiner dies while rank 0 hands them over.
        let before = module.clone();
        let (module, regrouped) = match self.kind.admit(module, plan, state.to_bytes()?) {
            Ok(admitted) => admitted,
            Err(e) if self.settings.survivors_continue => {
                return self.carry_on_after(e, before, None, started);
            }
            Err(e) => return Err(e),
        };
        if !regrouped.joined.is_empty() || !regrouped.lost.is_empty() {
            self.after_regroup(regrouped, schedule, started)?;
        }
        Ok(module)
    }

    /// A failure at a step boundary that the survivors survive: the step kind re-forms the
    /// group with the ranks that carry on, from `module` (the weights at the boundary); when
    /// some of them had finished one more step than others, every member takes the new rank
    /// 0's state ([`roll_forward`](Self::roll_forward)); then
    /// [`after_regroup`](Self::after_regroup). `dropped`: the schedule's state before the step
    /// in flight, when the failure came during it (the step is dropped). Any other error, or
    /// one while re-forming, ends the run as before. Returns the module to go on with.
    /// Collective over the survivors.
    fn carry_on_after(
        &mut self,
        error: anyhow::Error,
        module: K::Module,
        dropped: Option<Vec<u8>>,
        started: Instant,
    ) -> anyhow::Result<K::Module> {
        let in_step = dropped.is_some();
        let Some(known_gone) = peer_failure(&error) else {
            return Err(error);
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
        Ok(module)
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

    /// The learning-rate schedule's state (its record), as a checkpoint holds it.
    fn schedule_state(&self) -> anyhow::Result<Vec<u8>> {
        self.schedule
            .to_bytes()
            .map_err(|e| anyhow::anyhow!("the learning-rate schedule: {e}"))
    }

    /// The rest of the run at the new world size, from the position: the epoch re-sharded
    /// over the ranks left, the plan and the schedule's length planned again (the schedule
    /// goes on from `schedule`, its state at the position), as a resume at this world size
    /// would; the `Regrouped` event. Fewer ranks than `fault_tolerance.min_world_size` stop
    /// the run (exit code 2).
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

    /// The end of the run: the step times over the ranks, the final checkpoint and validation
    /// if the last step had none, then what the run held (`Finished`, whose peak memory
    /// counts the final checkpoint and validation), the step kind's own end. Collective.
    fn finish(mut self, module: &K::Module) -> anyhow::Result<Summary> {
        self.events.on(Event::StepsDone)?;
        // Taken before the final checkpoint: the report is of the steps' times.
        let times = self.step_times()?;
        let position = self.position;
        if self.last_saved != Some(position.step) {
            self.save_checkpoint(module)?;
        }
        let validation = match self.last_valid.take() {
            Some(v) if v.step == position.step => Some(v),
            _ => {
                // Stopped mid-epoch (max_steps): validate the final model too, and record it.
                let v = self.kind.validate(module, position.step)?;
                if let Some(v) = &v {
                    self.events.on(Event::Validated {
                        epoch: position.epoch,
                        validation: v,
                        epochs: None,
                    })?;
                }
                v
            }
        };
        let time = match times {
            Some((time, report)) => {
                self.finished(time, &report)?;
                Some(report)
            }
            None => None,
        };
        self.kind.finish(position)?;
        self.events.on(Event::Ended)?;
        Ok(Summary {
            validation,
            steps: position.step,
            skipped_steps: self.skipped,
            membership: self.membership.clone(),
            time,
        })
    }

    /// The run's step times over the ranks and the report in words; `None` without steps.
    /// Collective.
    fn step_times(&mut self) -> anyhow::Result<Option<(StepTime, String)>> {
        // The steps since the last log line count in the run's totals.
        let _ = self.clock.take_window();
        if self.clock.run_steps() == 0 {
            return Ok(None);
        }
        let (time, ranks) = self.kind.across_ranks(self.clock.run_means())?;
        let report = time.describe(&ranks);
        Ok(Some((time, report)))
    }

    /// The `Finished` event: the step times, and each rank's peak memory and held training
    /// state, read now, so that the peak includes everything the run did (the final
    /// checkpoint and validation: at ZeRO stage 2 rank 0's merge of the optimizer state for
    /// the checkpoint is often its peak). Collective.
    fn finished(&mut self, time: StepTime, report: &str) -> anyhow::Result<()> {
        let mut ours = vec![crate::engine::memory::peak_resident_bytes().unwrap_or(0) as f64];
        ours.extend(self.kind.held_state()?.to_values());
        let all = self.kind.all_gather(&ours)?;
        let per_rank = all.chunks(ours.len());
        self.events.on(Event::Finished {
            step: self.position.step,
            world_size: self.kind.world_size(),
            time,
            report,
            peak_rss_bytes: per_rank.clone().map(|r| r[0] as u64).collect(),
            held: per_rank.map(|r| HeldState::from_values(&r[1..])).collect(),
        })
    }

    /// A checkpoint of the current position (the step kind writes it). Collective.
    fn save_checkpoint(&mut self, module: &K::Module) -> anyhow::Result<()> {
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
fn plan<K: StepKind>(
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
