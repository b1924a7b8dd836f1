//! Every backend and cargo feature of the engine, in one place: which Burn backend each
//! `output.device` runs, whether this build and machine can run it, and how gradients are
//! averaged on it (through the host, or NCCL on CUDA). The training loop has no `cfg`.

use std::time::Duration;

#[cfg(feature = "cuda")]
use anyhow::Context;
use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
#[cfg(feature = "cuda")]
use burn_ddp::ddp::NcclBackend;
use burn_ddp::ddp::{GradientCheck, HostStaging, Reducer, ReducerStats};
#[cfg(feature = "cuda")]
use burn_ddp::group::nccl::{NcclGroupOptions, NcclProcessGroup};
use burn_ddp::kernels::BucketOps;
use burn_ddp::{DdpError, Distributed, TcpProcessGroup};

use crate::app::Learn;
use crate::config::{DeviceKind, DistributedConfig, GradientSyncMode};
use crate::error::UsageError;

/// The CPU backend: Burn's pure-Rust `Flex` under autodiff.
pub type CpuBackend = Autodiff<Flex>;

/// What the training loop needs of a backend beyond autodiff: the bucket kernels (or their
/// fallback) on its inner backend, and whether its gradients can be summed by NCCL. Every
/// backend can average through the host; only CUDA overrides `sync_with_nccl` (feature `cuda`).
pub trait TrainBackend: AutodiffBackend<InnerBackend: BucketOps> {
    /// Whether [`sync_with_nccl`](TrainBackend::sync_with_nccl) works: `false` except for
    /// Burn's plain CUDA backend. Where NCCL was asked for and this is `false` (Burn's fusion
    /// backend), gradients go through the host instead, with a log line saying so.
    const NCCL: bool = false;

    /// Averages `grads` over `group` without leaving the GPU (`NcclBuckets`).
    /// [`GradientSync::new`] picks NCCL only for `output.device = "cuda"`, which runs the CUDA
    /// backend, so this default is never reached; if it were, it fails instead of guessing.
    #[cfg(feature = "cuda")]
    fn sync_with_nccl<M: AutodiffModule<Self>>(
        reducer: &mut Reducer,
        group: &mut NcclProcessGroup,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<GradientCheck, DdpError> {
        let _ = (reducer, group, model, grads);
        Err(DdpError::Unsupported(
            "distributed.gradient_sync = \"nccl\" needs the CUDA backend".into(),
        ))
    }
}

impl TrainBackend for CpuBackend {}

#[cfg(feature = "wgpu")]
impl TrainBackend for Autodiff<burn::backend::Wgpu> {}

/// Whichever type `burn::backend::Cuda` is in this build (plain, or fused with Burn's default
/// features): [`NcclBackend`] says whether its buckets can go to NCCL.
#[cfg(feature = "cuda")]
impl TrainBackend for Autodiff<burn::backend::Cuda> {
    const NCCL: bool = <burn::backend::Cuda as NcclBackend>::NCCL;

    fn sync_with_nccl<M: AutodiffModule<Self>>(
        reducer: &mut Reducer,
        group: &mut NcclProcessGroup,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<GradientCheck, DdpError> {
        <burn::backend::Cuda as NcclBackend>::sync_nccl::<Self, M>(reducer, group, model, grads)
    }
}

/// An app that can train on every backend of this build. Implement [`Learn<B>`] for every
/// `B: AutodiffBackend` and this holds.
pub trait LearnAnywhere: Learn<CpuBackend> + LearnOnWgpu + LearnOnCuda {}
impl<A: Learn<CpuBackend> + LearnOnWgpu + LearnOnCuda> LearnAnywhere for A {}

/// [`Learn`] on the wgpu backend, in builds with `--features wgpu`.
#[cfg(feature = "wgpu")]
pub trait LearnOnWgpu: Learn<Autodiff<burn::backend::Wgpu>> {}
#[cfg(feature = "wgpu")]
impl<A: Learn<Autodiff<burn::backend::Wgpu>>> LearnOnWgpu for A {}
/// Nothing to require in builds without `wgpu`.
#[cfg(not(feature = "wgpu"))]
pub trait LearnOnWgpu {}
#[cfg(not(feature = "wgpu"))]
impl<A> LearnOnWgpu for A {}

/// [`Learn`] on the CUDA backend, in builds with `--features cuda`.
#[cfg(feature = "cuda")]
pub trait LearnOnCuda: Learn<Autodiff<burn::backend::Cuda>> {}
#[cfg(feature = "cuda")]
impl<A: Learn<Autodiff<burn::backend::Cuda>>> LearnOnCuda for A {}
/// Nothing to require in builds without `cuda`.
#[cfg(not(feature = "cuda"))]
pub trait LearnOnCuda {}
#[cfg(not(feature = "cuda"))]
impl<A> LearnOnCuda for A {}

/// Work to do on the backend of `output.device`, with app `A` ([`with_backend`]).
pub trait OnBackend<A> {
    type Output;
    fn run<B: TrainBackend>(self, device: B::Device) -> Self::Output
    where
        A: Learn<B>;
}

/// Runs `task` on the backend of `device`, on the GPU of this rank's `local_rank`.
pub fn with_backend<A: LearnAnywhere, T: OnBackend<A, Output = anyhow::Result<R>>, R>(
    device: DeviceKind,
    local_rank: usize,
    task: T,
) -> anyhow::Result<R> {
    let _ = local_rank;
    match device {
        DeviceKind::Cpu => task.run::<CpuBackend>(Default::default()),
        // One adapter per rank when the machine has several; else everyone shares the default.
        #[cfg(feature = "wgpu")]
        DeviceKind::Wgpu => task
            .run::<Autodiff<burn::backend::Wgpu>>(burn::backend::wgpu::WgpuDevice::DefaultDevice),
        // The local rank is the device ordinal (as with torchrun), unless the launcher gave
        // each process one GPU through CUDA_VISIBLE_DEVICES (then it is 0): see
        // `burn_ddp::cuda::local_device`. The NCCL group uses the same ordinal.
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => task.run::<Autodiff<burn::backend::Cuda>>(
            burn::backend::cuda::CudaDevice::new(burn_ddp::cuda::local_device(local_rank)),
        ),
        #[allow(unreachable_patterns)]
        other => Err(device_available(other, local_rank)
            .err()
            .unwrap_or_else(|| anyhow::anyhow!("device {other:?} is not available"))),
    }
}

/// Whether this build can train on `device`, and (for CUDA) whether this machine can: a missing
/// driver or GPU is a clear usage error before any rank starts, never a panic inside CUDA.
pub fn device_available(device: DeviceKind, local_rank: usize) -> anyhow::Result<()> {
    let _ = local_rank;
    let built_in = match device {
        DeviceKind::Cpu => true,
        DeviceKind::Wgpu => cfg!(feature = "wgpu"),
        DeviceKind::Cuda => cfg!(feature = "cuda"),
    };
    let name = format!("{device:?}").to_lowercase();
    if !built_in {
        return Err(UsageError(format!(
            "output.device = \"{name}\" is not available in this build. Rebuild with `--features {name}` (e.g. `cargo build --release -p trainer --features {name}`), or set output.device = \"cpu\""
        ))
        .into());
    }
    #[cfg(feature = "cuda")]
    if device == DeviceKind::Cuda {
        burn_ddp::cuda::check_cuda_available(burn_ddp::cuda::local_device(local_rank))
            .map_err(|e| UsageError(format!("output.device = \"cuda\": {e}")))?;
    }
    Ok(())
}

/// How this rank averages gradients once per optimizer step (`distributed.gradient_sync`),
/// with one [`Reducer`] either way (`distributed.gradient_compression` applies to both).
pub struct GradientSync {
    reducer: Reducer,
    /// `None`: through the host, over the job's TCP group. `Some`: on the GPU, over an NCCL
    /// group formed beside the TCP one (as PyTorch keeps a gloo group beside its NCCL group),
    /// dropped before the final TCP barrier.
    #[cfg(feature = "cuda")]
    nccl: Option<Box<NcclProcessGroup>>,
}

impl GradientSync {
    /// The configured kind. For NCCL this forms the group through the job's store: collective,
    /// every rank calls it at the same point (after the config check, so ranks agree on the
    /// kind), bounded by `distributed.timeout_secs`.
    pub fn new<B: TrainBackend>(
        d: &DistributedConfig,
        device: DeviceKind,
        dist: &Distributed,
    ) -> anyhow::Result<Self> {
        let reducer = Reducer::new(d.bucket_cap_mb, d.gradient_compression.format());
        let mut use_nccl =
            d.gradient_sync.resolve(device, dist.env.world_size) == GradientSyncMode::Nccl;
        if use_nccl && !B::NCCL {
            if d.gradient_sync == GradientSyncMode::Nccl {
                anyhow::bail!(UsageError(
                    "distributed.gradient_sync = \"nccl\": this build's CUDA backend is Burn's fusion backend (Burn's default features), whose tensors NCCL cannot address yet; use \"auto\" or \"host\" (gradients through the host), or build burn without default features".into()
                ));
            }
            tracing::warn!(
                "gradients are averaged through the host (TCP ring), not NCCL: this build's CUDA backend is Burn's fusion backend (Burn's default features), whose tensors NCCL cannot address yet"
            );
            use_nccl = false;
        }
        // Unreachable in practice: pre-flight refuses `output.device = "cuda"` in such a build,
        // and validation refuses "nccl" on other devices.
        #[cfg(not(feature = "cuda"))]
        if use_nccl {
            anyhow::bail!(UsageError(
                "distributed.gradient_sync = \"nccl\" needs a build with `--features cuda`".into()
            ));
        }
        Ok(Self {
            reducer,
            #[cfg(feature = "cuda")]
            nccl: if use_nccl {
                Some(nccl_group(d, dist)?)
            } else {
                None
            },
        })
    }

    /// Replaces every gradient with its mean over the ranks. Collective, once per optimizer step
    /// ([`Reducer::sync`]).
    pub fn sync<B: TrainBackend, M: AutodiffModule<B>>(
        &mut self,
        tcp: &mut TcpProcessGroup,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<GradientCheck, DdpError> {
        #[cfg(feature = "cuda")]
        if let Some(group) = &mut self.nccl {
            return B::sync_with_nccl(&mut self.reducer, group, model, grads);
        }
        self.reducer
            .sync::<B, M, _>(&mut HostStaging(tcp), model, grads)
    }

    pub fn stats(&self) -> ReducerStats {
        self.reducer.stats()
    }
}

/// Forms the NCCL group for gradients (`distributed.gradient_sync` resolved to `"nccl"`).
#[cfg(feature = "cuda")]
fn nccl_group(d: &DistributedConfig, dist: &Distributed) -> anyhow::Result<Box<NcclProcessGroup>> {
    let (rank, world) = (dist.env.rank, dist.env.world_size);
    let options = NcclGroupOptions {
        timeout: Duration::from_secs(d.timeout_secs),
        stall_warning: Duration::from_secs(d.stall_warning_secs),
        ..Default::default()
    };
    // The same ordinal as the CudaDevice of `with_backend`, so NCCL and Burn share one GPU.
    let device = burn_ddp::cuda::local_device(dist.env.local_rank);
    let group = NcclProcessGroup::with_options(dist.store.clone(), rank, world, device, options)
        .context(
            "forming the NCCL group for distributed.gradient_sync \
             (set it to \"host\" to average gradients through the host instead)",
        )?;
    tracing::info!(rank, world, device, "gradients are averaged with NCCL");
    Ok(Box::new(group))
}

/// The process group options of the job's TCP group from `[distributed]`.
pub fn tcp_options(d: &DistributedConfig) -> burn_ddp::TcpGroupOptions {
    burn_ddp::TcpGroupOptions {
        timeout: Duration::from_secs(d.timeout_secs),
        stall_warning: Duration::from_secs(d.stall_warning_secs),
        ..Default::default()
    }
}
