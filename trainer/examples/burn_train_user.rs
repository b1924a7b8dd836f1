//! A Burn user's `SupervisedTraining` program, written as Burn's guide writes one (model with
//! `TrainStep` / `InferenceStep`, a batcher, `DataLoaderBuilder`, `LossMetric` /
//! `AccuracyMetric`, the default checkpointers), made data-parallel across processes by changing two
//! lines: the loader builder and the training strategy (marked `burn-ddp:` below).
//!
//! ```text
//! cargo build --release -p trainer --example burn_train_user
//! trainer launch --nproc-per-node 2 -- target/release/examples/burn_train_user --dir runs/user --batch 16
//! target/release/examples/burn_train_user --plain --dir runs/user-1 --batch 32   # the original program
//! ```
//! `--plain` runs the unchanged program (burn's `DataLoaderBuilder`, burn-train's default
//! single-device strategy): with SGD, no shuffle and no dropout, 2 ranks of batch 16 end with
//! the weights of `--plain` with batch 32. `--shuffle SEED` shuffles (a global order per epoch
//! across the ranks). `--burn-loader` keeps burn's `DataLoaderBuilder` under the data-parallel
//! strategy (each rank then trains on a contiguous slice).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{
    ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep,
    TrainingStrategy,
};
use burn_ddp::learner::{DdpStrategy, DistributedDataLoaderBuilder};
use burn_ddp::{DdpOptions, GradientTransport, ZeroStage};
use burn_store::{ModuleSnapshot, SafetensorsStore};

const FEATURES: usize = 16;
const CLASSES: usize = 4;

#[derive(Module, Debug)]
pub struct Model {
    fc1: Linear,
    fc2: Linear,
    activation: Relu,
}

impl Model {
    pub fn new(device: &Device) -> Self {
        Self {
            fc1: LinearConfig::new(FEATURES, 32).init(device),
            fc2: LinearConfig::new(32, CLASSES).init(device),
            activation: Relu::new(),
        }
    }

    pub fn forward_classification(
        &self,
        inputs: Tensor<2>,
        targets: Tensor<1, Int>,
    ) -> ClassificationOutput {
        let output = self
            .fc2
            .forward(self.activation.forward(self.fc1.forward(inputs)));
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), targets.clone());
        ClassificationOutput::new(loss, output, targets)
    }
}

impl TrainStep for Model {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> TrainOutput<ClassificationOutput> {
        let item = self.forward_classification(batch.inputs, batch.targets);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Model {
    type Input = Batch;
    type Output = ClassificationOutput;

    fn step(&self, batch: Batch) -> ClassificationOutput {
        self.forward_classification(batch.inputs, batch.targets)
    }
}

#[derive(Clone, Debug)]
pub struct Item {
    features: [f32; FEATURES],
    label: usize,
}

#[derive(Clone, Debug)]
pub struct Batch {
    inputs: Tensor<2>,
    targets: Tensor<1, Int>,
}

#[derive(Clone, Default)]
pub struct ItemBatcher;

impl Batcher<Item, Batch> for ItemBatcher {
    fn batch(&self, items: Vec<Item>, device: &Device) -> Batch {
        let n = items.len();
        let features: Vec<f32> = items.iter().flat_map(|i| i.features).collect();
        let labels: Vec<i64> = items.iter().map(|i| i.label as i64).collect();
        Batch {
            inputs: Tensor::from_data(TensorData::new(features, [n, FEATURES]), device),
            targets: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// A deterministic data set: the label is the index of the largest of four feature sums.
fn dataset(len: usize, offset: usize) -> InMemDataset<Item> {
    let items = (offset..offset + len)
        .map(|i| {
            let mut features = [0f32; FEATURES];
            for (k, f) in features.iter_mut().enumerate() {
                *f = (((i * 7919 + k * 104_729) % 1000) as f32 / 500.0) - 1.0;
            }
            let sums: Vec<f32> = features
                .chunks(FEATURES / CLASSES)
                .map(|c| c.iter().sum())
                .collect();
            let label = (0..CLASSES)
                .max_by(|&a, &b| sums[a].total_cmp(&sums[b]))
                .unwrap_or(0);
            Item { features, label }
        })
        .collect();
    InMemDataset::new(items)
}

struct Args {
    dir: PathBuf,
    batch: usize,
    epochs: usize,
    plain: bool,
    burn_loader: bool,
    shuffle: Option<u64>,
    /// burn-train's resume: load the checkpoint of this epoch and go on with the next.
    resume: Option<usize>,
    /// Adam (lr 1e-3) instead of SGD (lr 0.05).
    adam: bool,
    /// No file checkpointer (ZeRO stages 1 and 2 refuse one).
    no_checkpointer: bool,
    /// burn-ddp's options: ZeRO stage, gradients over NCCL (feature `cuda`, `--cuda`).
    zero_stage: ZeroStage,
    nccl: bool,
    cuda: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        dir: PathBuf::from("runs/burn-train-user"),
        batch: 16,
        epochs: 2,
        plain: false,
        burn_loader: false,
        shuffle: None,
        resume: None,
        adam: false,
        no_checkpointer: false,
        zero_stage: ZeroStage::Off,
        nccl: false,
        cuda: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--dir" => args.dir = PathBuf::from(value()?),
            "--batch" => args.batch = value()?.parse().map_err(|e| format!("--batch: {e}"))?,
            "--epochs" => args.epochs = value()?.parse().map_err(|e| format!("--epochs: {e}"))?,
            "--shuffle" => {
                args.shuffle = Some(value()?.parse().map_err(|e| format!("--shuffle: {e}"))?)
            }
            "--resume" => {
                args.resume = Some(value()?.parse().map_err(|e| format!("--resume: {e}"))?)
            }
            "--zero-stage" => {
                args.zero_stage = value()?.parse().map_err(|e| format!("--zero-stage: {e}"))?
            }
            "--plain" => args.plain = true,
            "--burn-loader" => args.burn_loader = true,
            "--adam" => args.adam = true,
            "--no-checkpointer" => args.no_checkpointer = true,
            "--nccl" => args.nccl = true,
            "--cuda" => args.cuda = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

/// The program on `device` (an autodiff device: Burn's `Flex` CPU, or this rank's GPU) with
/// optimizer `optim` at the constant rate `lr`.
fn run(args: &Args, device: Device, optim: ModuleOptimizer, lr: f64) -> ExitCode {
    device.seed(42);
    let dir = args.dir.display().to_string();

    let valid_data = dataset(130, 10_000);
    let (train, valid) = if args.plain || args.burn_loader {
        // The original program's loaders.
        let mut train = DataLoaderBuilder::new(ItemBatcher).batch_size(args.batch);
        if let Some(seed) = args.shuffle {
            train = train.shuffle(seed);
        }
        let valid = DataLoaderBuilder::new(ItemBatcher).batch_size(args.batch);
        (
            train.set_device(device.clone()).build(dataset(512, 0)),
            valid.set_device(device.clone()).build(valid_data),
        )
    } else {
        // burn-ddp, line 1: the loader builder (each rank its shard of one global order per
        // epoch).
        let mut train = DistributedDataLoaderBuilder::new(ItemBatcher).batch_size(args.batch);
        if let Some(seed) = args.shuffle {
            train = train.shuffle(seed);
        }
        let valid = DistributedDataLoaderBuilder::new(ItemBatcher).batch_size(args.batch);
        (
            train.set_device(device.clone()).build(dataset(512, 0)),
            valid.set_device(device.clone()).build(valid_data),
        )
    };
    let training = SupervisedTraining::new(&dir, train, valid);
    let (training, rank) = if args.plain {
        (training, 0)
    } else {
        // burn-ddp, line 2: the strategy (joins the job the launcher started), with the
        // options this program was asked for (the defaults are PyTorch DDP's).
        let transport = if args.nccl {
            GradientTransport::Nccl
        } else {
            GradientTransport::Auto
        };
        let options = DdpOptions::default()
            .with_zero_stage(args.zero_stage)
            .with_transport(transport);
        let ddp = match DdpStrategy::from_env_with(options) {
            Ok(ddp) => Arc::new(ddp),
            Err(e) => {
                eprintln!("burn_train_user: cannot start the strategy: {e}");
                return ExitCode::from(if e.is_usage() { 2 } else { 1 });
            }
        };
        let rank = ddp.rank();
        (
            training.with_training_strategy(TrainingStrategy::Custom(ddp)),
            rank,
        )
    };

    let training = match args.resume {
        Some(epoch) => training.checkpoint(epoch),
        None => training,
    };
    let training = training
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        .num_epochs(args.epochs)
        .summary();
    let training = if args.no_checkpointer {
        training
    } else {
        training.with_default_checkpointers()
    };
    let result = training.launch(Learner::new(Model::new(&device), optim, lr));

    // As with `torch.save` under DDP: one rank writes the final model.
    if rank == 0 {
        // A resumed run replaces the model an earlier run of the same directory wrote.
        let mut store =
            SafetensorsStore::from_file(args.dir.join("model.safetensors")).overwrite(true);
        if let Err(e) = result.model.save_into(&mut store) {
            eprintln!("burn_train_user: cannot save the model: {e}");
            return ExitCode::from(1);
        }
    }
    println!("trained {} epoch(s) as rank {rank}", args.epochs);
    ExitCode::SUCCESS
}

/// The device: Burn's CPU backend (`Flex`), or with `--cuda` this rank's GPU (feature
/// `cuda`); under autodiff.
fn device(args: &Args) -> Result<Device, ExitCode> {
    if args.cuda {
        #[cfg(feature = "cuda")]
        {
            let local_rank = burn_ddp::DistEnv::from_env().map_or(0, |env| env.local_rank);
            return Ok(Device::cuda(burn_ddp::cuda::local_device(local_rank)).autodiff());
        }
        #[cfg(not(feature = "cuda"))]
        {
            eprintln!("burn_train_user: --cuda needs a build with `--features cuda`");
            return Err(ExitCode::from(2));
        }
    }
    Ok(Device::flex().autodiff())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("burn_train_user: {e}");
            return ExitCode::from(2);
        }
    };
    let device = match device(&args) {
        Ok(device) => device,
        Err(code) => return code,
    };
    // The optimizer and its learning rate: Adam (1e-3) or SGD (0.05).
    let (optim, lr) = if args.adam {
        (AdamConfig::new().init(), 1e-3)
    } else {
        (SgdConfig::new().init(), 0.05)
    };
    run(&args, device, optim, lr)
}
