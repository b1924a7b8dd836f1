//! [`GradientSync`]: how this rank averages gradients once per optimizer step — through the
//! host over the job's TCP group, or on the GPU over an NCCL group formed beside it (as
//! PyTorch keeps a gloo group beside its NCCL group) — with one [`Reducer`] either way.

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::Device;

use super::comm::HostStaging;
use super::finite::GradientCheck;
use super::options::DdpOptions;
use super::reducer::{Reducer, ReducerStats};
use super::transport::GradientTransport;
use crate::error::DdpError;
#[cfg(feature = "cuda")]
use crate::group::nccl::{NcclGroupOptions, NcclProcessGroup};
use crate::group::TcpProcessGroup;
use crate::init::Distributed;

/// The gradient path of one rank (module docs).
pub struct GradientSync {
    reducer: Reducer,
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
    /// [`GradientTransport::choose`] refuses: NCCL asked for with ZeRO stage 1, in a build
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
        Ok(Self {
            reducer,
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
    /// step ([`Reducer::sync`]).
    pub fn sync<M: Module>(
        &mut self,
        tcp: &mut TcpProcessGroup,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<GradientCheck, DdpError> {
        #[cfg(feature = "cuda")]
        if let Some(group) = &mut self.nccl {
            return super::device::sync_with_nccl(&mut self.reducer, group, model, grads);
        }
        self.reducer.sync(&mut HostStaging(tcp), model, grads)
    }

    pub fn stats(&self) -> ReducerStats {
        self.reducer.stats()
    }
}

/// Whether `device` is a CUDA device that NCCL can reduce on (always `false` without feature
/// `cuda`).
fn is_cuda(device: &Device) -> bool {
    #[cfg(feature = "cuda")]
    return super::device::cuda_ordinal(device).is_some();
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
    let device = super::device::cuda_ordinal(device)
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
