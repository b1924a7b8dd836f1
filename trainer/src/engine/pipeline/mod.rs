//! Pipeline stages in the engine (`[distributed] pipeline_stages = P`): a program says how its
//! app's model splits with a [`StageSplit`], given to the entry point
//! ([`main_with_stages`](crate::run::main_with_stages)); each rank then builds and trains
//! only its stage, `world / P` replicas of the pipeline train data-parallel, and
//! `training.accumulation_steps` is the micro-batch count of each optimizer step.
//!
//! | module | owns |
//! |---|---|
//! | this one | [`StageSplit`] (the program's answer) and the dispatch from the engine |
//! | [`stage_of`] | [`StageOf`]: which stage a rank builds |
//! | [`stage_steps`] | the pipeline step kind of the engine's one loop: micro-batches through burn-ddp's pipeline step, the validation pass through the stages, per-stage checkpoints and resume |
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
pub mod stage_of;
mod stage_steps;

use std::process::ExitCode;

use burn::tensor::{Device, Tensor};

use crate::app::{App, AppError, TrainInput, TrainItem, ValidItem};
use crate::engine::fit::RankStart;

/// burn-ddp's contract for one pipeline stage of a model (what [`StageSplit::new`] builds).
pub use burn_ddp::pipeline::PipelineStage;
pub use stage_of::StageOf;

type Runner<A> = Box<dyn Fn(RankStart<A>) -> anyhow::Result<ExitCode> + Send + Sync>;

/// How an app's model is cut into pipeline stages, for `[distributed] pipeline_stages > 1`:
/// built from a function that makes stage `i` of `n` on a device (only that stage's layers;
/// the same parameters as the whole model's when seeded alike, if runs are to be compared) as
/// a burn-ddp [`PipelineStage`] whose batch is the model's training input, and one that makes
/// the model's `TrainStep` output from the last stage's output (what the metrics read).
///
/// The program gives it to the entry point, [`main_with_stages`](crate::run::main_with_stages),
/// beside the app: the app itself (the user's contract) knows nothing of the engine. A program
/// that gives none trains data-parallel only, and the pre-flight refuses a config asking for
/// stages before any rank starts.
pub struct StageSplit<A: App> {
    run: Runner<A>,
}

impl<A: App> StageSplit<A> {
    /// `build(model, data, which, device)` builds only stage `which.stage` of `which.stages`
    /// on `device`. Activations between stages are float tensors of rank `D`; every stage
    /// gets the whole micro-batch (the model's training input), the first reads its inputs
    /// and the last its targets. A `build` error is a usage error (exit code 2), e.g. more
    /// stages than the model has layers.
    ///
    /// `output(last_output, loss, batch)` makes the whole model's [`TrainStep`](burn::train::TrainStep) output from
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
            run: Box::new(move |start| stage_steps::train::<A, S, D>(start, &build, &output)),
        }
    }
}

/// Trains this rank's stage of the app's model with the program's split, as
/// `[distributed] pipeline_stages` asks (the pre-flight refused a program without one).
pub(crate) fn train<A: App>(start: RankStart<A>, split: StageSplit<A>) -> anyhow::Result<ExitCode> {
    (split.run)(start)
}
