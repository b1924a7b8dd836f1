//! The `eval` command: a checkpoint of any app (a pipeline's stage checkpoints joined into the
//! whole model) validated by one process, as training validates it ([`evaluate_shard`]).

use std::path::Path;
use std::process::ExitCode;

use anyhow::bail;
use burn::module::Module;

use crate::app::App;
use crate::engine::checkpoint;
use crate::engine::device::train_device;
use crate::engine::preflight::{preflight, Splitting};
use crate::engine::validation::evaluate_shard;
use crate::error::UsageError;
use crate::report::metrics;

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
