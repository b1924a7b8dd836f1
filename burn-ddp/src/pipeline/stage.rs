//! One pipeline step on one stage: the user's stage module run through a schedule, its
//! activations and their gradients exchanged with the neighbouring stages, its parameter
//! gradients accumulated over the micro-batches.
//!
//! The backward pass of a stage that is not the last is the backward of
//! `(output · incoming_gradient).sum()`: its input is a leaf that requires a gradient, and that
//! gradient is what goes back to the previous stage. The last stage's loss of each micro-batch
//! is divided by the micro-batch count, so the accumulated gradients are those of the mean
//! loss over the whole batch — what one process computes on the whole model (for micro-batches
//! of equal size, and a loss that is a mean over its micro-batch).

use std::collections::BTreeMap;

use burn::module::Module;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{Device, Tensor, TensorData};

use super::link::{LinkError, StageLinks};
use super::schedule::{stage_actions, Action, PipelineSchedule};
use crate::host_values::host_values;

/// A user's model cut into stages: each rank builds the stage it holds (e.g. a struct with
/// the embedding on the first stage, some layers on every stage, the head on the last) and
/// implements this. Activations between stages are float tensors of rank `D`.
pub trait PipelineStage<const D: usize>: Module {
    /// One micro-batch. Every stage of a pipeline gets the same micro-batches: the first reads
    /// its inputs, the last its targets.
    type Batch;

    /// This stage's forward pass: from the micro-batch on the first stage (`activation` is
    /// `None`), from the previous stage's output on the others (a leaf that requires a
    /// gradient; `batch` is there for masks and the like).
    fn forward(&self, activation: Option<Tensor<D>>, batch: &Self::Batch) -> Tensor<D>;

    /// The last stage's loss on its own output: a mean over the micro-batch.
    fn loss(&self, output: Tensor<D>, batch: &Self::Batch) -> Tensor<1>;
}

/// Why a pipeline step failed on this rank.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error("stage {stage}: cannot read {what} back to the host: {reason}")]
    Readback {
        stage: usize,
        what: &'static str,
        reason: String,
    },
    #[error(
        "stage {stage}: stage {from} sent {what} of shape {got:?}, but this stage expects {expected}: the stages' shapes do not fit together"
    )]
    Shape {
        stage: usize,
        from: usize,
        what: &'static str,
        got: Vec<usize>,
        expected: String,
    },
    #[error(
        "stage {stage}: its forward pass failed on the activation of shape {shape:?} from stage {previous}: {message}. The previous stage's output must be this stage's input: the stages' shapes probably do not fit together"
    )]
    ForwardOnActivation {
        stage: usize,
        previous: usize,
        shape: Vec<usize>,
        message: String,
    },
    #[error("stage {stage}: its forward pass failed: {message}")]
    Forward { stage: usize, message: String },
    #[error(
        "stage {stage}, the last: its loss failed on its output and the batch's targets: {message}"
    )]
    Loss { stage: usize, message: String },
    #[error(
        "stage {stage}: its output does not depend on its input (no gradient to send back to stage {previous}): a stage must use the activation it is given"
    )]
    NoInputGradient { stage: usize, previous: usize },
}

/// What one pipeline step gave this stage.
pub struct StepResult {
    /// The gradients of this stage's parameters, summed over the micro-batches (of the mean
    /// loss over the whole batch).
    pub grads: GradientsParams,
    /// On the last stage, the mean of the micro-batches' losses; `None` elsewhere.
    pub loss: Option<f64>,
}

/// Where this rank's stage sits, and how the step is run.
#[derive(Debug, Clone, Copy)]
pub struct StepPlan {
    pub stage: usize,
    pub stages: usize,
    pub schedule: PipelineSchedule,
}

/// A micro-batch between its forward and its backward pass.
struct InFlight<const D: usize> {
    /// The activation received (a leaf requiring a gradient), on stages after the first.
    input: Option<Tensor<D>>,
    /// The stage's output, or on the last stage its loss (rank 1, as `Tensor<D>` cannot hold it).
    output: Output<D>,
}

enum Output<const D: usize> {
    Sent(Tensor<D>),
    Loss(Tensor<1>),
}

/// Runs one pipeline step of `micro_batches` on `stage` (this rank's stage, on the autodiff
/// `device`) as `plan` says, with equal micro-batches ([`pipeline_step_weighted`] with
/// `1 / m` each).
pub fn pipeline_step<S, const D: usize>(
    stage: &S,
    plan: StepPlan,
    micro_batches: &[S::Batch],
    links: &mut StageLinks,
    device: &Device,
) -> Result<StepResult, StageError>
where
    S: PipelineStage<D>,
{
    let m = micro_batches.len();
    let weights = vec![1.0 / m as f64; m];
    pipeline_step_weighted(stage, plan, micro_batches, &weights, links, device)
}

/// Runs one pipeline step of `micro_batches` on `stage` as `plan` says; the last stage scales
/// micro-batch `i`'s loss by `weights[i]` (its share of the step's samples, so that unequal
/// micro-batches still give the gradient of the mean over the step). Only the last stage
/// reads the weights. Collective with the neighbouring stages (through `links`): every stage
/// of the pipeline must run the same plan with the same number of micro-batches; a neighbour
/// that is lost or silent past the links' timeout fails the step naming it.
///
/// # Panics
///
/// If `weights` and `micro_batches` differ in length (a programming error).
pub fn pipeline_step_weighted<S, const D: usize>(
    stage: &S,
    plan: StepPlan,
    micro_batches: &[S::Batch],
    weights: &[f64],
    links: &mut StageLinks,
    device: &Device,
) -> Result<StepResult, StageError>
where
    S: PipelineStage<D>,
{
    pipeline_step_with_outputs(
        stage,
        plan,
        micro_batches,
        weights,
        links,
        device,
        |_, _, _| {},
    )
}

/// [`pipeline_step_weighted`], and on the last stage `on_output(i, output, loss)` for each
/// micro-batch `i` right after its forward pass: the stage's output and the micro-batch's own
/// loss (its mean, before the weight), both detached — for the program's metrics, as PyTorch's
/// pipeline schedules return the last stage's outputs. Never called on the other stages.
/// Collective with the neighbouring stages, as [`pipeline_step_weighted`].
///
/// # Panics
///
/// If `weights` and `micro_batches` differ in length (a programming error).
pub fn pipeline_step_with_outputs<S, const D: usize>(
    stage: &S,
    plan: StepPlan,
    micro_batches: &[S::Batch],
    weights: &[f64],
    links: &mut StageLinks,
    device: &Device,
    mut on_output: impl FnMut(usize, Tensor<D>, Tensor<1>),
) -> Result<StepResult, StageError>
where
    S: PipelineStage<D>,
{
    assert_eq!(
        micro_batches.len(),
        weights.len(),
        "one weight per micro-batch"
    );
    let m = micro_batches.len();
    let mut in_flight: BTreeMap<usize, InFlight<D>> = BTreeMap::new();
    let mut accumulator = GradientsAccumulator::new();
    let mut loss_sum = 0.0;
    for action in stage_actions(plan.schedule, plan.stages, plan.stage, m) {
        match action {
            Action::Forward(i) => {
                let micro = MicroBatch {
                    index: i,
                    batch: &micro_batches[i],
                    weight: weights[i],
                };
                let flight = forward(stage, plan, micro, links, device, &mut on_output)?;
                in_flight.insert(i, flight);
            }
            Action::Backward(i) => {
                let Some(flight) = in_flight.remove(&i) else {
                    unreachable!("stage_actions puts every forward before its backward")
                };
                if let Output::Loss(loss) = &flight.output {
                    loss_sum += scalar(plan.stage, loss.clone())?;
                }
                let grads = backward(plan, i, flight, links, device)?;
                accumulator.accumulate(stage, GradientsParams::from_grads(grads, stage));
            }
        }
    }
    links.flush()?;
    let last = plan.stage + 1 == plan.stages;
    Ok(StepResult {
        grads: accumulator.grads(),
        loss: last.then_some(loss_sum),
    })
}

/// One micro-batch of a step: its place, its data and its share of the step's samples.
struct MicroBatch<'b, B> {
    index: usize,
    batch: &'b B,
    weight: f64,
}

/// A micro-batch's forward pass: receive, run the stage, send on (or, on the last stage, show
/// the output and loss to `on_output` and take the weighted loss).
fn forward<S: PipelineStage<D>, const D: usize>(
    stage: &S,
    plan: StepPlan,
    micro: MicroBatch<'_, S::Batch>,
    links: &mut StageLinks,
    device: &Device,
    on_output: &mut impl FnMut(usize, Tensor<D>, Tensor<1>),
) -> Result<InFlight<D>, StageError> {
    let MicroBatch {
        index: i,
        batch,
        weight,
    } = micro;
    let input = if plan.stage == 0 {
        None
    } else {
        Some(receive_activation::<D>(plan, i, links, device)?.require_grad())
    };
    let out = run_forward(stage, plan, input.clone(), batch)?;
    let output = if plan.stage + 1 == plan.stages {
        let shown = out.clone().detach();
        let loss = unwinding(|| stage.loss(out, batch)).map_err(|message| StageError::Loss {
            stage: plan.stage,
            message,
        })?;
        on_output(i, shown, loss.clone().detach());
        // Each micro-batch's share of the batch mean.
        Output::Loss(loss * weight)
    } else {
        let shape = out.dims().to_vec();
        let values = read(plan.stage, "an activation", out.clone())?;
        links.send_activation(i, &shape, &values)?;
        Output::Sent(out)
    };
    Ok(InFlight { input, output })
}

/// `stage.forward(input, batch)`. The user's forward pass panics where the activation it is
/// given does not fit it (Burn checks shapes by panicking): that becomes an error naming this
/// stage, the previous one and the activation's shape, so the rank fails with a message and its
/// neighbours are told, instead of a panic on one rank and waits on the others.
fn run_forward<S: PipelineStage<D>, const D: usize>(
    stage: &S,
    plan: StepPlan,
    input: Option<Tensor<D>>,
    batch: &S::Batch,
) -> Result<Tensor<D>, StageError> {
    let shape = input.as_ref().map(|t| t.dims().to_vec());
    unwinding(|| stage.forward(input, batch)).map_err(|message| match shape {
        Some(shape) => StageError::ForwardOnActivation {
            stage: plan.stage,
            previous: plan.stage - 1,
            shape,
            message,
        },
        None => StageError::Forward {
            stage: plan.stage,
            message,
        },
    })
}

/// `work()`, or the message of its panic (the user's code panics where Burn rejects a shape).
fn unwinding<T>(work: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|m| (*m).to_owned()))
            .unwrap_or_else(|| "it panicked".to_owned())
    })
}

/// Micro-batch `i`'s activation from the previous stage, its rank checked.
fn receive_activation<const D: usize>(
    plan: StepPlan,
    i: usize,
    links: &mut StageLinks,
    device: &Device,
) -> Result<Tensor<D>, StageError> {
    let (shape, values) = links.recv_activation(i)?;
    if shape.len() != D {
        return Err(StageError::Shape {
            stage: plan.stage,
            from: plan.stage - 1,
            what: "an activation",
            got: shape,
            expected: format!("a tensor of rank {D}"),
        });
    }
    Ok(Tensor::<D>::from_data(
        TensorData::new(values, shape),
        device,
    ))
}

/// Forward passes only (validation, inference) of `micro_batches` through the pipeline:
/// each stage receives micro-batch `i`'s activation, runs `stage` and sends its output on;
/// the last stage gives each output to `on_output(i, output)`. The stages work on different
/// micro-batches at once (sends never wait). Use the stage and device without autodiff.
/// Collective with the neighbouring stages, as [`pipeline_step`].
pub fn pipeline_forward<S, const D: usize>(
    stage: &S,
    plan: StepPlan,
    micro_batches: &[S::Batch],
    links: &mut StageLinks,
    device: &Device,
    mut on_output: impl FnMut(usize, Tensor<D>),
) -> Result<(), StageError>
where
    S: PipelineStage<D>,
{
    for (i, batch) in micro_batches.iter().enumerate() {
        let input = if plan.stage == 0 {
            None
        } else {
            Some(receive_activation::<D>(plan, i, links, device)?)
        };
        let out = run_forward(stage, plan, input, batch)?;
        if plan.stage + 1 == plan.stages {
            on_output(i, out);
        } else {
            let shape = out.dims().to_vec();
            let values = read(plan.stage, "an activation", out)?;
            links.send_activation(i, &shape, &values)?;
        }
    }
    Ok(links.flush()?)
}

/// Micro-batch `i`'s backward pass: the stage's gradients, and its input's gradient sent back.
fn backward<const D: usize>(
    plan: StepPlan,
    i: usize,
    flight: InFlight<D>,
    links: &mut StageLinks,
    device: &Device,
) -> Result<burn::tensor::Gradients, StageError> {
    let grads = match flight.output {
        Output::Loss(loss) => loss.backward(),
        Output::Sent(out) => {
            let (shape, values) = links.recv_gradient(i)?;
            if shape != out.dims() {
                return Err(StageError::Shape {
                    stage: plan.stage,
                    from: plan.stage + 1,
                    what: "a gradient",
                    got: shape,
                    expected: format!("the shape of its output, {:?}", out.dims()),
                });
            }
            let incoming = Tensor::<D>::from_data(TensorData::new(values, shape), device);
            (out * incoming).sum().backward()
        }
    };
    if let Some(input) = flight.input {
        let previous = plan.stage - 1;
        let grad = input.grad(&grads).ok_or(StageError::NoInputGradient {
            stage: plan.stage,
            previous,
        })?;
        let shape = grad.dims().to_vec();
        let values = read(plan.stage, "an input gradient", grad)?;
        links.send_gradient(i, &shape, &values)?;
    }
    Ok(grads)
}

fn read<const D: usize>(
    stage: usize,
    what: &'static str,
    tensor: Tensor<D>,
) -> Result<Vec<f32>, StageError> {
    host_values::<f32>(tensor.into_data()).map_err(|e| StageError::Readback {
        stage,
        what,
        reason: format!("{e:?}"),
    })
}

fn scalar(stage: usize, loss: Tensor<1>) -> Result<f64, StageError> {
    let values = read(stage, "the loss", loss)?;
    Ok(values.first().copied().map_or(f64::NAN, f64::from))
}

#[cfg(test)]
mod tests;
