//! The engine's training loop, for any [`App`], read top to bottom:
//!
//! 1. **join the job** — one process or one rank of many (launcher, torchrun, SLURM); ranks
//!    check that they run the same config;
//! 2. **open the data** — the app's data sets, once per rank; only this rank's shard is read;
//! 3. **build the model**, **restore** the newest checkpoint if there is one, and make replicas
//!    equal (deterministic parameter ids, broadcast from rank 0);
//! 4. **for each epoch**: the sampler gives this rank its shard of the epoch's global order
//!    (skipping what a restored checkpoint already consumed); each optimizer step runs
//!    `accumulation_steps` micro-batches through [`TrainStep::step`], averages the gradients
//!    across ranks once, and calls [`TrainStep::optimize`]; then validation on every
//!    validation sample exactly once, and a checkpoint — as the [`StepPlan`] says.
//!
//! In code, step 3 is `restore` and step 4 is `Training`, one named step each:
//! `set_up` (sampler, plan, schedule, metrics file) → per epoch `train_epoch`: for each
//! optimizer step `optimizer_step` (`accumulate` the micro-batches, `apply_gradients` across
//! the ranks, buffers made equal) and `after_step` (metrics line, replica check, checkpoint);
//! then `end_of_epoch` (validation, checkpoint) → `finish` (time report, final checkpoint
//! and validation).
//!
//! No `cfg(feature)` here: devices live in [`crate::backend`] (the loop runs on the [`Device`]
//! `backend::train_device` picks), the gradient path in `burn_ddp::DataParallel`, which chooses
//! host staging or NCCL from that device.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use burn::data::dataloader::Progress;
use burn::data::dataset::Dataset;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdamConfig, AdamWConfig, GradientsAccumulator, GradientsParams, ModuleOptimizer, SgdConfig,
};
use burn::tensor::{Device, Tensor};
use burn::train::{ItemLazy, TrainStep};
use burn_ddp::sampler::{DistributedSampler, Sample, WeightedDistributedSampler};
use burn_ddp::{DataParallel, Distributed, ProcessGroup, StepOutcome, TcpProcessGroup};

use crate::app::{App, AppConfig, AppError, Datasets, TrainItem, ValidItem};
use crate::backend;
use crate::checkpoint::{self, Checkpoint, TrainPosition};
use crate::config::{OnNonFinite, OptimizerConfig, OptimizerName, OutputConfig, TrainingConfig};
use crate::error::UsageError;
use crate::fault_injection;
use crate::loader::BatchStream;
use crate::metrics::{self, MetricValue, Metrics, Record, Reporter};
use crate::parallel::{self, CheckpointPolicy};
use crate::plan::{PlanInput, StepPlan};
use crate::preflight::{preflight, Splitting};
use crate::schedule::Schedule;
use crate::throughput::ThroughputWindow;
use crate::timing::{Phase, PhaseClock, RankTimes, StepTime};

/// Everything one rank's training needs (steps 1 and 2 of the module docs): the app, its
/// config, the formed job, the data sets and the device; then [`train`] (data parallel) or
/// the program's pipeline split (pipeline stages) trains.
pub struct RankStart<A: App> {
    pub app: A,
    pub config: AppConfig<A>,
    pub dist: Distributed,
    pub data: Datasets<A::Item>,
    /// This rank's autodiff training device.
    pub device: Device,
    /// `--no-resume`: start over even where `checkpoint.resume` would resume.
    pub no_resume: bool,
}

/// `--config FILE` as one rank (or the only process): the pre-flight (`splitting`: whether the
/// program gave a pipeline split), the data sets, the job (collective: every rank joins) and
/// the device.
pub fn start<A: App>(
    app: A,
    config_path: &Path,
    no_resume: bool,
    splitting: Splitting,
) -> anyhow::Result<RankStart<A>> {
    // This rank's share; the job's world size divides a ZeRO-sharded optimizer state.
    let world_size = burn_ddp::DistEnv::from_env().map_or(1, |env| env.world_size);
    let config = preflight(&app, config_path, 1, world_size, splitting)?;
    backend::pin_default_device();
    let data = app.datasets(&config.data)?;
    if data.train.is_empty() {
        bail!(AppError(
            "data: the training set is empty (check the [data] table)".into()
        ));
    }
    let dist = Distributed::from_env_or_standalone(
        parallel::ddp_options(&config.distributed).tcp_options(),
    )?;
    let device = backend::train_device(config.output.device, dist.env.local_rank)?;
    Ok(RankStart {
        app,
        config,
        dist,
        data,
        device,
        no_resume,
    })
}

/// Trains app `A` data-parallel as one rank of the formed job (steps 3 and 4 of the module
/// docs).
pub fn train<A: App>(start: RankStart<A>) -> anyhow::Result<ExitCode> {
    let RankStart {
        app,
        config,
        dist,
        data,
        device,
        no_resume,
    } = start;
    let ddp = parallel::data_parallel(dist, &config.distributed, config.output.device, &device)?;
    let checkpoints = CheckpointPolicy::for_app(&app, &config);
    let resume = config.checkpoint.resume && !no_resume;
    let mut job = Job::<A> {
        app,
        config,
        ddp,
        data,
        device,
        checkpoints,
        resume,
    };
    job.ddp.check_same(&job.config.fingerprint())?;
    job.device.seed(fault_injection::init_seed(
        job.config.training.seed,
        job.rank(),
    ));
    let model = job
        .app
        .model(&job.config.model, &job.config.data, &job.device)?;
    let summary = with_optimizer(&mut job, model)?;
    if job.rank() == 0 {
        println!("{}", summary.line(job.world_size()));
        if let Some(time) = &summary.time {
            println!("{time}");
        }
        if job.config.output.plots {
            write_plots(&job.config.output.dir);
        }
    }
    // Rank 0 may host the store: leave together.
    job.ddp.barrier()?;
    Ok(ExitCode::SUCCESS)
}

/// The end of a run's closing line for `skipped` optimizer steps skipped for non-finite
/// gradients: nothing when there were none.
pub(crate) fn skipped_steps(skipped: usize) -> String {
    match skipped {
        0 => String::new(),
        n => format!("; skipped {n} optimizer steps with non-finite gradients"),
    }
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Summary {
    /// The final validation metrics, `None` without a validation set.
    pub validation: Option<Validation>,
    pub steps: usize,
    /// Optimizer steps skipped for non-finite gradients (`training.on_nonfinite = "skip"`).
    pub skipped_steps: usize,
    /// Where the time of this process's steps went, over the ranks (`None` without steps).
    pub time: Option<String>,
}

impl Summary {
    /// The line rank 0 prints at the end of a run.
    pub fn line(&self, world_size: usize) -> String {
        format!(
            "{}{}",
            self.result_line(world_size),
            skipped_steps(self.skipped_steps)
        )
    }

    fn result_line(&self, world_size: usize) -> String {
        match &self.validation {
            Some(v) => format!(
                "final validation: {} ({} samples, {} optimizer steps, world size {world_size})",
                metrics::describe(&v.metrics),
                v.samples,
                self.steps
            ),
            None => format!(
                "finished: {} optimizer steps, world size {world_size}; no validation set (data has none), so no validation metrics",
                self.steps
            ),
        }
    }
}

/// Validation results over all ranks.
#[derive(Debug, Clone)]
pub struct Validation {
    pub metrics: Vec<MetricValue>,
    pub samples: usize,
    /// The optimizer step it was measured after.
    pub step: usize,
}

/// Everything one rank's training needs.
struct Job<A: App> {
    app: A,
    config: AppConfig<A>,
    ddp: DataParallel,
    data: Datasets<A::Item>,
    /// This rank's autodiff training device.
    device: Device,
    /// `None` without `checkpoint.dir`.
    checkpoints: Option<CheckpointPolicy>,
    /// Resume from the newest checkpoint (`checkpoint.resume`, not `--no-resume`).
    resume: bool,
}

impl<A: App> Job<A> {
    fn rank(&self) -> usize {
        self.ddp.rank()
    }

    fn world_size(&self) -> usize {
        self.ddp.world_size()
    }

    /// The newest usable checkpoint, if resuming; every rank sees the same one. Collective.
    fn find_checkpoint(&mut self) -> anyhow::Result<Option<Checkpoint>> {
        match (&self.checkpoints, self.resume) {
            (Some(policy), true) => parallel::latest_checkpoint(&mut self.ddp, policy),
            _ => Ok(None),
        }
    }

    /// Rank 0 writes; the others wait for it. Collective.
    fn save_checkpoint<M: Module>(
        &mut self,
        position: TrainPosition,
        model: &M,
        optim: &ModuleOptimizer,
        schedule: &Schedule,
    ) -> anyhow::Result<()> {
        let Some(policy) = &self.checkpoints else {
            return Ok(());
        };
        parallel::save_training_checkpoint(&mut self.ddp, policy, position, model, optim, schedule)
    }
}

/// Builds the configured optimizer, then runs [`fit`] with it.
fn with_optimizer<A: App>(job: &mut Job<A>, model: A::Model) -> anyhow::Result<Summary> {
    let optim = optimizer(&job.config.optimizer);
    fit(job, model, optim)
}

/// The optimizer `[optimizer]` names, for any module (the whole model, or a pipeline stage).
pub(crate) fn optimizer(o: &OptimizerConfig) -> ModuleOptimizer {
    let decay = (o.weight_decay > 0.0).then(|| WeightDecayConfig::new(o.weight_decay as f32));
    match o.name {
        OptimizerName::Sgd => {
            let momentum = (o.momentum > 0.0).then(|| {
                MomentumConfig::new()
                    .with_momentum(o.momentum)
                    .with_dampening(0.0)
            });
            SgdConfig::new()
                .with_momentum(momentum)
                .with_weight_decay(decay)
                .init()
        }
        OptimizerName::Adam => AdamConfig::new().with_weight_decay(decay).init(),
        OptimizerName::AdamW => AdamWConfig::new()
            .with_weight_decay(o.weight_decay as f32)
            .init(),
    }
}

/// The loop itself (module docs, steps 3 and 4): restore, set up, then each epoch's optimizer
/// steps and its end, as the [`StepPlan`] says; then the finish.
fn fit<A: App>(
    job: &mut Job<A>,
    model: A::Model,
    optim: ModuleOptimizer,
) -> anyhow::Result<Summary> {
    let (mut model, optim, restored) = restore(job, model, optim)?;
    let mut training = Training::set_up(job, optim, restored.as_ref())?;
    while training.plan.more_after(training.position) {
        model = training.train_epoch(model)?;
    }
    training.finish(&model)
}

/// Loads the newest checkpoint, if resuming, then makes the replicas equal (rank 0's weights,
/// deterministic parameter ids) and keeps this rank's optimizer state. Collective.
fn restore<A: App>(
    job: &mut Job<A>,
    model: A::Model,
    optim: ModuleOptimizer,
) -> anyhow::Result<(A::Model, ModuleOptimizer, Option<Checkpoint>)> {
    let restored = job.find_checkpoint()?;
    let mut model = model;
    let mut optim = optim;
    if let Some(ckpt) = &restored {
        model = checkpoint::load_model(ckpt, model)?;
    }
    let model = job.ddp.prepare(model)?;
    if let Some(ckpt) = &restored {
        optim = checkpoint::load_optimizer(ckpt, optim)?;
        // A checkpoint holds every parameter's state; under ZeRO stage 1 keep this rank's.
        optim = job.ddp.keep_owned_state(&model, optim)?;
        let position = ckpt.manifest.position;
        tracing::info!(
            "resumed from {} (epoch {}, {} samples into it, step {}; saved with world size {}, now {})",
            ckpt.dir.display(),
            position.epoch,
            position.consumed,
            position.step,
            ckpt.manifest.world_size,
            job.world_size()
        );
    }
    Ok((model, optim, restored))
}

/// The state of one rank's training between its named steps (see [`fit`]).
struct Training<'j, A: App> {
    job: &'j mut Job<A>,
    optim: ModuleOptimizer,
    schedule: Schedule,
    plan: StepPlan,
    sampler: EpochSampler,
    train: Arc<dyn Dataset<A::Item>>,
    batcher: A::Batcher,
    train_metrics: Metrics<TrainItem<A>>,
    valid_metrics: Metrics<ValidItem<A>>,
    reporter: Reporter,
    window: ThroughputWindow,
    clock: PhaseClock,
    /// Each micro-batch's output with its number of samples, until the next log line.
    outputs: Vec<(TrainItem<A>, usize)>,
    position: TrainPosition,
    last_saved: Option<usize>,
    last_valid: Option<Validation>,
    lr: f64,
    skipped: usize,
    slow_step: Option<Duration>,
}

impl<'j, A: App> Training<'j, A> {
    /// The sampler, the step plan from the restored position, the schedule (restored), the
    /// batcher, metrics and the metrics file with its `start` line.
    fn set_up(
        job: &'j mut Job<A>,
        optim: ModuleOptimizer,
        restored: Option<&Checkpoint>,
    ) -> anyhow::Result<Self> {
        let t = job.config.training.clone();
        let (rank, world) = (job.rank(), job.world_size());
        let position = restored.map_or_else(TrainPosition::default, |c| c.manifest.position);
        let train = job.data.train.clone();
        let sampler = EpochSampler::for_job(job, &*train)?;
        let plan = StepPlan::new(
            PlanInput {
                train_len: train.len(),
                world_size: world,
                batch_size: t.batch_size,
                accumulation_steps: t.accumulation_steps,
                epochs: t.epochs,
                max_steps: t.max_steps,
                log_every: t.log_every,
                checkpoint_every_steps: job.config.checkpoint.every_steps,
                checkpoint_every_epochs: job.config.checkpoint.every_epochs,
                check_replicas_every: t.check_replicas_every,
            },
            position,
            sampler.samples(0, 0).len(),
            sampler
                .samples(position.epoch as u64, position.consumed)
                .len(),
        );
        let mut schedule = Schedule::new(&job.config.optimizer, world, plan.total_steps)?;
        if let Some(ckpt) = restored {
            schedule = checkpoint::load_schedule(ckpt, schedule)?;
        }
        let batcher = job
            .app
            .batcher(&job.config.model, &job.config.data, &job.device);
        let resumed_from = restored.map(|c| c.manifest.position.step);
        let reporter = open_reporter(
            rank,
            world,
            &job.config.output,
            plan.total_steps,
            position,
            resumed_from,
        )?;
        Ok(Self {
            train_metrics: job.app.train_metrics(),
            valid_metrics: job.app.valid_metrics(),
            job,
            optim,
            schedule,
            plan,
            sampler,
            train,
            batcher,
            reporter,
            window: ThroughputWindow::new(),
            clock: PhaseClock::new(),
            outputs: Vec::new(),
            position,
            last_saved: resumed_from,
            last_valid: None,
            lr: 0.0,
            skipped: 0,
            slow_step: fault_injection::slow_step_if_asked(rank),
        })
    }

    /// The rest of the current epoch: its optimizer steps (until the plan's last step), then
    /// its end if every sample of it was consumed.
    fn train_epoch(&mut self, mut model: A::Model) -> anyhow::Result<A::Model> {
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
        let num_workers = self.job.config.training.num_workers;
        let mut batches = BatchStream::new(self.train.clone(), micro_indices, num_workers);
        for (k, step_samples) in steps.iter().enumerate() {
            model = self.optimizer_step(model, &mut batches, step_samples)?;
            self.position = self.plan.after_step(self.position, epoch_start, k);
            self.clock.end_step();
            self.window.add(step_samples.len() * self.job.world_size());
            self.after_step(&model, step_samples)?;
            if self.position.step >= self.plan.total_steps {
                break;
            }
        }
        if self.plan.epoch_complete(self.position, samples.is_empty()) {
            self.end_of_epoch(&model)?;
        }
        Ok(model)
    }

    /// One optimizer step: its micro-batches' gradients accumulated, then burn-ddp's DDP
    /// step (averaged across the ranks, applied or skipped when non-finite, the buffers made
    /// equal). Collective.
    fn optimizer_step(
        &mut self,
        model: A::Model,
        batches: &mut BatchStream<A::Item>,
        step_samples: &[Sample],
    ) -> anyhow::Result<A::Model> {
        // Seeded per step, so dropout masks are the same in a resumed run.
        let seed = self.job.config.training.seed;
        self.job
            .device
            .seed(seed.wrapping_add(self.position.step as u64 + 1));
        let grads = self.accumulate(&model, batches, step_samples)?;
        self.apply_gradients(model, grads)
    }

    /// Forward and backward of each micro-batch of the step, each weighted by its share of the
    /// step's samples (the step's gradient is the mean over its samples); waits for the device.
    fn accumulate(
        &mut self,
        model: &A::Model,
        batches: &mut BatchStream<A::Item>,
        step_samples: &[Sample],
    ) -> anyhow::Result<GradientsParams> {
        let mut accumulator = GradientsAccumulator::<A::Model>::new();
        for (micro, weight) in self.plan.micro_batches(step_samples) {
            let (batcher, device) = (&self.batcher, &self.job.device);
            let batch = self
                .clock
                .time(Phase::Data, || batches.next_batch(batcher, device))?;
            let compute = Instant::now();
            let output = TrainStep::step(model, batch);
            let mut grads = output.grads;
            if weight != 1.0 {
                // Each micro-batch's mean loss counts by its share.
                scale_gradients(model, &mut grads, weight);
            }
            accumulator.accumulate(model, grads);
            self.outputs.push((output.item, micro.len()));
            self.clock.add(Phase::Compute, compute.elapsed());
        }
        let compute = Instant::now();
        if let Some(extra) = self.slow_step {
            std::thread::sleep(extra);
        }
        // On an asynchronous device the backward is still queued: wait for it here, so that
        // its time counts as compute, not as gradient communication (the sync needs the
        // gradients next anyway).
        self.job
            .device
            .sync()
            .map_err(|e| anyhow::anyhow!("the device failed: {e:?}"))?;
        self.clock.add(Phase::Compute, compute.elapsed());
        Ok(accumulator.grads())
    }

    /// burn-ddp's DDP step with the optimizer at the schedule's next rate; when some rank's
    /// gradients were not finite, stops or skips on every rank alike (`training.on_nonfinite`).
    /// Its time counts as sync, the optimizer's own as optimizer. Collective.
    fn apply_gradients(
        &mut self,
        model: A::Model,
        grads: GradientsParams,
    ) -> anyhow::Result<A::Model> {
        self.lr = self.schedule.next_lr();
        let (optim, lr) = (&mut self.optim, self.lr);
        let mut optimizer_time = Duration::ZERO;
        let started = Instant::now();
        let (model, outcome) = self.job.ddp.step(model, grads, |model, grads| {
            let optimize = Instant::now();
            let model = model.optimize(optim, lr.into(), grads);
            optimizer_time = optimize.elapsed();
            model
        })?;
        self.clock.add(Phase::Optimizer, optimizer_time);
        self.clock.add(
            Phase::Sync,
            started.elapsed().saturating_sub(optimizer_time),
        );
        if let StepOutcome::Skipped { ranks } = outcome {
            // Every rank has the same outcome: all stop, or all skip, together.
            let failed = NonFiniteGradients {
                step: self.position.step + 1,
                ranks,
                last_checkpoint: self.last_saved,
            };
            match self.job.config.training.on_nonfinite {
                OnNonFinite::Stop => return Err(failed.into()),
                OnNonFinite::Skip => {
                    self.skipped += 1;
                    tracing::warn!("{failed}; skipped (training.on_nonfinite = \"skip\")");
                }
            }
        }
        Ok(model)
    }

    /// What the plan asks for after an optimizer step: the sample log, a metrics line, a
    /// replica check, a checkpoint; then the fault-injection hooks.
    fn after_step(&mut self, model: &A::Model, step_samples: &[Sample]) -> anyhow::Result<()> {
        let (rank, step) = (self.job.rank(), self.position.step);
        if self.job.config.output.log_samples {
            log_samples(
                &self.job.config.output.dir,
                rank,
                self.position.epoch,
                step_samples,
            )?;
        }
        if self.plan.log_after(step) {
            self.log_train()?;
        }
        if self.plan.check_replicas_after(step) {
            self.job.ddp.check_replicas(model, step)?;
        }
        if self.plan.checkpoint_after_step(step) {
            self.save_checkpoint(model)?;
        }
        fault_injection::crash_after_step_if_asked(rank, step);
        fault_injection::stall_if_asked(rank, step);
        Ok(())
    }

    /// A `train` line: the metrics of the steps since the last one over all ranks, the rate,
    /// the step times. Collective. Device-to-host reads of the outputs happen here, not every
    /// micro-batch.
    fn log_train(&mut self) -> anyhow::Result<()> {
        let position = self.position;
        let values = train_metrics_window(
            &mut self.train_metrics,
            std::mem::take(&mut self.outputs),
            position,
            self.train.len(),
            self.lr,
            self.job.ddp.group(),
        )?;
        let rate = self.window.rate();
        let (time, _) = across_ranks(self.job.ddp.group(), self.clock.take_window())?;
        self.reporter.record(&Record::Train {
            epoch: position.epoch,
            step: position.step,
            lr: self.lr,
            samples_per_sec: rate,
            world_size: self.job.world_size(),
            metrics: metrics::as_map(&values),
            time,
        });
        self.reporter.progress(
            position.step as u64,
            format!(
                "epoch {} {} {:.0} samples/s",
                position.epoch + 1,
                metrics::describe(&values),
                rate
            ),
        );
        self.window = ThroughputWindow::new();
        Ok(())
    }

    /// A complete epoch: the position moves to the next one, then validation (kept out of
    /// the step times and the rate) and, as the plan says, a checkpoint. Collective.
    fn end_of_epoch(&mut self, model: &A::Model) -> anyhow::Result<()> {
        self.position.epoch += 1;
        self.position.consumed = 0;
        let validating = Instant::now();
        let v = self.validate(model)?;
        self.clock.exclude(validating.elapsed());
        self.window.exclude(validating.elapsed());
        if let Some(v) = &v {
            record_validation(&mut self.reporter, self.position.epoch - 1, v);
            self.reporter.say(&format!(
                "epoch {}/{}: validation {} ({} samples)",
                self.position.epoch,
                self.job.config.training.epochs,
                metrics::describe(&v.metrics),
                v.samples
            ));
        }
        self.last_valid = v;
        if self.plan.checkpoint_after_epoch(self.position.epoch)
            && self.last_saved != Some(self.position.step)
        {
            self.save_checkpoint(model)?;
        }
        Ok(())
    }

    /// The end of the run: where the time went (a `finish` line), the final checkpoint and
    /// validation if the last step had none, the reducer's statistics. Collective.
    fn finish(mut self, model: &A::Model) -> anyhow::Result<Summary> {
        self.reporter.finish();
        let time = self.time_report()?;
        let position = self.position;
        if self.last_saved != Some(position.step) {
            self.save_checkpoint(model)?;
        }
        let validation = match self.last_valid.take() {
            Some(v) if v.step == position.step => Some(v),
            _ => {
                // Stopped mid-epoch (max_steps): validate the final model too, and record it.
                let v = self.validate(model)?;
                if let Some(v) = &v {
                    record_validation(&mut self.reporter, position.epoch, v);
                }
                v
            }
        };
        self.write_reducer_stats()?;
        Ok(Summary {
            validation,
            steps: position.step,
            skipped_steps: self.skipped,
            time,
        })
    }

    /// The run's step times over the ranks, its peak memory and optimizer state per rank, as
    /// a `finish` line; the report in words, `None` without steps. Collective.
    fn time_report(&mut self) -> anyhow::Result<Option<String>> {
        // The steps since the last log line count in the run's totals.
        let _ = self.clock.take_window();
        if self.clock.run_steps() == 0 {
            return Ok(None);
        }
        let (time, ranks) = across_ranks(self.job.ddp.group(), self.clock.run_means())?;
        let report = time.describe(&ranks);
        let ours = [
            crate::memory::peak_resident_bytes().unwrap_or(0) as f64,
            burn_ddp::ddp::zero::state_param_ids(&self.optim)?.len() as f64,
        ];
        let all = self.job.ddp.all_gather(&ours)?;
        self.reporter.record(&Record::Finish {
            step: self.position.step,
            world_size: self.job.world_size(),
            time,
            report: report.clone(),
            peak_rss_bytes: all.iter().step_by(2).map(|&b| b as u64).collect(),
            optimizer_state_params: all.iter().skip(1).step_by(2).map(|&n| n as u64).collect(),
        });
        Ok(Some(report))
    }

    /// Rank 0, with `output.log_samples`: the gradient synchronisations and bytes per optimizer
    /// step, for the tests.
    fn write_reducer_stats(&self) -> anyhow::Result<()> {
        let stats = self.job.ddp.gradient_stats();
        tracing::debug!(
            rank = self.job.rank(),
            syncs = stats.syncs,
            buckets = stats.bucket_all_reduces,
            lr = self.lr,
            "gradient synchronisation"
        );
        if self.job.rank() == 0 && self.job.config.output.log_samples {
            fs::write(
                self.job.config.output.dir.join("reducer-stats.json"),
                format!(
                    "{{\"syncs\":{},\"bucket_all_reduces\":{},\"bytes_reduced\":{},\"steps\":{}}}",
                    stats.syncs, stats.bucket_all_reduces, stats.bytes_reduced, self.position.step
                ),
            )?;
        }
        Ok(())
    }

    /// Rank 0 writes a checkpoint of the current position; the others wait. Collective.
    fn save_checkpoint(&mut self, model: &A::Model) -> anyhow::Result<()> {
        let saving = Instant::now();
        self.job
            .save_checkpoint(self.position, model, &self.optim, &self.schedule)?;
        self.clock.add(Phase::Checkpoint, saving.elapsed());
        self.last_saved = Some(self.position.step);
        Ok(())
    }

    /// Every validation sample once across the ranks. Collective.
    fn validate(&mut self, model: &A::Model) -> anyhow::Result<Option<Validation>> {
        validate::<A>(
            self.job,
            model,
            &self.batcher,
            &mut self.valid_metrics,
            self.position.step,
        )
    }
}

/// The training metrics of a `train` record: the micro-batches' `outputs` since the last one
/// (each with its samples), synced and fed to `metrics` here, then summed over every rank of
/// `group`. Collective.
pub(crate) fn train_metrics_window<I: ItemLazy>(
    metrics: &mut Metrics<I>,
    outputs: Vec<(I, usize)>,
    position: TrainPosition,
    train_len: usize,
    lr: f64,
    group: &mut impl ProcessGroup,
) -> anyhow::Result<Vec<MetricValue>> {
    let progress = Progress {
        items_processed: position.consumed,
        items_total: train_len,
        unit: None,
    };
    for (output, samples) in outputs {
        metrics.update_lazy(
            output,
            samples,
            progress.clone(),
            position.step,
            Some(lr),
            "training",
        )?;
    }
    Ok(metrics.global(group)?)
}

/// Rank 0's progress bar and metrics file (and TensorBoard files), with the run's `start`
/// line.
pub(crate) fn open_reporter(
    rank: usize,
    world_size: usize,
    output: &OutputConfig,
    total_steps: usize,
    position: TrainPosition,
    resumed_from: Option<usize>,
) -> anyhow::Result<Reporter> {
    let mut reporter = Reporter::new(rank, &output.dir, total_steps as u64, position.step as u64)?;
    if output.tensorboard {
        reporter = reporter.with_tensorboard(&output.dir.join("tensorboard"))?;
    }
    reporter.record(&Record::Start {
        step: position.step,
        epoch: position.epoch,
        world_size,
        resumed_from,
        restart: fault_injection::restart_count(),
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
    });
    Ok(reporter)
}

/// Every rank's step times, combined over the ranks (collective: one small all-gather).
/// Every rank's phase times of `group` (the job), and their spread. Collective.
pub(crate) fn across_ranks(
    group: &mut TcpProcessGroup,
    ours: RankTimes,
) -> anyhow::Result<(StepTime, Vec<RankTimes>)> {
    let row = ours.to_row();
    let mut all = vec![0.0; row.len() * group.world_size()];
    group.all_gather(&row, &mut all)?;
    let ranks: Vec<RankTimes> = all
        .chunks_exact(RankTimes::ROW)
        .map(RankTimes::from_row)
        .collect();
    Ok((StepTime::across_ranks(&ranks), ranks))
}

/// Rank 0, at the end of a run (`output.plots`): charts must never fail a finished run.
pub(crate) fn write_plots(dir: &Path) {
    match crate::plot::write_plots(dir) {
        Ok(files) => tracing::info!(
            "wrote {} charts to {}",
            files.len(),
            dir.join("plots").display()
        ),
        Err(e) => tracing::warn!("could not write the charts of {}: {e:#}", dir.display()),
    }
}

/// A step whose gradients held a NaN or an infinity on some ranks (`training.on_nonfinite`).
#[derive(Debug, thiserror::Error)]
#[error(
    "non-finite gradients (NaN or Inf) at optimizer step {step}, first on rank(s) {ranks:?}: the model was not updated and no checkpoint was written{}; lower optimizer.learning_rate, check the data, or set training.on_nonfinite = \"skip\"",
    match last_checkpoint { Some(s) => format!(" (the newest checkpoint, of step {s}, is kept)"), None => String::new() }
)]
pub struct NonFiniteGradients {
    pub step: usize,
    pub ranks: Vec<usize>,
    pub last_checkpoint: Option<usize>,
}

/// The `valid` line of `metrics.jsonl` for a validation during `epoch`.
pub(crate) fn record_validation(reporter: &mut Reporter, epoch: usize, v: &Validation) {
    reporter.record(&Record::Valid {
        epoch,
        step: v.step,
        samples: v.samples,
        metrics: metrics::as_map(&v.metrics),
    });
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

/// The training sampler: uniform (PyTorch's `DistributedSampler`) or weighted
/// (`WeightedDistributedSampler`, with the app's per-sample weights, as many draws per epoch as
/// the data set has samples). Both shard one global order per epoch.
pub(crate) enum EpochSampler {
    Uniform(DistributedSampler),
    Weighted(WeightedDistributedSampler),
}

impl EpochSampler {
    /// The job's sampler over `train`: weighted with the app's per-sample weights under
    /// `training.balance_classes`, else uniform.
    fn for_job<A: App>(job: &Job<A>, train: &dyn Dataset<A::Item>) -> anyhow::Result<Self> {
        let t = &job.config.training;
        Self::for_app(&job.app, t, train, job.world_size(), job.rank())
    }

    /// Rank `rank` of `world`'s sampler over `train` for app `app` (a pipeline's replicas are
    /// its ranks: every stage of one replica gets the same samples).
    pub(crate) fn for_app<A: App>(
        app: &A,
        t: &TrainingConfig,
        train: &dyn Dataset<A::Item>,
        world: usize,
        rank: usize,
    ) -> anyhow::Result<Self> {
        let weights = if t.balance_classes {
            let w = app.sample_weights(train).ok_or_else(|| {
                UsageError(
                    "training.balance_classes = true, but this app gives no per-sample weights (App::sample_weights)".into(),
                )
            })?;
            Some(w)
        } else {
            None
        };
        Self::new(train.len(), t, world, rank, weights)
    }

    fn new(
        len: usize,
        t: &TrainingConfig,
        world: usize,
        rank: usize,
        weights: Option<Vec<f64>>,
    ) -> anyhow::Result<Self> {
        match weights {
            None => Ok(Self::Uniform(
                DistributedSampler::new(len, world, rank)
                    .with_seed(t.seed)
                    .with_shuffle(t.shuffle)
                    .with_drop_last(t.drop_last),
            )),
            Some(weights) => WeightedDistributedSampler::new(&weights, len, world, rank, t.seed)
                .map(Self::Weighted)
                .ok_or_else(|| {
                    anyhow::anyhow!(UsageError(
                        "training.balance_classes: no usable sample weights".into()
                    ))
                }),
        }
    }

    pub(crate) fn samples(&self, epoch: u64, consumed: usize) -> Vec<Sample> {
        match self {
            Self::Uniform(s) => s.samples(epoch, consumed),
            Self::Weighted(s) => s.samples(epoch, consumed),
        }
    }
}

/// Evaluates every validation sample exactly once across the ranks (no padding) and sums the
/// metrics with their real counts. Collective; `None` when the app has no validation set.
fn validate<A: App>(
    job: &mut Job<A>,
    model: &A::Model,
    batcher: &A::Batcher,
    metrics: &mut Metrics<ValidItem<A>>,
    step: usize,
) -> anyhow::Result<Option<Validation>> {
    let Some(valid) = job.data.valid.clone() else {
        return Ok(None);
    };
    // The model without autodiff, fed batches made on the device without autodiff (as
    // burn-train's own validation does).
    let inner = model.valid();
    let device = job.device.clone().inner();
    let samples = crate::eval::evaluate_shard(
        &inner,
        &*valid,
        batcher,
        metrics,
        job.rank(),
        job.world_size(),
        &device,
        job.config.training.batch_size,
    )?;
    let values = metrics.global(job.ddp.group())?;
    let [n] = job.ddp.sum([samples as f64])?;
    Ok(Some(Validation {
        metrics: values,
        samples: n as usize,
        step,
    }))
}

/// Appends `epoch index is_padding` lines for the samples of one step (for tests).
pub(crate) fn log_samples(
    dir: &Path,
    rank: usize,
    epoch: usize,
    chunk: &[Sample],
) -> anyhow::Result<()> {
    fs::create_dir_all(dir)?;
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("samples-rank{rank}.txt")))?;
    for s in chunk {
        writeln!(f, "{epoch} {} {}", s.index, u8::from(s.is_padding))?;
    }
    Ok(())
}
