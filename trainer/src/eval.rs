//! Evaluation: every validation sample exactly once across the ranks, and the `eval` command
//! (a checkpoint of any app validated by one process).

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::bail;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::Progress;
use burn::data::dataset::Dataset;
use burn::module::AutodiffModule;
use burn::prelude::*;
use burn::train::{InferenceStep, ItemLazy};
use burn_ddp::sampler::DistributedSampler;

use crate::app::{App, AppError, Learn};
use crate::backend::{self, LearnAnywhere, OnBackend, TrainBackend};
use crate::checkpoint::{self, Checkpoint};
use crate::config::AppConfig;
use crate::error::UsageError;
use crate::metrics::{self, MetricValue, Metrics};
use crate::preflight::preflight;

/// Feeds this rank's evaluation shard of `items` through `model` to `metrics` (local); returns
/// the shard's size.
#[allow(clippy::too_many_arguments)]
pub(crate) fn evaluate_shard<IB, I, VM, Bt>(
    model: &VM,
    items: &dyn Dataset<I>,
    batcher: &Bt,
    metrics: &mut Metrics<<VM::Output as ItemLazy>::ItemSync>,
    rank: usize,
    world: usize,
    device: &IB::Device,
    batch_size: usize,
) -> anyhow::Result<usize>
where
    IB: Backend,
    VM: InferenceStep,
    Bt: Batcher<IB, I, VM::Input>,
{
    let indices = DistributedSampler::new(items.len(), world, rank).eval_indices();
    for (k, chunk) in indices.chunks(batch_size.max(1)).enumerate() {
        let batch_items = chunk
            .iter()
            .map(|&i| {
                items.get(i).ok_or_else(|| {
                    AppError(match crate::app::take_item_error() {
                        Some(reason) => {
                            format!("cannot read item {i} of the validation set: {reason}")
                        }
                        None => format!(
                            "the validation set returned no item for index {i} (its len() is {})",
                            items.len()
                        ),
                    })
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let batch = batcher.batch(batch_items, device);
        let output = model.step(batch).sync();
        let progress = Progress {
            items_processed: ((k + 1) * batch_size).min(indices.len()),
            items_total: indices.len(),
        };
        metrics.update(&output, chunk.len(), progress, k, None);
    }
    Ok(indices.len())
}

/// `eval --config FILE --checkpoint DIR`: loads a checkpoint into app `A`'s model and validates
/// it on the configured device (one process).
pub fn evaluate<A: LearnAnywhere>(
    app: A,
    config_path: &Path,
    checkpoint_path: &Path,
) -> anyhow::Result<ExitCode> {
    let config = preflight(&app, config_path, 1, 1)?;
    let ckpt = if checkpoint_path.join("manifest.json").exists() {
        checkpoint::open(checkpoint_path)?
    } else {
        checkpoint::latest(checkpoint_path)?.ok_or_else(|| {
            UsageError(format!(
                "no usable checkpoint in {} (give a checkpoint directory, or the checkpoint.dir that holds them)",
                checkpoint_path.display()
            ))
        })?
    };
    checkpoint::check_compatible(&ckpt, &app.name(&config.model), &config.model_fingerprint())?;
    let data = app.datasets(&config.data)?;
    let Some(valid) = data.valid else {
        bail!(UsageError(
            "the data has no validation set (e.g. data.validation_fraction = 0): nothing to evaluate".into()
        ));
    };
    struct Eval<A: App> {
        app: A,
        config: AppConfig<A>,
        ckpt: Checkpoint,
        valid: Arc<dyn Dataset<A::Item>>,
    }
    impl<A: App> OnBackend<A> for Eval<A> {
        type Output = anyhow::Result<(Vec<MetricValue>, usize)>;
        fn run<B: TrainBackend>(self, device: B::Device) -> Self::Output
        where
            A: Learn<B>,
        {
            let model = self
                .app
                .model(&self.config.model, &self.config.data, &device)?;
            let model = checkpoint::load_model::<B, A::Model>(&self.ckpt, model)?.valid();
            let (_, batcher) = self
                .app
                .batchers(&self.config.model, &self.config.data, &device);
            let mut metrics = self.app.valid_metrics();
            let n = evaluate_shard::<B::InnerBackend, _, _, _>(
                &model,
                &*self.valid,
                &batcher,
                &mut metrics,
                0,
                1,
                &device,
                self.config.training.batch_size,
            )?;
            let mut alone = burn_ddp::Distributed::standalone();
            Ok((metrics.global(&mut alone.group)?, n))
        }
    }
    let (step, dir) = (ckpt.manifest.position.step, ckpt.dir.clone());
    let device = config.output.device;
    let (values, n) = backend::with_backend::<A, _, _>(
        device,
        0,
        Eval {
            app,
            config,
            ckpt,
            valid,
        },
    )?;
    println!(
        "checkpoint {} (step {step}): validation {}, {n} samples",
        dir.display(),
        metrics::describe(&values),
    );
    Ok(ExitCode::SUCCESS)
}
