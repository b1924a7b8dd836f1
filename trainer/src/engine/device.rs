//! Which Burn backend each `output.device` runs, whether this build and machine can run it, and
//! what `trainer doctor` needs to know of the devices ([`device_facts`]; the doctor judges
//! them). How gradients are averaged on a device (host staging, or NCCL on CUDA) is
//! `burn_ddp::DataParallel`'s choice. The training loop has no `cfg`: it runs on the [`Device`]
//! [`train_device`] picks at run time.

use burn::tensor::Device;
use burn_ddp::GradientTransport;

use crate::config::DeviceKind;
use crate::error::UsageError;
use crate::features::this_program;

/// The autodiff device this rank trains on for `output.device = device`: the CPU is Burn's
/// pure-Rust Flex, wgpu the adapter wgpu picks (one per machine, shared by its ranks), CUDA the
/// GPU of `local_rank`. The model is built and trained on it; validation runs on its
/// non-autodiff twin (`device.clone().inner()`). A device this build lacks, or CUDA without a
/// driver or GPU, is a usage error (exit code 2) naming the cargo feature or the problem
/// ([`device_available`]). Never Burn's `Device::default()`, which prefers CUDA in CUDA builds.
pub fn train_device(device: DeviceKind, local_rank: usize) -> anyhow::Result<Device> {
    device_available(device, local_rank)?;
    match device {
        DeviceKind::Cpu => Ok(Device::flex().autodiff()),
        // One adapter per machine: every local rank shares wgpu's default one.
        #[cfg(feature = "wgpu")]
        DeviceKind::Wgpu => Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice).autodiff()),
        // The local rank is the device ordinal (as with torchrun), unless the launcher gave
        // each process one GPU through CUDA_VISIBLE_DEVICES (then it is 0): see
        // `burn_ddp::cuda::local_device`. The NCCL group uses the same ordinal.
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => Ok(Device::cuda(burn_ddp::cuda::local_device(local_rank)).autodiff()),
        #[allow(unreachable_patterns)]
        other => Err(UsageError(format!(
            "output.device = \"{}\" is not available in this build",
            device_name(other)
        ))
        .into()),
    }
}

/// Points Burn's default device (`BURN_DEVICE`) at host memory (Flex) for every job. The engine
/// names the device of everything it builds; Burn falls back to its default device only where
/// it is not told one: when it restores an optimizer state (`ModuleOptimizer::load_record`
/// materialises it there and moves each parameter's state to that parameter's device on the
/// next step). Burn's own default prefers CUDA in a CUDA build, which would put the whole state
/// of every local rank on GPU 0 at resume (or panic on a CPU job on a machine without a GPU),
/// and a user's `BURN_DEVICE` naming a backend this build lacks would panic inside Burn: so the
/// value is always replaced. Called at the start of a rank's run, before Burn reads it.
pub fn pin_default_device() {
    std::env::set_var("BURN_DEVICE", "flex");
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

/// How to get a build that trains on `device`, for `program` (the running binary's name): the
/// `trainer` binary's own feature, or, in a program of the user's crate, a feature of that
/// crate forwarding trainer's and Burn's (the crate that builds the binary decides).
pub fn rebuild_advice(device: DeviceKind, program: &str) -> String {
    let name = device_name(device);
    if program == "trainer" {
        format!("rebuild with `cargo build --release -p trainer --features {name}`")
    } else {
        format!(
            "rebuild {program} with `--features {name}`, a feature of its own crate that turns on `trainer/{name}` and `burn/{name}` (in its Cargo.toml: `[features] {name} = [\"burn/{name}\", \"trainer/{name}\"]`, as examples/custom-model/Cargo.toml has)"
        )
    }
}

/// Whether this build can train on `device`, and (for CUDA) whether this machine can: a missing
/// driver or GPU is a clear usage error before any rank starts, never a panic inside CUDA.
pub fn device_available(device: DeviceKind, local_rank: usize) -> anyhow::Result<()> {
    let _ = local_rank;
    let name = device_name(device);
    if !built_in(device) {
        return Err(UsageError(format!(
            "output.device = \"{name}\" is not available in this build: {}, or set output.device = \"cpu\"",
            rebuild_advice(device, &this_program())
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

/// What `trainer doctor`'s device checks need to know of the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceJob {
    /// The config's `output.device`; `None` without a config, when every device this build has
    /// counts as wanted (a CUDA build is made to run on GPUs).
    pub device: Option<DeviceKind>,
    /// Ranks on this machine (one GPU each).
    pub local_ranks: usize,
    pub world_size: usize,
    pub gradient_sync: GradientTransport,
}

impl DeviceJob {
    /// Whether the job trains on CUDA (any device this build has, without a config).
    pub fn wants_cuda(&self) -> bool {
        self.device.is_none_or(|d| d == DeviceKind::Cuda)
    }

    /// Whether the job's gradients go through NCCL when it trains on CUDA (burn-ddp's
    /// [`GradientTransport::resolve`]: `"auto"` means NCCL for several ranks only).
    pub fn nccl_on_cuda(&self) -> bool {
        self.gradient_sync.resolve(true, self.world_size) == GradientTransport::Nccl
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
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // probed in `cuda` builds only
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
#[cfg_attr(not(feature = "wgpu"), allow(dead_code))] // probed in `wgpu` builds only
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
            // Each local rank's device, as the engine picks it (`train_device`).
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
    // The adapter `Device::wgpu(DeviceKind::DefaultDevice)` (what `train_device` uses) picks.
    const DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);
    // CubeCL panics when it finds no adapter: search on a thread, with the panic caught and
    // its message kept out of the report.
    let (tx, rx) = std::sync::mpsc::channel();
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    std::thread::spawn(move || {
        let found = std::panic::catch_unwind(|| {
            let setup =
                init_setup::<AutoGraphicsApi>(&WgpuDevice::default(), RuntimeOptions::default());
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
