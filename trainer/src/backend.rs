//! Every backend and cargo feature of the engine, in one place: which Burn backend each
//! `output.device` runs, whether this build and machine can run it, and how gradients are
//! averaged on it (through the host, or NCCL on CUDA), and what `trainer doctor` needs to know
//! of the devices ([`device_facts`]; the doctor judges them). The training loop has no `cfg`.

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

/// Whether this build has the backend of `device` (cargo features `wgpu`, `cuda`).
pub fn built_in(device: DeviceKind) -> bool {
    match device {
        DeviceKind::Cpu => true,
        DeviceKind::Wgpu => cfg!(feature = "wgpu"),
        DeviceKind::Cuda => cfg!(feature = "cuda"),
    }
}

/// `output.device`'s spelling of `device`.
pub fn device_name(device: DeviceKind) -> String {
    format!("{device:?}").to_lowercase()
}

/// Whether this build can train on `device`, and (for CUDA) whether this machine can: a missing
/// driver or GPU is a clear usage error before any rank starts, never a panic inside CUDA.
pub fn device_available(device: DeviceKind, local_rank: usize) -> anyhow::Result<()> {
    let _ = local_rank;
    let name = device_name(device);
    if !built_in(device) {
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
        if use_nccl && d.zero_stage == 1 {
            // Stage 1 needs a reduce-scatter and an all-gather over blocks of different sizes
            // (one per owner), which NCCL lacks: it runs over the TCP group.
            if d.gradient_sync == GradientSyncMode::Nccl {
                anyhow::bail!(UsageError(
                    "distributed.zero_stage = 1 runs over the host (TCP ring) in this version; set distributed.gradient_sync = \"auto\" or \"host\", or zero_stage = 0 for NCCL".into()
                ));
            }
            use_nccl = false;
        }
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

/// What `trainer doctor`'s device checks need to know of the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceJob {
    /// The config's `output.device`; `None` without a config, when every device this build has
    /// counts as wanted (a CUDA build is made to run on GPUs).
    pub device: Option<DeviceKind>,
    /// Ranks on this machine (one GPU each).
    pub local_ranks: usize,
    pub world_size: usize,
    pub gradient_sync: GradientSyncMode,
}

impl DeviceJob {
    /// Whether the job trains on CUDA (any device this build has, without a config).
    pub fn wants_cuda(&self) -> bool {
        self.device.is_none_or(|d| d == DeviceKind::Cuda)
    }
}

/// What this build and machine have for training, probed here (where every cargo feature is
/// gated) and judged by `trainer doctor` (`doctor::checks::devices`). Plain data, the same in
/// every build: a probe this build cannot make is `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFacts {
    /// The devices this build trains on.
    pub built: Vec<DeviceKind>,
    /// CUDA builds: the driver and its GPUs, or why there are none.
    pub cuda: Option<Result<CudaFacts, CudaProblem>>,
    /// CUDA builds whose job trains on CUDA: NCCL as `"2.21.5 at /path"`, or why not.
    pub nccl: Option<Result<String, String>>,
    /// wgpu builds: the adapter Burn's wgpu backend would pick, or why none.
    pub wgpu: Option<Result<WgpuAdapter, WgpuProblem>>,
}

/// The CUDA driver and the GPUs the local ranks would use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaFacts {
    /// `(major, minor)` of the CUDA version the driver supports.
    pub driver_version: (u32, u32),
    /// The driver library that was loaded.
    pub library: String,
    pub device_count: usize,
    /// The name of device 0.
    pub first_device: String,
    /// `CUDA_VISIBLE_DEVICES`, or `<unset>`.
    pub visible: String,
    /// Devices the local ranks use (`0..needed`, as the engine picks them).
    pub needed: usize,
}

/// Why CUDA cannot be used here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaProblem {
    /// No driver library could be opened.
    DriverNotFound { tried: String, reason: String },
    /// Another problem, with its message (which says what to do).
    Other(String),
}

/// The wgpu adapter that would be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgpuAdapter {
    /// Name, API, kind and driver.
    pub description: String,
    /// A software adapter (Mesa's lavapipe, ...), which runs on the CPU.
    pub software: bool,
}

/// Why no wgpu adapter was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WgpuProblem {
    /// The search failed, with its message.
    NotFound(String),
    /// The search did not answer within this many seconds.
    Timeout(u64),
}

/// Probes what [`DeviceFacts`] holds. Never panics: CUDA is probed through
/// [`burn_ddp::cuda`]'s checks, which `dlopen` the libraries themselves, and the wgpu adapter
/// search runs on a thread of its own.
pub fn device_facts(job: &DeviceJob) -> DeviceFacts {
    let _ = job;
    DeviceFacts {
        built: [DeviceKind::Cpu, DeviceKind::Wgpu, DeviceKind::Cuda]
            .into_iter()
            .filter(|&d| built_in(d))
            .collect(),
        #[cfg(feature = "cuda")]
        cuda: Some(cuda_facts(job.local_ranks)),
        #[cfg(not(feature = "cuda"))]
        cuda: None,
        #[cfg(feature = "cuda")]
        nccl: job.wants_cuda().then(|| {
            burn_ddp::cuda::check_nccl_available()
                .map(|v| format!("{v} at {}", v.library))
                .map_err(|e| e.to_string())
        }),
        #[cfg(not(feature = "cuda"))]
        nccl: None,
        #[cfg(feature = "wgpu")]
        wgpu: Some(wgpu_adapter()),
        #[cfg(not(feature = "wgpu"))]
        wgpu: None,
    }
}

/// The CUDA driver, and the devices `local_ranks` ranks would use.
#[cfg(feature = "cuda")]
fn cuda_facts(local_ranks: usize) -> Result<CudaFacts, CudaProblem> {
    use burn_ddp::cuda::{self, CudaUnavailable};
    match cuda::check_cuda_available(0) {
        Ok(info) => Ok(CudaFacts {
            driver_version: info.driver_version,
            library: info.library,
            device_count: info.device_count,
            first_device: info.name,
            visible: std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into()),
            // Each local rank's device, as the engine picks it (`with_backend`).
            needed: (0..local_ranks.max(1))
                .map(cuda::local_device)
                .max()
                .map_or(1, |d| d + 1),
        }),
        Err(CudaUnavailable::DriverNotFound { tried, reason }) => {
            Err(CudaProblem::DriverNotFound { tried, reason })
        }
        Err(e) => Err(CudaProblem::Other(e.to_string())),
    }
}

/// The adapter Burn's wgpu backend would pick.
#[cfg(feature = "wgpu")]
fn wgpu_adapter() -> Result<WgpuAdapter, WgpuProblem> {
    use burn::backend::wgpu::{graphics::AutoGraphicsApi, init_setup, RuntimeOptions, WgpuDevice};
    const DEADLINE: Duration = Duration::from_secs(60);
    // CubeCL panics when it finds no adapter: search on a thread, with the panic caught and
    // its message kept out of the report.
    let (tx, rx) = std::sync::mpsc::channel();
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    std::thread::spawn(move || {
        let found = std::panic::catch_unwind(|| {
            let setup = init_setup::<AutoGraphicsApi>(
                &WgpuDevice::DefaultDevice,
                RuntimeOptions::default(),
            );
            let info = setup.adapter.get_info();
            let kind = format!("{:?}", info.device_type);
            let driver = [info.driver.as_str(), info.driver_info.as_str()]
                .iter()
                .filter(|s| !s.is_empty())
                .copied()
                .collect::<Vec<_>>()
                .join(" ");
            WgpuAdapter {
                description: format!(
                    "{} ({:?}, {kind}, driver {driver})",
                    info.name, info.backend
                ),
                software: kind == "Cpu",
            }
        });
        let _ = tx.send(found.map_err(|panic| {
            panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "the adapter search panicked".into())
        }));
    });
    let found = rx.recv_timeout(DEADLINE);
    std::panic::set_hook(hook);
    match found {
        Ok(Ok(adapter)) => Ok(adapter),
        Ok(Err(why)) => Err(WgpuProblem::NotFound(why)),
        Err(_) => Err(WgpuProblem::Timeout(DEADLINE.as_secs())),
    }
}
