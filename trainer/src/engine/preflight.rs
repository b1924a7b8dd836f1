//! The pre-flight check: what can be checked before any rank starts, in the launcher and again
//! in every rank. It reads the config file only: never the data.

use std::path::Path;

use anyhow::bail;
use burn_ddp::pipeline::{LayoutError, PipelineLayout};

use crate::app::{App, AppConfig};
use crate::config::{DeviceKind, OutputConfig};
use crate::engine::device::device_available;
use crate::engine::memory::{available_memory, MemoryEstimate};
use crate::error::UsageError;
use crate::features::Feature;

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
/// memory (on the CPU, for apps that give [`App::parameter_count`]; ZeRO stages 1 and 2
/// divide the optimizer state, stage 2 the gradients too, by the replicas of a stage,
/// `pipeline_stages` the model by the stages),
/// and that the stages divide the world size (burn-ddp's [`PipelineLayout`]). Reads no data
/// and allocates no model.
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
    let layout = pipeline_layout(stages, world_size)?;
    if config.output.device == DeviceKind::Cpu {
        // A rank of a pipeline holds one stage: about 1/stages of the model (stages are cut
        // by layers); ZeRO divides the optimizer state among the replicas of a stage.
        let parameters = app
            .parameter_count(&config.model, &config.data)
            .map(|p| p.div_ceil(layout.stages() as u64));
        if let (Some(parameters), Some((available, source))) = (parameters, available_memory()) {
            MemoryEstimate::new(parameters, &config.optimizer)
                .with_zero_stage(config.distributed.zero_stage, layout.replicas())
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
    device_available(config.output.device, local_rank)?;
    outputs_available(&config.output)?;
    Ok(config)
}

/// `output.plots` and `output.tensorboard` asked of a build without their features: a usage
/// error (exit code 2) naming the feature.
fn outputs_available(output: &OutputConfig) -> Result<(), UsageError> {
    let asked = [
        (output.plots, Feature::Plots, "output.plots = true"),
        (
            output.tensorboard,
            Feature::Tensorboard,
            "output.tensorboard = true",
        ),
    ];
    for (on, feature, what) in asked {
        if on {
            feature
                .require(what)
                .map_err(|e| UsageError(e.to_string()))?;
        }
    }
    Ok(())
}

/// The stages × replicas grid of `world_size` ranks cut into `stages` stages, as burn-ddp's
/// [`PipelineLayout`] (the one home of "the stages divide the world") builds it. One process
/// (`trainer eval`, or a run started alone) holds the whole model: its grid is one stage of
/// one replica, and a pipeline started alone is told by the pipeline itself.
fn pipeline_layout(stages: usize, world_size: usize) -> Result<PipelineLayout, UsageError> {
    if world_size <= 1 {
        return Ok(PipelineLayout::new(1, 1).expect("one rank is one stage of one replica"));
    }
    PipelineLayout::new(world_size, stages).map_err(|e| match e {
        LayoutError::NotAMultiple { world, stages } => UsageError(format!(
            "distributed.pipeline_stages = {stages} does not divide the world size {world}: every replica of the pipeline needs all {stages} stages (run {stages} × replicas processes)"
        )),
        other => UsageError(format!("distributed.pipeline_stages: {other}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stages_must_divide_the_world_and_one_process_holds_the_whole_model() {
        let grid =
            |stages, world| pipeline_layout(stages, world).map(|l| (l.stages(), l.replicas()));
        assert_eq!(grid(2, 6).unwrap(), (2, 3));
        assert_eq!(grid(1, 4).unwrap(), (1, 4));
        assert_eq!(grid(3, 1).unwrap(), (1, 1));
        let err = grid(2, 3).unwrap_err().0;
        assert_eq!(
            err,
            "distributed.pipeline_stages = 2 does not divide the world size 3: every replica of the pipeline needs all 2 stages (run 2 × replicas processes)"
        );
    }
}
