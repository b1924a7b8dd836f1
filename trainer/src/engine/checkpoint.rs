//! Rank-0 checkpoints: one directory per checkpoint, written atomically, with a manifest.
//!
//! ```text
//! <checkpoint.dir>/step-00000120/
//!     model.safetensors   the weights, named as in the plain model (loads in Python too)
//!     optimizer.bpk       the optimizer state (Burn's `ModuleOptimizer` record, burnpack)
//!     scheduler.bpk       the learning-rate scheduler's record (`LrSchedulerRecord`, burnpack)
//!     manifest.json       format version, model name and fingerprint, config fingerprint,
//!                         world size, training position, and a checksum of each file
//! ```
//! A checkpoint is written into `.tmp-step-…-<pid>`, each file is synced, and the directory is
//! renamed into place: a crash or a full disk mid-write leaves the previous checkpoints intact
//! and no half-written `step-*` directory. Loading verifies every checksum; a damaged checkpoint
//! is reported and the previous one is used.
//!
//! The training position is global (epoch, samples consumed in the epoch, optimizer steps), not
//! per rank, so a job can resume with another world size: the rest of the epoch is re-sharded.
//!
//! Under ZeRO stage 3 every rank writes a checkpoint of this layout of its own part (its
//! shards), and the manifest's `shards` says which tensors are shards
//! ([`crate::engine::sharded_checkpoint`]).

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::Bytes;
use burn_store::{ModuleSnapshot, SafetensorsStore};
use serde::{Deserialize, Serialize};

use crate::engine::schedule::Schedule;

/// Bumped when the layout or the manifest changes incompatibly (3: Burn 0.22's burnpack
/// optimizer and scheduler records; 2: Burn 0.21's MessagePack ones).
pub const FORMAT_VERSION: u32 = 3;
pub(crate) const MODEL_FILE: &str = "model.safetensors";
const OPTIMIZER_FILE: &str = "optimizer.bpk";
pub(crate) const SCHEDULER_FILE: &str = "scheduler.bpk";
pub(crate) const MANIFEST_FILE: &str = "manifest.json";
/// The Burn release this build trains with, recorded in every manifest: a build on another
/// Burn that cannot read these files names it (`tests` checks it against `Cargo.lock`).
pub const BURN_VERSION: &str = "0.22.1";

/// The optimizer state a checkpoint saves (as `optimizer.bpk`).
#[derive(Clone, Copy)]
pub enum OptimizerState<'a> {
    /// An optimizer holding every parameter's state (ZeRO stage 0), serialised on save.
    Whole(&'a ModuleOptimizer),
    /// Every rank's state merged (ZeRO stage 1), already serialised: what
    /// `ModuleOptimizer::into_bytes` gives for the whole state.
    Bytes(&'a [u8]),
}

/// Where training stands; everything needed to continue, independent of the world size.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct TrainPosition {
    /// The epoch in progress (or the next one when `consumed` is 0).
    pub epoch: usize,
    /// Global positions of the epoch's sample order already trained on.
    pub consumed: usize,
    /// Optimizer steps taken since the start of the run.
    pub step: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub format_version: u32,
    pub model: String,
    pub model_fingerprint: String,
    pub config_fingerprint: String,
    pub seed: u64,
    pub world_size: usize,
    pub position: TrainPosition,
    /// File name → FNV-1a 64 of its bytes, hex.
    pub checksums: BTreeMap<String, String>,
    /// The Burn release of the build that wrote it (absent before it was recorded).
    #[serde(default)]
    pub burn_version: Option<String>,
    /// A ZeRO stage-3 rank's part (absent in a whole checkpoint): which of its tensors are
    /// shards (see [`crate::engine::sharded_checkpoint`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<ShardManifest>,
}

/// What a ZeRO stage-3 rank's manifest says of its part
/// ([`crate::engine::sharded_checkpoint`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ShardManifest {
    pub rank: usize,
    pub world_size: usize,
    /// The sharded tensors of its `model.safetensors`, by name.
    pub tensors: BTreeMap<String, ShardedTensor>,
}

/// One sharded parameter.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ShardedTensor {
    /// Its id (the key of its optimizer state).
    pub param_id: u64,
    /// Its whole shape.
    pub shape: Vec<usize>,
}

/// A checkpoint found on disk with a verified manifest.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub manifest: Manifest,
}

/// The checkpoint does not fit the configured model: a usage error (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("checkpoint {dir} does not fit this config: {reason}. Use another checkpoint.dir, or --no-resume to start over (nothing was overwritten)")]
pub struct CheckpointMismatch {
    pub dir: PathBuf,
    pub reason: String,
}

/// A file's checksum in the manifest: FNV-1a 64, a detector of flipped bytes and truncation
/// (not a defence against tampering).
fn checksum(bytes: &[u8]) -> String {
    burn_ddp::hash::fnv1a64_hex(bytes)
}

pub(crate) fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

/// Writes `bytes` to `path` and syncs them to the disk; the error names the file.
fn write_synced(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut f = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write {} ({} bytes)", path.display(), bytes.len()))
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Writes a checkpoint of `model` and `optim` (with the scheduler record `scheduler`) at
/// `position` into `root` and prunes old ones to `keep_last`. Called on rank 0 only (at ZeRO
/// stage 3, by every rank into its own root); returns the checkpoint's directory.
pub fn save<M: Module>(
    root: &Path,
    keep_last: usize,
    manifest: Manifest,
    model: &M,
    optim: OptimizerState<'_>,
    scheduler: &[u8],
) -> anyhow::Result<PathBuf> {
    let final_dir = root.join(step_dir_name(manifest.position.step));
    if final_dir.exists() {
        return Ok(final_dir); // this step is already saved (e.g. right after a resume)
    }
    // Serialise in memory, then write with our own I/O: disk errors (a full disk, a lost
    // mount) then surface as the operating system's error, and the checksum needs no
    // read-back.
    let mut store = SafetensorsStore::from_bytes(None);
    // A `RunningState` (BatchNorm statistics) shows visitors its committed value, one
    // update behind; `valid()` commits the pending one, so the snapshot has the latest.
    let _ = model.valid();
    model
        .save_into(&mut store)
        .map_err(|e| anyhow::anyhow!("cannot serialise the model weights: {e}"))?;
    let weights = store
        .get_bytes()
        .map_err(|e| anyhow::anyhow!("cannot serialise the model weights: {e}"))?;
    let whole;
    let optimizer: &[u8] = match optim {
        OptimizerState::Whole(optim) => {
            whole = optim
                .into_bytes()
                .map_err(|e| anyhow::anyhow!("cannot serialise the optimizer state: {e}"))?;
            &whole
        }
        OptimizerState::Bytes(bytes) => bytes,
    };
    save_files(root, keep_last, manifest, &weights, optimizer, scheduler)
}

/// [`save`] of weights (safetensors) and optimizer state (burnpack) already serialised.
pub fn save_files(
    root: &Path,
    keep_last: usize,
    mut manifest: Manifest,
    weights: &[u8],
    optimizer: &[u8],
    scheduler: &[u8],
) -> anyhow::Result<PathBuf> {
    fs::create_dir_all(root)
        .with_context(|| format!("cannot create checkpoint directory {}", root.display()))?;
    let name = step_dir_name(manifest.position.step);
    let final_dir = root.join(&name);
    if final_dir.exists() {
        return Ok(final_dir);
    }
    remove_stale_temporaries(root);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let result = (|| -> anyhow::Result<()> {
        write_synced(&tmp.join(MODEL_FILE), weights)?;
        manifest
            .checksums
            .insert(MODEL_FILE.to_string(), checksum(weights));
        burn_ddp::fault::point(burn_ddp::fault::FaultPoint::InCheckpoint {
            step: manifest.position.step,
        });
        write_synced(&tmp.join(OPTIMIZER_FILE), optimizer)?;
        manifest
            .checksums
            .insert(OPTIMIZER_FILE.to_string(), checksum(optimizer));
        write_synced(&tmp.join(SCHEDULER_FILE), scheduler)?;
        manifest
            .checksums
            .insert(SCHEDULER_FILE.to_string(), checksum(scheduler));
        write_synced(
            &tmp.join(MANIFEST_FILE),
            serde_json::to_string_pretty(&manifest)?.as_bytes(),
        )?;
        sync_dir(&tmp)?;
        fs::rename(&tmp, &final_dir)?;
        sync_dir(root)?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e.context(format!(
            "checkpoint {} was not written (the previous checkpoints are intact)",
            final_dir.display()
        )));
    }
    prune(root, keep_last);
    Ok(final_dir)
}

/// Removes `.tmp-*` directories left by a writer that died mid-checkpoint. Only rank 0 writes,
/// so any temporary directory present before it starts a new checkpoint is stale.
fn remove_stale_temporaries(root: &Path) {
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    for entry in entries.filter_map(Result::ok) {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(".tmp-step-")
        {
            tracing::warn!(
                "removing {} left by an interrupted checkpoint",
                entry.path().display()
            );
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// The `step-*` directories in `root`, newest first.
fn list(root: &Path) -> Vec<(usize, PathBuf)> {
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    let mut found: Vec<(usize, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let step = name.strip_prefix("step-")?.parse::<usize>().ok()?;
            Some((step, e.path()))
        })
        .collect();
    found.sort_by_key(|f| std::cmp::Reverse(f.0));
    found
}

/// Removes the checkpoints in `root` of steps after `step` (`None`: all): another part of the
/// job (a pipeline's other stages) has none of them, so a resume goes back to `step` and they
/// would stand in for the steps retrained. Returns how many were removed.
pub fn discard_after(root: &Path, step: Option<usize>) -> anyhow::Result<usize> {
    let newer: Vec<PathBuf> = list(root)
        .into_iter()
        .filter(|(s, _)| step.is_none_or(|step| *s > step))
        .map(|(_, dir)| dir)
        .collect();
    for dir in &newer {
        fs::remove_dir_all(dir)
            .with_context(|| format!("cannot remove the checkpoint {}", dir.display()))?;
    }
    Ok(newer.len())
}

fn prune(root: &Path, keep_last: usize) {
    for (_, dir) in list(root).into_iter().skip(keep_last) {
        if let Err(e) = fs::remove_dir_all(&dir) {
            tracing::warn!("cannot remove old checkpoint {}: {e}", dir.display());
        }
    }
}

/// Reads and verifies one checkpoint directory.
pub fn open(dir: &Path) -> anyhow::Result<Checkpoint> {
    let text = fs::read_to_string(dir.join(MANIFEST_FILE)).with_context(|| {
        format!(
            "checkpoint {} has no readable {MANIFEST_FILE}",
            dir.display()
        )
    })?;
    check_format_version(dir, &text)?;
    let manifest: Manifest = serde_json::from_str(&text)
        .with_context(|| format!("checkpoint {}: {MANIFEST_FILE} is damaged", dir.display()))?;
    for file in [MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE] {
        let bytes = fs::read(dir.join(file))
            .with_context(|| format!("checkpoint {}: cannot read {file}", dir.display()))?;
        let expected = manifest
            .checksums
            .get(file)
            .map(String::as_str)
            .unwrap_or("(none)");
        let actual = checksum(&bytes);
        if actual != expected {
            bail!(
                "checkpoint {}: {file} is corrupted (checksum {actual}, manifest says {expected}; {} bytes)",
                dir.display(),
                bytes.len()
            );
        }
    }
    Ok(Checkpoint {
        dir: dir.to_path_buf(),
        manifest,
    })
}

/// Refuses (exit code 2) a manifest of another format version: files another build wrote,
/// which this one must neither read nor skip (skipping would start over and rotate them out).
/// Reads only the version, so a manifest of any layout is recognised.
fn check_format_version(dir: &Path, manifest: &str) -> Result<(), CheckpointMismatch> {
    #[derive(Deserialize)]
    struct Versions {
        format_version: Option<u32>,
        burn_version: Option<String>,
    }
    let Ok(found) = serde_json::from_str::<Versions>(manifest) else {
        return Ok(()); // damaged: reported as such by the full parse
    };
    match found.format_version {
        Some(version) if version != FORMAT_VERSION => Err(CheckpointMismatch {
            dir: dir.to_path_buf(),
            reason: format!(
                "it has checkpoint format version {version} (written by a build on Burn {}), this build (Burn {BURN_VERSION}) reads version {FORMAT_VERSION}: resume it with the build that wrote it (the README names the last commit of each format)",
                found
                    .burn_version
                    .as_deref()
                    .unwrap_or("0.21.0 or older")
            ),
        }),
        _ => Ok(()),
    }
}

/// The newest checkpoint in `root` that verifies; damaged ones are reported and skipped.
/// One of another format version is an error (exit code 2), never skipped.
pub fn latest(root: &Path) -> Result<Option<Checkpoint>, CheckpointMismatch> {
    for (_, dir) in list(root) {
        match open(&dir) {
            Ok(c) => return Ok(Some(c)),
            Err(e) => match e.downcast::<CheckpointMismatch>() {
                Ok(other_format) => return Err(other_format),
                Err(e) => tracing::warn!("{e:#}; falling back to the previous checkpoint"),
            },
        }
    }
    Ok(None)
}

/// Checks that `ckpt` was written for this model.
pub fn check_compatible(
    ckpt: &Checkpoint,
    model: &str,
    model_fingerprint: &str,
) -> Result<(), CheckpointMismatch> {
    let m = &ckpt.manifest;
    if m.model != model || m.model_fingerprint != model_fingerprint {
        return Err(CheckpointMismatch {
            dir: ckpt.dir.clone(),
            reason: format!(
                "it holds model '{}' (fingerprint {}), the config trains '{model}' (fingerprint {model_fingerprint})",
                m.model, m.model_fingerprint
            ),
        });
    }
    Ok(())
}

/// Loads the weights of `ckpt` into `model`.
pub fn load_model<M: Module>(ckpt: &Checkpoint, model: M) -> anyhow::Result<M> {
    load_model_from(
        &ckpt.dir,
        SafetensorsStore::from_file(ckpt.dir.join(MODEL_FILE)),
        model,
    )
}

/// Loads whole weights serialised as safetensors (`weights`, e.g. a ZeRO stage-3 checkpoint's
/// shards joined) into `model`; `dir` names the checkpoint in errors.
pub fn load_model_bytes<M: Module>(dir: &Path, weights: Vec<u8>, model: M) -> anyhow::Result<M> {
    load_model_from(dir, SafetensorsStore::from_bytes(Some(weights)), model)
}

fn load_model_from<M: Module>(
    dir: &Path,
    mut store: SafetensorsStore,
    mut model: M,
) -> anyhow::Result<M> {
    let result = model
        .load_from(&mut store)
        .map_err(|e| CheckpointMismatch {
            dir: dir.to_path_buf(),
            reason: format!("its weights do not load: {e}"),
        })?;
    if !result.is_success() || !result.missing.is_empty() || !result.unused.is_empty() {
        return Err(CheckpointMismatch {
            dir: dir.to_path_buf(),
            reason: format!(
                "its weights do not match the model (missing: {:?}, unused: {:?}, errors: {:?})",
                result.missing, result.unused, result.errors
            ),
        }
        .into());
    }
    Ok(model)
}

/// Loads into `model` the weights of `parts`, checkpoints of one step that each hold some of
/// its parameters under the model's names (a pipeline's stages): every parameter must come
/// from exactly one part, and every part's tensors must belong to the model.
pub fn load_model_parts<M: Module>(parts: &[Checkpoint], mut model: M) -> anyhow::Result<M> {
    let mut loaded: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut everything = Vec::new();
    for part in parts {
        let mut store = SafetensorsStore::from_file(part.dir.join(MODEL_FILE)).allow_partial(true);
        let result = model
            .load_from(&mut store)
            .map_err(|e| CheckpointMismatch {
                dir: part.dir.clone(),
                reason: format!("its weights do not load: {e}"),
            })?;
        if !result.errors.is_empty() || !result.unused.is_empty() {
            return Err(CheckpointMismatch {
                dir: part.dir.clone(),
                reason: format!(
                    "its weights do not match the model (not in the model: {:?}, errors: {:?})",
                    result.unused, result.errors
                ),
            }
            .into());
        }
        for key in result.applied {
            if let Some(other) = loaded.insert(key.clone(), part.dir.clone()) {
                bail!(CheckpointMismatch {
                    dir: part.dir.clone(),
                    reason: format!("{key} is also in {}", other.display()),
                });
            }
        }
        everything = result
            .missing
            .into_iter()
            .map(|(key, _)| key)
            .chain(loaded.keys().cloned())
            .collect();
    }
    let missing: Vec<&String> = everything
        .iter()
        .filter(|k| !loaded.contains_key(*k))
        .collect();
    if !missing.is_empty() {
        let dir = parts.first().map_or_else(PathBuf::new, |p| p.dir.clone());
        bail!(CheckpointMismatch {
            dir,
            reason: format!("no stage holds {missing:?}"),
        });
    }
    Ok(model)
}

/// The learning-rate scheduler's record of `ckpt` (see `crate::engine::schedule`).
pub fn scheduler_bytes(ckpt: &Checkpoint) -> anyhow::Result<Vec<u8>> {
    fs::read(ckpt.dir.join(SCHEDULER_FILE)).with_context(|| {
        format!(
            "checkpoint {}: cannot read {SCHEDULER_FILE}",
            ckpt.dir.display()
        )
    })
}

/// `schedule` with the state of `ckpt`'s scheduler, or [`CheckpointMismatch`] when the
/// checkpoint's scheduler is of another kind.
pub fn load_schedule(ckpt: &Checkpoint, schedule: Schedule) -> anyhow::Result<Schedule> {
    Ok(schedule
        .load_bytes(scheduler_bytes(ckpt)?)
        .map_err(|reason| CheckpointMismatch {
            dir: ckpt.dir.clone(),
            reason,
        })?)
}

/// Loads the optimizer state of `ckpt` into `optim`. Burn materialises the state on its
/// default device and moves each parameter's state to that parameter's device on the next step.
pub fn load_optimizer(
    ckpt: &Checkpoint,
    optim: ModuleOptimizer,
) -> anyhow::Result<ModuleOptimizer> {
    load_optimizer_bytes(&ckpt.dir, optimizer_bytes(ckpt)?, optim)
}

/// The optimizer state file of `ckpt`, as burnpack bytes.
pub fn optimizer_bytes(ckpt: &Checkpoint) -> anyhow::Result<Vec<u8>> {
    fs::read(ckpt.dir.join(OPTIMIZER_FILE)).with_context(|| {
        format!(
            "checkpoint {}: cannot read {OPTIMIZER_FILE}",
            ckpt.dir.display()
        )
    })
}

/// [`load_optimizer`] of state already read (or re-cut: a ZeRO stage-3 checkpoint's); `dir`
/// names the checkpoint in errors.
pub fn load_optimizer_bytes(
    dir: &Path,
    bytes: Vec<u8>,
    optim: ModuleOptimizer,
) -> anyhow::Result<ModuleOptimizer> {
    let mismatch = |reason: String| CheckpointMismatch {
        dir: dir.to_path_buf(),
        reason,
    };
    let saved =
        burn_ddp::ddp::zero::sharded_sync::state_param_ids_of(Bytes::from_bytes_vec(bytes.clone()))
            .map_err(|e| mismatch(format!("its optimizer state does not load: {e}")))?;
    let optim = optim
        .from_bytes(Bytes::from_bytes_vec(bytes))
        .map_err(|e| mismatch(format!("its optimizer state does not load: {e}")))?;
    // Burn skips, without a word, the state it cannot rebuild for the configured optimizer
    // (e.g. Adam's moments into SGD with momentum): a resume would silently start them over.
    let loaded = burn_ddp::ddp::zero::sharded_sync::state_param_ids(&optim)
        .map_err(|e| mismatch(format!("its optimizer state does not load: {e}")))?;
    if loaded != saved {
        return Err(mismatch(format!(
            "its optimizer state (of {} parameters) is not the configured optimizer's ({} \
             parameters restored): resume with the [training] optimizer that wrote it",
            saved.len(),
            loaded.len()
        ))
        .into());
    }
    Ok(optim)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recorded_burn_version_is_the_one_in_the_lock_file() {
        let lock = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock"))
            .expect("the workspace's Cargo.lock");
        let burn = lock
            .split("[[package]]")
            .find(|p| p.contains("\nname = \"burn\"\n"))
            .expect("burn in Cargo.lock");
        assert!(
            burn.contains(&format!("\nversion = \"{BURN_VERSION}\"\n")),
            "BURN_VERSION {BURN_VERSION} is not the locked burn: {burn}"
        );
    }

    #[test]
    fn another_format_version_is_refused_not_skipped() {
        let dir = Path::new("/nonexistent/step-00000001");
        let old = r#"{"format_version": 1, "model": "mlp"}"#;
        let e = check_format_version(dir, old).unwrap_err().to_string();
        assert!(e.contains("format version 1"), "{e}");
        assert!(e.contains("0.21.0 or older"), "{e}");
        assert!(e.contains("--no-resume"), "{e}");
        // A checkpoint of the Burn 0.21 builds (format 2) is refused, not misread.
        let burn_021 = r#"{"format_version": 2, "burn_version": "0.21.0"}"#;
        let e = check_format_version(dir, burn_021).unwrap_err().to_string();
        assert!(
            e.contains("format version 2") && e.contains("Burn 0.21.0"),
            "{e}"
        );
        assert!(
            e.contains("this build (Burn 0.22.1) reads version 3"),
            "{e}"
        );
        let newer = r#"{"format_version": 4, "burn_version": "0.23.0"}"#;
        let e = check_format_version(dir, newer).unwrap_err().to_string();
        assert!(e.contains("Burn 0.23.0"), "{e}");
        let ours = format!(r#"{{"format_version": {FORMAT_VERSION}}}"#);
        assert!(check_format_version(dir, &ours).is_ok());
        assert!(check_format_version(dir, "not json").is_ok());
    }

    #[test]
    fn checksum_detects_flips_and_truncation() {
        let a = checksum(b"hello world");
        assert_ne!(a, checksum(b"hello worle"));
        assert_ne!(a, checksum(b"hello worl"));
        assert_eq!(a, checksum(b"hello world"));
    }

    #[test]
    fn listing_orders_newest_first_and_ignores_temporaries() {
        let root = std::env::temp_dir().join(format!("ckpt-list-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        for d in [
            "step-00000002",
            "step-00000010",
            ".tmp-step-00000011-1",
            "other",
        ] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        let steps: Vec<usize> = list(&root).into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, vec![10, 2]);
        prune(&root, 1);
        assert_eq!(list(&root).len(), 1);
        assert!(
            latest(&root).is_ok_and(|found| found.is_none()),
            "no manifest: not a usable checkpoint"
        );
        let _ = fs::remove_dir_all(&root);
    }
}
