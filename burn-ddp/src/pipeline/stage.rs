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
mod tests {
    use std::net::{IpAddr, Ipv4Addr};
    use std::sync::Arc;
    use std::time::Duration;

    use burn::module::Param;
    use burn::nn::loss::{MseLoss, Reduction};
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::activation::relu;

    use super::*;
    use crate::group::TcpGroupOptions;
    use crate::pipeline::PipelineLayout;
    use crate::store::{MemoryStore, Store};

    const ROWS: usize = 8;

    /// The links' options in these tests: loopback, a generous deadline.
    fn link_options() -> TcpGroupOptions {
        TcpGroupOptions {
            timeout: Duration::from_secs(120),
            advertise_ip: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            ..Default::default()
        }
    }

    /// Consecutive layers of a 4 → 8 → 8 → 3 perceptron (ReLU between layers), MSE on the last.
    #[derive(Module, Debug)]
    struct Part {
        layers: Vec<Linear>,
        #[module(skip)]
        holds_the_head: bool,
    }

    struct Micro {
        x: Tensor<2>,
        y: Tensor<2>,
    }

    impl PipelineStage<2> for Part {
        type Batch = Micro;

        fn forward(&self, activation: Option<Tensor<2>>, batch: &Micro) -> Tensor<2> {
            let mut x = activation.unwrap_or_else(|| batch.x.clone());
            for (k, layer) in self.layers.iter().enumerate() {
                x = layer.forward(x);
                if !(self.holds_the_head && k + 1 == self.layers.len()) {
                    x = relu(x);
                }
            }
            x
        }

        fn loss(&self, output: Tensor<2>, batch: &Micro) -> Tensor<1> {
            MseLoss::new().forward(output, batch.y.clone(), Reduction::Mean)
        }
    }

    fn device() -> Device {
        Device::flex().autodiff()
    }

    fn rows(first: usize, count: usize, device: &Device) -> Micro {
        let x: Vec<f32> = (first * 4..(first + count) * 4)
            .map(|k| ((k * 37 % 17) as f32 - 8.0) / 8.0)
            .collect();
        let y: Vec<f32> = (first * 3..(first + count) * 3)
            .map(|k| ((k * 11 % 7) as f32 - 3.0) / 3.0)
            .collect();
        Micro {
            x: Tensor::from_data(TensorData::new(x, [count, 4]), device),
            y: Tensor::from_data(TensorData::new(y, [count, 3]), device),
        }
    }

    fn whole_model(device: &Device) -> Part {
        let sizes = [(4, 8), (8, 8), (8, 3)];
        Part {
            layers: sizes
                .iter()
                .map(|&(i, o)| LinearConfig::new(i, o).init(device))
                .collect(),
            holds_the_head: true,
        }
    }

    /// Flat gradients of `layers` (weights then biases, layer by layer) in `grads`.
    fn flat_grads(layers: &[Linear], grads: &GradientsParams) -> Vec<f32> {
        let mut out = Vec::new();
        let mut push = |t: Option<Tensor<1>>| {
            let t = t.expect("a gradient for every parameter");
            out.extend(host_values::<f32>(t.into_data()).unwrap());
        };
        for layer in layers {
            let weight: &Param<Tensor<2>> = &layer.weight;
            push(grads.get::<2>(weight.id).map(|t| t.flatten(0, 1)));
            push(layer.bias.as_ref().and_then(|b| grads.get::<1>(b.id)));
        }
        out
    }

    /// What one pipeline step gave: every stage's flat gradients, the last stage's loss, and
    /// the outputs and losses it showed, by micro-batch.
    struct Stepped {
        grads: Vec<f32>,
        loss: f64,
        shown: BTreeMap<usize, (Vec<f32>, f32)>,
    }

    /// Trains one step of `cut` (the layers of each stage) with `schedule` and 4 micro-batches
    /// of 2 rows, one thread per stage over loopback.
    fn pipeline(model: &Part, cut: &[usize], schedule: PipelineSchedule) -> Stepped {
        let stages = cut.len();
        let layout = PipelineLayout::new(stages, stages).unwrap();
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let mut first = 0;
        let threads: Vec<_> = cut
            .iter()
            .enumerate()
            .map(|(stage, &count)| {
                let part = Part {
                    layers: model.layers[first..first + count].to_vec(),
                    holds_the_head: stage + 1 == stages,
                };
                first += count;
                let store = Arc::clone(&store);
                std::thread::spawn(move || {
                    let options = link_options();
                    let mut links =
                        StageLinks::connect(store, "pipeline", &layout, stage, "test", &options)
                            .unwrap();
                    let device = device();
                    let micro: Vec<Micro> = (0..4).map(|i| rows(2 * i, 2, &device)).collect();
                    let plan = StepPlan {
                        stage,
                        stages,
                        schedule,
                    };
                    let mut shown = BTreeMap::new();
                    let step = pipeline_step_with_outputs(
                        &part,
                        plan,
                        &micro,
                        &[0.25; 4],
                        &mut links,
                        &device,
                        |i, output, loss| {
                            let output = host_values::<f32>(output.into_data()).unwrap();
                            let loss = host_values::<f32>(loss.into_data()).unwrap()[0];
                            assert!(shown.insert(i, (output, loss)).is_none(), "{i} twice");
                        },
                    )
                    .unwrap();
                    (flat_grads(&part.layers, &step.grads), step.loss, shown)
                })
            })
            .collect();
        let mut stepped = Stepped {
            grads: Vec::new(),
            loss: f64::NAN,
            shown: BTreeMap::new(),
        };
        for (stage, thread) in threads.into_iter().enumerate() {
            let (grads, loss, shown) = thread.join().expect("a stage's thread panicked");
            stepped.grads.extend(grads);
            if stage + 1 == stages {
                stepped.loss = loss.unwrap_or(f64::NAN);
                stepped.shown = shown;
            } else {
                assert!(
                    shown.is_empty() && loss.is_none(),
                    "stage {stage} showed outputs"
                );
            }
        }
        stepped
    }

    fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn stages_give_the_gradients_of_the_whole_model_on_the_whole_batch() {
        let device = device();
        let model = whole_model(&device);
        let batch = rows(0, ROWS, &device);
        let loss = model.loss(model.forward(None, &batch), &batch);
        let reference_loss = f64::from(host_values::<f32>(loss.clone().into_data()).unwrap()[0]);
        let reference = flat_grads(
            &model.layers,
            &GradientsParams::from_grads(loss.backward(), &model),
        );

        let gpipe = pipeline(&model, &[1, 2], PipelineSchedule::GPipe);
        let one_f1b = pipeline(&model, &[1, 2], PipelineSchedule::OneForwardOneBackward);
        let three = pipeline(&model, &[1, 1, 1], PipelineSchedule::OneForwardOneBackward);
        for (name, run) in [("GPipe", &gpipe), ("1F1B", &one_f1b), ("3 stages", &three)] {
            let diff = max_abs_diff(&run.grads, &reference);
            assert!(diff < 1e-6, "{name}: max |Δgrad| {diff:e}");
        }
        // The same backward order under both schedules: the same sums, bit for bit.
        assert_eq!(gpipe.grads, one_f1b.grads);
        for loss in [gpipe.loss, three.loss] {
            assert!(
                (loss - reference_loss).abs() < 1e-6,
                "{loss} vs {reference_loss}"
            );
        }
        // The outputs shown are the whole model's, micro-batch by micro-batch, each with its
        // own (unweighted) loss.
        for (name, run) in [("GPipe", &gpipe), ("1F1B", &one_f1b), ("3 stages", &three)] {
            assert_eq!(run.shown.keys().copied().collect::<Vec<_>>(), [0, 1, 2, 3]);
            for (&i, (output, loss)) in &run.shown {
                let micro = rows(2 * i, 2, &device);
                let whole = model.forward(None, &micro);
                let expected_loss = model.loss(whole.clone(), &micro);
                let expected = host_values::<f32>(whole.into_data()).unwrap();
                let diff = max_abs_diff(output, &expected);
                assert!(
                    diff < 1e-6,
                    "{name}, micro-batch {i}: max |Δoutput| {diff:e}"
                );
                let expected_loss = host_values::<f32>(expected_loss.into_data()).unwrap()[0];
                assert!(
                    (loss - expected_loss).abs() < 1e-6,
                    "{name}, micro-batch {i}"
                );
            }
        }
        // Not trivially equal: the gradients are not zero.
        assert!(reference.iter().any(|g| g.abs() > 1e-3));
    }

    #[test]
    fn a_stage_that_does_not_take_its_neighbours_output_names_both_stages() {
        let build = device();
        // Stage 0 outputs 8 columns, stage 1 takes 5.
        let parts = [
            Part {
                layers: vec![LinearConfig::new(4, 8).init(&build)],
                holds_the_head: false,
            },
            Part {
                layers: vec![LinearConfig::new(5, 3).init(&build)],
                holds_the_head: true,
            },
        ];
        let layout = PipelineLayout::new(2, 2).unwrap();
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let threads: Vec<_> = parts
            .into_iter()
            .enumerate()
            .map(|(stage, part)| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || {
                    let options = link_options();
                    let mut links =
                        StageLinks::connect(store, "pipeline", &layout, stage, "test", &options)
                            .unwrap();
                    let device = device();
                    let micro = vec![rows(0, 2, &device)];
                    let plan = StepPlan {
                        stage,
                        stages: 2,
                        schedule: PipelineSchedule::GPipe,
                    };
                    pipeline_step(&part, plan, &micro, &mut links, &device)
                        .err()
                        .map(|e| e.to_string())
                })
            })
            .collect();
        let errors: Vec<String> = threads
            .into_iter()
            .map(|t| t.join().expect("no panic escapes").unwrap_or_default())
            .collect();
        assert!(
            errors[1].contains(
                "stage 1: its forward pass failed on the activation of shape [2, 8] from stage 0"
            ),
            "{}",
            errors[1]
        );
        // Stage 0 learns that its neighbour is gone, instead of waiting for the timeout.
        assert!(errors[0].contains("rank 1"), "{}", errors[0]);
    }

    fn flat_weights(layers: &[Linear]) -> Vec<f32> {
        let mut out = Vec::new();
        for layer in layers {
            out.extend(host_values::<f32>(layer.weight.val().into_data()).unwrap());
            if let Some(bias) = &layer.bias {
                out.extend(host_values::<f32>(bias.val().into_data()).unwrap());
            }
        }
        out
    }

    /// 2 stages × 2 replicas (4 ranks, one thread each): each stage's gradients averaged over
    /// its replicas with the DDP step on a sub-group, 2 SGD steps; against one process with the
    /// whole model and the global batch of 16 rows.
    #[test]
    fn stage_replicas_average_to_the_whole_model_on_the_global_batch() {
        use burn::optim::SgdConfig;

        use crate::env::DistEnv;
        use crate::group::{TcpGroupOptions, TcpProcessGroup};
        use crate::{DataParallel, DdpOptions, Distributed};

        // Its DataParallel handles install synchronised BatchNorm's group (module docs of
        // `sync_group`): not while another test relies on there being none.
        let _alone = crate::ddp::sync_batch_norm::sync_group::TEST_LOCK
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (stages, replicas, steps, lr) = (2, 2, 2, 0.1);
        let device = device();
        let start = whole_model(&device);
        let mut reference = start.clone();
        let mut optim = SgdConfig::new().init();
        for step in 0..steps {
            let batch = rows(step * 16, 16, &device);
            let loss = reference.loss(reference.forward(None, &batch), &batch);
            let grads = GradientsParams::from_grads(loss.backward(), &reference);
            reference = optim.step(lr, reference, grads);
        }

        let layout = PipelineLayout::new(stages * replicas, stages).unwrap();
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let threads: Vec<_> = (0..layout.world_size())
            .map(|rank| {
                let position = layout.position(rank);
                let layers = if position.stage == 0 { 0..1 } else { 1..3 };
                let part = Part {
                    layers: start.layers[layers].to_vec(),
                    holds_the_head: position.stage == 1,
                };
                let store = Arc::clone(&store);
                std::thread::spawn(move || {
                    let options = TcpGroupOptions::default();
                    let env = DistEnv {
                        rank,
                        world_size: layout.world_size(),
                        local_rank: rank,
                        local_world_size: layout.world_size(),
                        master_addr: "127.0.0.1".into(),
                        master_port: 0,
                        derived: Vec::new(),
                        launcher_job: None,
                    };
                    let group =
                        TcpProcessGroup::new(Arc::clone(&store), rank, env.world_size, options)
                            .unwrap();
                    let world = Distributed::from_group(env, group, Arc::clone(&store));
                    let device = super::tests::device();
                    let members = layout.replica_group(rank);
                    let sub = world
                        .sub_group(&members, &format!("stage-{}", position.stage))
                        .unwrap();
                    let mut ddp = DataParallel::new(sub, DdpOptions::default(), &device).unwrap();
                    let options = link_options();
                    let mut links =
                        StageLinks::connect(store, "pipeline", &layout, rank, "test", &options)
                            .unwrap();
                    let mut part = ddp.prepare(part).unwrap();
                    let mut optim = SgdConfig::new().init();
                    let plan = StepPlan {
                        stage: position.stage,
                        stages,
                        schedule: PipelineSchedule::OneForwardOneBackward,
                    };
                    for step in 0..steps {
                        let first = step * 16 + position.replica * 8;
                        let micro: Vec<Micro> =
                            (0..4).map(|i| rows(first + 2 * i, 2, &device)).collect();
                        let result =
                            pipeline_step(&part, plan, &micro, &mut links, &device).unwrap();
                        let mut grads = result.grads;
                        ddp.average_gradients(&part, &mut grads).unwrap();
                        part = optim.step(lr, part, grads);
                    }
                    flat_weights(&part.layers)
                })
            })
            .collect();
        let weights: Vec<Vec<f32>> = threads
            .into_iter()
            .map(|t| t.join().expect("a rank's thread panicked"))
            .collect();
        // Replicas of a stage are equal; stage 0 + stage 1 = the whole model.
        assert_eq!(weights[0], weights[2]);
        assert_eq!(weights[1], weights[3]);
        let pipelined: Vec<f32> = [weights[0].clone(), weights[1].clone()].concat();
        let expected = flat_weights(&reference.layers);
        let diff = max_abs_diff(&pipelined, &expected);
        assert!(diff < 1e-5, "max |Δw| {diff:e}");
        assert!(
            max_abs_diff(&flat_weights(&start.layers), &expected) > 1e-3,
            "the steps moved the weights"
        );
    }
}
