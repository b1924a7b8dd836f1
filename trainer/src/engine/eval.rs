//! Evaluation: every validation sample exactly once across the ranks, and the `eval` command
//! (a checkpoint of any app validated by one process).

use std::path::Path;
use std::process::ExitCode;

use anyhow::bail;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::Progress;
use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::tensor::Device;
use burn::train::InferenceStep;
use burn_ddp::sampler::DistributedSampler;

use crate::app::{App, AppError};
use crate::engine::checkpoint;
use crate::engine::device::train_device;
use crate::engine::preflight::{preflight, Splitting};
use crate::error::UsageError;
use crate::report::metrics::{self, Metrics};

/// Feeds this rank's evaluation shard of `items` through `model` to `metrics` (local); returns
/// the shard's size. `model` is the `valid()` copy and `device` the device without autodiff
/// the batches are made on.
#[allow(clippy::too_many_arguments)]
pub(crate) fn evaluate_shard<I, VM, Bt>(
    model: &VM,
    items: &dyn Dataset<I>,
    batcher: &Bt,
    metrics: &mut Metrics<VM::Output>,
    rank: usize,
    world: usize,
    device: &Device,
    batch_size: usize,
) -> anyhow::Result<usize>
where
    VM: InferenceStep,
    Bt: Batcher<I, VM::Input>,
{
    let indices = DistributedSampler::new(items.len(), world, rank).eval_indices();
    for (k, chunk) in indices.chunks(batch_size.max(1)).enumerate() {
        let batch_items = chunk
            .iter()
            .map(|&i| crate::app::read_item(items, i, "validation set").map_err(AppError))
            .collect::<Result<Vec<_>, _>>()?;
        let batch = batcher.batch(batch_items, device);
        let progress = Progress {
            items_processed: ((k + 1) * batch_size).min(indices.len()),
            items_total: indices.len(),
            unit: None,
        };
        metrics.update_lazy(
            model.step(batch),
            chunk.len(),
            progress,
            k,
            None,
            "validation",
        )?;
    }
    Ok(indices.len())
}

/// `eval --config FILE --checkpoint DIR`: loads a checkpoint into app `A`'s model and validates
/// it on the configured device (one process).
pub fn evaluate<A: App>(
    app: A,
    config_path: &Path,
    checkpoint_path: &Path,
) -> anyhow::Result<ExitCode> {
    let config = preflight(&app, config_path, 1, 1, Splitting::Possible)?;
    let stages = config.distributed.pipeline_stages;
    // A pipeline's stages hold the model's parameters under its names: their checkpoints of
    // one step together load into the whole model.
    let parts = if stages > 1 {
        crate::engine::pipeline::stage_checkpoint::newest_common(checkpoint_path, stages)?
    } else if checkpoint_path.join("manifest.json").exists() {
        vec![checkpoint::open(checkpoint_path)?]
    } else {
        vec![checkpoint::latest(checkpoint_path)?.ok_or_else(|| {
            UsageError(format!(
                "no usable checkpoint in {} (give a checkpoint directory, or the checkpoint.dir that holds them)",
                checkpoint_path.display()
            ))
        })?]
    };
    let name = app.name(&config.model);
    for (stage, part) in parts.iter().enumerate() {
        let expected = if stages > 1 {
            crate::engine::pipeline::stage_checkpoint::stage_model_name(&name, stage, stages)
        } else {
            name.clone()
        };
        checkpoint::check_compatible(part, &expected, &config.model_fingerprint())?;
    }
    let ckpt = &parts[0];
    let data = app.datasets(&config.data)?;
    let Some(valid) = data.valid else {
        bail!(UsageError(
            "the data has no validation set (e.g. data.validation_fraction = 0): nothing to evaluate".into()
        ));
    };
    let step = ckpt.manifest.position.step;
    let dir = match stages {
        1 => ckpt.dir.clone(),
        _ => ckpt.dir.parent().and_then(Path::parent).map_or_else(
            || ckpt.dir.clone(),
            |pipeline| pipeline.join(format!("stage-*/{}", checkpoint::step_dir_name(step))),
        ),
    };
    let device = train_device(config.output.device, 0)?;
    let model = app.model(&config.model, &config.data, &device)?;
    let model = checkpoint::load_model_parts(&parts, model)?.valid();
    let batcher = app.batcher(&config.model, &config.data, &device);
    let mut metrics = app.valid_metrics();
    let n = evaluate_shard(
        &model,
        &*valid,
        &batcher,
        &mut metrics,
        0,
        1,
        &device.without_autodiff(),
        config.training.batch_size,
    )?;
    let mut alone = burn_ddp::Distributed::standalone();
    let values = metrics.global(&mut alone.group)?;
    println!(
        "checkpoint {} (step {step}): validation {}, {n} samples",
        dir.display(),
        metrics::describe(&values),
    );
    Ok(ExitCode::SUCCESS)
}
