//! A user's own model trained data-parallel by burn-ddp's engine: everything here is the
//! user's (model, batch type, loss, data set, config tables); the engine brings the command
//! line, the launcher, sharding, gradient averaging, metrics across ranks and checkpoints.
//!
//! ```text
//! custom-model --config circles.toml                      # one process
//! custom-model --config circles.toml --nproc-per-node 2   # two ranks, launched by itself
//! trainer launch --nproc-per-node 2 -- custom-model --config circles.toml
//! ```
//!
//! With `[distributed] pipeline_stages = 2` the same model trains as 2 pipeline stages (the
//! hidden layer on one process, the output layer and the loss on the next): see
//! [`circles_stages`] and [`CirclesStage`].

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::data::dataset::DatasetError;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use serde::{Deserialize, Serialize};
use trainer::app::{App, AppError, Datasets, Metrics, TrainItem, ValidItem};
// burn-ddp through the engine's re-export: one build of it in the program, the engine's, so
// SyncBatchNorm finds the job's process group (no second path dependency to keep in step).
use trainer::burn_ddp::{mark_block, SyncBatchNorm, SyncBatchNormConfig};
use trainer::pipeline::{PipelineStage, StageOf, StageSplit};

/// The model: a two-layer perceptron on 2-D points (Burn 0.22: no backend type parameter; the
/// engine puts it on the device `output.device` names).
#[derive(Module, Debug)]
pub struct CirclesNet {
    hidden: Linear,
    /// `model.sync_batch_norm`: the hidden features normalised over the job's global batch.
    norm: Option<SyncBatchNorm>,
    output: Linear,
    activation: Relu,
}

impl CirclesNet {
    fn forward(&self, points: Tensor<2>) -> Tensor<2> {
        // Each layer is a block for gradient overlap: `mark_block` at its entry lets its
        // gradients go on the wire as soon as backward has passed it (an identity otherwise).
        let mut x = mark_block(&points, &self.hidden).forward(points);
        if let Some(norm) = &self.norm {
            x = norm.forward(x);
        }
        let x = self.activation.forward(x);
        mark_block(&x, &self.output).forward(x)
    }

    fn classify(&self, batch: PointsBatch) -> ClassificationOutput {
        let logits = self.forward(batch.points);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), batch.labels.clone());
        ClassificationOutput::new(loss, logits, batch.labels)
    }
}

/// burn-train's contract: a training step (on the autodiff device) returns the gradients and an
/// output for metrics.
impl TrainStep for CirclesNet {
    type Input = PointsBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: PointsBatch) -> TrainOutput<ClassificationOutput> {
        let output = self.classify(batch);
        TrainOutput::new(self, output.loss.backward(), output)
    }
}

/// Validation runs this on `model.valid()`, the same type without autodiff.
impl InferenceStep for CirclesNet {
    type Input = PointsBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: PointsBatch) -> ClassificationOutput {
        self.classify(batch)
    }
}

/// [`CirclesNet`] cut into 2 pipeline stages: the hidden layer on stage 0, the output layer and
/// the loss on stage 1. Field names as in `CirclesNet`, so the stages' checkpoints together are
/// the whole model's. Activations between the stages are the hidden features `[batch, hidden]`.
#[derive(Module, Debug)]
pub struct CirclesStage {
    hidden: Option<Linear>,
    output: Option<Linear>,
    activation: Relu,
}

impl PipelineStage<2> for CirclesStage {
    type Batch = PointsBatch;

    fn forward(&self, activation: Option<Tensor<2>>, batch: &PointsBatch) -> Tensor<2> {
        let x = match (&self.hidden, activation) {
            (Some(hidden), _) => self
                .activation
                .forward(hidden.forward(batch.points.clone())),
            (None, Some(features)) => features,
            (None, None) => unreachable!("every stage after the first gets its input"),
        };
        match &self.output {
            Some(output) => output.forward(x),
            None => x,
        }
    }

    fn loss(&self, logits: Tensor<2>, batch: &PointsBatch) -> Tensor<1> {
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, batch.labels.clone())
    }
}

/// Draws `layer`'s parameters now (Burn draws them lazily, at first use).
fn draw(layer: &Linear) {
    drop(layer.weight.val());
    if let Some(bias) = &layer.bias {
        drop(bias.val());
    }
}

/// One sample: a point and whether it is on the outer circle.
#[derive(Clone, Debug)]
pub struct Point {
    pub xy: [f32; 2],
    pub outer: bool,
}

/// The user's own batch type.
#[derive(Clone, Debug)]
pub struct PointsBatch {
    pub points: Tensor<2>,
    pub labels: Tensor<1, Int>,
}

#[derive(Clone, Debug)]
pub struct PointsBatcher;

impl Batcher<Point, PointsBatch> for PointsBatcher {
    fn batch(&self, items: Vec<Point>, device: &Device) -> PointsBatch {
        let n = items.len();
        let xy: Vec<f32> = items.iter().flat_map(|p| p.xy).collect();
        let labels: Vec<i64> = items.iter().map(|p| i64::from(p.outer)).collect();
        PointsBatch {
            points: Tensor::from_data(TensorData::new(xy, [n, 2]), device),
            labels: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

/// Points on two noisy circles, computed from their index: nothing is held in memory, and a
/// rank only computes the points of its shard.
pub struct Circles {
    len: usize,
    first: usize,
    noise: f32,
    seed: u64,
    /// How many times `get` was called (reported with `CIRCLES_DATA_LOG`, see below).
    reads: AtomicUsize,
}

impl Dataset<Point> for Circles {
    /// Computed, so never an error.
    ///
    /// # Panics
    ///
    /// If `index >= len()` (Burn's `Dataset::get` contract).
    fn get(&self, index: usize) -> Result<Point, DatasetError> {
        assert!(index < self.len, "Circles: index {index} >= {}", self.len);
        self.reads.fetch_add(1, Ordering::Relaxed);
        let mut h = splitmix(self.seed ^ (self.first + index) as u64);
        let mut unit = || {
            h = splitmix(h);
            (h >> 40) as f32 / (1u64 << 24) as f32
        };
        let outer = unit() < 0.5;
        let angle = unit() * std::f32::consts::TAU;
        let radius = if outer { 1.0 } else { 0.5 } + self.noise * (2.0 * unit() - 1.0);
        Ok(Point {
            xy: [radius * angle.cos(), radius * angle.sin()],
            outer,
        })
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// For the tests (`CIRCLES_DATA_LOG=FILE`): each process appends which data sets it opened
/// and how many items it read from them, which shows that a rank reads only its shard and that
/// the launcher reads nothing.
fn data_log(line: &str) {
    if let Some(path) = std::env::var_os("CIRCLES_DATA_LOG") {
        let rank = std::env::var("RANK").unwrap_or_else(|_| "none".into());
        let line = format!("pid={} rank={rank} {line}\n", std::process::id());
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
    }
}

impl Drop for Circles {
    fn drop(&mut self) {
        data_log(&format!(
            "first={} len={} reads={}",
            self.first,
            self.len,
            self.reads.load(Ordering::Relaxed)
        ));
    }
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `[model]`: the user's own table; a misspelt key is an error naming it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub hidden: usize,
    /// A `SyncBatchNorm` after the hidden layer (PyTorch's `SyncBatchNorm`: statistics over
    /// every rank's batch, as one process with the whole batch computes them).
    #[serde(default)]
    pub sync_batch_norm: bool,
}

/// `[data]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    pub train_points: usize,
    pub valid_points: usize,
    pub noise: f32,
    pub seed: u64,
}

/// The app: everything the engine needs to know about this model and data, in one trait.
#[derive(Clone, Copy)]
pub struct CirclesApp;

impl App for CirclesApp {
    type ModelConfig = ModelConfig; // the [model] table
    type DataConfig = DataConfig; // the [data] table
    type Item = Point;
    type Model = CirclesNet;
    type Batcher = PointsBatcher;

    fn datasets(&self, d: &DataConfig) -> Result<Datasets<Point>, AppError> {
        data_log("opened the data sets");
        let circles = |first, len| Circles {
            len,
            first,
            noise: d.noise,
            seed: d.seed,
            reads: AtomicUsize::new(0),
        };
        Ok(Datasets {
            train: Arc::new(circles(0, d.train_points)),
            valid: Some(Arc::new(circles(d.train_points, d.valid_points))),
        })
    }

    fn model(
        &self,
        m: &ModelConfig,
        _: &DataConfig,
        device: &Device,
    ) -> Result<CirclesNet, AppError> {
        Ok(CirclesNet {
            hidden: LinearConfig::new(2, m.hidden).init(device),
            norm: m
                .sync_batch_norm
                .then(|| SyncBatchNormConfig::new(m.hidden).init(device)),
            output: LinearConfig::new(m.hidden, 2).init(device),
            activation: Relu::new(),
        })
    }

    fn batcher(&self, _: &ModelConfig, _: &DataConfig, _: &Device) -> PointsBatcher {
        PointsBatcher
    }

    fn train_metrics(&self) -> Metrics<TrainItem<Self>> {
        Metrics::new()
            .with(LossMetric::new())
            .with(AccuracyMetric::new())
    }

    fn valid_metrics(&self) -> Metrics<ValidItem<Self>> {
        Metrics::new()
            .with(LossMetric::new())
            .with(AccuracyMetric::new())
    }

    // Optional from here on.

    /// For messages and checkpoint manifests (the default is the model type's name).
    fn name(&self, _model: &ModelConfig) -> String {
        "circles".into()
    }

    /// Refuses bad tables in the launcher, before any rank starts.
    fn check(&self, model: &ModelConfig, data: &DataConfig) -> Result<(), AppError> {
        if model.hidden == 0 {
            return Err(AppError::key("model.hidden", "must be at least 1"));
        }
        if data.train_points == 0 {
            return Err(AppError::key("data.train_points", "must be at least 1"));
        }
        Ok(())
    }

    /// Lets the pre-flight refuse a model too big for memory before any rank starts (a
    /// formula here; `trainer::app::parameter_count` counts a lazily built model instead).
    fn parameter_count(&self, model: &ModelConfig, _data: &DataConfig) -> Option<u64> {
        let h = model.hidden as u64;
        let norm = if model.sync_batch_norm { 2 * h } else { 0 };
        Some((2 * h + h) + norm + (h * 2 + 2))
    }
}

/// Optional: an allocation failure becomes a one-line error instead of an abort.
#[global_allocator]
static ALLOC: trainer::alloc::ReportingAllocator = trainer::alloc::ReportingAllocator;

/// How the model splits for `[distributed] pipeline_stages = 2`, given to the entry point beside
/// the app (see `main`). Both layers are drawn in
/// the whole model's order, so each stage starts with the whole model's weights (a model
/// too big for one process would build only its own stage's layers, drawing the others one
/// at a time, as `models::TextClassifierStage` does).
fn circles_stages() -> StageSplit<CirclesApp> {
    StageSplit::new(
        |m: &ModelConfig, d: &DataConfig, which: StageOf, device: &Device| {
            if which.stages != 2 {
                return Err(AppError::key(
                    "distributed.pipeline_stages",
                    format!(
                        "CirclesNet has 2 layers: 1 or 2 stages, not {}",
                        which.stages
                    ),
                ));
            }
            if m.sync_batch_norm {
                return Err(AppError::key(
                    "model.sync_batch_norm",
                    "the 2-stage split of CirclesNet has no place for the norm: turn it off for pipeline stages",
                ));
            }
            let CirclesNet {
                hidden,
                output,
                activation,
                ..
            } = CirclesApp.model(m, d, device)?;
            draw(&hidden);
            draw(&output);
            Ok(CirclesStage {
                hidden: which.is_first().then_some(hidden),
                output: which.is_last().then_some(output),
                activation,
            })
        },
        // The last stage's logits as the whole model's output, for the metrics above.
        |logits: Tensor<2>, loss: Tensor<1>, batch: &PointsBatch| {
            ClassificationOutput::new(loss, logits, batch.labels.clone())
        },
    )
}

fn main() -> ExitCode {
    // `main_with(CirclesApp, ...)` would train data-parallel only; the split lets a config ask
    // for pipeline stages too.
    trainer::run::main_with_stages(CirclesApp, circles_stages(), trainer::program_info!())
}
