//! The NCCL and CUDA driver calls the group makes, wrapped: the non-blocking config, the
//! element types and reduce ops, the communicator's and the stream's state, and NCCL's error
//! text. Each `unsafe` call states why it is sound.

use std::ffi::{c_char, CStr};

use cudarc::driver::{result as cu, sys as cu_sys};
use cudarc::nccl::sys as nccl_sys;

use super::fault::Fault;
use crate::call::{DataType, ReduceOp};
use crate::cuda::driver_error_text;

/// An `ncclConfig_t` as `NCCL_CONFIG_INITIALIZER` makes it, with `blocking = 0`.
///
/// Every field NCCL should default must hold `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`) or null — zero
/// is a real value that NCCL rejects for some fields. `size` and `version` describe the layout
/// of cudarc's bindings (NCCL 2.30.0); NCCL copies at most its own `sizeof(ncclConfig_t)` and
/// only reads fields that the version says exist, so older and newer libraries read it right.
pub(super) fn nonblocking_config() -> nccl_sys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    const NCCL_API_MAGIC: u32 = 0xcafe_beef;
    // NCCL_VERSION(2, 30, 0): the release whose ncclConfig_t layout cudarc's bindings describe.
    const BINDINGS_VERSION: u32 = 2 * 10_000 + 30 * 100;
    nccl_sys::ncclConfig_t {
        size: std::mem::size_of::<nccl_sys::ncclConfig_t>(),
        magic: NCCL_API_MAGIC,
        version: BINDINGS_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// The NCCL type of `dtype`.
pub(super) fn nccl_dtype(dtype: DataType) -> nccl_sys::ncclDataType_t {
    use nccl_sys::ncclDataType_t as T;
    match dtype {
        DataType::F32 => T::ncclFloat32,
        DataType::F64 => T::ncclFloat64,
        DataType::I32 => T::ncclInt32,
        DataType::I64 => T::ncclInt64,
        DataType::U8 => T::ncclUint8,
        DataType::BF16 => T::ncclBfloat16,
        DataType::F16 => T::ncclFloat16,
    }
}

/// `Avg` is NCCL's `ncclAvg` (NCCL ≥ 2.10; integer types divide after summing, like the TCP
/// group).
pub(super) fn nccl_op(op: ReduceOp) -> nccl_sys::ncclRedOp_t {
    use nccl_sys::ncclRedOp_t as O;
    match op {
        ReduceOp::Sum => O::ncclSum,
        ReduceOp::Avg => O::ncclAvg,
        ReduceOp::Max => O::ncclMax,
        ReduceOp::Min => O::ncclMin,
    }
}

/// NCCL's state of `comm`: `Ok(true)` when nothing is pending, `Ok(false)` while NCCL is still
/// working on a call on its own thread (`ncclInProgress`), `Err` on an error.
pub(super) fn nccl_state(comm: nccl_sys::ncclComm_t) -> Result<bool, Fault> {
    let mut state = nccl_sys::ncclResult_t::ncclSuccess;
    // SAFETY: `comm` is a live communicator (callers take it from `self.comm` or just created
    // it); `state` is a valid, writable ncclResult_t.
    let rc = unsafe { nccl_sys::ncclCommGetAsyncError(comm, &mut state) };
    if rc != nccl_sys::ncclResult_t::ncclSuccess {
        return Err(Fault::Failed(format!(
            "ncclCommGetAsyncError: {}",
            nccl_error_text(rc)
        )));
    }
    match state {
        nccl_sys::ncclResult_t::ncclSuccess => Ok(true),
        nccl_sys::ncclResult_t::ncclInProgress => Ok(false),
        error => Err(Fault::Failed(nccl_error_text(error))),
    }
}

/// Whether every piece of work on `stream` has finished.
pub(super) fn stream_state(stream: cu_sys::CUstream) -> Result<bool, Fault> {
    // SAFETY: `stream` is the group's live stream, in the context bound by the caller.
    match unsafe { cu_sys::cuStreamQuery(stream) } {
        cu_sys::CUresult::CUDA_SUCCESS => Ok(true),
        cu_sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        error => Err(Fault::Failed(format!(
            "cuStreamQuery: {}",
            driver_error_text(cu::DriverError(error))
        ))),
    }
}

/// "ncclRemoteError: <NCCL's description> (<hint>); NCCL's last warning: <...>".
pub(super) fn nccl_error_text(code: nccl_sys::ncclResult_t) -> String {
    use nccl_sys::ncclResult_t as R;
    // SAFETY: ncclGetErrorString returns null or a static NUL-terminated string for any code.
    let description = unsafe { c_str(nccl_sys::ncclGetErrorString(code)) };
    // SAFETY: ncclGetLastError ignores its argument and returns NCCL's global NUL-terminated
    // last-warning buffer.
    let last = unsafe { c_str(nccl_sys::ncclGetLastError(std::ptr::null_mut())) };
    let hint = match code {
        R::ncclRemoteError | R::ncclSystemError => {
            " (a peer probably exited or crashed, or the network failed: look at the other ranks' logs)"
        }
        R::ncclUnhandledCudaError => " (a CUDA call inside NCCL failed)",
        R::ncclInvalidUsage => {
            " (e.g. two ranks on one GPU, or ranks that called different collectives)"
        }
        _ => "",
    };
    let mut text = format!("{code:?}: {description}{hint}");
    if !last.is_empty() {
        text.push_str("; NCCL's last warning: ");
        text.push_str(&last);
    }
    text
}

/// # Safety
/// `ptr` is null or points to a NUL-terminated string that stays valid during the call.
unsafe fn c_str(ptr: *const c_char) -> String {
    if ptr.is_null() {
        String::new()
    } else {
        // SAFETY: non-null and NUL-terminated (the caller's contract).
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::element::Element;

    #[test]
    fn config_is_nccl_config_initializer_with_blocking_off() {
        let c = nonblocking_config();
        assert_eq!(c.size, std::mem::size_of::<nccl_sys::ncclConfig_t>());
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.version, 23000);
        assert_eq!(c.blocking, 0);
        assert_eq!(
            (c.minCTAs, c.maxCTAs, c.cgaClusterSize),
            (i32::MIN, i32::MIN, i32::MIN)
        );
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn element_types_and_ops_map_to_nccl() {
        use nccl_sys::{ncclDataType_t as T, ncclRedOp_t as O};
        assert_eq!(nccl_dtype(f32::DTYPE), T::ncclFloat32);
        assert_eq!(nccl_dtype(f64::DTYPE), T::ncclFloat64);
        assert_eq!(nccl_dtype(i32::DTYPE), T::ncclInt32);
        assert_eq!(nccl_dtype(i64::DTYPE), T::ncclInt64);
        assert_eq!(nccl_dtype(u8::DTYPE), T::ncclUint8);
        assert_eq!(nccl_dtype(half::bf16::DTYPE), T::ncclBfloat16);
        assert_eq!(nccl_dtype(half::f16::DTYPE), T::ncclFloat16);
        assert_eq!(nccl_op(ReduceOp::Avg), O::ncclAvg);
        assert_eq!(nccl_op(ReduceOp::Sum), O::ncclSum);
        assert_eq!(nccl_op(ReduceOp::Max), O::ncclMax);
        assert_eq!(nccl_op(ReduceOp::Min), O::ncclMin);
    }
}
