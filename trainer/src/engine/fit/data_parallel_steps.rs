//! The data-parallel step kind of one rank: every rank holds the whole model (or its ZeRO
//! shard) and trains on its shard of the data; one optimizer step is burn-ddp's
//! `DataParallel::step` over the accumulated micro-batches (gradients averaged across the
//! ranks, the job's verdict on them, the optimizer, the buffers made equal); the membership
//! changes the loop asks for are `DataParallel::regroup`, `regroup_after_failure` and
//! `admit_joiners`, with rank 0's state handed over. [`super::data_parallel::train`] runs the
//! loop with it.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsAccumulator, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor};
use burn::train::TrainStep;
use burn_ddp::ddp::fsdp::reshard::ShardTarget;
use burn_ddp::ddp::zero::sharded_sync;
use burn_ddp::elastic::{AgreementOptions, PlannedJoin};
use burn_ddp::fault::{self, FaultPoint, JoinStage};
use burn_ddp::{DataParallel, MicroBatch, StepOutcome};

use super::across_ranks::{across_ranks, train_metrics_window};
use super::events::HeldState;
use super::membership::{MembershipChange, Regrouped};
use super::optimizer::optimizer;
use super::step_kind::{StepInput, StepKind};
use super::summary::Validation;
use crate::app::{App, AppConfig, Datasets, TrainItem, ValidItem};
use crate::engine::checkpoint::{self, Checkpoint, TrainPosition};
use crate::engine::fault_injection;
use crate::engine::loader::BatchStream;
use crate::engine::parallel::{self, CheckpointPolicy};
use crate::engine::schedule::Schedule;
use crate::engine::sharded_checkpoint;
use crate::report::metrics::{MetricValue, Metrics};
use crate::report::timing::{Phase, PhaseClock, RankTimes, StepTime};

/// The data-parallel step kind of one rank (module docs).
pub(super) struct DataParallelSteps<A: App> {
    /// Kept to start again as a joiner (the tests' scripted grow).
    app: A,
    pub(super) config: AppConfig<A>,
    pub(super) ddp: DataParallel,
    data: Datasets<A::Item>,
    /// This rank's autodiff training device.
    device: Device,
    optim: ModuleOptimizer,
    batcher: A::Batcher,
    train_metrics: Metrics<TrainItem<A>>,
    valid_metrics: Metrics<ValidItem<A>>,
    /// Each micro-batch's output with its number of samples, until the next `train` line.
    outputs: Vec<(TrainItem<A>, usize)>,
    /// `None` without `checkpoint.dir`.
    checkpoints: Option<CheckpointPolicy>,
    /// Resume from the newest checkpoint (`checkpoint.resume`, not `--no-resume`).
    resume: bool,
    /// Fault injection: extra time in every step of this rank.
    slow_step: Option<Duration>,
    /// How many outputs the step in flight found in `outputs` (its own go if it is dropped).
    outputs_before_step: usize,
}

impl<A: App> DataParallelSteps<A> {
    pub(super) fn new(
        app: A,
        config: AppConfig<A>,
        ddp: DataParallel,
        data: Datasets<A::Item>,
        device: Device,
        no_resume: bool,
    ) -> Self {
        Self {
            optim: optimizer(&config.optimizer),
            batcher: app.batcher(&config.model, &config.data, &device),
            train_metrics: app.train_metrics(),
            valid_metrics: app.valid_metrics(),
            outputs: Vec::new(),
            checkpoints: CheckpointPolicy::for_app(&app, &config),
            resume: config.checkpoint.resume && !no_resume,
            slow_step: fault_injection::plan().slow_step(ddp.rank()),
            outputs_before_step: 0,
            app,
            config,
            ddp,
            data,
            device,
        }
    }

    /// What a rank that left the job keeps to start again as one that joins it (the tests'
    /// scripted grow): the app, its config, the job (to close), the data sets and the device.
    pub(super) fn into_parts(self) -> (A, AppConfig<A>, DataParallel, Datasets<A::Item>, Device) {
        (self.app, self.config, self.ddp, self.data, self.device)
    }

    /// Rank 0's training state to the ranks that join (`joining`: this rank is one; the
    /// members' own state is kept): its weights (as at the start: `DataParallel::prepare`),
    /// its optimizer state (burnpack bytes, as a checkpoint holds it) and `loop_state`;
    /// returns the module and rank 0's loop state. Collective over the grown job.
    fn hand_over(
        &mut self,
        module: A::Model,
        loop_state: Vec<u8>,
        joining: bool,
    ) -> anyhow::Result<(A::Model, Vec<u8>)> {
        let module = self.ddp.prepare(module)?;
        let ours = match self.ddp.rank() {
            0 => self
                .optim
                .into_bytes()
                .map_err(|e| anyhow::anyhow!("cannot serialise the optimizer state: {e}"))?
                .to_vec(),
            _ => Vec::new(),
        };
        let state = self.ddp.broadcast_bytes(ours)?;
        if joining {
            self.optim = checkpoint::load_optimizer_bytes(
                Path::new("(rank 0's optimizer state, handed over)"),
                state,
                optimizer(&self.config.optimizer),
            )?;
        }
        let loop_state = self.ddp.broadcast_bytes(loop_state)?;
        Ok((module, loop_state))
    }

    /// Forward and backward of each micro-batch of the step, each weighted by its share of the
    /// step's samples (the step's gradient is the mean over its samples); waits for the device.
    fn accumulate(
        &mut self,
        model: &A::Model,
        batches: &mut BatchStream<A::Item>,
        step: &StepInput<'_>,
        clock: &mut PhaseClock,
    ) -> anyhow::Result<GradientsParams> {
        let mut accumulator = GradientsAccumulator::<A::Model>::new();
        let last = step.micro_batches.len().saturating_sub(1);
        for (i, (micro, weight)) in step.micro_batches.iter().enumerate() {
            let (batcher, device) = (&self.batcher, &self.device);
            let batch = clock.time(Phase::Data, || batches.next_batch(batcher, device))?;
            let compute = Instant::now();
            // What runs before this micro-batch's forward and backward (burn-ddp orders it):
            // the last one's backward may put marked blocks' gradients on the wire as it goes,
            // combined with the earlier ones as below; at ZeRO stage 3 the marked blocks are
            // gathered whole for the forward and backward.
            let earlier = (i == last && i > 0).then(|| accumulator.grads());
            let position = if i == last {
                MicroBatch::Last {
                    earlier: earlier.as_ref(),
                    weight: *weight,
                }
            } else {
                MicroBatch::Accumulating
            };
            let scope = self.ddp.micro_batch(model, position);
            if let Some(earlier) = earlier {
                accumulator.accumulate(model, earlier);
            }
            let output = TrainStep::step(model, batch);
            drop(scope);
            let mut grads = output.grads;
            if *weight != 1.0 {
                // Each micro-batch's mean loss counts by its share.
                scale_gradients(model, &mut grads, *weight);
            }
            accumulator.accumulate(model, grads);
            self.outputs.push((output.item, micro.len()));
            clock.add(Phase::Compute, compute.elapsed());
        }
        let compute = Instant::now();
        if let Some(extra) = self.slow_step {
            std::thread::sleep(extra);
        }
        // On an asynchronous device the backward is still queued: wait for it here, so that
        // its time counts as compute, not as gradient communication (the sync needs the
        // gradients next anyway).
        self.device
            .sync()
            .map_err(|e| anyhow::anyhow!("the device failed: {e:?}"))?;
        clock.add(Phase::Compute, compute.elapsed());
        Ok(accumulator.grads())
    }
}

impl<A: App> DataParallelSteps<A> {
    /// ZeRO stage 3: the model with its marked blocks cut into shards, the blocks found by
    /// one forward and backward of the training set's first sample (burn-ddp's
    /// `DataParallel::fully_shard`). Other stages: the model as it is.
    fn fully_shard(&mut self, model: A::Model) -> anyhow::Result<A::Model> {
        if !self.config.distributed.zero_stage.shards_parameters() {
            return Ok(model);
        }
        let item = self
            .data
            .train
            .get(0)
            .map_err(|e| anyhow::anyhow!("data: cannot read the first training sample: {e}"))?;
        let batch: <A::Model as TrainStep>::Input =
            Batcher::batch(&self.batcher, vec![item], &self.device);
        Ok(self.ddp.fully_shard(model, |model| {
            let _ = TrainStep::step(model, batch);
        })?)
    }
}

impl<A: App> StepKind for DataParallelSteps<A> {
    type Item = A::Item;
    type Module = A::Model;

    fn rank(&self) -> usize {
        self.ddp.rank()
    }

    fn world_size(&self) -> usize {
        self.ddp.world_size()
    }

    fn data_parallel_size(&self) -> usize {
        self.ddp.world_size()
    }

    fn train_set(&self) -> Arc<dyn Dataset<A::Item>> {
        self.data.train.clone()
    }

    /// Loads the newest checkpoint, if resuming, then makes the replicas equal (rank 0's
    /// weights, deterministic parameter ids), cuts the marked blocks into shards at ZeRO stage
    /// 3, and keeps this rank's optimizer state (a stage-3 checkpoint's joined or re-cut for
    /// this world size and stage).
    fn restore(&mut self, model: A::Model) -> anyhow::Result<(A::Model, Option<Checkpoint>)> {
        let restored = match (&self.checkpoints, self.resume) {
            (Some(policy), true) => sharded_checkpoint::latest_agreed(&mut self.ddp, policy)?,
            _ => None,
        };
        let mut model = model;
        if let Some(found) = &restored {
            model = found.load_model(model)?;
        }
        let model = self.ddp.prepare(model)?;
        let model = self.fully_shard(model)?;
        let (rank, world) = (self.ddp.rank(), self.ddp.world_size());
        if let Some(found) = &restored {
            let optim = std::mem::replace(&mut self.optim, optimizer(&self.config.optimizer));
            let optim = match self.ddp.shard_layout() {
                Some(layout) => found.load_optimizer(
                    optim,
                    ShardTarget::Shard { rank, world },
                    layout.shapes(),
                )?,
                None => found.load_optimizer(optim, ShardTarget::Whole, &HashMap::new())?,
            };
            // A checkpoint holds every parameter's state; under ZeRO stages 1 and 2 keep this rank's.
            self.optim = self.ddp.keep_owned_state(&model, optim)?;
            let manifest = found.manifest();
            if let (Some(policy), Some(_)) = (&self.checkpoints, self.ddp.shard_layout()) {
                // Parts this rank wrote after the step every rank has (a crash between the
                // ranks' writes) would stand in for the steps retrained.
                sharded_checkpoint::discard_after(
                    &policy.dir,
                    world,
                    rank,
                    manifest.position.step,
                )?;
            }
            let position = manifest.position;
            tracing::info!(
                "resumed from {} (epoch {}, {} samples into it, step {}; saved with world size {}, now {})",
                found.dir().display(),
                position.epoch,
                position.consumed,
                position.step,
                manifest.world_size,
                world
            );
        }
        Ok((model, restored.map(|found| found.checkpoint().clone())))
    }

    /// The micro-batches' gradients accumulated, then burn-ddp's DDP step with the optimizer
    /// at the step's rate. The DDP step's time counts as sync, the optimizer's own as
    /// optimizer.
    fn step(
        &mut self,
        model: A::Model,
        batches: &mut BatchStream<A::Item>,
        step: &StepInput<'_>,
        clock: &mut PhaseClock,
    ) -> anyhow::Result<(A::Model, StepOutcome)> {
        self.device.seed(step.seed);
        self.outputs_before_step = self.outputs.len();
        let grads = self.accumulate(&model, batches, step, clock)?;
        fault::point(FaultPoint::InStep {
            rank: self.ddp.rank(),
            step: step.number,
        });
        let (optim, lr) = (&mut self.optim, step.lr);
        let mut optimizer_time = Duration::ZERO;
        let mut updated = false;
        let started = Instant::now();
        let stepped = self.ddp.step(model, grads, |model, grads| {
            updated = true;
            let optimize = Instant::now();
            let model = model.optimize(optim, lr.into(), grads);
            optimizer_time = optimize.elapsed();
            model
        });
        let stepped = match stepped {
            Ok(stepped) => stepped,
            // The optimizer state has moved on: this step cannot be dropped any more, so the
            // error is not one the survivors carry on after.
            Err(e) if updated => bail!(
                "{e} (after this rank's optimizer applied the step, so the step cannot be dropped: restart from the newest checkpoint)"
            ),
            Err(e) => return Err(e.into()),
        };
        clock.add(Phase::Optimizer, optimizer_time);
        clock.add(
            Phase::Sync,
            started.elapsed().saturating_sub(optimizer_time),
        );
        Ok(stepped)
    }

    /// A planned resize: the ranks not leaving re-form in their order. After a failure: the
    /// survivors' agreement through the store, then the same (burn-ddp's
    /// `DataParallel::regroup_after_failure`); a dropped step's outputs go.
    fn regroup(&mut self, change: MembershipChange<'_>) -> anyhow::Result<Regrouped> {
        let previous_world = self.ddp.world_size();
        let mut roll_forward = None;
        let lost = match change {
            MembershipChange::Planned { leaving } => {
                let members: Vec<usize> = (0..previous_world)
                    .filter(|r| !leaving.contains(r))
                    .collect();
                self.ddp.regroup(&members)?;
                (0..previous_world)
                    .filter(|r| leaving.contains(r))
                    .collect()
            }
            MembershipChange::Failure {
                known_gone,
                step,
                in_step,
            } => {
                if in_step {
                    self.outputs.truncate(self.outputs_before_step);
                }
                let detection = Duration::from_secs_f64(self.config.fault_tolerance.detection_secs);
                let old_rank = self.ddp.rank();
                let survivors = self.ddp.regroup_after_failure(
                    known_gone,
                    step as u64,
                    &AgreementOptions::after_detection(detection),
                )?;
                if !survivors.behind.is_empty() {
                    roll_forward = Some(survivors.behind.contains(&old_rank));
                }
                survivors.lost
            }
        };
        tracing::info!(
            "the job re-formed without rank(s) {lost:?}: rank {} of {} now",
            self.ddp.rank(),
            self.ddp.world_size()
        );
        Ok(Regrouped {
            previous_world,
            lost,
            joined: Vec::new(),
            roll_forward,
        })
    }

    /// The scripted grow (`TRAINER_JOIN_AFTER_STEP`) admits its joiner at its step only,
    /// waiting for it there at most the group's timeout.
    fn joiners_due(&mut self, step: usize) -> anyhow::Result<Option<PlannedJoin>> {
        let wait = match fault_injection::plan().join_after_step() {
            Some(at) if at == step => {
                Some(Duration::from_secs(self.config.distributed.timeout_secs))
            }
            Some(_) => return Ok(None),
            None => None,
        };
        Ok(self.ddp.joiners_due(step as u64, wait)?)
    }

    fn admit(
        &mut self,
        module: A::Model,
        plan: &PlannedJoin,
        loop_state: Vec<u8>,
    ) -> anyhow::Result<(A::Model, Regrouped)> {
        let previous_world = self.ddp.world_size();
        let admitted = self.ddp.admit_joiners(plan)?;
        if admitted.failure.is_some() {
            // The members carried on without the joiners: as after a failure, a group that
            // lost them (and any member that died meanwhile).
            let grown = previous_world + plan.requests.len();
            let lost = admitted.lost.into_iter().chain(previous_world..grown);
            return Ok((
                module,
                Regrouped {
                    previous_world: grown,
                    lost: lost.collect(),
                    joined: Vec::new(),
                    roll_forward: None,
                },
            ));
        }
        let joined = admitted.joined;
        if joined == 0 {
            return Ok((
                module,
                Regrouped {
                    previous_world,
                    lost: Vec::new(),
                    joined: Vec::new(),
                    roll_forward: None,
                },
            ));
        }
        tracing::info!(
            "{joined} rank(s) joined the job after step {}: {} ranks now",
            plan.step,
            self.ddp.world_size()
        );
        let (module, _) = self.hand_over(module, loop_state, false)?;
        Ok((
            module,
            Regrouped {
                previous_world,
                lost: Vec::new(),
                joined: (previous_world..self.ddp.world_size()).collect(),
                roll_forward: None,
            },
        ))
    }

    fn catch_up(
        &mut self,
        module: A::Model,
        loop_state: Vec<u8>,
        receiving: bool,
    ) -> anyhow::Result<(A::Model, Vec<u8>)> {
        self.hand_over(module, loop_state, receiving)
    }

    fn join(&mut self, module: A::Model) -> anyhow::Result<(A::Model, Vec<u8>)> {
        fault::point(FaultPoint::Joining(JoinStage::Admitted));
        self.hand_over(module, Vec::new(), true)
    }

    fn train_metrics(
        &mut self,
        position: TrainPosition,
        lr: f64,
    ) -> anyhow::Result<Vec<MetricValue>> {
        train_metrics_window(
            &mut self.train_metrics,
            std::mem::take(&mut self.outputs),
            position,
            self.data.train.len(),
            lr,
            self.ddp.group(),
        )
    }

    fn across_ranks(&mut self, ours: RankTimes) -> anyhow::Result<(StepTime, Vec<RankTimes>)> {
        across_ranks(self.ddp.group(), ours)
    }

    fn all_gather(&mut self, ours: &[f64]) -> anyhow::Result<Vec<f64>> {
        Ok(self.ddp.all_gather(ours)?)
    }

    fn held_state(&mut self) -> anyhow::Result<HeldState> {
        Ok(HeldState {
            optimizer_state_params: sharded_sync::state_param_ids(&self.optim)?.len() as u64,
            optimizer_state_bytes: sharded_sync::state_bytes(&self.optim)?,
            gradient_bytes: self.ddp.gradient_bytes(),
            parameter_bytes: self.ddp.parameter_bytes(),
            gathered_peak_bytes: self.ddp.gathered_peak_bytes(),
        })
    }

    fn check_replicas(&mut self, model: &A::Model, step: usize) -> anyhow::Result<()> {
        Ok(self.ddp.check_replicas(model, step)?)
    }

    /// Rank 0 writes, the others wait for it; at ZeRO stage 3 every rank writes its part.
    fn save(
        &mut self,
        position: TrainPosition,
        model: &A::Model,
        schedule: &Schedule,
    ) -> anyhow::Result<()> {
        let Some(policy) = &self.checkpoints else {
            return Ok(());
        };
        // ZeRO stage 3: every rank writes its part; otherwise rank 0 writes the whole.
        let save = if self.ddp.shard_layout().is_some() {
            sharded_checkpoint::save::<A::Model>
        } else {
            parallel::save_training_checkpoint::<A::Model>
        };
        save(
            &mut self.ddp,
            policy,
            position,
            model,
            &self.optim,
            schedule,
        )
    }

    /// Evaluates every validation sample exactly once across the ranks (no padding) and sums
    /// the metrics with their real counts.
    fn validate(&mut self, model: &A::Model, step: usize) -> anyhow::Result<Option<Validation>> {
        let Some(valid) = self.data.valid.clone() else {
            return Ok(None);
        };
        // The model without autodiff, fed batches made on the device without autodiff (as
        // burn-train's own validation does); at ZeRO stage 3 gathered whole (collective),
        // since each rank validates its own number of batches.
        let inner = self.ddp.gathered(&model.valid())?;
        let device = self.device.clone().inner();
        let samples = crate::engine::validation::evaluate_shard(
            &inner,
            &*valid,
            &self.batcher,
            &mut self.valid_metrics,
            self.ddp.rank(),
            self.ddp.world_size(),
            &device,
            self.config.training.batch_size,
        )?;
        let values = self.valid_metrics.global(self.ddp.group())?;
        let [n] = self.ddp.sum([samples as f64])?;
        Ok(Some(Validation {
            metrics: values,
            samples: n as usize,
            step,
        }))
    }

    /// The gradient synchronisations and bytes of the run (rank 0, with `output.log_samples`:
    /// for the tests).
    fn finish(&mut self, position: TrainPosition) -> anyhow::Result<()> {
        // A process that asks to join from now on is told the job is over.
        self.ddp.close_to_joiners()?;
        let stats = self.ddp.gradient_stats();
        let overlap = self.ddp.overlap_stats();
        tracing::debug!(
            rank = self.ddp.rank(),
            syncs = stats.syncs,
            buckets = stats.bucket_all_reduces,
            "gradient synchronisation"
        );
        if self.ddp.rank() == 0 && self.config.output.log_samples {
            std::fs::write(
                self.config.output.dir.join("reducer-stats.json"),
                format!(
                    "{{\"syncs\":{},\"bucket_all_reduces\":{},\"bytes_reduced\":{},\"steps\":{},\"overlap_planned_steps\":{},\"overlap_buckets_during_backward\":{}}}",
                    stats.syncs,
                    stats.bucket_all_reduces,
                    stats.bytes_reduced,
                    position.step,
                    overlap.planned_steps,
                    overlap.buckets_during_backward
                ),
            )?;
        }
        Ok(())
    }
}

/// Multiplies every gradient of `model`'s float parameters in `grads` by `factor`.
fn scale_gradients<M: Module>(model: &M, grads: &mut GradientsParams, factor: f32) {
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f32,
    }
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(param.id) {
                self.grads.register(param.id, g.mul_scalar(self.factor));
            }
        }
    }
    model.visit(&mut Scale { grads, factor });
}
