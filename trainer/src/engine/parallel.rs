//! The engine's side of the DDP step: [`burn_ddp::DataParallel`] (the handle every rank
//! trains through; own-loop programs use it directly) configured from `[distributed]`, and the
//! collectives of the engine's checkpoints ([`latest_checkpoint`], [`save_checkpoint`]).
//!
//! Every function marked *collective* must be called by every rank, in the same order; each
//! has a deadline (`distributed.timeout_secs`, or the checkpoint timeout) after which it fails
//! naming the ranks that did not arrive.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::Device;
use burn_ddp::{DataParallel, DdpOptions, Distributed};

use crate::app::{App, AppConfig};
use crate::config::{DistributedConfig, FaultToleranceConfig};
use crate::engine::checkpoint::{
    self, Checkpoint, Manifest, OptimizerState, TrainPosition, FORMAT_VERSION,
};
use crate::engine::schedule::Schedule;
use crate::launcher::worker_env;

/// Where rank 0 writes checkpoints and what they must match to be loaded.
#[derive(Debug, Clone)]
pub struct CheckpointPolicy {
    /// The checkpoint root (`step-XXXXXXXX/` directories), shared by every rank.
    pub dir: PathBuf,
    /// Keep this many newest checkpoints.
    pub keep_last: usize,
    /// How long the other ranks wait for rank 0's write.
    pub timeout: Duration,
    /// A checkpoint of another model name or model fingerprint is refused on load.
    pub model_name: String,
    pub model_fingerprint: String,
    /// Recorded in the manifest (which settings produced it).
    pub config_fingerprint: String,
    pub seed: u64,
}

/// The DDP options `[distributed]` describes: its fields are burn-ddp's types already.
pub fn ddp_options(d: &DistributedConfig, ft: &FaultToleranceConfig) -> DdpOptions {
    DdpOptions {
        transport: d.gradient_sync,
        zero_stage: d.zero_stage,
        compression: d.gradient_compression,
        bucket_cap_mb: d.bucket_cap_mb,
        overlap: d.gradient_overlap,
        buffers: d.sync_buffers,
        timeout: Duration::from_secs(d.timeout_secs),
        stall_warning: Duration::from_secs(d.stall_warning_secs),
        // One detection time, whatever the failure mode: under "restart" it bounds how long
        // the error that names the dead rank takes.
        failure_detection: Duration::from_secs_f64(ft.detection_secs),
        // A cut-off or frozen rank is then named within the detection time too.
        peer_heartbeats: ft.survivors_continue(d),
        max_world_size: ft.max_world_size,
    }
}

impl CheckpointPolicy {
    /// Why no checkpoint of `position` is written: its weights hold a NaN or an infinity (the
    /// checkpoints already written are kept, never rotated out by a diverged run's).
    pub fn non_finite(&self, position: TrainPosition) -> anyhow::Error {
        anyhow::anyhow!(
            "refusing to write a checkpoint of non-finite weights (NaN or Inf) at optimizer step {}: the checkpoints already in {} are kept",
            position.step,
            self.dir.display()
        )
    }

    /// The manifest of a checkpoint of `position` written by a job of `world_size` ranks
    /// (its checksums are filled in as its files are written).
    pub fn manifest(&self, world_size: usize, position: TrainPosition) -> Manifest {
        Manifest {
            format_version: FORMAT_VERSION,
            model: self.model_name.clone(),
            model_fingerprint: self.model_fingerprint.clone(),
            config_fingerprint: self.config_fingerprint.clone(),
            seed: self.seed,
            world_size,
            position,
            checksums: Default::default(),
            burn_version: Some(checkpoint::BURN_VERSION.to_string()),
            shards: None,
        }
    }

    /// The run's policy from `[checkpoint]` for app `app`; `None` without `checkpoint.dir`.
    pub fn for_app<A: App>(app: &A, config: &AppConfig<A>) -> Option<Self> {
        let c = &config.checkpoint;
        Some(Self {
            dir: c.dir.clone()?,
            keep_last: c.keep_last,
            timeout: Duration::from_secs(c.timeout_secs),
            model_name: app.name(&config.model),
            model_fingerprint: config.model_fingerprint(),
            config_fingerprint: config.fingerprint(),
            seed: config.training.seed,
        })
    }
}

/// The DDP handle of this rank over the formed job `dist`, as `[distributed]` says, for a
/// model trained on `device`, which decides how gradients travel (through the host, or NCCL
/// on CUDA: burn-ddp's choice). Collective when the options choose NCCL.
pub fn data_parallel(
    dist: Distributed,
    options: &DistributedConfig,
    ft: &FaultToleranceConfig,
    device: &Device,
) -> anyhow::Result<DataParallel> {
    Ok(DataParallel::new(dist, ddp_options(options, ft), device)?)
}

/// The newest usable checkpoint under `policy.dir` (damaged ones are skipped with a
/// warning), checked against the policy's model; the same on every rank or an error.
/// Collective.
pub fn latest_checkpoint(
    ddp: &mut DataParallel,
    policy: &CheckpointPolicy,
) -> anyhow::Result<Option<Checkpoint>> {
    let found = checkpoint::latest(&policy.dir)?;
    if let Some(ckpt) = &found {
        checkpoint::check_compatible(ckpt, &policy.model_name, &policy.model_fingerprint)?;
    }
    let step = found
        .as_ref()
        .map_or(-1, |c| c.manifest.position.step as i64);
    agree_on_step(ddp, step)?;
    Ok(found)
}

/// Fails on a rank whose newest checkpoint (`step`, -1: none) is not rank 0's. Collective.
pub(crate) fn agree_on_step(ddp: &mut DataParallel, step: i64) -> anyhow::Result<()> {
    let agreed = ddp.broadcast_from_rank_zero(step)?;
    if agreed != step {
        bail!(
            "rank {} found the checkpoint of step {step} but rank 0 found step {agreed} (-1: none): the checkpoint directory must be the same directory, shared by every rank",
            ddp.rank(),
        );
    }
    Ok(())
}

/// Rank 0 writes a checkpoint of `model`, `optim` and `scheduler` (a learning-rate
/// scheduler's record, or empty) at `position`, atomically, and prunes old ones; the others
/// wait for it (deadline `policy.timeout`, so a slow disk never trips the collectives'),
/// and fail if it failed. Collective.
///
/// Refuses (on every rank alike, without writing or pruning anything) a model whose
/// weights hold a NaN or an infinity: a diverged run never rotates good checkpoints out.
pub fn save_checkpoint<M: Module>(
    ddp: &mut DataParallel,
    policy: &CheckpointPolicy,
    position: TrainPosition,
    model: &M,
    optim: OptimizerState<'_>,
    scheduler: &[u8],
) -> anyhow::Result<()> {
    if !burn_ddp::ddp::buckets::finite::module_is_finite(model)? {
        return Err(policy.non_finite(position));
    }
    let manifest = policy.manifest(ddp.world_size(), position);
    let key = worker_env::checkpoint_key(position.step);
    let written = ddp.run_on_rank_zero("to write a checkpoint", &key, policy.timeout, || {
        checkpoint::save(
            &policy.dir,
            policy.keep_last,
            manifest,
            model,
            optim,
            scheduler,
        )
        .map(|dir| tracing::info!("checkpoint written: {}", dir.display()))
    })?;
    written
}

/// [`save_checkpoint`] of a training run's state: `model`, its optimizer's state (under ZeRO
/// stage 1 every rank's part, merged on rank 0) and the learning-rate schedule. Collective.
pub fn save_training_checkpoint<M: Module>(
    ddp: &mut DataParallel,
    policy: &CheckpointPolicy,
    position: TrainPosition,
    model: &M,
    optim: &ModuleOptimizer,
    schedule: &Schedule,
) -> anyhow::Result<()> {
    let scheduler = schedule.to_bytes().map_err(anyhow::Error::msg)?;
    // ZeRO stages 1 and 2: rank 0 saves every rank's optimizer state, merged (collective).
    let merged = ddp.gather_optimizer_state(optim)?;
    save_checkpoint(
        ddp,
        policy,
        position,
        model,
        merged
            .as_deref()
            .map_or(OptimizerState::Whole(optim), OptimizerState::Bytes),
        &scheduler,
    )
}
