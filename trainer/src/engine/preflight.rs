//! The pre-flight check: what can be checked before any rank starts, in the launcher and again
//! in every rank. It reads the config file only: never the data.

use std::path::Path;

use anyhow::bail;

use crate::app::{App, AppConfig};
use crate::backend;
use crate::config::DeviceKind;
use crate::engine::memory::{available_memory, MemoryEstimate};
use crate::error::UsageError;

/// Whether `[distributed] pipeline_stages > 1` can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Splitting {
    /// The program gave the entry point a [`StageSplit`](crate::engine::pipeline::StageSplit), or what
    /// it runs needs none (`eval` reads a pipeline's checkpoints as the whole model).
    Possible,
    /// No split: a config asking for stages is refused.
    Impossible,
}

/// Checks what can be checked before any rank starts: the config file (the engine's sections
/// and the app's tables), the app's own checks, whether the program can run the stages asked
/// for (`splitting`), the output directories, the device, and
/// whether `ranks_here` ranks (of a job of `world_size`) of this model fit in this machine's
/// memory (on the CPU, for apps that give [`App::parameter_count`]; ZeRO stage 1 divides the
/// optimizer state by the replicas of a stage, `pipeline_stages` the model by the stages),
/// and that the stages divide the world size. Reads no data and allocates no model.
pub fn preflight<A: App>(
    app: &A,
    config_path: &Path,
    ranks_here: usize,
    world_size: usize,
    splitting: Splitting,
) -> anyhow::Result<AppConfig<A>> {
    let config = AppConfig::<A>::load(config_path)?;
    app.check(&config.model, &config.data)?;
    let stages = config.distributed.pipeline_stages;
    if stages > 1 && splitting == Splitting::Impossible {
        bail!(UsageError(format!(
            "distributed.pipeline_stages = {stages}: the model of this app ({}) cannot be cut into stages (this program gives no StageSplit); set pipeline_stages = 1, or start the program with trainer::run::main_with_stages and the model's StageSplit",
            app.name(&config.model)
        )));
    }
    // One process (`trainer eval`, or a run started alone) is told by the pipeline itself.
    if world_size > 1 && !world_size.is_multiple_of(stages) {
        bail!(UsageError(format!(
            "distributed.pipeline_stages = {stages} does not divide the world size {world_size}: every replica of the pipeline needs all {stages} stages (run {stages} × replicas processes)"
        )));
    }
    if config.output.device == DeviceKind::Cpu {
        // A rank of a pipeline holds one stage: about 1/stages of the model (stages are cut
        // by layers); one process (`trainer eval`) the whole model.
        let per_rank = if world_size > 1 { stages } else { 1 };
        let parameters = app
            .parameter_count(&config.model, &config.data)
            .map(|p| p.div_ceil(per_rank as u64));
        if let (Some(parameters), Some((available, source))) = (parameters, available_memory()) {
            MemoryEstimate::new(parameters, &config.optimizer)
                .with_zero_stage(config.distributed.zero_stage, world_size / per_rank)
                .check(ranks_here, available, source)?;
        }
    }
    if config.training.balance_classes && config.training.drop_last {
        // The weighted sampler draws with replacement and never drops: say so instead of
        // silently ignoring one of them.
        bail!(UsageError(
            "training.balance_classes draws with replacement and cannot drop_last: set one of them to false".into()
        ));
    }
    let dirs = [
        ("checkpoint.dir", config.checkpoint.dir.as_deref()),
        ("output.dir", Some(config.output.dir.as_path())),
    ];
    for (key, dir) in dirs {
        if let Some(dir) = dir.filter(|d| d.exists() && !d.is_dir()) {
            bail!(UsageError(format!(
                "{key} = \"{}\" is a file, not a directory: point {key} at a directory (it is created if missing)",
                dir.display()
            )));
        }
    }
    let local_rank = std::env::var(crate::launcher::worker_env::LOCAL_RANK_VAR)
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    backend::device_available(config.output.device, local_rank)?;
    Ok(config)
}
