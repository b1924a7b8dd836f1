//! Pipeline stages in the engine (`[distributed] pipeline_stages = P`): an app says how its
//! model splits with [`StageSplit`] (from [`App::stages`]); each rank then builds and trains
//! only its stage, `world / P` replicas of the pipeline train data-parallel, and
//! `training.accumulation_steps` is the micro-batch count of each optimizer step.
//!
//! | module | owns |
//! |---|---|
//! | this one | [`StageSplit`] (the app's answer) and the dispatch from the engine |
//! | [`stage_fit`] | one stage's training loop: samples of its replica, micro-batches through burn-ddp's pipeline step, the optimizer, per-stage checkpoints and resume |
//! | [`stage_checkpoint`] | where each stage's checkpoints live and which step every stage resumes from |
//!
//! What the engine gives a stage that plain data parallelism also gives: the sampler (a
//! replica is a rank of it), the step plan, the learning-rate schedule, the optimizer and its
//! state (ZeRO stage 1 within a stage's replicas), validation (the last stage's loss),
//! checkpoints and resume, the metrics file, plots, the sample log, replica checks
//! (`training.check_replicas_every`, among a stage's replicas), `training.on_nonfinite`
//! (a skipped step is skipped by the whole job), fault injection, and the app's own training
//! and validation metrics, computed on the last stage's outputs (made into the model's
//! `TrainStep` output by the app's function given to [`StageSplit::new`]).

pub(crate) mod stage_checkpoint;
mod stage_fit;

use std::process::ExitCode;

use burn::tensor::{Device, Tensor};
use burn::train::TrainStep;
use burn_ddp::pipeline::PipelineStage;

use crate::app::{App, AppError, TrainItem, ValidItem};
use crate::fit::RankStart;
use crate::preflight::cannot_split;

/// Which stage a rank builds: stage `stage` of `stages`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageOf {
    pub stage: usize,
    pub stages: usize,
}

impl StageOf {
    pub fn is_first(&self) -> bool {
        self.stage == 0
    }

    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }
}

type Runner<A> = Box<dyn Fn(RankStart<A>) -> anyhow::Result<ExitCode> + Send + Sync>;

/// How an app's model is cut into pipeline stages (see [`App::stages`]): built from the
/// function that makes stage `i` of `n` on a device.
pub struct StageSplit<A: App> {
    run: Runner<A>,
}

/// The model's training input: what every stage's micro-batches are.
pub type TrainInput<A> = <<A as App>::Model as TrainStep>::Input;

impl<A: App> StageSplit<A> {
    /// `build(model, data, which, device)` builds only stage `which.stage` of `which.stages`
    /// on `device`. Activations between stages are float tensors of rank `D`; every stage
    /// gets the whole micro-batch (the model's training input), the first reads its inputs
    /// and the last its targets. A `build` error is a usage error (exit code 2), e.g. more
    /// stages than the model has layers.
    ///
    /// `output(last_output, loss, batch)` makes the whole model's [`TrainStep`] output from
    /// the last stage's output, the micro-batch's mean loss (both detached) and the
    /// micro-batch — e.g. `ClassificationOutput::new(loss, logits, batch.targets.clone())`.
    /// The app's training metrics read it, and its validation metrics read it converted
    /// with `Into` (the identity when, as in most models, `TrainStep` and `InferenceStep`
    /// have the same output), so a pipeline reports the metrics the whole model reports.
    pub fn new<S, const D: usize, F, O>(build: F, output: O) -> Self
    where
        S: PipelineStage<D, Batch = TrainInput<A>> + 'static,
        F: Fn(&A::ModelConfig, &A::DataConfig, StageOf, &Device) -> Result<S, AppError>
            + Send
            + Sync
            + 'static,
        O: Fn(Tensor<D>, Tensor<1>, &TrainInput<A>) -> TrainItem<A> + Send + Sync + 'static,
        TrainItem<A>: Into<ValidItem<A>>,
    {
        Self {
            run: Box::new(move |start| stage_fit::train::<A, S, D>(start, &build, &output)),
        }
    }
}

/// Trains this rank's stage of the app's model, as `[distributed] pipeline_stages` asks;
/// refuses an app whose model does not split (the pre-flight already did).
pub(crate) fn train<A: App>(start: RankStart<A>) -> anyhow::Result<ExitCode> {
    let Some(split) = start.app.stages() else {
        anyhow::bail!(cannot_split(&start.app, &start.config));
    };
    (split.run)(start)
}
