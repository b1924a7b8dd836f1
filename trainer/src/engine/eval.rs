//! The `eval` command: a checkpoint of any app (a pipeline's stage checkpoints joined into the
//! whole model) validated by one process, as training validates it ([`evaluate_shard`]).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::bail;
use burn::module::Module;

use crate::app::App;
use crate::engine::checkpoint::{self, Checkpoint, CheckpointMismatch};
use crate::engine::device::train_device;
use crate::engine::preflight::{preflight, Splitting};
use crate::engine::sharded_checkpoint::{self, Found};
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
    evaluate_checkpoint(app, config_path, checkpoint_path).map_err(told_for_eval)
}

/// A checkpoint that does not fit the config, told without the training command's way out
/// (`--no-resume`, which `eval` does not have); any other error as it is.
fn told_for_eval(e: anyhow::Error) -> anyhow::Error {
    match e.downcast_ref::<CheckpointMismatch>() {
        Some(m) => UsageError(format!(
            "checkpoint {} does not fit this config: {}. Give --checkpoint a checkpoint of a run of this --config (or --config the run's configuration)",
            m.dir.display(),
            m.reason
        ))
        .into(),
        None => e,
    }
}

/// The name this program was started under (`trainer`, or an app's own binary), for the
/// commands a message tells the user to run.
fn program_name() -> String {
    std::env::args_os()
        .next()
        .map(PathBuf::from)
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "trainer".into())
}

/// The error for a ZeRO stage-3 checkpoint, which `eval` cannot read: `what` it found, and the
/// two commands that consolidate the run's checkpoint root `root` and evaluate the result.
fn consolidate_first(what: String, root: Option<&Path>, config_path: &Path) -> anyhow::Error {
    let program = program_name();
    // A part found outside its set names no root: a guessed one would give a command that
    // cannot work.
    let root = root.map_or_else(
        || "<the run's checkpoint.dir>".to_string(),
        |r| r.display().to_string(),
    );
    UsageError(format!(
        "{what}. A ZeRO stage-3 run (distributed.zero_stage = 3) writes each rank's shards apart, under {root}/zero3-world-N/rank-R/; eval reads a whole checkpoint. Join the newest one's parts first, then evaluate:\n  {program} consolidate {root}\n  {program} eval --config {} --checkpoint {root}",
        config_path.display(),
    ))
    .into()
}

/// The whole checkpoint at `path` (a checkpoint directory, or the newest in a checkpoint
/// root); a ZeRO stage-3 checkpoint, or one rank's part of it, is refused with the commands
/// that consolidate it.
fn whole_checkpoint(path: &Path, config_path: &Path) -> anyhow::Result<Checkpoint> {
    if let Some(root) = sharded_checkpoint::root_of_set_member(path) {
        return Err(consolidate_first(
            format!(
                "{} is in a ZeRO stage-3 checkpoint's per-rank parts: each part holds one rank's shard of the model, not the model",
                path.display()
            ),
            Some(&root),
            config_path,
        ));
    }
    let ckpt = if path.join(checkpoint::MANIFEST_FILE).exists() {
        checkpoint::open(path)?
    } else {
        match sharded_checkpoint::latest(path)? {
            Some(Found::Whole(ckpt)) => *ckpt,
            Some(Found::Sharded(sharded)) => {
                return Err(consolidate_first(
                    format!(
                        "no whole checkpoint to evaluate in {}: its newest checkpoint (step {}) is a ZeRO stage-3 one, in parts under {}",
                        path.display(),
                        sharded.manifest().position.step,
                        sharded.dir().display()
                    ),
                    Some(path),
                    config_path,
                ))
            }
            None => bail!(UsageError(format!(
                "no usable checkpoint in {} (give a checkpoint directory, or the checkpoint.dir that holds them)",
                path.display()
            ))),
        }
    };
    // A part moved out of its set still says what it is.
    if let Some(part) = &ckpt.manifest.shards {
        return Err(consolidate_first(
            format!(
                "{} is rank {}'s part (of {}) of a ZeRO stage-3 checkpoint: it holds that rank's shard of the model, not the model",
                ckpt.dir.display(),
                part.rank,
                part.world_size
            ),
            None,
            config_path,
        ));
    }
    Ok(ckpt)
}

fn evaluate_checkpoint<A: App>(
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
    } else {
        vec![whole_checkpoint(checkpoint_path, config_path)?]
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
