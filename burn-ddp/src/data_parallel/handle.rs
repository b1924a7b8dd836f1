//! [`DataParallel`]: the handle, joining, preparing and the DDP step (the module docs of
//! [`crate::data_parallel`] show the loop).

use std::marker::PhantomData;
use std::time::Duration;

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Bytes, Device, GradientCheckpointingStrategy};

use crate::data_parallel::outcome::StepOutcome;
use crate::ddp::buffers::{self, BufferSync};
use crate::ddp::fsdp::shard_gather::ShardComm;
use crate::ddp::fsdp::sharded_module::{ShardLayout, ShardedForward};
use crate::ddp::micro_batch::{MicroBatch, MicroBatchScope};
use crate::ddp::options::groups::ProcessGroupRole;
use crate::ddp::options::zero_stage::ZeroStage;
use crate::ddp::sharding::Sharding;
use crate::ddp::sync_batch_norm::sync_group::{self, SyncGroupGuard};
use crate::ddp::zero::sharded_sync;
use crate::ddp::{
    prepare_module, DdpOptions, GradientCheck, GradientSync, OverlapStats, ReducerStats,
    StepTimeline,
};
use crate::elastic::JoinWatch;
use crate::error::DdpError;
use crate::group::TcpProcessGroup;
use crate::init::Distributed;
use crate::kernels::host_memory;

/// One rank's membership of a data-parallel job, and the DDP step it takes with the others.
pub struct DataParallel {
    pub(super) dist: Distributed,
    pub(super) sync: GradientSync,
    /// How this rank holds the model: the ZeRO stage, with its state. Every stage-dependent
    /// part of the step is a method of it: the handle never matches on the stage.
    pub(super) sharding: Sharding,
    /// Whether gradients are checked for NaN / ±Inf (always, today).
    check_finite: bool,
    /// Bytes of the gradients the last step's optimizer was given (this rank's own at stages 1
    /// and 2).
    gradient_bytes: u64,
    /// Bytes of the model's parameters at the last step (shards at stage 3).
    parameter_bytes: u64,
    /// `None`: each rank keeps its own buffers.
    buffer_rule: Option<BufferSync>,
    /// Whether the model has buffers at all (learnt at the first sync; the same on every rank).
    has_buffers: Option<bool>,
    pub(super) timeout: Duration,
    /// The group of [`SyncBatchNorm`](crate::ddp::SyncBatchNorm)'s statistics, installed
    /// process-wide while this handle lives (none in a world of one); it also tells this
    /// build's layers that a `DataParallel` of their build is alive.
    pub(super) _sync_batch_norm: SyncGroupGuard,
    /// What the handle was made with, to form its groups again ([`Self::regroup`]).
    pub(super) options: DdpOptions,
    pub(super) device: Device,
    /// What this member knows of processes joining the job ([`Self::joiners_due`]).
    pub(super) joins: JoinWatch,
    /// This rank's settings fingerprint, once [`Self::check_same`] has checked it: a joiner
    /// with another is refused.
    pub(super) fingerprint: Option<String>,
}

impl DataParallel {
    /// Joins the job the environment describes (this project's launcher, torchrun, Slurm,
    /// Open MPI variables: [`crate::env`]), or forms a job of one without them. Collective:
    /// every rank calls it with the same options; it returns once all have joined (deadline
    /// `options.timeout`). `device` is the device the model trains on, autodiff or not
    /// (whether its gradients can go through NCCL).
    ///
    /// # Errors
    /// What joining reports ([`DdpError::Init`] for a bad environment), and
    /// [`DdpError::Options`] for options that cannot work here.
    pub fn from_env(options: DdpOptions, device: &Device) -> Result<Self, DdpError> {
        let dist = Distributed::from_env_or_standalone(options.tcp_options())?;
        Self::new(dist, options, device)
    }

    /// The handle over an already formed job. Collective when the options choose NCCL (the
    /// group is formed through the job's store, within `options.timeout`). In a world of more
    /// than one rank it also installs, process-wide while the handle lives, what synchronised
    /// BatchNorm needs to form its own group at its first use (see [`crate::ddp::sync_batch_norm::sync_group`]).
    /// `device`: the training device, as for [`from_env`](Self::from_env).
    pub fn new(dist: Distributed, options: DdpOptions, device: &Device) -> Result<Self, DdpError> {
        let (sync, sharding, sync_batch_norm) = Self::form_parts(&dist, &options, device)?;
        let joins = JoinWatch::new(dist.joins_handled);
        let fingerprint = dist.fingerprint.clone();
        let checkpointing = device.gradient_checkpointing_strategy();
        if needs_checkpointing(options.zero_stage, device)
            && checkpointing != Some(GradientCheckpointingStrategy::Balanced)
        {
            tracing::warn!(
                "ZeRO stage 3 on a device backend without Burn's gradient checkpointing: the weights Burn reshapes stay gathered until backward; train on DataParallel::training_device(&options, device)"
            );
        }
        Ok(Self {
            dist,
            sync,
            sharding,
            check_finite: true,
            gradient_bytes: 0,
            parameter_bytes: 0,
            buffer_rule: options.buffers,
            has_buffers: None,
            timeout: options.timeout,
            _sync_batch_norm: sync_batch_norm,
            options,
            device: device.clone(),
            joins,
            fingerprint,
        })
    }

    /// What the handle forms over `dist`'s group: the gradient path, the sharding of its ZeRO
    /// stage, and synchronised BatchNorm's recipe (installed process-wide). Collective as
    /// [`new`](Self::new) is.
    pub(super) fn form_parts(
        dist: &Distributed,
        options: &DdpOptions,
        device: &Device,
    ) -> Result<(GradientSync, Sharding, SyncGroupGuard), DdpError> {
        let sync = GradientSync::new(options, dist, device)?;
        let sharding = Sharding::form(options.zero_stage, options.compression, dist)?;
        let sync_batch_norm = if dist.env.world_size > 1 {
            let role_options = ProcessGroupRole::SyncBatchNorm.options(dist.group.options());
            sync_group::install(sync_group::Recipe {
                store: dist.store.clone(),
                rank: dist.env.rank,
                world_size: dist.env.world_size,
                options: role_options,
            })
        } else {
            sync_group::install_none()
        };
        Ok((sync, sharding, sync_batch_norm))
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

    /// The job's TCP process group, for collectives of your own.
    pub fn group(&mut self) -> &mut TcpProcessGroup {
        &mut self.dist.group
    }

    /// Whether gradients go through NCCL (else through the host).
    pub fn uses_nccl(&self) -> bool {
        self.sync.is_nccl()
    }

    /// Fails on every rank whose `fingerprint` (of its settings) differs from rank 0's, naming
    /// it ([`DdpError::Mismatch`]). Collective.
    pub fn check_same(&mut self, fingerprint: &str) -> Result<(), DdpError> {
        self.dist.check_same(fingerprint, self.timeout)?;
        self.fingerprint = Some(fingerprint.to_owned());
        Ok(())
    }

    /// Makes the replicas equal: parameter ids from the visit order (so optimizer state
    /// matches across ranks and runs) and rank 0's parameter values on every rank, as PyTorch's
    /// `DistributedDataParallel` constructor does. Collective; the model must have the same
    /// architecture everywhere.
    pub fn prepare<M: Module>(&mut self, model: M) -> Result<M, DdpError> {
        prepare_module(model, &mut self.dist.group, 0)
    }

    /// ZeRO stage 3 (FSDP's `fully_shard`): runs `forward` (one forward of the model, e.g. on
    /// one sample; its result is dropped) to learn which blocks the model marks with
    /// [`mark_block`](crate::mark_block), then returns the model with those blocks'
    /// parameters cut into flat shards, this rank's kept. Call it after
    /// [`prepare`](Self::prepare), before the first step; then run every training forward
    /// and its backward under [`micro_batch`](Self::micro_batch)'s scope. At stages
    /// 0 to 2 it returns `model` as it is, without running `forward`, so a loop written for
    /// stage 3 runs at every stage.
    ///
    /// Not collective (every rank cuts its equal replica the same way), but every rank must
    /// call it, with the same model. On Burn's CPU backend the blocks gathered ahead are the
    /// tensors' storage: each block's memory is given back once the forward enters the next
    /// block and gathered again when its backward reads it, whatever keeps the tensors
    /// (`ddp::fsdp::block_storage`), so no recompute is needed. On a device backend the gathered
    /// values are copied to the device: a parameter that an op takes as it is (a matmul) is
    /// still dropped after the forward and gathered again for the backward, but one that Burn
    /// reshapes first (its linear on a batched input) is dropped only on a device with Burn's
    /// gradient checkpointing: train on [`training_device`](Self::training_device), which
    /// turns it on where stage 3 needs it (without it such weights live until backward, as
    /// activations do).
    ///
    /// # Errors
    /// [`DdpError::Options`] when `forward` marks no block; [`DdpError::Unsupported`] when a
    /// parameter cannot be read as `f32`.
    pub fn fully_shard<M: Module>(
        &mut self,
        model: M,
        forward: impl FnOnce(&M),
    ) -> Result<M, DdpError> {
        self.sharding.shard(model, forward)
    }

    /// Under ZeRO stage 3, once [`fully_shard`](Self::fully_shard) has run: the guard under
    /// which [`mark_block`](crate::mark_block) takes each marked block of `model` whole for
    /// the forward (all-gathered ahead, block by block, on a thread of their own). `None` at
    /// other stages. Collective (it queues this forward's gathers on every rank). Part of
    /// [`micro_batch`](Self::micro_batch), the one place that orders what runs before a
    /// backward.
    fn sharded_forward<M: Module>(&self, model: &M) -> Option<ShardedForward> {
        self.sharding.forward(model)
    }

    /// Under ZeRO stage 3, a copy of `model` with every shard gathered whole (for a
    /// validation that each rank runs on its own number of batches, or to save the whole
    /// model); at other stages a clone. Collective at stage 3. Works on an autodiff model or
    /// on its [`valid`](burn::module::AutodiffModule::valid) copy.
    ///
    /// # Errors
    /// A failed gather.
    pub fn gathered<M: Module>(&mut self, model: &M) -> Result<M, DdpError> {
        self.sharding.gathered(model)
    }

    /// The stage-3 group's counters (gathers, reduce-scatters, blocks gathered ahead, bytes);
    /// `None` at other stages.
    pub fn shard_comm(&self) -> Option<&ShardComm> {
        self.sharding.comm()
    }

    /// The full shapes of the parameters sharded at stage 3 (`None` before
    /// [`fully_shard`](Self::fully_shard), and at other stages).
    pub fn shard_layout(&self) -> Option<&ShardLayout> {
        self.sharding.layout()
    }

    /// Everything the DDP step needs set up before one micro-batch's forward and backward, in
    /// the one order that works, so a training loop never orders it (as PyTorch's DDP
    /// `forward` does it for you):
    /// 1. for the step's last micro-batch ([`MicroBatch::Last`]; [`MicroBatch::ONLY`] without
    ///    accumulation), the gradient overlap is armed: the blocks the model marks with
    ///    [`mark_block`](crate::mark_block) hand their gradients over as soon as backward has
    ///    passed them (combined with the earlier micro-batches' as `earlier` and `weight` say;
    ///    at ZeRO stage 2 each bucket reduce-scattered to its owners), and
    ///    [`step`](Self::step) waits only for what is still on the wire. The earlier
    ///    micro-batches ([`MicroBatch::Accumulating`]) send nothing (PyTorch's `no_sync`);
    /// 2. at ZeRO stage 3, the marked blocks are gathered ahead for the forward (and again
    ///    for the backward where they were given back).
    ///
    /// Hold the returned scope over the micro-batch's forward and backward; drop it after the
    /// backward (before validation: see [`gathered`](Self::gathered)). After the step's last
    /// micro-batch, call [`step`](Self::step): the one place that orders what runs after.
    ///
    /// Collective at ZeRO stage 3 (every rank marking the same blocks in the same order: the
    /// same model, the same number of micro-batches); otherwise local and never blocking.
    /// Without overlap (a job of one, NCCL, ZeRO stages 1 and 3, a model that marks nothing,
    /// or overlap off) `step` sums every bucket after backward, in the same plan: the same
    /// bits.
    pub fn micro_batch<M: Module>(
        &mut self,
        model: &M,
        position: MicroBatch<'_>,
    ) -> MicroBatchScope<'_> {
        if let MicroBatch::Last { earlier, weight } = position {
            self.overlap_next_backward(model, earlier, weight);
        }
        MicroBatchScope {
            _gather: self.sharded_forward(model),
            handle: PhantomData,
        }
    }

    /// The device to train on under `options`: `device` itself, except at ZeRO stage 3 on a
    /// device backend (not Burn's CPU backend), where Burn's gradient checkpointing is turned
    /// on. There the gathered weights are copied into the device's memory, which burn-ddp
    /// cannot give back after the forward: checkpointing makes Burn gather them again in
    /// backward instead of keeping them. On the CPU the gathered values are the tensors'
    /// storage, given back and gathered again by the block itself, so no activation is
    /// recomputed. Always an autodiff device. Pure; call it before building the model and
    /// [`new`](Self::new) (which warns when stage 3 trains on a device backend without it).
    pub fn training_device(options: &DdpOptions, device: Device) -> Device {
        let device = device.autodiff();
        if needs_checkpointing(options.zero_stage, &device) {
            device.gradient_checkpointing()
        } else {
            device
        }
    }

    /// Arms the next backward for the gradient overlap (step 1 of
    /// [`micro_batch`](Self::micro_batch)): `earlier`, the sum of the step's earlier
    /// micro-batches' gradients; `weight`, this micro-batch's factor. Not collective; a no-op
    /// where overlap cannot run.
    fn overlap_next_backward<M: Module>(
        &mut self,
        model: &M,
        earlier: Option<&GradientsParams>,
        weight: f32,
    ) {
        let world = self.world_size();
        self.sharding
            .arm_overlap(&mut self.sync, model, earlier, weight, world);
    }

    /// What the gradient overlap did so far (zeros where it never ran).
    pub fn overlap_stats(&self) -> OverlapStats {
        self.sync.overlap_stats()
    }

    /// When each bucket of the last step summed on the communication thread was queued,
    /// taken up and done on this rank, after that step's forward began (`None` before any,
    /// with overlap off, or where blocks are not marked). Local: not collective.
    pub fn overlap_timeline(&self) -> Option<&StepTimeline> {
        self.sync.overlap_timeline()
    }

    /// Whether gradient overlap is on ([`DdpOptions::overlap`]).
    pub fn overlap_enabled(&self) -> bool {
        self.sync.overlap_enabled()
    }

    /// The DDP step, once per optimizer step, after the backward passes of all the step's
    /// micro-batches (`grads`: this rank's, accumulated): in this order, every gradient
    /// replaced with its mean over the ranks (under ZeRO stages 1 and 2 only this rank's
    /// parameters keep theirs); the verdict on non-finite gradients, agreed by all ranks; when
    /// finite, `optimize(model, grads)` (your optimizer: `|m, g| optim.step(lr, m, g)`) and,
    /// under stages 1 and 2, every rank's stepped parameters sent to the others; then the buffers
    /// (BatchNorm statistics) made equal as the options say. Returns the model, ready for the
    /// next step, and what was done ([`StepOutcome`]). You never order these parts yourself,
    /// as with PyTorch's DDP.
    ///
    /// Collective: every rank calls it for every optimizer step, with a model of the same
    /// architecture. Each exchange has the options' deadline, after which it fails naming the
    /// ranks that did not arrive.
    ///
    /// # Errors
    /// A collective's failure; [`DdpError::SyncBatchNorm`] when synchronised BatchNorm failed
    /// in this step's forward or backward (reported here, before any gradient is sent).
    pub fn step<M: Module>(
        &mut self,
        model: M,
        grads: GradientsParams,
        optimize: impl FnOnce(M, GradientsParams) -> M,
    ) -> Result<(M, StepOutcome), DdpError> {
        self.step_with_verdict(model, grads, |check| Ok(check.nonfinite_ranks), optimize)
    }

    /// [`step`](Self::step) with the verdict widened by `verdict`: given this group's
    /// [`GradientCheck`], it returns the ranks (of whatever numbering the caller reports) whose
    /// gradients were not finite, the same on every rank of this group, e.g. agreed over a
    /// larger job (a pipeline's stages: no stage may step while another skips). The one home
    /// of the step's order; collective as `step`, and as `verdict` is.
    pub(crate) fn step_with_verdict<M: Module>(
        &mut self,
        model: M,
        mut grads: GradientsParams,
        verdict: impl FnOnce(GradientCheck) -> Result<Vec<usize>, DdpError>,
        optimize: impl FnOnce(M, GradientsParams) -> M,
    ) -> Result<(M, StepOutcome), DdpError> {
        let check = self.sync_gradients(&model, &mut grads)?;
        self.gradient_bytes = sharded_sync::gradient_bytes(&model, &grads);
        self.parameter_bytes = sharded_sync::parameter_bytes(&model);
        let nonfinite = verdict(check)?;
        let (model, outcome) = if nonfinite.is_empty() {
            let model = optimize(model, grads);
            (self.finish_step(model)?, StepOutcome::Applied)
        } else {
            (model, StepOutcome::Skipped { ranks: nonfinite })
        };
        // Every rank's forward passes updated its own buffers, whether it stepped or not.
        Ok((self.sync_buffers(model)?, outcome))
    }

    /// Replaces every gradient with its mean over the ranks (through the host, or NCCL;
    /// compressed as the options say), whatever the ZeRO stage. Collective, once per optimizer
    /// step, after all the micro-batches of the step.
    ///
    /// Returns which ranks' own gradients held a NaN or an infinity (the same on every rank;
    /// empty when all were finite). Where it is not empty the mean is not finite either: do
    /// not apply it (skip the step, or stop).
    ///
    /// # Errors
    /// A collective's failure; [`DdpError::SyncBatchNorm`] when synchronised BatchNorm failed
    /// in this step's forward or backward (those cannot return errors, so it is reported here,
    /// before any gradient is sent).
    ///
    /// The step reaches the same function through its sharding ([`Sharding::sync_gradients`]);
    /// this handle's own entry is for the tests.
    #[cfg(test)]
    pub(crate) fn average_gradients<M: Module>(
        &mut self,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<GradientCheck, DdpError> {
        crate::ddp::sharding::average_gradients(&mut self.sync, &mut self.dist.group, model, grads)
    }

    /// The ZeRO stage this handle runs: `Off` (every rank steps every parameter),
    /// `OptimizerState` (each rank steps, and keeps optimizer state for, the parameters it
    /// owns), `Gradients` (and keeps only their gradients) or `Parameters` (and only a shard
    /// of the marked blocks' weights).
    pub fn zero_stage(&self) -> ZeroStage {
        self.sharding.stage()
    }

    /// Bytes of the gradients the last [`step`](Self::step) gave the optimizer: every
    /// parameter's at stage 0, this rank's own at stages 1 and 2 (what a rank keeps of the
    /// gradient for its step; stage 1 held the whole of it until its exchange after
    /// backward, stage 2 drops each bucket's other gradients as it is sent). Local.
    pub fn gradient_bytes(&self) -> u64 {
        self.gradient_bytes
    }

    /// Bytes of the parameters this rank held at the last [`step`](Self::step): the whole
    /// model's at stages 0 to 2, the shards and the parameters outside marked blocks at
    /// stage 3. Local.
    pub fn parameter_bytes(&self) -> u64 {
        self.parameter_bytes
    }

    /// At ZeRO stage 3, the most bytes of whole (gathered) parameters this rank held at once
    /// during a training forward and backward so far: the blocks in use, gathered ahead and
    /// gathered again for a backward, which [`parameter_bytes`](Self::parameter_bytes) (the
    /// shards) leaves out. Measured on Burn's CPU backend (a device backend copies the values
    /// and they go at once); 0 at other stages. Local.
    pub fn gathered_peak_bytes(&self) -> u64 {
        self.shard_comm()
            .map_or(0, |comm| comm.gathered_bytes().training_peak())
    }

    /// What the optimizer step needs from the other ranks, as the ZeRO stage says
    /// ([`Sharding::sync_gradients`]). Stage 0: every gradient replaced with its mean
    /// ([`average_gradients`](crate::ddp::sharding::average_gradients)). Stages 1 and 2:
    /// `grads` keeps only the gradients of the parameters this rank owns, each the mean over
    /// the ranks (stage 1: one reduce-scatter of the whole gradient after backward; stage 2:
    /// one per bucket, in the gradient path's bucket plan, during backward for marked blocks);
    /// step the optimizer with them, then call [`finish_step`](Self::finish_step). Stage 3:
    /// the shards' gradients (reduce-scattered by the backward) and the whole parameters'
    /// (averaged as at stage 0) under one verdict. Collective, once per optimizer step; the
    /// verdict on non-finite gradients is the same as stage 0's. Errors as
    /// [`average_gradients`](crate::ddp::sharding::average_gradients).
    pub(crate) fn sync_gradients<M: Module>(
        &mut self,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<GradientCheck, DdpError> {
        self.sharding.sync_gradients(
            &mut self.sync,
            &mut self.dist.group,
            model,
            grads,
            self.check_finite,
        )
    }

    /// After the optimizer step. Stages 1 and 2: every rank sends the parameters it stepped
    /// and receives the others' (the replicas are bit-identical again). Stage 0: nothing.
    /// Collective under stages 1 and 2; call it only after a step that was taken.
    pub(crate) fn finish_step<M: Module>(&mut self, model: M) -> Result<M, DdpError> {
        self.sharding.finish_step(&mut self.dist.group, model)
    }

    /// Makes the model's buffers (BatchNorm running statistics, any `RunningState`, frozen
    /// parameters) equal across ranks, as the options' buffer rule says: rank 0's, or the
    /// mean. Collective (nothing is sent for a model without buffers, or without a rule);
    /// call it once per optimizer step, after the step, so replicas are identical at every
    /// step boundary.
    pub(crate) fn sync_buffers<M: Module>(&mut self, model: M) -> Result<M, DdpError> {
        let Some(rule) = self.buffer_rule else {
            return Ok(model);
        };
        if self.world_size() == 1 {
            return Ok(model);
        }
        let has = *self
            .has_buffers
            .get_or_insert_with(|| buffers::buffer_elements(&model) > 0);
        if !has {
            return Ok(model);
        }
        buffers::sync_buffers(model, &mut self.dist.group, rule)
    }

    /// Under stages 1 and 2, drops the optimizer state of the parameters another rank owns
    /// (after loading a checkpoint's full state); under stage 0 returns `optim` as it is.
    /// Local.
    ///
    /// # Errors
    /// [`DdpError::State`] when the state cannot be split (stages 1 and 2 only).
    pub fn keep_owned_state<M: Module>(
        &mut self,
        model: &M,
        optim: ModuleOptimizer,
    ) -> Result<ModuleOptimizer, DdpError> {
        let (rank, world) = (self.rank(), self.world_size());
        self.sharding.keep_owned_state(model, optim, rank, world)
    }

    /// Under stages 1 and 2, every rank's optimizer state merged on rank 0 as burnpack bytes
    /// (`Some` there, `None` elsewhere): the state a stage-0 run would hold, the bytes
    /// [`ModuleOptimizer::into_bytes`] gives for it, what a checkpoint saves so that it loads
    /// at any world size and stage ([`ModuleOptimizer::from_bytes`]). Under stage 0, `None`
    /// (save `optim.into_bytes()`). Collective under stages 1 and 2.
    ///
    /// # Errors
    /// What the group reports, and [`DdpError::State`] when a rank's state cannot be
    /// serialised or read.
    pub fn gather_optimizer_state(
        &mut self,
        optim: &ModuleOptimizer,
    ) -> Result<Option<Bytes>, DdpError> {
        self.sharding
            .gather_optimizer_state(&mut self.dist.group, optim)
    }

    /// What gradient synchronisation did so far (synchronisations, collectives, bytes; at
    /// stages 1 and 2 the parameters' all-gathers included, at stage 3 the shards' gathers and
    /// reduce-scatters).
    pub fn gradient_stats(&self) -> ReducerStats {
        self.sharding.gradient_stats(self.sync.stats())
    }
}

/// Whether training at `stage` on `device` needs Burn's gradient checkpointing: ZeRO stage 3 on
/// a device backend, where the gathered weights are copies in the device's memory that
/// burn-ddp cannot give back after the forward (the one home of the rule:
/// [`DataParallel::training_device`] applies it, [`DataParallel::new`] warns without it).
fn needs_checkpointing(stage: ZeroStage, device: &Device) -> bool {
    stage.shards_parameters() && !host_memory(device.as_dispatch())
}
