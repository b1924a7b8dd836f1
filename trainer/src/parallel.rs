//! Tier 2, "your own loop": [`DataParallel`], one handle for people who keep their own training
//! loop (what Accelerate's `Accelerator` is to PyTorch). The engine's loop (`fit`) is written
//! with this same handle.
//!
//! ```text
//! let mut ddp = DataParallel::from_env(&DistributedConfig::default(), DeviceKind::Cpu)?;
//! let mut model = ddp.prepare(model)?;                    // replicas equal (rank 0's weights)
//! for epoch in 0..epochs {
//!     for batch in ddp.shard(train.len(), seed, epoch).chunks(b) {   // this rank's samples
//!         let mut grads = GradientsParams::from_grads(loss.backward(), &model);
//!         let check = ddp.average_gradients(&model, &mut grads)?;    // the mean over all ranks
//!         if !check.all_finite() { bail!("NaN/Inf on ranks {:?}", check.nonfinite_ranks) }
//!         model = optim.step(lr, model, grads);
//!     }
//!     let [loss_sum, n] = ddp.sum([loss_sum, n])?;        // exact global metrics
//!     ddp.save_checkpoint(&policy, position, &model, &optim, &[])?;   // rank 0 writes
//! }
//! ```
//! A compiled, runnable version: `trainer/examples/own_loop.rs`.
//!
//! Every method marked *collective* must be called by every rank, in the same order, with
//! arguments that agree where it says so; each has a deadline (`distributed.timeout_secs`, or
//! the checkpoint timeout) after which it fails naming the ranks that did not arrive.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use burn::module::{AutodiffModule, ParamId};
use burn::optim::{GradientsParams, Optimizer};
use burn::record::Record;
use burn::tensor::backend::AutodiffBackend;
use burn_ddp::ddp::buffers::{self, BufferSync};
use burn_ddp::ddp::zero::{self, StateMap};
use burn_ddp::ddp::{param_checksum, prepare_module, GradientCheck, ReducerStats, ShardedSync};
use burn_ddp::sampler::DistributedSampler;
use burn_ddp::{Distributed, ProcessGroup};

use crate::backend::{self, GradientSync, TrainBackend};
use crate::checkpoint::{self, Checkpoint, Manifest, TrainPosition, FORMAT_VERSION};
use crate::config::{DeviceKind, DistributedConfig, SyncBuffers};
use crate::error::UsageError;
use crate::metrics::{global_sum, MetricValue, Metrics};
use crate::worker_env;

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

/// One rank's membership of a data-parallel job, and everything it does with the other ranks.
pub struct DataParallel {
    dist: Distributed,
    sync: GradientSync,
    /// `Some` under ZeRO stage 1 (`distributed.zero_stage = 1`).
    sharded: Option<ShardedSync>,
    /// `None` with `distributed.sync_buffers = "off"`.
    buffer_rule: Option<BufferSync>,
    /// Whether the model has buffers at all (learnt at the first sync; the same on every rank).
    has_buffers: Option<bool>,
    timeout: Duration,
}

impl DataParallel {
    /// Joins the job described by the environment (this project's launcher, torchrun, SLURM,
    /// Open MPI: `burn_ddp::env`), or forms a job of one when there is none. Collective: every
    /// rank calls it; it returns once all have joined (deadline `timeout_secs`). `B` is the
    /// backend the model trains on (whether its gradients can go through NCCL).
    pub fn from_env<B: TrainBackend>(
        options: &DistributedConfig,
        device: DeviceKind,
    ) -> anyhow::Result<Self> {
        let dist = Distributed::from_env_or_standalone(backend::tcp_options(options))?;
        Self::new::<B>(dist, options, device)
    }

    /// The handle over an already formed group.
    pub fn new<B: TrainBackend>(
        dist: Distributed,
        options: &DistributedConfig,
        device: DeviceKind,
    ) -> anyhow::Result<Self> {
        let sync = GradientSync::new::<B>(options, device, &dist)?;
        let sharded = (options.zero_stage == 1)
            .then(|| ShardedSync::new(options.gradient_compression.format()));
        let buffer_rule = match options.sync_buffers {
            SyncBuffers::Broadcast => Some(BufferSync::Broadcast { root: 0 }),
            SyncBuffers::Average => Some(BufferSync::Average),
            SyncBuffers::Off => None,
        };
        Ok(Self {
            dist,
            sync,
            sharded,
            buffer_rule,
            has_buffers: None,
            timeout: Duration::from_secs(options.timeout_secs),
        })
    }

    pub fn rank(&self) -> usize {
        self.dist.env.rank
    }

    pub fn world_size(&self) -> usize {
        self.dist.env.world_size
    }

    /// This rank's index among the ranks of its machine (the GPU it should use).
    pub fn local_rank(&self) -> usize {
        self.dist.env.local_rank
    }

    /// The process group, for collectives of your own.
    pub fn group(&mut self) -> &mut burn_ddp::TcpProcessGroup {
        &mut self.dist.group
    }

    /// Fails on every rank whose `fingerprint` (of its settings) differs from rank 0's, naming
    /// it. Collective.
    pub fn check_same(&mut self, fingerprint: &str) -> anyhow::Result<()> {
        if self.world_size() == 1 {
            return Ok(());
        }
        let rank = self.rank();
        let store = &self.dist.store;
        store.set(&worker_env::config_key(rank), fingerprint.as_bytes())?;
        let theirs = store.get(&worker_env::config_key(0), self.timeout)?;
        if theirs != fingerprint.as_bytes() {
            bail!(UsageError(format!(
                "rank {rank}'s config differs from rank 0's (fingerprint {fingerprint} vs {}): every rank must train with the same settings",
                String::from_utf8_lossy(&theirs)
            )));
        }
        Ok(())
    }

    /// Makes the replicas equal: parameter ids from the visit order (so optimizer state
    /// matches across ranks and runs) and rank 0's parameter values on every rank, as PyTorch's
    /// `DistributedDataParallel` constructor does. Collective; the model must have the same
    /// architecture everywhere.
    pub fn prepare<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        model: M,
    ) -> anyhow::Result<M> {
        Ok(prepare_module(model, &mut self.dist.group, 0)?)
    }

    /// Replaces every gradient with its mean over the ranks (through the host, or NCCL on
    /// CUDA; compressed as `gradient_compression` says). Collective, once per optimizer step,
    /// after all the micro-batches of the step.
    ///
    /// Returns which ranks' own gradients held a NaN or an infinity (the same on every rank;
    /// empty when all were finite). Where it is not empty the mean is not finite either: do
    /// not apply it (skip the step, or stop — see `training.on_nonfinite`).
    pub fn average_gradients<B: TrainBackend, M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        grads: &mut GradientsParams,
    ) -> anyhow::Result<GradientCheck> {
        Ok(self.sync.sync::<B, M>(&mut self.dist.group, model, grads)?)
    }

    /// The ZeRO stage this handle runs: 0 (every rank steps every parameter) or 1 (each
    /// rank steps, and keeps optimizer state for, the parameters it owns).
    pub fn zero_stage(&self) -> u8 {
        u8::from(self.sharded.is_some())
    }

    /// What the optimizer step needs from the other ranks, as the ZeRO stage says. Stage 0:
    /// [`average_gradients`](Self::average_gradients). Stage 1: `grads` keeps only the
    /// gradients of the parameters this rank owns, each the mean over the ranks; step the
    /// optimizer with them, then call [`finish_step`](Self::finish_step). Collective, once per
    /// optimizer step; the verdict on non-finite gradients is the same as stage 0's.
    pub fn sync_gradients<B: TrainBackend, M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        grads: &mut GradientsParams,
    ) -> anyhow::Result<GradientCheck> {
        match &mut self.sharded {
            Some(sharded) => {
                Ok(sharded.reduce_to_owners::<B, M, _>(&mut self.dist.group, model, grads)?)
            }
            None => self.average_gradients::<B, M>(model, grads),
        }
    }

    /// After the optimizer step. Stage 1: every rank sends the parameters it stepped and
    /// receives the others' (the replicas are bit-identical again). Stage 0: nothing.
    /// Collective under stage 1; call it only after a step that was taken.
    pub fn finish_step<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        model: M,
    ) -> anyhow::Result<M> {
        match &mut self.sharded {
            Some(sharded) => Ok(sharded.gather_parameters::<B, M, _>(&mut self.dist.group, model)?),
            None => Ok(model),
        }
    }

    /// Makes the model's buffers (BatchNorm running statistics, any `RunningState`, frozen
    /// parameters) equal across ranks, as `distributed.sync_buffers` says: rank 0's, or the
    /// mean. Collective (nothing is sent for a model without buffers, or with `"off"`); call
    /// it once per optimizer step, after the step, so replicas are identical at every step
    /// boundary.
    pub fn sync_buffers<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        model: M,
    ) -> anyhow::Result<M> {
        let Some(rule) = self.buffer_rule else {
            return Ok(model);
        };
        if self.world_size() == 1 {
            return Ok(model);
        }
        let has = *self
            .has_buffers
            .get_or_insert_with(|| buffers::buffer_elements::<B, M>(&model) > 0);
        if !has {
            return Ok(model);
        }
        Ok(buffers::sync_buffers::<B, M, _>(
            model,
            &mut self.dist.group,
            rule,
        )?)
    }

    /// Under stage 1, drops the optimizer state of the parameters another rank owns (after
    /// loading a checkpoint's full state); under stage 0 returns `optim` as it is. Local.
    pub fn keep_owned_state<B, M, O, R>(&mut self, model: &M, optim: O) -> O
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B, Record = StateMap<ParamId, R>>,
    {
        let (rank, world) = (self.rank(), self.world_size());
        match &mut self.sharded {
            Some(sharded) => zero::keep_owned_state(optim, sharded.plan(model, world), rank),
            None => optim,
        }
    }

    /// Under stage 1, every rank's optimizer state merged on rank 0 (`Some` there, `None`
    /// elsewhere), as a stage-0 run would hold it: what a checkpoint saves, so that it loads
    /// at any world size and stage. Under stage 0, `None`. Collective under stage 1.
    pub fn gather_optimizer_state<B, M, O, R>(
        &mut self,
        optim: &O,
        device: &B::Device,
    ) -> anyhow::Result<Option<O>>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B, Record = StateMap<ParamId, R>>,
        R: Record<B>,
    {
        if self.sharded.is_none() {
            return Ok(None);
        }
        Ok(zero::gather_state::<M, B, O, R, _>(
            optim,
            &mut self.dist.group,
            0,
            device,
        )?)
    }

    /// What gradient synchronisation did so far (synchronisations, collectives, bytes).
    pub fn gradient_stats(&self) -> ReducerStats {
        match &self.sharded {
            Some(sharded) => sharded.stats(),
            None => self.sync.stats(),
        }
    }

    /// This rank's data-set indices for `epoch`: its share of one global permutation seeded by
    /// `seed + epoch`, padded so every rank gets as many (PyTorch's `DistributedSampler`).
    /// Local; `len` and `seed` must agree across ranks.
    pub fn shard(&self, len: usize, seed: u64, epoch: usize) -> Vec<usize> {
        DistributedSampler::new(len, self.world_size(), self.rank())
            .with_seed(seed)
            .indices(epoch as u64, 0)
    }

    /// Element-wise sums over the ranks. Collective.
    pub fn sum<const N: usize>(&mut self, values: [f64; N]) -> anyhow::Result<[f64; N]> {
        Ok(global_sum(&mut self.dist.group, values)?)
    }

    /// Every rank's `values`, concatenated in rank order (`world_size × values.len()`).
    /// Collective; every rank passes the same number of values.
    pub fn all_gather(&mut self, values: &[f64]) -> anyhow::Result<Vec<f64>> {
        let mut all = vec![0.0; values.len() * self.world_size()];
        self.dist.group.all_gather(values, &mut all)?;
        Ok(all)
    }

    /// Every metric's global value (summed with its counts over the ranks), then clears them.
    /// Collective, with the same metric set everywhere.
    pub fn metrics<I>(&mut self, metrics: &mut Metrics<I>) -> anyhow::Result<Vec<MetricValue>> {
        Ok(metrics.global(&mut self.dist.group)?)
    }

    /// Fails when the replicas' parameters are not bit-identical, naming the first rank that
    /// differs from rank 0. Collective.
    pub fn check_replicas<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        model: &M,
        step: usize,
    ) -> anyhow::Result<()> {
        let ours = param_checksum::<B, M>(model) as i64;
        let mut all = vec![0i64; self.world_size()];
        self.dist.group.all_gather(&[ours], &mut all)?;
        if let Some(r) = all.iter().position(|&c| c != all[0]) {
            bail!(
                "replica drift at step {step}: rank {r}'s parameters (checksum {:016x}) differ from rank 0's ({:016x})",
                all[r] as u64,
                all[0] as u64
            );
        }
        Ok(())
    }

    /// The newest usable checkpoint under `policy.dir` (damaged ones are skipped with a
    /// warning), checked against the policy's model; the same on every rank or an error.
    /// Collective.
    pub fn latest_checkpoint(
        &mut self,
        policy: &CheckpointPolicy,
    ) -> anyhow::Result<Option<Checkpoint>> {
        let found = checkpoint::latest(&policy.dir);
        if let Some(ckpt) = &found {
            checkpoint::check_compatible(ckpt, &policy.model_name, &policy.model_fingerprint)?;
        }
        let step = found
            .as_ref()
            .map_or(-1, |c| c.manifest.position.step as i64);
        let mut agreed = [step];
        self.dist.group.broadcast(&mut agreed, 0)?;
        if agreed[0] != step {
            bail!(
                "rank {} found the checkpoint of step {step} but rank 0 found step {} (-1: none): the checkpoint directory must be the same directory, shared by every rank",
                self.rank(),
                agreed[0]
            );
        }
        Ok(found)
    }

    /// Rank 0 writes a checkpoint of `model`, `optim` and `scheduler` (a learning-rate
    /// scheduler's record, or empty) at `position`, atomically, and prunes old ones; the others
    /// wait for it (deadline `policy.timeout`, so a slow disk never trips the collectives'),
    /// and fail if it failed. Collective.
    ///
    /// Refuses (on every rank alike, without writing or pruning anything) a model whose
    /// weights hold a NaN or an infinity: a diverged run never rotates good checkpoints out.
    pub fn save_checkpoint<B, M, O>(
        &mut self,
        policy: &CheckpointPolicy,
        position: TrainPosition,
        model: &M,
        optim: &O,
        scheduler: &[u8],
    ) -> anyhow::Result<()>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        if !burn_ddp::ddp::finite::module_is_finite::<B, M>(model)? {
            bail!(
                "refusing to write a checkpoint of non-finite weights (NaN or Inf) at optimizer step {}: the checkpoints already in {} are kept",
                position.step,
                policy.dir.display()
            );
        }
        let key = worker_env::checkpoint_key(position.step);
        if self.rank() == 0 {
            let manifest = Manifest {
                format_version: FORMAT_VERSION,
                model: policy.model_name.clone(),
                model_fingerprint: policy.model_fingerprint.clone(),
                config_fingerprint: policy.config_fingerprint.clone(),
                seed: policy.seed,
                world_size: self.world_size(),
                position,
                checksums: Default::default(),
            };
            let result = checkpoint::save::<B, M, O>(
                &policy.dir,
                policy.keep_last,
                manifest,
                model,
                optim,
                scheduler,
            );
            let status = match &result {
                Ok(dir) => {
                    tracing::info!("checkpoint written: {}", dir.display());
                    "ok".to_string()
                }
                Err(e) => format!("{e:#}"),
            };
            if self.world_size() > 1 {
                self.dist.store.set(&key, status.as_bytes())?;
            }
            result.map(|_| ())
        } else {
            let status = self
                .dist
                .store
                .get(&key, policy.timeout)
                .context("waiting for rank 0 to write a checkpoint")?;
            if status != b"ok" {
                bail!(
                    "rank 0 failed to write the checkpoint: {}",
                    String::from_utf8_lossy(&status)
                );
            }
            Ok(())
        }
    }

    /// Waits for every rank. Call it last: rank 0 may host the rendezvous store, so ranks
    /// leave together. Collective.
    pub fn barrier(&mut self) -> anyhow::Result<()> {
        Ok(self.dist.group.barrier()?)
    }
}
