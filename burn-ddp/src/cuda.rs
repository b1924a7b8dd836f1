//! Is CUDA usable in this process? Checks that never panic, for the GPU path to run first.
//!
//! cudarc is built with `fallback-dynamic-loading`: it compiles without a CUDA toolkit and opens
//! `libcuda`, `libnccl` (and `libnvrtc`) the first time one of their functions is called — and
//! **panics** when the library or a symbol is missing. Every entry into the GPU path therefore
//! calls [`check_cuda_available`] (and [`check_nccl_available`] before NCCL) first: they open the
//! libraries with `dlopen(3)` themselves, look up every symbol this crate calls through cudarc,
//! and only then let cudarc talk to the driver. A missing piece becomes a [`CudaUnavailable`]
//! that says what is missing and how to fix it.
//!
//! The libraries opened here stay loaded for the life of the process (no `dlclose`): cudarc
//! opens the same files next, and unloading a driver library is a known source of crashes.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt;

use cudarc::driver::{result as cu, sys as cu_sys};

/// Names of the CUDA driver library, in the order they are tried. `libcuda.so.1` is the name the
/// driver installs; `libcuda.so` is a development link that may be absent. cudarc tries both.
pub const CUDA_DRIVER_LIBRARIES: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// The name cudarc opens NCCL by (the first of its candidates; the others — `libnccl.so.1`,
/// `.9` … `.13` — are names NCCL is never installed under).
pub const NCCL_LIBRARY: &str = "libnccl.so";

/// The name NCCL is installed under by its packages (the `nvidia-nccl-cu12` Python wheel, the
/// `libnccl2` Debian package). cudarc does not look for it.
pub const NCCL_VERSIONED_LIBRARY: &str = "libnccl.so.2";

/// Oldest NCCL this crate works with: 2.14 brought `ncclConfig_t` (non-blocking communicators,
/// which bounded-time set-up relies on) and `ncclCommFinalize`; `ncclAvg` is from 2.10.
pub const MIN_NCCL_VERSION: (u32, u32) = (2, 14);

/// Driver functions the GPU path calls through cudarc (including inside `CudaContext::new` and
/// its `Drop`). Looked up before the first call, because cudarc panics on a missing symbol.
const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamQuery",
    "cuStreamSynchronize",
    "cuStreamDestroy_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
];

/// NCCL functions [`crate::group::nccl`] calls through cudarc.
const NCCL_SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclCommInitRankConfig",
    "ncclCommGetAsyncError",
    "ncclCommFinalize",
    "ncclCommDestroy",
    "ncclCommAbort",
    "ncclAllReduce",
    "ncclBroadcast",
    "ncclAllGather",
    "ncclReduceScatter",
];

/// The device a check found usable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaInfo {
    /// The ordinal that was checked (numbered among the visible devices).
    pub ordinal: usize,
    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// How many devices this process sees.
    pub device_count: usize,
    /// The CUDA version the driver supports, as (major, minor).
    pub driver_version: (u32, u32),
    /// The file the driver library was loaded from.
    pub library: String,
}

/// The NCCL library a check found usable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
    /// The file the library was loaded from.
    pub library: String,
}

impl NcclVersion {
    /// Decodes `ncclGetVersion`'s code: `major*10000 + minor*100 + patch` since 2.9,
    /// `major*1000 + minor*100 + patch` before.
    pub fn from_code(code: i32, library: String) -> Self {
        let code = code.max(0) as u32;
        let (major, rest) = if code >= 10_000 {
            (code / 10_000, code % 10_000)
        } else {
            (code / 1_000, code % 1_000)
        };
        Self {
            major,
            minor: rest / 100,
            patch: rest % 100,
            library,
        }
    }

    /// Whether this version is `major.minor` or newer.
    pub fn at_least(&self, (major, minor): (u32, u32)) -> bool {
        (self.major, self.minor) >= (major, minor)
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Why CUDA or NCCL cannot be used in this process; each message says what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaUnavailable {
    /// No CUDA driver library could be opened.
    #[error("the CUDA driver library could not be loaded (tried {tried}: {reason}). Is an NVIDIA driver installed (does `nvidia-smi` work)? In a container, start it with the GPUs exposed (e.g. `docker run --gpus all`); if the driver is installed in a non-standard folder, add that folder to LD_LIBRARY_PATH")]
    DriverNotFound { tried: String, reason: String },
    /// The driver library lacks a function this crate calls.
    #[error("the CUDA driver at {library} has no `{symbol}`: it is too old for this build; update the NVIDIA driver")]
    DriverTooOld { library: String, symbol: String },
    /// A driver call failed before any device could be used.
    #[error("CUDA driver ({library}): {call} failed: {error}")]
    InitFailed {
        library: String,
        call: &'static str,
        error: String,
    },
    /// The driver works but shows this process no device.
    #[error("no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES={}). Check `nvidia-smi`, and that CUDA_VISIBLE_DEVICES, if set, names existing devices", visible_devices.as_deref().unwrap_or("<unset>"))]
    NoDevice { visible_devices: Option<String> },
    /// The requested ordinal is not among the visible devices.
    #[error("CUDA device {ordinal} does not exist: this process sees {count} device(s), numbered 0..{count} (CUDA_VISIBLE_DEVICES={}; the driver numbers the visible devices from 0, so with CUDA_VISIBLE_DEVICES set, ordinals index that list). Start at most {count} local ranks, or expose more devices", visible_devices.as_deref().unwrap_or("<unset>"))]
    OrdinalOutOfRange {
        ordinal: usize,
        count: usize,
        visible_devices: Option<String>,
    },
    /// Neither `libnccl.so` nor `libnccl.so.2` could be opened.
    #[error("NCCL could not be loaded: `{NCCL_LIBRARY}` was not found ({reason}). Install NCCL (e.g. `pip install nvidia-nccl-cu12`, which ships `{NCCL_VERSIONED_LIBRARY}` in `<site-packages>/nvidia/nccl/lib`), then put a folder holding a link `libnccl.so -> libnccl.so.2` on LD_LIBRARY_PATH")]
    NcclNotFound { reason: String },
    /// `libnccl.so.2` is there but cudarc only opens `libnccl.so`.
    #[error("NCCL is installed as {found}, but cudarc opens NCCL as `{NCCL_LIBRARY}`, which is not on the library path. Fix: `mkdir -p ~/.local/lib/nccl && ln -sf {found} ~/.local/lib/nccl/libnccl.so && export LD_LIBRARY_PATH=~/.local/lib/nccl:$LD_LIBRARY_PATH` (the `nvidia-nccl-cu12` Python package ships only `{NCCL_VERSIONED_LIBRARY}`)")]
    NcclUnversionedNameMissing { found: String },
    /// The NCCL library lacks a function this crate calls.
    #[error("the NCCL library at {library} has no `{symbol}`: it is too old or not NCCL; install NCCL {}.{} or newer", MIN_NCCL_VERSION.0, MIN_NCCL_VERSION.1)]
    NcclSymbolMissing { library: String, symbol: String },
    /// NCCL is older than [`MIN_NCCL_VERSION`].
    #[error("NCCL {version} at {library} is too old: non-blocking communicators need NCCL {}.{} or newer", MIN_NCCL_VERSION.0, MIN_NCCL_VERSION.1)]
    NcclTooOld { version: String, library: String },
    /// `ncclGetVersion` itself failed.
    #[error("NCCL at {library}: ncclGetVersion failed with code {code}")]
    NcclVersionFailed { library: String, code: i32 },
}

/// Checks that the CUDA driver can be loaded and that device `device_ordinal` exists, without
/// panicking. Only once the driver library and every symbol this crate uses are found does it
/// call the driver (through cudarc): `cuInit`, the device count, the device's name.
///
/// Not collective; cheap after the first call (the driver is initialised once per process).
pub fn check_cuda_available(device_ordinal: usize) -> Result<CudaInfo, CudaUnavailable> {
    let lib =
        open_first(&CUDA_DRIVER_LIBRARIES).map_err(|reason| CudaUnavailable::DriverNotFound {
            tried: CUDA_DRIVER_LIBRARIES.join(", "),
            reason,
        })?;
    let library = lib.path_or(CUDA_DRIVER_LIBRARIES[0]);
    if let Some(symbol) = lib.first_missing(DRIVER_SYMBOLS) {
        return Err(CudaUnavailable::DriverTooOld {
            library,
            symbol: symbol.to_string(),
        });
    }
    let failed = |call: &'static str, e: cu::DriverError| CudaUnavailable::InitFailed {
        library: library.clone(),
        call,
        error: driver_error_text(e),
    };
    let visible_devices = std::env::var("CUDA_VISIBLE_DEVICES").ok();

    let mut version: c_int = 0;
    // SAFETY: every symbol in DRIVER_SYMBOLS was found in the driver library, so cudarc's loader
    // cannot panic; cuDriverGetVersion writes one int through a valid pointer and may be called
    // before cuInit.
    unsafe { cu_sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(|e| failed("cuDriverGetVersion", e))?;
    let driver_version = ((version / 1000) as u32, ((version % 1000) / 10) as u32);

    match cu::init() {
        Ok(()) => {}
        Err(e) if e.0 == cu_sys::CUresult::CUDA_ERROR_NO_DEVICE => {
            return Err(CudaUnavailable::NoDevice { visible_devices });
        }
        Err(e) => return Err(failed("cuInit", e)),
    }
    let count = cu::device::get_count().map_err(|e| failed("cuDeviceGetCount", e))?;
    let count = count.max(0) as usize;
    if count == 0 {
        return Err(CudaUnavailable::NoDevice { visible_devices });
    }
    if device_ordinal >= count {
        return Err(CudaUnavailable::OrdinalOutOfRange {
            ordinal: device_ordinal,
            count,
            visible_devices,
        });
    }
    let device = cu::device::get(device_ordinal as c_int).map_err(|e| failed("cuDeviceGet", e))?;
    let name = cu::device::get_name(device).map_err(|e| failed("cuDeviceGetName", e))?;
    Ok(CudaInfo {
        ordinal: device_ordinal,
        name,
        device_count: count,
        driver_version,
        library,
    })
}

/// Checks that NCCL can be loaded the way cudarc loads it (as `libnccl.so`), that it has every
/// function this crate calls, and that it is at least [`MIN_NCCL_VERSION`]. Never panics and
/// never calls into cudarc: the version is read through the symbol found here.
///
/// When only `libnccl.so.2` loads (the usual case with the `nvidia-nccl-cu12` wheel), the error
/// says exactly that, and how to add the `libnccl.so` link cudarc needs.
pub fn check_nccl_available() -> Result<NcclVersion, CudaUnavailable> {
    check_nccl_named(NCCL_LIBRARY, NCCL_VERSIONED_LIBRARY)
}

/// [`check_nccl_available`] with the library names as parameters, so tests can point it at
/// libraries that do or do not exist.
fn check_nccl_named(name: &str, versioned: &str) -> Result<NcclVersion, CudaUnavailable> {
    let lib = match Library::open(name) {
        Ok(lib) => lib,
        Err(reason) => {
            return Err(match Library::open(versioned) {
                Ok(found) => CudaUnavailable::NcclUnversionedNameMissing {
                    found: found.path_or(versioned),
                },
                Err(_) => CudaUnavailable::NcclNotFound { reason },
            });
        }
    };
    let library = lib.path_or(name);
    let missing = |symbol: &str| CudaUnavailable::NcclSymbolMissing {
        library: library.clone(),
        symbol: symbol.to_string(),
    };
    let get_version = lib
        .symbol("ncclGetVersion")
        .ok_or_else(|| missing("ncclGetVersion"))?;
    if let Some(symbol) = lib.first_missing(NCCL_SYMBOLS) {
        return Err(missing(symbol));
    }
    // SAFETY: the symbol is NCCL's `ncclResult_t ncclGetVersion(int* version)`; ncclResult_t is a
    // C enum, passed as an int. Reading the result as c_int (not as cudarc's Rust enum) stays
    // defined whatever code a newer NCCL returns.
    let get_version: unsafe extern "C" fn(*mut c_int) -> c_int =
        unsafe { std::mem::transmute::<*mut c_void, _>(get_version) };
    let mut code: c_int = 0;
    // SAFETY: `code` is a valid, writable int for the duration of the call.
    let rc = unsafe { get_version(&mut code) };
    if rc != 0 {
        return Err(CudaUnavailable::NcclVersionFailed { library, code: rc });
    }
    let version = NcclVersion::from_code(code, library);
    if !version.at_least(MIN_NCCL_VERSION) {
        return Err(CudaUnavailable::NcclTooOld {
            version: version.to_string(),
            library: version.library,
        });
    }
    Ok(version)
}

/// The CUDA device ordinal for the process with local rank `local_rank` (one process per GPU).
///
/// The driver numbers the devices this process can see from 0, in the order of
/// `CUDA_VISIBLE_DEVICES` when it is set (`CUDA_VISIBLE_DEVICES=2,3`: ordinal 0 is GPU 2). So
/// when every local rank sees the node's GPUs (torchrun, this crate's launcher), the ordinal is
/// simply `local_rank`, and restricting a job to some GPUs needs nothing but
/// `CUDA_VISIBLE_DEVICES`. When the launcher gives each process exactly one GPU instead
/// (`srun --gpus-per-task=1`, which sets `CUDA_VISIBLE_DEVICES` to one device per task), that
/// device is ordinal 0 whatever the local rank.
pub fn local_device(local_rank: usize) -> usize {
    local_device_for(
        local_rank,
        std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
    )
}

/// [`local_device`] with the value of `CUDA_VISIBLE_DEVICES` as a parameter (pure).
fn local_device_for(local_rank: usize, visible_devices: Option<&str>) -> usize {
    let visible = visible_devices
        .map(|v| v.split(',').filter(|d| !d.trim().is_empty()).count())
        .unwrap_or(0);
    if visible == 1 {
        0
    } else {
        local_rank
    }
}

/// "CUDA_ERROR_NAME (description)" for a driver error, with a hint where one is known.
pub(crate) fn driver_error_text(e: cu::DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    let description = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let hint = match e.0 {
        cu_sys::CUresult::CUDA_ERROR_STUB_LIBRARY => {
            ". A stub libcuda.so from the CUDA toolkit was loaded instead of the driver's: remove the toolkit's `stubs` folder from LD_LIBRARY_PATH"
        }
        cu_sys::CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
        | cu_sys::CUresult::CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE => {
            ". The driver library does not match the loaded kernel module: reboot after a driver update, or fix the container's driver mount"
        }
        cu_sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
            ". Another process may hold the GPU's memory: check `nvidia-smi`"
        }
        _ => "",
    };
    if description.is_empty() {
        format!("{name}{hint}")
    } else {
        format!("{name} ({description}){hint}")
    }
}

/// A library opened with `dlopen(3)`, never closed (module docs).
struct Library {
    handle: *mut c_void,
}

impl Library {
    /// `dlopen(name, RTLD_NOW | RTLD_LOCAL)`; the error is `dlerror()`'s message.
    fn open(name: &str) -> Result<Self, String> {
        let c_name = CString::new(name).map_err(|_| format!("bad library name {name:?}"))?;
        // SAFETY: `c_name` is a valid NUL-terminated string for the duration of the call.
        // RTLD_LOCAL keeps the library's symbols out of the global namespace (cudarc resolves
        // them through its own handle); RTLD_NOW resolves the library's own dependencies now,
        // so a broken installation fails here rather than at some later call.
        let handle = unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(last_dl_error().unwrap_or_else(|| format!("{name}: cannot be loaded")));
        }
        Ok(Self { handle })
    }

    /// The address of `symbol`, or `None` when the library does not export it.
    fn symbol(&self, symbol: &str) -> Option<*mut c_void> {
        let c_symbol = CString::new(symbol).ok()?;
        // SAFETY: `self.handle` came from a successful dlopen and is never closed; `c_symbol`
        // is a valid NUL-terminated string for the duration of the call.
        let ptr = unsafe { libc::dlsym(self.handle, c_symbol.as_ptr()) };
        // Functions are never at address 0, so null means "not exported".
        (!ptr.is_null()).then_some(ptr)
    }

    fn first_missing<'a>(&self, symbols: &[&'a str]) -> Option<&'a str> {
        symbols.iter().copied().find(|s| self.symbol(s).is_none())
    }

    /// The file the library was loaded from (found through one of its symbols), or `fallback`.
    fn path_or(&self, fallback: &str) -> String {
        // Any exported function finds the file; NCCL and the driver both export these.
        let probe = ["cuInit", "ncclGetVersion"]
            .iter()
            .find_map(|s| self.symbol(s));
        let Some(addr) = probe else {
            return fallback.to_string();
        };
        // SAFETY: an all-zero Dl_info is a valid value (null pointers, zero addresses).
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: `addr` is an address inside a loaded library and `info` is a valid, writable
        // Dl_info; dladdr only writes to `info`.
        let found = unsafe { libc::dladdr(addr as *const c_void, &mut info) };
        if found == 0 || info.dli_fname.is_null() {
            return fallback.to_string();
        }
        // SAFETY: dladdr set `dli_fname` to a NUL-terminated path owned by the loader, valid
        // while the library stays loaded (it is never closed).
        unsafe { CStr::from_ptr(info.dli_fname) }
            .to_string_lossy()
            .into_owned()
    }
}

/// `dlerror()`'s message for the last failed dl call on this thread, if any.
fn last_dl_error() -> Option<String> {
    // SAFETY: dlerror returns null or a NUL-terminated string that stays valid until the next dl
    // call on this thread (glibc keeps it per thread); it is copied at once.
    let msg: *const c_char = unsafe { libc::dlerror() };
    if msg.is_null() {
        None
    } else {
        // SAFETY: non-null, NUL-terminated (above).
        Some(
            unsafe { CStr::from_ptr(msg) }
                .to_string_lossy()
                .into_owned(),
        )
    }
}

/// Opens the first library of `names` that loads; the error lists every name's failure.
fn open_first(names: &[&str]) -> Result<Library, String> {
    let mut reasons = Vec::new();
    for name in names {
        match Library::open(name) {
            Ok(lib) => return Ok(lib),
            Err(reason) => reasons.push(reason),
        }
    }
    Err(reasons.join("; "))
}

#[cfg(test)]
mod tests {
    //! These run on machines without a GPU (and pass on machines with one): the checks must
    //! return an error, never panic, and name the library.
    use super::*;

    #[test]
    fn cuda_check_returns_an_error_or_a_device_without_panicking() {
        match check_cuda_available(0) {
            Ok(info) => {
                assert!(!info.name.is_empty());
                assert!(info.device_count >= 1);
            }
            Err(e @ CudaUnavailable::DriverNotFound { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("libcuda.so.1"), "{msg}");
                assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
                assert!(msg.contains("nvidia-smi"), "{msg}");
            }
            // A driver without a usable device (CI runners with a driver but no GPU).
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }

    #[test]
    fn absent_driver_is_reported_with_every_name_tried() {
        let err = open_first(&["libdefinitely-not-a-driver.so.1", "libnor-this.so"])
            .err()
            .expect("these libraries do not exist");
        assert!(err.contains("libdefinitely-not-a-driver.so.1"), "{err}");
        assert!(err.contains("libnor-this.so"), "{err}");
    }

    #[test]
    fn ordinal_out_of_range_names_the_count_and_cuda_visible_devices() {
        let e = CudaUnavailable::OrdinalOutOfRange {
            ordinal: 3,
            count: 2,
            visible_devices: Some("4,5".into()),
        };
        let msg = e.to_string();
        assert!(
            msg.contains("device 3") && msg.contains("sees 2 device(s)"),
            "{msg}"
        );
        assert!(msg.contains("CUDA_VISIBLE_DEVICES=4,5"), "{msg}");
        let none = CudaUnavailable::NoDevice {
            visible_devices: None,
        };
        assert!(none.to_string().contains("CUDA_VISIBLE_DEVICES=<unset>"));
    }

    #[test]
    fn nccl_check_returns_an_error_or_a_version_without_panicking() {
        match check_nccl_available() {
            Ok(v) => assert!(v.at_least(MIN_NCCL_VERSION), "{v}"),
            Err(e @ CudaUnavailable::NcclNotFound { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("libnccl.so"), "{msg}");
                assert!(msg.contains("nvidia-nccl-cu12"), "{msg}");
                assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
            }
            Err(e) => assert!(e.to_string().contains("libnccl") || e.to_string().contains("NCCL")),
        }
    }

    #[test]
    fn only_the_versioned_name_gives_the_symlink_fix() {
        // libc.so.6 stands in for a library that loads under its versioned name only.
        let err = check_nccl_named("libnccl-absent-for-test.so", "libc.so.6").unwrap_err();
        assert!(
            matches!(err, CudaUnavailable::NcclUnversionedNameMissing { .. }),
            "{err}"
        );
        let msg = err.to_string();
        assert!(msg.contains("libc.so.6"), "{msg}");
        assert!(msg.contains("ln -sf"), "{msg}");
        assert!(msg.contains("libnccl.so"), "{msg}");
        assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
    }

    #[test]
    fn a_library_without_nccl_symbols_is_refused_by_name() {
        let err = check_nccl_named("libc.so.6", "libc.so.6").unwrap_err();
        let CudaUnavailable::NcclSymbolMissing { symbol, .. } = &err else {
            panic!("expected NcclSymbolMissing, got {err}");
        };
        assert_eq!(symbol, "ncclGetVersion");
    }

    #[test]
    fn nothing_found_is_nccl_not_found() {
        let err = check_nccl_named("libnccl-absent-a.so", "libnccl-absent-b.so.2").unwrap_err();
        assert!(matches!(err, CudaUnavailable::NcclNotFound { .. }), "{err}");
        assert!(err.to_string().contains("libnccl-absent-a.so"), "{err}");
    }

    #[test]
    fn nccl_version_codes() {
        let v = NcclVersion::from_code(22105, String::new());
        assert_eq!((v.major, v.minor, v.patch), (2, 21, 5));
        assert_eq!(v.to_string(), "2.21.5");
        assert!(v.at_least((2, 14)) && !v.at_least((2, 22)));
        let old = NcclVersion::from_code(2804, String::new());
        assert_eq!((old.major, old.minor, old.patch), (2, 8, 4));
        assert!(!old.at_least(MIN_NCCL_VERSION));
    }

    #[test]
    fn local_device_follows_cuda_visible_devices() {
        assert_eq!(local_device_for(3, None), 3);
        assert_eq!(local_device_for(1, Some("2,3")), 1);
        // One device per process (srun --gpus-per-task=1): it is ordinal 0.
        assert_eq!(local_device_for(1, Some("3")), 0);
        assert_eq!(local_device_for(2, Some("")), 2);
    }
}
