//! One rank's training of its pipeline stage, read top to bottom:
//!
//! 1. **form the pipeline** — this rank's stage and replica, the links to its neighbouring
//!    stages, the DDP step over its stage's replicas (burn-ddp's `PipelineParallel`);
//! 2. **build the stage** (seeded as the whole model would be), **restore** the newest step
//!    every stage has, make the stage's replicas equal;
//! 3. **for each epoch**: the sampler gives this rank's *replica* its shard (every stage of a
//!    replica reads the same samples: the first its inputs, the last its targets); each
//!    optimizer step cuts it into `accumulation_steps` micro-batches, runs them through the
//!    pipeline (GPipe or 1F1B), averages the stage's gradients over its replicas and steps
//!    the optimizer; then the sample log, the `train` record, the replica check and the
//!    checkpoints the plan asks for; at the end of an epoch, validation through the pipeline
//!    without autodiff.
//!
//! The app's metrics read the last stage's outputs, made into the model's `TrainStep` output
//! by the app's function (`StageSplit::new`); every rank takes part in their sums, the other
//! stages with nothing counted.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::Progress;
use burn::module::Module;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::ModuleOptimizer;
use burn::tensor::{Device, Tensor};
use burn_ddp::host_values::host_values;
use burn_ddp::pipeline::{
    PipelineConfig, PipelineError, PipelineParallel, PipelineStage, StageStep,
};
use burn_ddp::sampler::{DistributedSampler, Sample};
use burn_ddp::{Distributed, ProcessGroup, ReduceOp, StepOutcome};

use super::stage_checkpoint::{agreed_checkpoint, stage_policy};
use super::stage_of::StageOf;
use crate::app::{read_item, App, AppConfig, AppError, TrainInput, TrainItem, ValidItem};
use crate::checkpoint::{self, Checkpoint, TrainPosition};
use crate::config::OnNonFinite;
use crate::error::UsageError;
use crate::fault_injection;
use crate::fit::{
    across_ranks, log_samples, open_reporter, optimizer, record_validation, train_metrics_window,
    write_plots, EpochSampler, RankStart, Summary, Validation,
};
use crate::loader::BatchStream;
use crate::metrics::{self, Metrics, Record, Reporter};
use crate::parallel::{self, CheckpointPolicy};
use crate::plan::{PlanInput, StepPlan};
use crate::schedule::Schedule;
use crate::throughput::ThroughputWindow;
use crate::timing::{Phase, PhaseClock};

/// The app's stage builder (see [`super::StageSplit::new`]).
type Build<A, S> = dyn Fn(
    &<A as App>::ModelConfig,
    &<A as App>::DataConfig,
    StageOf,
    &Device,
) -> Result<S, AppError>;

/// The app's function from the last stage's output, loss and micro-batch to the model's
/// training output (see [`super::StageSplit::new`]).
type ToOutput<A, const D: usize> = dyn Fn(Tensor<D>, Tensor<1>, &TrainInput<A>) -> TrainItem<A>;

/// Trains this rank's stage (module docs). Collective over the whole job.
pub(crate) fn train<A, S, const D: usize>(
    start: RankStart<A>,
    build: &Build<A, S>,
    output: &ToOutput<A, D>,
) -> anyhow::Result<ExitCode>
where
    A: App,
    S: PipelineStage<D, Batch = TrainInput<A>> + 'static,
    TrainItem<A>: Into<ValidItem<A>>,
{
    let RankStart {
        app,
        config,
        dist,
        data,
        device,
        no_resume,
    } = start;
    let mut pp = form::<A>(dist, &config, no_resume, &device)?;
    let which = StageOf {
        stage: pp.stage(),
        stages: pp.stages(),
    };
    // As the whole model is seeded (the replica's first rank's seed): every stage draws its
    // parameters as that model would.
    device.seed(fault_injection::init_seed(
        config.training.seed,
        pp.replica(),
    ));
    let stage = build(&config.model, &config.data, which, &device)?;
    let policy = CheckpointPolicy::for_app(&app, &config).map(|run| stage_policy(&run, which));
    let restored = match (&policy, config.checkpoint.resume && !no_resume) {
        (Some(policy), true) => agreed_checkpoint(&mut pp, policy)?,
        _ => None,
    };
    let (stage, optim) = restore(
        &mut pp,
        stage,
        optimizer(&config.optimizer),
        restored.as_ref(),
    )?;
    let mut training = StageTraining::<A, D> {
        position: restored
            .as_ref()
            .map_or_else(TrainPosition::default, |c| c.manifest.position),
        sampler: EpochSampler::for_app(
            &app,
            &config.training,
            &*data.train,
            pp.replicas(),
            pp.replica(),
        )?,
        batcher: app.batcher(&config.model, &config.data, &device),
        output,
        to_valid: Into::into,
        train_metrics: app.train_metrics(),
        valid_metrics: app.valid_metrics(),
        outputs: Vec::new(),
        config,
        data,
        device,
        pp,
        policy,
        optim,
        last_saved: None,
        samples: 0,
        skipped: 0,
        last_valid: None,
        reporter: None,
        clock: PhaseClock::new(),
        window: ThroughputWindow::new(),
        lr: 0.0,
    };
    let stage = training.run(stage, restored.as_ref())?;
    drop(stage);
    if training.pp.rank() == 0 && training.config.output.plots {
        write_plots(&training.config.output.dir);
    }
    // Rank 0 may host the store: leave together.
    training.pp.world_group().barrier()?;
    Ok(ExitCode::SUCCESS)
}

/// Checks that every rank runs this config, then forms the pipeline `[distributed]` asks for
/// over the job `dist` (the micro-batch count is `training.accumulation_steps`). Collective
/// over the whole job.
fn form<A: App>(
    dist: Distributed,
    config: &AppConfig<A>,
    no_resume: bool,
    device: &Device,
) -> anyhow::Result<PipelineParallel> {
    let d = &config.distributed;
    let pipeline = PipelineConfig {
        stages: d.pipeline_stages,
        schedule: d.pipeline_schedule.schedule(),
        micro_batches: config.training.accumulation_steps,
    };
    // Every rank against rank 0 first: a rank started with other settings (another stage
    // count, another plan) fails here at once, not in the pipeline's collectives.
    // The checkpoint settings decide collectives too (the resume agreement).
    let c = &config.checkpoint;
    let settings = format!(
        "{} checkpoint.dir={:?} resume={}",
        config.fingerprint(),
        c.dir.is_some(),
        c.resume && !no_resume
    );
    dist.check_same(&settings, Duration::from_secs(d.timeout_secs))?;
    PipelineParallel::new(dist, pipeline, parallel::ddp_options(d), device)
        .map_err(usage_or_failure)
}

/// A pipeline that could not form or step: a usage error (exit code 2) when it is one.
fn usage_or_failure(error: PipelineError) -> anyhow::Error {
    if error.is_usage() {
        UsageError(error.to_string()).into()
    } else {
        error.into()
    }
}

/// Loads the stage's part of `ckpt` (weights, optimizer state), then makes the stage's
/// replicas equal (replica 0's weights) and keeps this rank's optimizer state under ZeRO
/// stage 1. Collective over the stage's replicas.
fn restore<S: Module>(
    pp: &mut PipelineParallel,
    stage: S,
    optim: ModuleOptimizer,
    ckpt: Option<&Checkpoint>,
) -> anyhow::Result<(S, ModuleOptimizer)> {
    let Some(ckpt) = ckpt else {
        return Ok((pp.replica_group().prepare(stage)?, optim));
    };
    let stage = checkpoint::load_model(ckpt, stage)?;
    let stage = pp.replica_group().prepare(stage)?;
    let optim = checkpoint::load_optimizer(ckpt, optim)?;
    let optim = pp.replica_group().keep_owned_state(&stage, optim)?;
    let position = ckpt.manifest.position;
    tracing::info!(
        "stage {}: resumed from {} (epoch {}, step {}; saved with {} replicas, now {})",
        pp.stage(),
        ckpt.dir.display(),
        position.epoch,
        position.step,
        ckpt.manifest.world_size,
        pp.replicas()
    );
    Ok((stage, optim))
}

/// One rank's stage training between its named steps.
struct StageTraining<'o, A: App, const D: usize> {
    config: AppConfig<A>,
    data: crate::app::Datasets<A::Item>,
    device: Device,
    pp: PipelineParallel,
    policy: Option<CheckpointPolicy>,
    optim: ModuleOptimizer,
    sampler: EpochSampler,
    batcher: A::Batcher,
    /// The app's function to the model's training output (last stage).
    output: &'o ToOutput<A, D>,
    /// Its validation output from that (`Into::into`, kept here so that the methods need no
    /// bound of their own).
    to_valid: fn(TrainItem<A>) -> ValidItem<A>,
    train_metrics: Metrics<TrainItem<A>>,
    valid_metrics: Metrics<ValidItem<A>>,
    /// The last stage's outputs since the last log line, with their micro-batches' sizes.
    outputs: Vec<(TrainItem<A>, usize)>,
    position: TrainPosition,
    last_saved: Option<usize>,
    /// This replica's samples trained in this process.
    samples: usize,
    /// Optimizer steps skipped for non-finite gradients (`training.on_nonfinite = "skip"`).
    skipped: usize,
    last_valid: Option<LastValidation>,
    /// Rank 0's metrics file and progress bar, once the plan is known.
    reporter: Option<Reporter>,
    clock: PhaseClock,
    window: ThroughputWindow,
    lr: f64,
}

/// The last validation: the app's metrics, as the data-parallel loop reports them, and the
/// last stage's mean loss.
struct LastValidation {
    validation: Validation,
    loss: f64,
}

impl<A: App, const D: usize> StageTraining<'_, A, D> {
    /// The plan and schedule from the restored position, then every epoch's steps, then the
    /// final checkpoint and line. Collective over the whole job.
    fn run<S>(&mut self, mut stage: S, restored: Option<&Checkpoint>) -> anyhow::Result<S>
    where
        S: PipelineStage<D, Batch = TrainInput<A>>,
    {
        let plan = self.plan();
        let mut schedule =
            Schedule::new(&self.config.optimizer, self.pp.replicas(), plan.total_steps)?;
        if let Some(ckpt) = restored {
            schedule = checkpoint::load_schedule(ckpt, schedule)?;
            self.last_saved = Some(ckpt.manifest.position.step);
        }
        let world = self.pp.stages() * self.pp.replicas();
        self.reporter = Some(open_reporter(
            self.pp.rank(),
            world,
            &self.config.output,
            plan.total_steps,
            self.position,
            self.last_saved,
        )?);
        let started = Instant::now();
        while plan.more_after(self.position) {
            stage = self.train_epoch(stage, &plan, &mut schedule)?;
        }
        let elapsed = started.elapsed();
        if self.last_saved != Some(self.position.step) {
            self.save(&stage, &schedule)?;
        }
        if self
            .last_valid
            .as_ref()
            .is_none_or(|v| v.validation.step != self.position.step)
        {
            // Stopped mid-epoch (max_steps): validate the final model too.
            self.validate(&stage, self.position.epoch)?;
        }
        self.finish(elapsed)?;
        Ok(stage)
    }

    /// The step plan of this replica's shard (a replica is one rank of the sampler).
    fn plan(&self) -> StepPlan {
        let t = &self.config.training;
        let c = &self.config.checkpoint;
        let position = self.position;
        StepPlan::new(
            PlanInput {
                train_len: self.data.train.len(),
                world_size: self.pp.replicas(),
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
            self.sampler.samples(0, 0).len(),
            self.sampler
                .samples(position.epoch as u64, position.consumed)
                .len(),
        )
    }

    /// The rest of the current epoch: its optimizer steps, then its end.
    fn train_epoch<S>(
        &mut self,
        mut stage: S,
        plan: &StepPlan,
        schedule: &mut Schedule,
    ) -> anyhow::Result<S>
    where
        S: PipelineStage<D, Batch = TrainInput<A>>,
    {
        let samples = self
            .sampler
            .samples(self.position.epoch as u64, self.position.consumed);
        let epoch_start = self.position.consumed;
        let steps: Vec<&[Sample]> = samples.chunks(plan.per_step).collect();
        let micro_indices: Vec<Vec<usize>> = steps
            .iter()
            .flat_map(|step| plan.micro_batches(step))
            .map(|(micro, _)| micro.iter().map(|s| s.index).collect())
            .collect();
        let workers = self.config.training.num_workers;
        let mut batches = BatchStream::new(self.data.train.clone(), micro_indices, workers);
        for (k, step_samples) in steps.iter().enumerate() {
            stage = self.optimizer_step(stage, plan, &mut batches, step_samples, schedule)?;
            self.position = plan.after_step(self.position, epoch_start, k);
            self.after_step(&stage, plan, schedule, step_samples)?;
            if self.position.step >= plan.total_steps {
                break;
            }
        }
        if plan.epoch_complete(self.position, samples.is_empty()) {
            self.position.epoch += 1;
            self.position.consumed = 0;
            self.validate(&stage, self.position.epoch - 1)?;
            self.say_validation();
            if plan.checkpoint_after_epoch(self.position.epoch)
                && self.last_saved != Some(self.position.step)
            {
                self.save(&stage, schedule)?;
            }
        }
        Ok(stage)
    }

    /// One optimizer step: the step's micro-batches through the pipeline (gradients averaged
    /// over the stage's replicas), the optimizer, ZeRO's gather and the buffer rule.
    /// Collective over the whole job.
    fn optimizer_step<S>(
        &mut self,
        stage: S,
        plan: &StepPlan,
        batches: &mut BatchStream<A::Item>,
        step_samples: &[Sample],
        schedule: &mut Schedule,
    ) -> anyhow::Result<S>
    where
        S: PipelineStage<D, Batch = TrainInput<A>>,
    {
        // Seeded per step, as the data-parallel loop does.
        let seed = self.config.training.seed;
        self.device
            .seed(seed.wrapping_add(self.position.step as u64 + 1));
        let micro = plan.micro_batches(step_samples);
        let weights: Vec<f64> = micro.iter().map(|(_, w)| f64::from(*w)).collect();
        let (batcher, device) = (&self.batcher, &self.device);
        let inputs = self.clock.time(Phase::Data, || {
            micro
                .iter()
                .map(|_| batches.next_batch::<TrainInput<A>, _>(batcher, device))
                .collect::<anyhow::Result<Vec<_>>>()
        })?;
        // Forward, backward, the exchanges with the neighbouring stages, the gradients' average
        // over the stage's replicas, the job's verdict on them, the optimizer and ZeRO's
        // gather, in one; the last stage's outputs for the metrics (kept for a step that is
        // then skipped too, as the data-parallel loop keeps them).
        let sizes: Vec<usize> = micro.iter().map(|(samples, _)| samples.len()).collect();
        self.lr = schedule.next_lr();
        let (pp, output, outputs) = (&mut self.pp, self.output, &mut self.outputs);
        let (optim, lr) = (&mut self.optim, self.lr);
        let mut optimizer_time = Duration::ZERO;
        let started = Instant::now();
        let stepped = pp.step_with_outputs(
            stage,
            &inputs,
            &weights,
            device,
            |i, last, loss| outputs.push((output(last, loss, &inputs[i]), sizes[i])),
            |stage, grads| {
                let optimize = Instant::now();
                let stage = optim.step(ModuleLearningRate::from(lr), stage, grads);
                optimizer_time = optimize.elapsed();
                stage
            },
        );
        // The pipeline's passes and the exchanges count as compute, as before the step was one
        // call; the optimizer as optimizer.
        self.clock.add(Phase::Optimizer, optimizer_time);
        self.clock.add(
            Phase::Compute,
            started.elapsed().saturating_sub(optimizer_time),
        );
        let StageStep { stage, outcome, .. } = stepped.map_err(usage_or_failure)?;
        self.samples += step_samples.len();
        if let StepOutcome::Skipped { ranks } = outcome {
            self.skip_or_stop(ranks)?;
        }
        self.clock.end_step();
        self.window.add(step_samples.len() * self.pp.replicas());
        Ok(stage)
    }

    /// A step every rank of the job skipped for non-finite gradients (on `ranks`): under
    /// `training.on_nonfinite = "skip"` counted and warned of (by rank 0), under `"stop"` the
    /// error every rank stops with.
    fn skip_or_stop(&mut self, ranks: Vec<usize>) -> anyhow::Result<()> {
        let step = self.position.step + 1;
        if self.config.training.on_nonfinite == OnNonFinite::Stop {
            anyhow::bail!(
                "non-finite gradients (NaN or Inf) at optimizer step {step} on rank(s) {ranks:?}: the stages were not updated; lower optimizer.learning_rate, check the data, or set training.on_nonfinite = \"skip\""
            );
        }
        self.skipped += 1;
        if self.pp.rank() == 0 {
            tracing::warn!(
                "non-finite gradients (NaN or Inf) at optimizer step {step} on rank(s) {ranks:?}; skipped on every rank (training.on_nonfinite = \"skip\")"
            );
        }
        Ok(())
    }

    /// What the plan asks for after an optimizer step: the sample log, the loss line, a check
    /// that the stage's replicas hold the same parameters, a checkpoint; then the
    /// fault-injection hooks.
    fn after_step<S: Module>(
        &mut self,
        stage: &S,
        plan: &StepPlan,
        schedule: &Schedule,
        step_samples: &[Sample],
    ) -> anyhow::Result<()> {
        let step = self.position.step;
        if self.config.output.log_samples {
            // Every stage of a replica logs the same samples: its whole micro-batches.
            log_samples(
                &self.config.output.dir,
                self.pp.rank(),
                self.position.epoch,
                step_samples,
            )?;
        }
        if plan.log_after(step) {
            self.log_train()?;
        }
        if plan.check_replicas_after(step) {
            let which = self.pp.stage();
            self.pp
                .replica_group()
                .check_replicas(stage, step)
                .with_context(|| {
                    format!(
                        "stage {which}, across its replicas (its ranks here are replica numbers)"
                    )
                })?;
        }
        if plan.checkpoint_after_step(step) {
            self.save(stage, schedule)?;
        }
        let rank = self.pp.rank();
        fault_injection::crash_after_step_if_asked(rank, step);
        fault_injection::stall_if_asked(rank, step);
        Ok(())
    }

    /// A `train` record (rank 0 writes it): the app's training metrics on the last stage's
    /// outputs since the last one, the rate, the step times over every rank. Collective over
    /// the whole job.
    fn log_train(&mut self) -> anyhow::Result<()> {
        let position = self.position;
        let values = train_metrics_window(
            &mut self.train_metrics,
            std::mem::take(&mut self.outputs),
            position,
            self.data.train.len(),
            self.lr,
            self.pp.world_group(),
        )?;
        let (time, _) = across_ranks(self.pp.world_group(), self.clock.take_window())?;
        let rate = self.window.rate();
        self.window = ThroughputWindow::new();
        let world = self.pp.stages() * self.pp.replicas();
        if let Some(reporter) = &mut self.reporter {
            reporter.record(&Record::Train {
                epoch: position.epoch,
                step: position.step,
                lr: self.lr,
                samples_per_sec: rate,
                world_size: world,
                metrics: metrics::as_map(&values),
                time,
            });
            reporter.progress(
                position.step as u64,
                format!(
                    "epoch {} {} {rate:.0} samples/s",
                    position.epoch + 1,
                    metrics::describe(&values)
                ),
            );
        }
        Ok(())
    }

    /// The app's validation metrics, and the last stage's mean loss for the closing line, over
    /// every validation sample once (each replica its shard, in micro-batches of `batch_size`
    /// through the pipeline without autodiff); rank 0 records them. Collective over the whole
    /// job; nothing without a validation set.
    fn validate<S>(&mut self, stage: &S, epoch: usize) -> anyhow::Result<()>
    where
        S: PipelineStage<D, Batch = TrainInput<A>>,
    {
        let Some(valid) = self.data.valid.clone() else {
            return Ok(());
        };
        let validating = Instant::now();
        let inner = stage.valid();
        let device = self.device.clone().inner();
        let indices = DistributedSampler::new(valid.len(), self.pp.replicas(), self.pp.replica())
            .eval_indices();
        let t = &self.config.training;
        let (batch_size, per_pass) = (
            t.batch_size.max(1),
            t.batch_size.max(1) * t.accumulation_steps,
        );
        let mut loss = [0.0, 0.0];
        for (k, pass) in indices.chunks(per_pass).enumerate() {
            let mut batches = Vec::new();
            let mut sizes = Vec::new();
            for micro in pass.chunks(batch_size) {
                let items = micro
                    .iter()
                    .map(|&i| read_item(&*valid, i, "validation set").map_err(AppError))
                    .collect::<Result<Vec<_>, _>>()?;
                batches.push(Batcher::<A::Item, TrainInput<A>>::batch(
                    &self.batcher,
                    items,
                    &device,
                ));
                sizes.push(micro.len());
            }
            let progress = Progress {
                items_processed: (k * per_pass + pass.len()).min(indices.len()),
                items_total: indices.len(),
                unit: None,
            };
            self.validation_pass(&inner, &batches, &sizes, &device, &mut loss, progress)?;
        }
        self.pp.world_group().all_reduce(&mut loss, ReduceOp::Sum)?;
        let values = self.valid_metrics.global(self.pp.world_group())?;
        let [loss, samples] = loss;
        let loss = loss / samples.max(1.0);
        let validation = Validation {
            metrics: values,
            samples: samples as usize,
            step: self.position.step,
        };
        if let Some(reporter) = &mut self.reporter {
            record_validation(reporter, epoch, &validation);
        }
        // Kept out of the step times and the rate.
        self.clock.exclude(validating.elapsed());
        self.window.exclude(validating.elapsed());
        self.last_valid = Some(LastValidation { validation, loss });
        Ok(())
    }

    /// Rank 0's line for the validation at the end of an epoch (the last one is also in the
    /// final line).
    fn say_validation(&self) {
        if let (Some(reporter), Some(last)) = (&self.reporter, &self.last_valid) {
            let v = &last.validation;
            reporter.say(&format!(
                "epoch {}/{}: validation {} ({} samples)",
                self.position.epoch,
                self.config.training.epochs,
                metrics::describe(&v.metrics),
                v.samples
            ));
        }
    }

    /// One pass of validation micro-batches (`sizes[i]` samples in `batches[i]`) through the
    /// pipeline: on the last stage, each output into the app's validation metrics and its
    /// loss × samples, samples into `loss`. Collective over the pipeline.
    fn validation_pass<S>(
        &mut self,
        inner: &S,
        batches: &[TrainInput<A>],
        sizes: &[usize],
        device: &Device,
        loss: &mut [f64; 2],
        progress: Progress,
    ) -> anyhow::Result<()>
    where
        S: PipelineStage<D, Batch = TrainInput<A>>,
    {
        let (output, to_valid) = (self.output, self.to_valid);
        let metrics = &mut self.valid_metrics;
        let mut failed = None;
        let mut on_output = |i: usize, last: Tensor<D>| -> anyhow::Result<()> {
            let mean = inner.loss(last.clone(), &batches[i]);
            let n = sizes[i];
            // At any alignment of the bytes: a GPU's readback may not be aligned.
            let value = host_values::<f32>(mean.clone().into_data()).map_err(|e| {
                anyhow::anyhow!("validation: cannot read the loss back from the device: {e:?}")
            })?;
            loss[0] += f64::from(value.first().copied().unwrap_or(f32::NAN)) * n as f64;
            loss[1] += n as f64;
            let item = to_valid(output(last, mean, &batches[i]));
            metrics.update_lazy(item, n, progress.clone(), i, None, "validation")
        };
        self.pp
            .forward(inner, batches, device, |i, last| {
                if failed.is_none() {
                    failed = on_output(i, last).err();
                }
            })
            .map_err(usage_or_failure)?;
        failed.map_or(Ok(()), Err)
    }

    /// Each stage's replica 0 writes the stage's checkpoint; its replicas wait. Collective
    /// over the stage's replicas.
    fn save<S: Module>(&mut self, stage: &S, schedule: &Schedule) -> anyhow::Result<()> {
        let Some(policy) = &self.policy else {
            return Ok(());
        };
        let saving = Instant::now();
        parallel::save_training_checkpoint(
            self.pp.replica_group(),
            policy,
            self.position,
            stage,
            &self.optim,
            schedule,
        )
        .with_context(|| format!("stage {}", self.pp.stage()))?;
        self.clock.add(Phase::Checkpoint, saving.elapsed());
        self.last_saved = Some(self.position.step);
        Ok(())
    }

    /// Rank 0's closing lines: the final validation as the data-parallel loop says it, then
    /// the layout, the steps and the rate of the training loop (`elapsed`, checkpoints
    /// included), the last stage's validation loss, every rank's peak resident memory.
    /// Collective over the whole job.
    fn finish(&mut self, elapsed: Duration) -> anyhow::Result<()> {
        if let Some(reporter) = self.reporter.take() {
            reporter.finish();
        }
        let peak = crate::memory::peak_resident_bytes().unwrap_or(0) as f64;
        let mut all = vec![0.0; self.pp.stages() * self.pp.replicas()];
        self.pp.world_group().all_gather(&[peak], &mut all)?;
        // Each replica's first stage counts its samples once.
        let first = f64::from(u8::from(self.pp.stage() == 0));
        let mut samples = [self.samples as f64 * first];
        self.pp
            .world_group()
            .all_reduce(&mut samples, ReduceOp::Sum)?;
        let rate = samples[0] / elapsed.as_secs_f64().max(1e-9);
        let valid = self.last_valid.as_ref().map_or(String::new(), |v| {
            format!(", validation loss {:.6}", v.loss)
        });
        if self.pp.rank() == 0 {
            let summary = Summary {
                validation: self.last_valid.as_ref().map(|v| v.validation.clone()),
                steps: self.position.step,
                skipped_steps: self.skipped,
                time: None,
            };
            println!("{}", summary.line(all.len()));
            let mib: Vec<String> = all
                .iter()
                .map(|b| format!("{:.0}", b / (1024.0 * 1024.0)))
                .collect();
            println!(
                "pipeline: {} stages × {} replicas, {} micro-batches per step ({:?}): {} steps{valid}, {rate:.1} samples/s; peak RSS per rank (MiB, rank order): {}",
                self.pp.stages(),
                self.pp.replicas(),
                self.config.training.accumulation_steps,
                self.config.distributed.pipeline_schedule,
                self.position.step,
                mib.join(" ")
            );
        }
        Ok(())
    }
}
