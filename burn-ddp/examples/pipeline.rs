//! Pipeline parallelism in your own loop: a perceptron cut into stages, each rank holding one
//! stage of one pipeline replica, with [`burn_ddp::pipeline::PipelineParallel`]; the replicas
//! of each stage average their gradients with the DDP step.
//!
//! ```text
//! cargo build --release -p burn-ddp --example pipeline
//! # 2 stages x 2 replicas, 1F1B, 4 micro-batches of 2 rows per replica
//! trainer launch --nproc-per-node 4 -- target/release/examples/pipeline --stages 2 --batch 8 --out runs/pp
//! # the same global batch in one process, the whole model
//! target/release/examples/pipeline --stages 1 --batch 16 --out runs/one
//! ```
//! Every stage's first replica writes `stage-{s}.safetensors` under `--out`, with the whole
//! model's parameter names (a stage holds the whole model's structure with only its own layers
//! present), so the stages' files together are the model.

use std::path::PathBuf;
use std::process::ExitCode;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::prelude::*;
use burn::tensor::activation::relu;
use burn_ddp::pipeline::{
    check_layers, PipelineConfig, PipelineError, PipelineParallel, PipelineSchedule, PipelineStage,
};
use burn_ddp::rng::SplitMix64;
use burn_ddp::{DdpError, DdpOptions, StepOutcome};
use burn_store::{ModuleSnapshot, SafetensorsStore};

const SIZES: [usize; 4] = [20, 64, 64, 4];
const LAYERS: usize = SIZES.len() - 1;

/// The whole model's structure; a stage holds only its own layers (`None` elsewhere).
#[derive(Module, Debug)]
struct Stage {
    layers: Vec<Option<Linear>>,
}

/// One micro-batch: features and labels.
struct Rows {
    x: Tensor<2>,
    y: Tensor<1, Int>,
}

impl Stage {
    /// Stage `stage` of `stages`: the layers are dealt out in consecutive runs.
    fn new(stage: usize, stages: usize, device: &Device) -> Self {
        let layers = (0..LAYERS)
            .map(|k| {
                (k * stages / LAYERS == stage).then(|| {
                    // Each layer from a seed of its own: a stage draws only its own layers
                    // (the others are never allocated), with the weights the layer has in
                    // any cut. Burn initialises parameters lazily, at first use: draw them
                    // now, right after seeding.
                    device.seed(5 + k as u64);
                    let layer = LinearConfig::new(SIZES[k], SIZES[k + 1]).init(device);
                    let _ = layer.weight.val();
                    let _ = layer.bias.as_ref().map(|b| b.val());
                    layer
                })
            })
            .collect();
        Self { layers }
    }
}

impl PipelineStage<2> for Stage {
    type Batch = Rows;

    fn forward(&self, activation: Option<Tensor<2>>, batch: &Rows) -> Tensor<2> {
        let mut x = activation.unwrap_or_else(|| batch.x.clone());
        for (k, layer) in self.layers.iter().enumerate() {
            if let Some(layer) = layer {
                x = layer.forward(x);
                if k + 1 < LAYERS {
                    x = relu(x);
                }
            }
        }
        x
    }

    fn loss(&self, output: Tensor<2>, batch: &Rows) -> Tensor<1> {
        CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output, batch.y.clone())
    }
}

/// Sample `i` of the data: features, and the label the argmax of a fixed projection.
fn sample(i: usize) -> (Vec<f32>, i64) {
    let mut rng = SplitMix64::new(1000 + i as u64);
    let x: Vec<f32> = (0..SIZES[0]).map(|_| rng.symmetric_f32()).collect();
    let score = |c: usize| -> f32 {
        x.iter()
            .enumerate()
            .map(|(j, v)| v * ((j * 7 + c * 3) % 5) as f32)
            .sum()
    };
    let label = (0..SIZES[LAYERS])
        .max_by(|&a, &b| score(a).total_cmp(&score(b)))
        .unwrap_or(0);
    (x, label as i64)
}

fn rows(first: usize, count: usize, device: &Device) -> Rows {
    let (xs, ys): (Vec<Vec<f32>>, Vec<i64>) = (first..first + count).map(sample).unzip();
    let x: Vec<f32> = xs.concat();
    Rows {
        x: Tensor::<1>::from_floats(x.as_slice(), device).reshape([count, SIZES[0]]),
        y: Tensor::<1, Int>::from_ints(ys.as_slice(), device),
    }
}

struct Args {
    stages: usize,
    schedule: PipelineSchedule,
    micro_batches: usize,
    batch: usize,
    steps: usize,
    out: PathBuf,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        stages: 1,
        schedule: PipelineSchedule::OneForwardOneBackward,
        micro_batches: 4,
        batch: 8,
        steps: 10,
        out: PathBuf::from("runs/pipeline"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |v: String| v.parse::<usize>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--stages" => a.stages = number(value()?)?,
            "--micro-batches" => a.micro_batches = number(value()?)?,
            "--batch" => a.batch = number(value()?)?,
            "--steps" => a.steps = number(value()?)?,
            "--out" => a.out = PathBuf::from(value()?),
            "--schedule" => {
                a.schedule = match value()?.as_str() {
                    "gpipe" => PipelineSchedule::GPipe,
                    "1f1b" => PipelineSchedule::OneForwardOneBackward,
                    other => return Err(format!("--schedule {other}: use gpipe or 1f1b")),
                }
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    // Every stage needs a layer of the model: 1 to LAYERS stages.
    check_layers(LAYERS, a.stages).map_err(|e| format!("--stages {}: {e}", a.stages))?;
    if a.micro_batches == 0 || !a.batch.is_multiple_of(a.micro_batches) {
        return Err(format!(
            "--batch {} is not a multiple of --micro-batches {}",
            a.batch, a.micro_batches
        ));
    }
    Ok(a)
}

fn train(a: &Args) -> Result<(), PipelineError> {
    let device = Device::flex().autodiff();
    let config = PipelineConfig {
        stages: a.stages,
        schedule: a.schedule,
        micro_batches: a.micro_batches,
    };
    let mut pp = PipelineParallel::from_env(config, DdpOptions::default(), &device)?;
    let own = Stage::new(pp.stage(), pp.stages(), &device);
    let mut stage = pp.replica_group().prepare(own)?;
    let mut optim = SgdConfig::new().init();
    let (per_micro, global) = (a.batch / a.micro_batches, a.batch * pp.replicas());
    for step in 0..a.steps {
        let first = step * global + pp.replica() * a.batch;
        let micro: Vec<Rows> = (0..a.micro_batches)
            .map(|i| rows(first + i * per_micro, per_micro, &device))
            .collect();
        // The whole step: the pipeline's passes, the gradients' mean over the stage's
        // replicas, the job's verdict on NaN/Inf, the optimizer, the buffers.
        let stepped = pp.step(stage, &micro, &device, |s, g| optim.step(0.05, s, g))?;
        stage = stepped.stage;
        if let StepOutcome::Skipped { ranks } = stepped.outcome {
            let why = format!("non-finite gradients at step {step} on rank(s) {ranks:?}");
            return Err(DdpError::Unsupported(why).into());
        }
        if let Some(loss) = stepped.loss.filter(|_| pp.replica() == 0) {
            println!("step {step}: loss {loss:.4} (replica 0)");
        }
    }
    if pp.replica() == 0 {
        std::fs::create_dir_all(&a.out).map_err(|e| io_error(&a.out, e))?;
        let path = a.out.join(format!("stage-{}.safetensors", pp.stage()));
        let mut store = SafetensorsStore::from_file(&path).overwrite(true);
        stage
            .save_into(&mut store)
            .map_err(|e| io_error(&path, e))?;
    }
    if pp.is_last_stage() && pp.replica() == 0 {
        println!(
            "pipeline: {} steps, {} stage(s) x {} replica(s), {:?}",
            a.steps,
            pp.stages(),
            pp.replicas(),
            a.schedule
        );
    }
    Ok(pp.replica_group().barrier()?)
}

fn io_error(path: &std::path::Path, e: impl std::fmt::Display) -> PipelineError {
    PipelineError::Ddp(burn_ddp::DdpError::Unsupported(format!(
        "{}: {e}",
        path.display()
    )))
}

fn main() -> ExitCode {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match train(&a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(if e.is_usage() { 2 } else { 1 })
        }
    }
}
