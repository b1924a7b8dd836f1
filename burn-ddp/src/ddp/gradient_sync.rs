//! [`GradientSync`]: how this rank averages gradients once per optimizer step — through the
//! host over the job's TCP group, or on the GPU over an NCCL group formed beside it (as
//! PyTorch keeps a gloo group beside its NCCL group) — with one [`Reducer`] either way.

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Device;

use crate::ddp::buckets::comm::HostStaging;
use crate::ddp::buckets::finite::GradientCheck;
use crate::ddp::options::ddp_options::DdpOptions;
use crate::ddp::options::transport::GradientTransport;
use crate::ddp::overlap::ready_buckets::{
    GroupRecipe, Overlap, OverlapStats, Settings, StepTimeline,
};
use crate::ddp::reducer::{Reducer, ReducerStats};
use crate::ddp::zero::shard_plan::ShardPlan;
use crate::error::DdpError;
#[cfg(feature = "cuda")]
use crate::group::nccl::{NcclGroupOptions, NcclProcessGroup};
use crate::group::TcpProcessGroup;
use crate::init::Distributed;

/// The gradient path of one rank (module docs).
pub struct GradientSync {
    reducer: Reducer,
    /// The buckets of marked blocks, sent while backward runs (host path).
    overlap: Overlap,
    world_size: usize,
    /// `None`: through the host, over the job's TCP group. `Some`: on the GPU, over an NCCL
    /// group formed beside the TCP one, dropped before the job's final TCP barrier.
    #[cfg(feature = "cuda")]
    nccl: Option<Box<NcclProcessGroup>>,
}

impl GradientSync {
    /// The path `options` asks for on the training `device` (autodiff or not: NCCL needs a
    /// CUDA device of Burn's CUDA backend). For NCCL this forms the group through the
    /// job's store: collective, every rank calls it at the same point with the same options,
    /// bounded by `options.timeout`.
    ///
    /// # Errors
    /// [`DdpError::Options`] for a combination that cannot work (what
    /// [`GradientTransport::choose`] refuses: NCCL asked for with ZeRO stage 1 or 2, in a build
    /// without feature `cuda`, or off CUDA); what forming the NCCL group reports.
    pub fn new(
        options: &DdpOptions,
        dist: &Distributed,
        device: &Device,
    ) -> Result<Self, DdpError> {
        let reducer = Reducer::new(options.bucket_cap_mb, options.compression);
        let chosen = options
            .transport
            .choose(options.zero_stage, is_cuda(device), dist.env.world_size)
            .map_err(|e| DdpError::Options(e.to_string()))?;
        let use_nccl = chosen == GradientTransport::Nccl;
        // `choose` refuses NCCL in a build without feature `cuda`.
        debug_assert!(cfg!(feature = "cuda") || !use_nccl);
        // Overlap runs on the host path at ZeRO stages 0 and 2 (stage 1 reduces its flat
        // buffer after backward; NCCL sums after backward for now).
        let recipe = (dist.env.world_size > 1 && !use_nccl).then(|| GroupRecipe {
            store: dist.store.clone(),
            rank: dist.env.rank,
            world_size: dist.env.world_size,
            options: dist.group.options().clone(),
        });
        Ok(Self {
            reducer,
            overlap: Overlap::new(options.overlap, recipe),
            world_size: dist.env.world_size,
            #[cfg(feature = "cuda")]
            nccl: if use_nccl {
                Some(nccl_group(options, dist, device)?)
            } else {
                None
            },
        })
    }

    /// Whether gradients go through NCCL.
    pub fn is_nccl(&self) -> bool {
        #[cfg(feature = "cuda")]
        return self.nccl.is_some();
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Replaces every gradient with its mean over the ranks. Collective, once per optimizer
    /// step ([`Reducer::sync`]); on the host path it follows the overlap's plan
    /// ([`crate::ddp::overlap::ready_buckets`]), learning it (collective too) at the first armed step. With
    /// `owners` (ZeRO stage 2, host path only) `grads` keeps only this rank's own gradients,
    /// each the mean over the ranks.
    pub fn sync<M: Module>(
        &mut self,
        tcp: &mut TcpProcessGroup,
        model: &M,
        grads: &mut GradientsParams,
        owners: Option<&ShardPlan>,
    ) -> Result<GradientCheck, DdpError> {
        #[cfg(feature = "cuda")]
        if let Some(group) = &mut self.nccl {
            // `GradientTransport::choose` never picks NCCL at stage 2. The buckets are summed
            // without leaving the GPU.
            debug_assert!(owners.is_none());
            let buckets = &mut crate::ddp::buckets::nccl::NcclBuckets(group);
            return self.reducer.sync(buckets, model, grads);
        }
        self.overlap
            .after_backward(tcp, model, grads, self.reducer.bucket_cap())?;
        self.reducer.sync_with(
            &mut HostStaging(tcp),
            model,
            grads,
            Some(&mut self.overlap),
            owners,
        )
    }

    /// Arms the next backward for the overlap ([`crate::ddp::overlap::ready_buckets`]): `earlier`, the step's
    /// earlier micro-batches' summed gradients; `weight`, this micro-batch's factor; `owners`,
    /// at ZeRO stage 2, who keeps each gradient. Not collective; a no-op in a job of one or on
    /// NCCL.
    pub fn arm_overlap<M: Module>(
        &mut self,
        model: &M,
        earlier: Option<&GradientsParams>,
        weight: f32,
        owners: Option<&ShardPlan>,
    ) {
        let settings = Settings {
            compression: self.reducer.compression(),
            scale: 1.0 / self.world_size as f32,
            check_finite: self.reducer.checks_finite(),
        };
        self.overlap.arm(model, earlier, weight, settings, owners);
    }

    pub fn stats(&self) -> ReducerStats {
        self.reducer.stats()
    }

    pub fn overlap_enabled(&self) -> bool {
        self.overlap.is_enabled()
    }

    /// What the gradient overlap did so far.
    pub fn overlap_stats(&self) -> OverlapStats {
        self.overlap.stats()
    }

    /// The last overlapped step's buckets on this rank.
    pub fn overlap_timeline(&self) -> Option<&StepTimeline> {
        self.overlap.last_timeline()
    }
}

/// Whether `device` is a CUDA device that NCCL can reduce on (always `false` without feature
/// `cuda`).
fn is_cuda(device: &Device) -> bool {
    #[cfg(feature = "cuda")]
    return crate::ddp::buckets::nccl::cuda_ordinal(device).is_some();
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        false
    }
}

/// Forms the NCCL group for gradients on the GPU of the training `device` (a CUDA device: the
/// buckets NCCL sums live there).
#[cfg(feature = "cuda")]
fn nccl_group(
    options: &DdpOptions,
    dist: &Distributed,
    device: &Device,
) -> Result<Box<NcclProcessGroup>, DdpError> {
    let (rank, world) = (dist.env.rank, dist.env.world_size);
    let nccl_options = NcclGroupOptions {
        timeout: options.timeout,
        stall_warning: options.stall_warning,
        ..Default::default()
    };
    let device = crate::ddp::buckets::nccl::cuda_ordinal(device)
        .unwrap_or_else(|| crate::cuda::local_device(dist.env.local_rank));
    let group =
        NcclProcessGroup::with_options(dist.store.clone(), rank, world, device, nccl_options)
            .map_err(|e| {
                DdpError::Device(format!(
                    "forming the NCCL group for gradients (use the host transport, distributed.gradient_sync = \"host\", to average through the host instead): {e}"
                ))
            })?;
    tracing::info!(rank, world, device, "gradients are averaged with NCCL");
    Ok(Box::new(group))
}
