//! ZeRO stage 3's checkpoints: every rank writes its own part, and no rank holds the whole
//! model to save it.
//!
//! ```text
//! <checkpoint.dir>/zero3-world-4/rank-2/step-00000120/   rank 2's part, in the layout of
//!     model.safetensors    its shards (each `[1, …, 1, len]`,       crate::engine::checkpoint
//!                          under the parameter's name) and the parameters every rank holds whole
//!     optimizer.bpk        its optimizer state (shard-shaped for the shards)
//!     scheduler.bpk
//!     manifest.json        with `shards`: each sharded tensor's parameter id and full shape
//! ```
//! The parts of one step, one per rank, are the checkpoint. A resume takes the newest step
//! every rank of a set has (a crash between two ranks' writes leaves one a step ahead, so each
//! rank keeps at least 2), joins the weights whole and cuts the optimizer state for its own
//! world size and stage (burn-ddp's [`reshard`](burn_ddp::ddp::fsdp::reshard)): a stage-3
//! checkpoint resumes at any world size and stage. `trainer consolidate` writes the joined
//! checkpoint as a whole one (`<checkpoint.dir>/step-…/`), which `trainer eval` and Burn's
//! own loaders read.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use burn::module::{Module, ParamId};
use burn::optim::ModuleOptimizer;
use burn::tensor::{Bytes, DType};
use burn_ddp::ddp::fsdp::reshard::{reshard_state, reshard_tensors, ShardTarget};
use burn_ddp::DataParallel;
use burn_store::ModuleSnapshot;

use crate::engine::checkpoint::{
    self, Checkpoint, Manifest, OptimizerState, ShardManifest, ShardedTensor, TrainPosition,
};
use crate::engine::parallel::{self, CheckpointPolicy};
use crate::engine::schedule::Schedule;
use crate::error::UsageError;

/// The name of a set's directory, before its world size.
const SET_PREFIX: &str = "zero3-world-";

/// `<root>/zero3-world-N`.
fn set_dir(root: &Path, world: usize) -> PathBuf {
    root.join(format!("{SET_PREFIX}{world}"))
}

/// `<root>/zero3-world-N/rank-r`: rank `r`'s checkpoint root.
fn rank_dir(root: &Path, world: usize, rank: usize) -> PathBuf {
    set_dir(root, world).join(format!("rank-{rank}"))
}

/// The checkpoint root (a run's `checkpoint.dir`) whose stage-3 set holds `path`, where
/// `path` is one of the set's three levels: the set's directory `<root>/zero3-world-N`, a
/// rank's (`.../rank-r`), or one part's (`.../rank-r/step-N`). Only those depths are looked
/// at, so a user's own directory that happens to be named `zero3-world-N` higher up does not
/// count.
pub fn root_of_set_member(path: &Path) -> Option<PathBuf> {
    let set = path.ancestors().take(3).find(|a| {
        a.file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix(SET_PREFIX))
            .is_some_and(|world| world.parse::<usize>().is_ok())
    })?;
    Some(match set.parent() {
        Some(root) if !root.as_os_str().is_empty() => root.to_path_buf(),
        _ => PathBuf::from("."),
    })
}

/// A stage-3 checkpoint: its ranks' parts of one step, in rank order (never empty).
#[derive(Debug, Clone)]
pub struct ShardedCheckpoint {
    parts: Vec<Checkpoint>,
}

impl ShardedCheckpoint {
    /// Rank 0's manifest (the position, the model, the world size).
    pub fn manifest(&self) -> &Manifest {
        &self.parts[0].manifest
    }

    /// The set's directory, `<root>/zero3-world-N`.
    pub fn dir(&self) -> PathBuf {
        self.parts[0]
            .dir
            .parent()
            .and_then(Path::parent)
            .map_or_else(|| self.parts[0].dir.clone(), Path::to_path_buf)
    }

    /// The full shapes of the sharded tensors, checked to be the same in every part.
    fn shards(&self) -> anyhow::Result<&BTreeMap<String, ShardedTensor>> {
        let world = self.parts.len();
        let mut first = None;
        for (rank, part) in self.parts.iter().enumerate() {
            let Some(shards) = &part.manifest.shards else {
                bail!("{}: its manifest lists no shards", part.dir.display());
            };
            if shards.rank != rank || shards.world_size != world {
                bail!(
                    "{}: it is rank {} of {}, found as rank {rank} of {world}",
                    part.dir.display(),
                    shards.rank,
                    shards.world_size
                );
            }
            match first {
                None => first = Some(&shards.tensors),
                Some(first) if *first != shards.tensors => bail!(
                    "{}: its shards are not rank 0's: the parts are of different models",
                    part.dir.display()
                ),
                Some(_) => {}
            }
        }
        first.context("a sharded checkpoint without parts")
    }

    /// The whole weights, as safetensors: each sharded tensor joined from every part, the
    /// others rank 0's. Local; holds every part's weights once.
    pub fn joined_weights(&self) -> anyhow::Result<Vec<u8>> {
        let shards = self.shards()?;
        let files: Vec<Vec<u8>> = self
            .parts
            .iter()
            .map(|part| {
                let path = part.dir.join(checkpoint::MODEL_FILE);
                fs::read(&path).with_context(|| format!("cannot read {}", path.display()))
            })
            .collect::<anyhow::Result<_>>()?;
        let tables = files
            .iter()
            .zip(&self.parts)
            .map(|(bytes, part)| {
                safetensors::SafeTensors::deserialize(bytes).map_err(|e| {
                    anyhow::anyhow!("{}: its weights do not read: {e}", part.dir.display())
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let pieces: Vec<Vec<burn_pack::Tensor>> = tables
            .iter()
            .map(|table| {
                shards
                    .keys()
                    .map(|name| {
                        let view = table
                            .tensor(name)
                            .with_context(|| format!("a part has no shard of {name}"))?;
                        Ok(burn_pack::Tensor::new(
                            name.clone(),
                            DType::F32,
                            view.shape().to_vec(),
                            None,
                            Bytes::from_bytes_vec(view.data().to_vec()),
                        ))
                    })
                    .collect::<anyhow::Result<Vec<_>>>()
            })
            .collect::<anyhow::Result<_>>()?;
        let joined = reshard_tensors(
            pieces,
            |t| shards.get(&t.name).map(|s| s.shape.clone()),
            ShardTarget::Whole,
        )?;
        let joined: Vec<(String, Vec<usize>, Bytes)> = joined
            .into_iter()
            .map(|t| {
                let (name, _, shape, _, bytes) = t.into_parts()?;
                Ok((name, shape.to_vec(), bytes))
            })
            .collect::<Result<_, burn_pack::Error>>()
            .map_err(|e| anyhow::anyhow!("cannot join the shards: {e}"))?;
        let mut views = Vec::new();
        for (name, shape, bytes) in &joined {
            views.push((
                name.clone(),
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    shape.clone(),
                    bytes,
                )?,
            ));
        }
        for (name, view) in tables[0].iter() {
            if !shards.contains_key(name) {
                views.push((name.to_string(), view));
            }
        }
        Ok(safetensors::serialize(views, None)?)
    }

    /// The optimizer state, every sharded parameter's joined and cut as `target` says.
    /// Local.
    pub fn optimizer_state(&self, target: ShardTarget) -> anyhow::Result<Vec<u8>> {
        let sharded: HashMap<ParamId, Vec<usize>> = self
            .shards()?
            .values()
            .map(|s| (ParamId::from(s.param_id), s.shape.clone()))
            .collect();
        let parts = self
            .parts
            .iter()
            .map(|part| checkpoint::optimizer_bytes(part).map(Bytes::from_bytes_vec))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(reshard_state(parts, &sharded, target)?.to_vec())
    }
}

/// What a resume found: a whole checkpoint (ZeRO stages 0 to 2, or consolidated), or a
/// stage-3 one.
#[derive(Debug, Clone)]
pub enum Found {
    Whole(Box<Checkpoint>),
    Sharded(ShardedCheckpoint),
}

impl Found {
    pub fn manifest(&self) -> &Manifest {
        match self {
            Found::Whole(c) => &c.manifest,
            Found::Sharded(s) => s.manifest(),
        }
    }

    /// Where it is, for messages.
    pub fn dir(&self) -> PathBuf {
        match self {
            Found::Whole(c) => c.dir.clone(),
            Found::Sharded(s) => s.dir(),
        }
    }

    /// The checkpoint whose manifest and schedule a resume reads (a sharded one's rank 0
    /// part: the position and schedule are the same in every part).
    pub fn checkpoint(&self) -> &Checkpoint {
        match self {
            Found::Whole(c) => c,
            Found::Sharded(s) => &s.parts[0],
        }
    }

    /// `model` with the checkpoint's whole weights (a sharded one's joined). Local.
    pub fn load_model<M: Module>(&self, model: M) -> anyhow::Result<M> {
        match self {
            Found::Whole(c) => checkpoint::load_model(c, model),
            Found::Sharded(s) => checkpoint::load_model_bytes(&s.dir(), s.joined_weights()?, model),
        }
    }

    /// `optim` with the checkpoint's optimizer state cut as `target` says: whole for ZeRO
    /// stages 0 to 2, this rank's shards for stage 3. Local.
    pub fn load_optimizer(
        &self,
        optim: ModuleOptimizer,
        target: ShardTarget,
        sharded: &HashMap<ParamId, Vec<usize>>,
    ) -> anyhow::Result<ModuleOptimizer> {
        let (dir, bytes) = match (self, target) {
            (Found::Whole(c), ShardTarget::Whole) => return checkpoint::load_optimizer(c, optim),
            (Found::Whole(c), target) => {
                let whole = Bytes::from_bytes_vec(checkpoint::optimizer_bytes(c)?);
                (
                    c.dir.clone(),
                    reshard_state(vec![whole], sharded, target)?.to_vec(),
                )
            }
            (Found::Sharded(s), target) => (s.dir(), s.optimizer_state(target)?),
        };
        checkpoint::load_optimizer_bytes(&dir, bytes, optim)
    }

    /// Fails unless it was written for `model` / `fingerprint` (every part).
    pub fn check_compatible(&self, model: &str, fingerprint: &str) -> anyhow::Result<()> {
        match self {
            Found::Whole(c) => checkpoint::check_compatible(c, model, fingerprint)?,
            Found::Sharded(s) => {
                for part in &s.parts {
                    checkpoint::check_compatible(part, model, fingerprint)?;
                }
            }
        }
        Ok(())
    }
}

/// The newest usable checkpoint under `policy.dir` of either kind, whole (ZeRO stages 0 to 2,
/// or consolidated) or a stage-3 one (every rank's part), checked against the policy's model;
/// the same on every rank or an error. Collective.
pub fn latest_agreed(
    ddp: &mut DataParallel,
    policy: &CheckpointPolicy,
) -> anyhow::Result<Option<Found>> {
    let found = latest(&policy.dir)?;
    if let Some(found) = &found {
        found.check_compatible(&policy.model_name, &policy.model_fingerprint)?;
    }
    let step = found
        .as_ref()
        .map_or(-1, |c| c.manifest().position.step as i64);
    parallel::agree_on_step(ddp, step)?;
    Ok(found)
}

/// The newest checkpoint under `root` of either kind (a whole one where both have the step).
/// Local: it reads the shared directory.
pub fn latest(root: &Path) -> anyhow::Result<Option<Found>> {
    let whole = checkpoint::latest(root)?;
    let sharded = latest_sharded(root)?;
    Ok(match (whole, sharded) {
        (Some(w), Some(s)) if s.manifest().position.step > w.manifest.position.step => {
            Some(Found::Sharded(s))
        }
        (Some(w), _) => Some(Found::Whole(Box::new(w))),
        (None, Some(s)) => Some(Found::Sharded(s)),
        (None, None) => None,
    })
}

/// The newest stage-3 checkpoint under `root`, over every set (world size) there.
pub fn latest_sharded(root: &Path) -> anyhow::Result<Option<ShardedCheckpoint>> {
    let Ok(entries) = fs::read_dir(root) else {
        return Ok(None);
    };
    let mut newest: Option<ShardedCheckpoint> = None;
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().to_string();
        let Some(world) = name
            .strip_prefix(SET_PREFIX)
            .and_then(|w| w.parse::<usize>().ok())
        else {
            continue;
        };
        if let Some(found) = newest_in_set(root, world)? {
            let step = found.manifest().position.step;
            if newest
                .as_ref()
                .is_none_or(|n| n.manifest().position.step < step)
            {
                newest = Some(found);
            }
        }
    }
    Ok(newest)
}

/// The newest step every rank of the `world`-rank set under `root` has.
fn newest_in_set(root: &Path, world: usize) -> anyhow::Result<Option<ShardedCheckpoint>> {
    let mut common: Option<usize> = None;
    for rank in 0..world {
        match checkpoint::latest(&rank_dir(root, world, rank))? {
            Some(c) => {
                let step = c.manifest.position.step;
                common = Some(common.map_or(step, |s| s.min(step)));
            }
            None => return Ok(None),
        }
    }
    let Some(step) = common else {
        return Ok(None);
    };
    let parts = (0..world)
        .map(|rank| {
            let dir = rank_dir(root, world, rank).join(checkpoint::step_dir_name(step));
            checkpoint::open(&dir).with_context(|| {
                format!("the stage-3 checkpoint of step {step} at world size {world} is incomplete")
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Some(ShardedCheckpoint { parts }))
}

/// Every rank writes its part of a checkpoint of `position` (module docs) and prunes its old
/// ones. Collective over `ddp`'s group: all agree that the weights are finite (none is written
/// otherwise) and each learns whether the others' writes succeeded.
pub fn save<M: Module>(
    ddp: &mut DataParallel,
    policy: &CheckpointPolicy,
    position: TrainPosition,
    model: &M,
    optim: &ModuleOptimizer,
    schedule: &Schedule,
) -> anyhow::Result<()> {
    let (rank, world) = (ddp.rank(), ddp.world_size());
    let finite = burn_ddp::ddp::buckets::finite::module_is_finite(model)?;
    let flags = ddp.all_gather(&[f64::from(u8::from(finite))])?;
    if flags.contains(&0.0) {
        return Err(policy.non_finite(position));
    }
    let layout = ddp
        .shard_layout()
        .context("ZeRO stage 3: the model was not sharded before its checkpoint")?;
    let tensors = model
        .collect(None, None, false)
        .into_iter()
        .filter_map(|t| {
            let param_id = t.param_id?;
            let shape = layout.full_shape(ParamId::from(param_id))?.to_vec();
            Some((t.name, ShardedTensor { param_id, shape }))
        })
        .collect();
    let mut manifest = policy.manifest(world, position);
    manifest.shards = Some(ShardManifest {
        rank,
        world_size: world,
        tensors,
    });
    let scheduler = schedule.to_bytes().map_err(anyhow::Error::msg)?;
    let written = checkpoint::save(
        &rank_dir(&policy.dir, world, rank),
        policy.keep_last.max(2),
        manifest,
        model,
        OptimizerState::Whole(optim),
        &scheduler,
    );
    let flags = ddp.all_gather(&[f64::from(u8::from(written.is_ok()))])?;
    let dir = written?;
    if let Some(failed) = flags.iter().position(|&f| f == 0.0) {
        bail!(
            "rank {failed} did not write its part of the checkpoint of step {} (its log says why)",
            position.step
        );
    }
    if rank == 0 {
        tracing::info!(
            "checkpoint written: {} (and the other {} ranks' parts)",
            dir.display(),
            world - 1
        );
    }
    Ok(())
}

/// Removes this rank's parts after `step` (steps another rank does not have: a resume goes
/// back to `step`). Local.
pub fn discard_after(root: &Path, world: usize, rank: usize, step: usize) -> anyhow::Result<()> {
    checkpoint::discard_after(&rank_dir(root, world, rank), Some(step))?;
    Ok(())
}

/// `trainer consolidate`: the newest stage-3 checkpoint under `root` written as a whole one
/// (`<root>/step-…/`: the weights joined, the optimizer state whole, the same position), which
/// `trainer eval`, a resume at any stage and Burn's own loaders read. Returns its directory.
/// One process; holds the whole model's weights and optimizer state once.
pub fn consolidate(root: &Path) -> anyhow::Result<PathBuf> {
    let Some(sharded) = latest_sharded(root)? else {
        bail!(UsageError(format!(
            "no ZeRO stage-3 checkpoint in {} (a run with distributed.zero_stage = 3 writes its ranks' parts under {}N/): give the run's checkpoint.dir",
            root.display(),
            root.join(SET_PREFIX).display()
        )));
    };
    let weights = sharded.joined_weights()?;
    let optimizer = sharded.optimizer_state(ShardTarget::Whole)?;
    let scheduler = checkpoint::scheduler_bytes(&sharded.parts[0])?;
    let mut manifest = sharded.manifest().clone();
    manifest.shards = None;
    manifest.checksums.clear();
    checkpoint::save_files(root, usize::MAX, manifest, &weights, &optimizer, &scheduler)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_member_names_the_checkpoint_root_that_holds_it() {
        let root = Path::new("runs/x/ckpt");
        for member in [
            set_dir(root, 4),
            rank_dir(root, 4, 1),
            rank_dir(root, 4, 1).join("step-00000025"),
        ] {
            assert_eq!(
                root_of_set_member(&member).as_deref(),
                Some(root),
                "{member:?}"
            );
        }
        assert_eq!(
            root_of_set_member(Path::new("zero3-world-2/rank-0")).as_deref(),
            Some(Path::new("."))
        );
        for other in [
            "runs/x/ckpt",
            "runs/x/ckpt/step-00000025",
            "zero3-world-x/rank-0",
            "zero3-world-2/mine/runs/x/ckpt/step-00000025",
        ] {
            assert_eq!(root_of_set_member(Path::new(other)), None, "{other}");
        }
    }
}
