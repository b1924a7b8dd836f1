//! Where a pipeline's checkpoints live, and which step every stage resumes from.
//!
//! Stage `s` of a `P`-stage run keeps its checkpoints (its weights, its optimizer state, the
//! schedule, a manifest) under `checkpoint.dir/pipeline-P/stage-s/step-N/`, written by the
//! stage's replica 0, as a data-parallel run keeps its own under `checkpoint.dir/step-N/`:
//! the same format, the same atomic writes and pruning. The stages' checkpoints of step `N`
//! together are the model at step `N` (its parameters under the whole model's names). A
//! resume takes the newest step that **every** stage has (a crash between two stages' writes
//! leaves one stage a step ahead), so each stage keeps at least 2 checkpoints. Replicas are
//! not part of the path: a run resumes at any number of replicas.

use std::path::{Path, PathBuf};

use anyhow::bail;
use burn_ddp::pipeline::PipelineParallel;
use burn_ddp::ProcessGroup;
use burn_ddp::ReduceOp;

use super::stage_of::StageOf;
use crate::engine::checkpoint::{self, Checkpoint};
use crate::engine::parallel::{self, CheckpointPolicy};
use crate::error::UsageError;

/// Stage `which`'s checkpoint policy, from the run's.
pub(crate) fn stage_policy(run: &CheckpointPolicy, which: StageOf) -> CheckpointPolicy {
    CheckpointPolicy {
        dir: stage_dir(&run.dir, which),
        keep_last: run.keep_last.max(2),
        model_name: stage_model_name(&run.model_name, which.stage, which.stages),
        ..run.clone()
    }
}

/// The model name in stage `stage`'s manifests.
pub(crate) fn stage_model_name(model: &str, stage: usize, stages: usize) -> String {
    format!("{model} (stage {stage} of {stages})")
}

/// `root/pipeline-P/stage-s`.
pub(crate) fn stage_dir(root: &std::path::Path, which: StageOf) -> PathBuf {
    root.join(format!("pipeline-{}", which.stages))
        .join(format!("stage-{}", which.stage))
}

/// The checkpoint this rank's stage resumes from: the newest step every stage has, the same
/// on every rank; `None` when some stage has none. The stage's checkpoints after it (a stage
/// that saved one step more before a crash) are removed by its replica 0, so that the steps
/// retrained from there are saved anew. Collective over the whole job.
pub(crate) fn agreed_checkpoint(
    pp: &mut PipelineParallel,
    policy: &CheckpointPolicy,
) -> anyhow::Result<Option<Checkpoint>> {
    let agreed = newest_every_stage_has(pp, policy)?;
    if pp.replica() == 0 {
        let step = agreed.as_ref().map(|c| c.manifest.position.step);
        let removed = checkpoint::discard_after(&policy.dir, step)?;
        if removed > 0 {
            tracing::warn!(
                "stage {}: removed {removed} checkpoint(s) after step {} that another stage does not have",
                pp.stage(),
                step.map_or_else(|| "0".to_string(), |s| s.to_string())
            );
        }
    }
    Ok(agreed)
}

/// [`agreed_checkpoint`] before the clean-up. Collective over the whole job.
fn newest_every_stage_has(
    pp: &mut PipelineParallel,
    policy: &CheckpointPolicy,
) -> anyhow::Result<Option<Checkpoint>> {
    // The same on the stage's replicas (or an error), checked against the model.
    let found = parallel::latest_checkpoint(pp.replica_group(), policy)?;
    let ours = found
        .as_ref()
        .map_or(-1, |c| c.manifest.position.step as i64);
    let mut oldest = [ours];
    pp.world_group().all_reduce(&mut oldest, ReduceOp::Min)?;
    let [step] = oldest;
    match (found, step) {
        (_, -1) => Ok(None),
        (Some(c), step) if c.manifest.position.step as i64 == step => Ok(Some(c)),
        (_, step) => {
            let dir = policy.dir.join(checkpoint::step_dir_name(step as usize));
            if !dir.is_dir() {
                bail!(
                    "stage {}: another stage's newest checkpoint is of step {step}, which this stage no longer has ({} is missing): the stages' checkpoints do not fit together; remove {} to start over",
                    pp.stage(),
                    dir.display(),
                    policy.dir.parent().unwrap_or(&policy.dir).display()
                );
            }
            let ckpt = checkpoint::open(&dir)?;
            checkpoint::check_compatible(&ckpt, &policy.model_name, &policy.model_fingerprint)?;
            tracing::info!(
                "stage {}: resuming from step {step}, the newest step every stage has",
                pp.stage()
            );
            Ok(Some(ckpt))
        }
    }
}

/// The stages' checkpoints of the newest step every stage of a `stages`-stage run under
/// `root` has (for `trainer eval`, in one process); an error naming the stage without any.
pub(crate) fn newest_common(root: &Path, stages: usize) -> anyhow::Result<Vec<Checkpoint>> {
    let dirs: Vec<PathBuf> = (0..stages)
        .map(|stage| stage_dir(root, StageOf { stage, stages }))
        .collect();
    let mut newest = Vec::with_capacity(stages);
    for dir in &dirs {
        match checkpoint::latest(dir)? {
            Some(ckpt) => newest.push(ckpt.manifest.position.step),
            None => bail!(UsageError(format!(
                "no usable checkpoint in {} (a run of {stages} pipeline stages writes one per stage there)",
                dir.display()
            ))),
        }
    }
    let step = newest.iter().copied().min().unwrap_or(0);
    dirs.iter()
        .map(|dir| checkpoint::open(&dir.join(checkpoint::step_dir_name(step))))
        .collect()
}
