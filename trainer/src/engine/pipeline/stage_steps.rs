//! The pipeline step kind: this rank trains one stage of the model, and one optimizer step
//! runs the step's micro-batches through the pipeline (burn-ddp's `PipelineParallel`).
//!
//! 1. **form the pipeline** — this rank's stage and replica, the links to its neighbouring
//!    stages, the DDP step over its stage's replicas;
//! 2. **build the stage** (seeded as the whole model would be), **restore** the newest step
//!    every stage has, make the stage's replicas equal;
//! 3. **train** with the engine's one loop ([`crate::engine::fit::training_loop`]): the sampler gives
//!    this rank's *replica* its shard (every stage of a replica reads the same samples: the
//!    first its inputs, the last its targets); each optimizer step cuts it into
//!    `accumulation_steps` micro-batches, runs them through the pipeline (GPipe or 1F1B),
//!    averages the stage's gradients over its replicas and steps the optimizer; validation
//!    runs through the pipeline without autodiff.
//!
//! The app's metrics read the last stage's outputs, made into the model's `TrainStep` output
//! by the app's function (`StageSplit::new`); every rank takes part in their sums, the other
//! stages with nothing counted.

use std::marker::PhantomData;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::Progress;
use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::ModuleOptimizer;
use burn::tensor::{Device, Tensor};
use burn_ddp::ddp::zero::sharded_sync;
use burn_ddp::host_values::host_values;
use burn_ddp::pipeline::{
    PipelineConfig, PipelineError, PipelineParallel, PipelineStage, StageStep,
};
use burn_ddp::sampler::DistributedSampler;
use burn_ddp::{Distributed, ProcessGroup, ReduceOp, StepOutcome};

use super::stage_checkpoint::{agreed_checkpoint, stage_policy};
use super::stage_of::StageOf;
use crate::app::{read_item, App, AppConfig, AppError, Datasets, TrainInput, TrainItem, ValidItem};
use crate::engine::checkpoint::{self, Checkpoint, TrainPosition};
use crate::engine::fault_injection;
use crate::engine::fit::across_ranks::{across_ranks, train_metrics_window};
use crate::engine::fit::events::HeldState;
use crate::engine::fit::optimizer::optimizer;
use crate::engine::fit::rank_reporter::RankReporter;
use crate::engine::fit::sampler::EpochSampler;
use crate::engine::fit::step_kind::{StepInput, StepKind};
use crate::engine::fit::training_loop::fit;
use crate::engine::fit::{RankStart, Summary, Validation};
use crate::engine::loader::BatchStream;
use crate::engine::parallel::{self, CheckpointPolicy};
use crate::engine::schedule::Schedule;
use crate::error::UsageError;
use crate::report::metrics::{MetricValue, Metrics};
use crate::report::timing::{Phase, PhaseClock, RankTimes, StepTime};

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

/// Trains this rank's stage (module docs); rank 0 prints the closing lines. Collective over
/// the whole job.
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
    let settings = start.loop_settings();
    let RankStart {
        app,
        config,
        dist,
        data,
        device,
        no_resume,
        // Pipelines refuse on_rank_failure = "continue", so no stage is started to join.
        joined: _,
    } = start;
    let pp = form::<A>(dist, &config, no_resume, &device)?;
    let which = StageOf {
        stage: pp.stage(),
        stages: pp.stages(),
    };
    // As the whole model is seeded (the replica's first rank's seed): every stage draws its
    // parameters as that model would.
    device.seed(fault_injection::plan().init_seed(config.training.seed, pp.replica()));
    let stage = build(&config.model, &config.data, which, &device)?;
    let sampler = EpochSampler::for_app(
        &app,
        &config.training,
        &*data.train,
        pp.replicas(),
        pp.replica(),
    )?;
    let mut reporter = RankReporter::new(pp.rank(), &config.output);
    let mut steps = StageSteps::<A, S, D> {
        policy: CheckpointPolicy::for_app(&app, &config).map(|run| stage_policy(&run, which)),
        resume: config.checkpoint.resume && !no_resume,
        optim: optimizer(&config.optimizer),
        batcher: app.batcher(&config.model, &config.data, &device),
        output,
        to_valid: Into::into,
        train_metrics: app.train_metrics(),
        valid_metrics: app.valid_metrics(),
        outputs: Vec::new(),
        samples: 0,
        last_loss: None,
        config,
        data,
        device,
        pp,
        stage: PhantomData,
    };
    let started = Instant::now();
    let (stage, summary) = fit(&mut steps, stage, sampler, &settings, &mut reporter)?.done()?;
    drop(stage);
    steps.closing_lines(&summary, started.elapsed())?;
    // Rank 0 may host the store: leave together.
    steps.pp.world_group().barrier()?;
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
        schedule: d.pipeline_schedule,
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
    PipelineParallel::new(
        dist,
        pipeline,
        parallel::ddp_options(d, &Default::default()),
        device,
    )
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
fn restore_stage<S: Module>(
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

/// The pipeline step kind of one rank (module docs): stage type `S`, whose last stage's
/// output has `D` dimensions.
struct StageSteps<'o, A: App, S, const D: usize> {
    config: AppConfig<A>,
    data: Datasets<A::Item>,
    device: Device,
    pp: PipelineParallel,
    policy: Option<CheckpointPolicy>,
    /// Resume from the newest step every stage has (`checkpoint.resume`, not `--no-resume`).
    resume: bool,
    optim: ModuleOptimizer,
    batcher: A::Batcher,
    /// The app's function to the model's training output (last stage).
    output: &'o ToOutput<A, D>,
    /// Its validation output from that (`Into::into`, kept here so that the methods need no
    /// bound of their own).
    to_valid: fn(TrainItem<A>) -> ValidItem<A>,
    train_metrics: Metrics<TrainItem<A>>,
    valid_metrics: Metrics<ValidItem<A>>,
    /// The last stage's outputs since the last `train` line, with their micro-batches' sizes.
    outputs: Vec<(TrainItem<A>, usize)>,
    /// This replica's samples trained in this process.
    samples: usize,
    /// The last stage's mean loss at the last validation, for the closing line.
    last_loss: Option<f64>,
    stage: PhantomData<fn() -> S>,
}

impl<A: App, S, const D: usize> StepKind for StageSteps<'_, A, S, D>
where
    S: PipelineStage<D, Batch = TrainInput<A>>,
{
    type Item = A::Item;
    type Module = S;

    fn rank(&self) -> usize {
        self.pp.rank()
    }

    fn world_size(&self) -> usize {
        self.pp.stages() * self.pp.replicas()
    }

    fn data_parallel_size(&self) -> usize {
        self.pp.replicas()
    }

    fn train_set(&self) -> Arc<dyn Dataset<A::Item>> {
        self.data.train.clone()
    }

    /// The newest step every stage has a checkpoint of, if resuming (collective over the whole
    /// job), loaded into the stage (collective over its replicas).
    fn restore(&mut self, stage: S) -> anyhow::Result<(S, Option<Checkpoint>)> {
        let restored = match (&self.policy, self.resume) {
            (Some(policy), true) => agreed_checkpoint(&mut self.pp, policy)?,
            _ => None,
        };
        let optim = std::mem::replace(&mut self.optim, optimizer(&self.config.optimizer));
        let (stage, optim) = restore_stage(&mut self.pp, stage, optim, restored.as_ref())?;
        self.optim = optim;
        Ok((stage, restored))
    }

    /// The step's micro-batches through the pipeline: forward, backward, the exchanges with
    /// the neighbouring stages, the gradients' average over the stage's replicas, the job's
    /// verdict on them, the optimizer and ZeRO's gather, in one; the last stage's outputs for
    /// the metrics (kept for a step that is then skipped too, as the data-parallel step keeps
    /// them). The passes and exchanges count as compute, the optimizer as optimizer.
    fn step(
        &mut self,
        stage: S,
        batches: &mut BatchStream<A::Item>,
        step: &StepInput<'_>,
        clock: &mut PhaseClock,
    ) -> anyhow::Result<(S, StepOutcome)> {
        self.device.seed(step.seed);
        let micro = &step.micro_batches;
        let weights: Vec<f64> = micro.iter().map(|(_, w)| f64::from(*w)).collect();
        let (batcher, device) = (&self.batcher, &self.device);
        let inputs = clock.time(Phase::Data, || {
            micro
                .iter()
                .map(|_| batches.next_batch::<TrainInput<A>, _>(batcher, device))
                .collect::<anyhow::Result<Vec<_>>>()
        })?;
        let sizes: Vec<usize> = micro.iter().map(|(samples, _)| samples.len()).collect();
        let (pp, output, outputs) = (&mut self.pp, self.output, &mut self.outputs);
        let (optim, lr) = (&mut self.optim, step.lr);
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
        clock.add(Phase::Optimizer, optimizer_time);
        clock.add(
            Phase::Compute,
            started.elapsed().saturating_sub(optimizer_time),
        );
        let StageStep { stage, outcome, .. } = stepped.map_err(usage_or_failure)?;
        self.samples += step.samples.len();
        Ok((stage, outcome))
    }

    /// The app's training metrics on the last stage's outputs, over the whole job.
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
            self.pp.world_group(),
        )
    }

    fn across_ranks(&mut self, ours: RankTimes) -> anyhow::Result<(StepTime, Vec<RankTimes>)> {
        across_ranks(self.pp.world_group(), ours)
    }

    fn all_gather(&mut self, ours: &[f64]) -> anyhow::Result<Vec<f64>> {
        let mut all = vec![0.0; ours.len() * self.world_size()];
        self.pp.world_group().all_gather(ours, &mut all)?;
        Ok(all)
    }

    fn held_state(&mut self) -> anyhow::Result<HeldState> {
        Ok(HeldState {
            optimizer_state_params: sharded_sync::state_param_ids(&self.optim)?.len() as u64,
            optimizer_state_bytes: sharded_sync::state_bytes(&self.optim)?,
            gradient_bytes: self.pp.replica_group().gradient_bytes(),
            parameter_bytes: self.pp.replica_group().parameter_bytes(),
            // Pipeline stages do not combine with ZeRO stage 3.
            gathered_peak_bytes: 0,
        })
    }

    /// That the stage's replicas hold the same parameters. Collective over the stage's
    /// replicas.
    fn check_replicas(&mut self, stage: &S, step: usize) -> anyhow::Result<()> {
        let which = self.pp.stage();
        self.pp
            .replica_group()
            .check_replicas(stage, step)
            .with_context(|| {
                format!("stage {which}, across its replicas (its ranks here are replica numbers)")
            })
    }

    /// Each stage's replica 0 writes the stage's checkpoint; its replicas wait. Collective
    /// over the stage's replicas.
    fn save(
        &mut self,
        position: TrainPosition,
        stage: &S,
        schedule: &Schedule,
    ) -> anyhow::Result<()> {
        let Some(policy) = &self.policy else {
            return Ok(());
        };
        parallel::save_training_checkpoint(
            self.pp.replica_group(),
            policy,
            position,
            stage,
            &self.optim,
            schedule,
        )
        .with_context(|| format!("stage {}", self.pp.stage()))
    }

    fn validate(&mut self, stage: &S, step: usize) -> anyhow::Result<Option<Validation>> {
        self.validate_stage(stage, step)
    }
}

impl<A: App, S, const D: usize> StageSteps<'_, A, S, D>
where
    S: PipelineStage<D, Batch = TrainInput<A>>,
{
    /// The app's validation metrics, and the last stage's mean loss for the closing line, over
    /// every validation sample once (each replica its shard, in micro-batches of `batch_size`
    /// through the pipeline without autodiff). Collective over the whole
    /// job; nothing without a validation set.
    fn validate_stage(&mut self, stage: &S, step: usize) -> anyhow::Result<Option<Validation>> {
        let Some(valid) = self.data.valid.clone() else {
            return Ok(None);
        };
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
        self.last_loss = Some(loss / samples.max(1.0));
        Ok(Some(Validation {
            metrics: values,
            samples: samples as usize,
            step,
        }))
    }

    /// One pass of validation micro-batches (`sizes[i]` samples in `batches[i]`) through the
    /// pipeline: on the last stage, each output into the app's validation metrics and its
    /// loss × samples, samples into `loss`. Collective over the pipeline.
    fn validation_pass(
        &mut self,
        inner: &S,
        batches: &[TrainInput<A>],
        sizes: &[usize],
        device: &Device,
        loss: &mut [f64; 2],
        progress: Progress,
    ) -> anyhow::Result<()> {
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

    /// Rank 0's closing lines: the final validation as the data-parallel loop says it, then
    /// the layout, the steps and the rate of the run (`elapsed`, checkpoints included), the
    /// last stage's validation loss, every rank's peak resident memory. Collective over the
    /// whole job.
    fn closing_lines(&mut self, summary: &Summary, elapsed: Duration) -> anyhow::Result<()> {
        let peak = crate::engine::memory::peak_resident_bytes().unwrap_or(0) as f64;
        let all = self.all_gather(&[peak])?;
        // Each replica's first stage counts its samples once.
        let first = f64::from(u8::from(self.pp.stage() == 0));
        let mut samples = [self.samples as f64 * first];
        self.pp
            .world_group()
            .all_reduce(&mut samples, ReduceOp::Sum)?;
        let rate = samples[0] / elapsed.as_secs_f64().max(1e-9);
        let valid = self
            .last_loss
            .map_or(String::new(), |loss| format!(", validation loss {loss:.6}"));
        if self.pp.rank() == 0 {
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
                summary.steps,
                mib.join(" ")
            );
        }
        Ok(())
    }
}
