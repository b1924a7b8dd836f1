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
                    fence_id: None,
                };
                let group = TcpProcessGroup::new(Arc::clone(&store), rank, env.world_size, options)
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
                    let result = pipeline_step(&part, plan, &micro, &mut links, &device).unwrap();
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
