//! NCCL for gradient buckets (feature `cuda`): [`NcclBuckets`], the [`BucketComm`] that sums
//! buckets without leaving the GPU, the device addresses it needs, [`cuda_ordinal`] (whether a
//! training device is a CUDA one); the DDP step's NCCL path is the reducer over `NcclBuckets`
//! (`ddp::gradient_sync`).
//!
//! The [`Reducer`](crate::ddp::Reducer) does the rest, as for every other device; per bucket:
//!
//! ```text
//!   1. pack      BucketOps::pack_bucket: one fresh contiguous f32 buffer, on Burn's stream
//!                [BucketOps::compress_bucket: a fresh buffer of packed bf16 / fp16]
//!   2. address   client.get_resource::<Server>(handle) ─▶ CUdeviceptr (pool + view offset)
//!   3. fence     Cube::sync(device): Burn's CubeCL stream has finished the pack
//!   4. reduce    NcclProcessGroup::all_reduce_device(ptr, n, F32 | BF16 | F16, Sum), in place,
//!                on the group's own stream; it returns once that stream is idle
//!   5. unpack    BucketOps::unpack_bucket(bucket, shapes, 1/world) on Burn's stream
//!                [compressed: decompress_bucket, then unpack with scale 1: the 1/world was
//!                applied by compress_bucket]
//! ```
//!
//! # Why this ordering is enough (read from burn-cubecl 0.21.0 and cubecl 0.10.0; the calls
//! used are the same in burn-cubecl 0.22.1 / cubecl 0.11.3, where `get_resource` also checks that
//! the client is the CUDA runtime's and fails otherwise instead of panicking)
//! - **Addresses.** `ComputeClient::get_resource` (cubecl-runtime `src/client.rs`) runs the
//!   CUDA server's `get_resource` (cubecl-cuda `src/compute/server.rs`), which asks the memory
//!   manager for the handle's slice with the handle's `offset_start`/`offset_end`
//!   (cubecl-runtime `memory_management/memory_manage.rs`, `get_resource`), and `GpuStorage::get`
//!   (cubecl-cuda `compute/storage/gpu.rs`) returns `GpuResource { ptr: base + offset, size }`.
//!   So `ptr` is the address of the tensor's first element, pool and view offsets included.
//! - **Lifetimes.** The returned `ManagedResource` holds a binding of the memory (cubecl-runtime
//!   `storage/base.rs`: "here just to keep the underlying allocation alive"), and the bucket
//!   tensor itself is alive too: neither can be freed or reused by the pool until both are
//!   dropped, which happens only after NCCL has returned (see `with_device_ptr`).
//! - **Before NCCL.** CubeCL runs each thread's work on a private, non-blocking stream of the
//!   device's *primary* context (cubecl-cuda `src/runtime.rs`: `primary_ctx::retain`), which the
//!   NCCL group's stream does not wait for. `Backend::sync` for `CubeBackend` (burn-cubecl
//!   `src/backend.rs`) is `client.sync()`, which the server turns into a fence on the calling
//!   thread's stream and waits for (cubecl-cuda `compute/command.rs`, `Command::sync`). The
//!   server handles a client's requests in order, so the pack launches submitted before it are
//!   covered. The fence comes after `get_resource` so that it also covers anything the address
//!   lookup may have enqueued.
//! - **Under fusion.** Where a crate of the build turns on `burn-cubecl`'s `fusion` feature,
//!   `burn_cubecl::Cube` is `Fusion<CubeBackend>`: the bucket is a fusion handle, resolved to its
//!   CUDA tensor from a clone (which drains the fusion stream; the fusion server then keeps the
//!   tensor registered, so the handle still names the buffer NCCL writes). The fence is then
//!   `Fusion::sync`, which runs `CubeBackend::sync` on the fusion server's thread, whose stream
//!   ran the fused work. This configuration has not run on a GPU yet.
//! - **After NCCL.** [`NcclProcessGroup::all_reduce_device`] returns only after its stream has
//!   finished the all-reduce (it polls `cuStreamQuery`), so the result is complete in device
//!   memory before the unpack kernel is even enqueued on Burn's stream.
//! - **Threads.** Without fusion everything happens on the calling thread: the CubeCL stream
//!   synchronised in step 3 is the one the training loop's kernels ran on. The NCCL group binds
//!   the same primary context to the thread before each call.
//!
//! # Differences from host staging
//! - A job of one rank still runs every step above ([`BucketComm::reduces_alone`]), which is
//!   how a machine with a single GPU tests this path (NCCL refuses two ranks on one GPU). A
//!   training loop that wants the free no-op for a job of one uses host staging.
//! - Each bucket costs one host wait for Burn's stream (step 3) and one for NCCL's (step 4):
//!   communication does not overlap computation yet. Overlap needs CUDA events between the two
//!   streams, or Burn's `distributed` autodiff hooks (see the notes on the GPU path).
//! - NCCL writes into the packed buffer: on unfused CubeCL backends `pack_bucket` and
//!   `compress_bucket` always return a fresh buffer that no other tensor shares. Under fusion
//!   (Burn ops) a bucket of a single gradient may be that gradient's own buffer; the reducer has
//!   taken the gradient out of `GradientsParams` and never reads it again, so the write is
//!   seen only through the bucket.
//! - bf16 needs NCCL ≥ 2.10 (and a GPU of compute capability 8.0 or newer for fast reductions).

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{
    Backend, BackendTensor, BackendTypes, DType, Dispatch, DispatchAutodiffContext, DispatchDevice,
    DispatchTensor, DispatchTensorKind, TensorMetadata,
};
use burn::tensor::Device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{Cube, CubeBackend, CubeDevice};
use cubecl::cuda::CudaRuntime;
use cubecl_runtime::runtime::Runtime;

use crate::ddp::buckets::comm::BucketComm;
use crate::ddp::buckets::finite::FiniteScan;
use crate::error::DdpError;
use crate::group::nccl::NcclProcessGroup;
use crate::group::{DataType, ReduceOp};
use crate::kernels::HalfFormat;

/// The CUDA ordinal of `device` (in the numbering `CUDA_VISIBLE_DEVICES` leaves) when it is a
/// device of Burn's CUDA runtime, autodiff or not; `None` for every other device. Where the DDP
/// step may average gradients with NCCL.
pub fn cuda_ordinal(device: &Device) -> Option<usize> {
    dispatch_cuda_ordinal(device.as_dispatch())
}

fn dispatch_cuda_ordinal(device: &DispatchDevice) -> Option<usize> {
    match device {
        DispatchDevice::Cube(CubeDevice::Cuda(cuda)) => Some(cuda.index),
        DispatchDevice::Autodiff(device) => dispatch_cuda_ordinal(device),
        _ => None,
    }
}

/// The plain CubeCL tensor behind a primitive of `burn_cubecl::Cube`, whichever type that is in
/// this build (module docs, "Under fusion"). Both share the bucket's buffer.
trait CubeBuffers: BackendTypes {
    fn plain_float(tensor: &FloatTensor<Self>) -> CubeTensor;
    fn plain_int(tensor: &IntTensor<Self>) -> CubeTensor;
}

impl CubeBuffers for CubeBackend {
    fn plain_float(tensor: &CubeTensor) -> CubeTensor {
        tensor.clone()
    }

    fn plain_int(tensor: &CubeTensor) -> CubeTensor {
        tensor.clone()
    }
}

impl<B> CubeBuffers for burn_fusion::Fusion<B>
where
    B: burn_fusion::FusionBackend
        + BackendTypes<FloatTensorPrimitive = CubeTensor, IntTensorPrimitive = CubeTensor>,
{
    fn plain_float(tensor: &FloatTensor<Self>) -> CubeTensor {
        // Resolved from a clone: the fusion server then keeps the tensor registered (read-only
        // status) instead of handing its buffer over, so `tensor` still names that buffer and
        // sees what NCCL writes into it. Resolving drains the fusion stream first.
        tensor.client.resolve_tensor_float::<B>(tensor.clone())
    }

    fn plain_int(tensor: &IntTensor<Self>) -> CubeTensor {
        // As in `plain_float`.
        tensor.client.resolve_tensor_int::<B>(tensor.clone())
    }
}

/// The `Cube` primitive of a bucket, or why NCCL cannot take it.
fn cube_primitive<'a>(
    tensor: &'a DispatchTensor,
    what: &str,
) -> Result<&'a BackendTensor<Cube>, DdpError> {
    match tensor {
        DispatchTensor {
            kind: DispatchTensorKind::Cube(primitive),
            autodiff: DispatchAutodiffContext::Disabled,
        } => Ok(primitive),
        other => Err(DdpError::Device(format!(
            "NCCL sums {what} of Burn's CUDA backend, got a tensor on {:?}",
            other.device()
        ))),
    }
}

/// Calls `f` with the device address of the first element of `bucket` (a contiguous `f32`
/// tensor of Burn's CUDA backend), at a point where every device operation enqueued on Burn's
/// stream (the one that wrote `bucket` included) has finished. The memory stays allocated, and
/// is not handed to another tensor, until `f` returns.
///
/// Local (not collective). `f` may read and write the `numel × 4` bytes at the address (the
/// caller must then not have given `bucket` to anything else).
///
/// # Errors
/// [`DdpError::Device`] when `bucket` is not a contiguous `f32` CUDA tensor, when the backend
/// cannot give its address, or when device work failed before this point; otherwise what `f`
/// returns.
pub(crate) fn with_float_ptr<T>(
    bucket: &FloatTensor<Dispatch>,
    f: impl FnOnce(u64) -> Result<T, DdpError>,
) -> Result<T, DdpError> {
    let cube = match cube_primitive(bucket, "float buckets")? {
        BackendTensor::Float(tensor) => Cube::plain_float(tensor),
        other => {
            return Err(DdpError::Device(format!(
                "a gradient bucket must be a float tensor, got {}",
                other.name()
            )))
        }
    };
    with_cube_ptr(&cube, DType::F32, f)
}

/// [`with_float_ptr`] for a compressed bucket: a contiguous `u32` tensor of packed 16-bit values.
pub(crate) fn with_int_ptr<T>(
    words: &IntTensor<Dispatch>,
    f: impl FnOnce(u64) -> Result<T, DdpError>,
) -> Result<T, DdpError> {
    let cube = match cube_primitive(words, "compressed buckets")? {
        BackendTensor::Int(tensor) => Cube::plain_int(tensor),
        other => {
            return Err(DdpError::Device(format!(
                "a compressed bucket must be an int tensor, got {}",
                other.name()
            )))
        }
    };
    with_cube_ptr(&cube, DType::U32, f)
}

/// [`with_float_ptr`] for a `CubeTensor` of the 4-byte `dtype`.
fn with_cube_ptr<T>(
    tensor: &CubeTensor,
    dtype: DType,
    f: impl FnOnce(u64) -> Result<T, DdpError>,
) -> Result<T, DdpError> {
    let bytes = check_buffer(
        tensor.dtype,
        dtype,
        tensor.is_contiguous(),
        tensor.shape().num_elements(),
        tensor.handle.size_in_used(),
    )
    .map_err(DdpError::Device)?;
    // Pins the allocation for as long as `resource` lives (module docs, "Lifetimes"). Fails,
    // without panicking, for a tensor of another CubeCL runtime.
    let resource = tensor
        .client
        .get_resource::<<CudaRuntime as Runtime>::Server>(tensor.handle.clone())
        .map_err(|e| DdpError::Device(format!("cannot get the device address of a bucket: {e}")))?;
    let gpu = resource.resource();
    if gpu.size < bytes as u64 {
        return Err(DdpError::Device(format!(
            "the bucket's device buffer holds {} bytes, less than its {bytes} bytes of data",
            gpu.size
        )));
    }
    let ptr = gpu.ptr;
    // Module docs, "Before NCCL" / "Under fusion": waits for Burn's CubeCL stream.
    <Cube as Backend>::sync(&tensor.device).map_err(|e| {
        DdpError::Device(format!(
            "device work before the gradient all-reduce failed: {e:?}"
        ))
    })?;
    let result = f(ptr);
    drop(resource);
    result
}

/// Checks that a tensor can be handed to NCCL as one dense array of the 4-byte `expected`
/// dtype and returns its size in bytes (pure, so it is tested without a GPU).
fn check_buffer(
    dtype: DType,
    expected: DType,
    contiguous: bool,
    numel: usize,
    handle_bytes: u64,
) -> Result<usize, String> {
    if dtype != expected {
        return Err(format!(
            "a gradient bucket must be {expected:?}, got {dtype:?}"
        ));
    }
    if !contiguous {
        return Err("a gradient bucket must be contiguous".into());
    }
    let bytes = numel
        .checked_mul(4)
        .ok_or_else(|| format!("a bucket of {numel} 4-byte elements overflows usize"))?;
    if handle_bytes < bytes as u64 {
        return Err(format!(
            "the bucket's handle covers {handle_bytes} bytes, less than its {bytes} bytes of data"
        ));
    }
    Ok(bytes)
}

/// Sums gradient buckets with NCCL, in place on the GPU: the [`BucketComm`] of Burn's CUDA
/// backend. See the module docs for the ordering with Burn's stream.
pub struct NcclBuckets<'a>(pub &'a mut NcclProcessGroup);

impl NcclBuckets<'_> {
    /// NCCL may only be handed memory of the group's own GPU.
    fn check_device(&self, device: &DispatchDevice) -> Result<(), DdpError> {
        let group = self.0.device();
        let Some(bucket) = dispatch_cuda_ordinal(device) else {
            return Err(DdpError::Device(format!(
                "the gradients are on {device:?}, not a CUDA device: NCCL (CUDA device {group}) \
                 cannot sum them"
            )));
        };
        if bucket != group {
            return Err(DdpError::Device(format!(
                "the gradients are on CUDA device {bucket} but the NCCL group was formed on \
                 device {group}: form the group with the ordinal of the model's device"
            )));
        }
        Ok(())
    }
}

impl BucketComm for NcclBuckets<'_> {
    fn world_size(&self) -> usize {
        crate::group::ProcessGroup::world_size(&*self.0)
    }

    /// `true`: one rank on one GPU runs the whole NCCL path (module docs).
    fn reduces_alone(&self) -> bool {
        true
    }

    fn all_reduce_f32(
        &mut self,
        bucket: FloatTensor<Dispatch>,
        scan: &mut FiniteScan,
    ) -> Result<FloatTensor<Dispatch>, DdpError> {
        self.check_device(&bucket.device())?;
        // The bucket never leaves the GPU: check it there (one reduction, one value read).
        scan.device_f32(&bucket)?;
        let count = bucket.shape().num_elements();
        with_float_ptr(&bucket, |ptr| {
            // SAFETY: `ptr` addresses `bucket`, a contiguous f32 tensor of `count` elements
            // (checked by `with_float_ptr`), in a buffer of the group's CUDA device (checked
            // above) that `with_float_ptr` keeps allocated until this closure returns. Nothing
            // else reads or writes it meanwhile: the reducer gives NCCL the fresh buffer
            // `pack_bucket` returned, and Burn's work on it has finished (the sync in
            // `with_float_ptr`).
            unsafe {
                self.0
                    .all_reduce_device(ptr, count, DataType::F32, ReduceOp::Sum)
            }
            .map_err(DdpError::from)
        })?;
        Ok(bucket)
    }

    fn all_reduce_half(
        &mut self,
        words: IntTensor<Dispatch>,
        len: usize,
        format: HalfFormat,
        scan: &mut FiniteScan,
    ) -> Result<IntTensor<Dispatch>, DdpError> {
        self.check_device(&words.device())?;
        scan.device_half(&words, format)?;
        let capacity = words.shape().num_elements() * 2;
        if len > capacity {
            return Err(DdpError::Unsupported(format!(
                "a compressed bucket of {} words cannot hold {len} values",
                capacity / 2
            )));
        }
        let dtype = match format {
            HalfFormat::Bf16 => DataType::BF16,
            HalfFormat::F16 => DataType::F16,
        };
        with_int_ptr(&words, |ptr| {
            // SAFETY: as in `all_reduce_f32`, for the fresh buffer `compress_bucket` returned:
            // `len` 16-bit values fit in its `capacity / 2` u32 words (checked above).
            unsafe { self.0.all_reduce_device(ptr, len, dtype, ReduceOp::Sum) }
                .map_err(DdpError::from)
        })?;
        Ok(words)
    }

    fn gather_flags(&mut self, local: bool) -> Result<Vec<bool>, DdpError> {
        crate::ddp::buckets::comm::gather_flags(self.0, local)
    }
}

#[cfg(test)]
mod tests {
    //! Without a GPU only the pure checks run; with CUDA (and NCCL) the device tests below run
    //! too, and print `skipped: ...` where the machine lacks them.
    use std::sync::Arc;
    use std::time::Duration;

    use burn::backend::ops::FloatTensorOps;
    use burn::backend::{FlexDevice, Shape, TensorData};
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::GradientsParams;
    use burn::prelude::*;
    use cubecl::device::CudaDevice;

    use super::*;
    use crate::cuda::{check_cuda_available, check_nccl_available};
    use crate::ddp::buckets::plan::plan_buckets;
    use crate::ddp::{HostStaging, Reducer, ReducerStats};
    use crate::host_values::host_values;
    use crate::kernels::BucketOps;
    use crate::store::{MemoryStore, Store};
    use crate::testing::Needs;

    #[test]
    fn buffers_must_be_dense_and_of_the_expected_dtype() {
        let f32 = DType::F32;
        assert_eq!(check_buffer(f32, f32, true, 10, 40), Ok(40));
        assert_eq!(check_buffer(f32, f32, true, 10, 64), Ok(40));
        assert_eq!(check_buffer(f32, f32, true, 0, 0), Ok(0));
        assert_eq!(check_buffer(DType::U32, DType::U32, true, 3, 12), Ok(12));
        let e = check_buffer(DType::F16, f32, true, 10, 40).unwrap_err();
        assert!(e.contains("F32") && e.contains("F16"), "{e}");
        let e = check_buffer(f32, DType::U32, true, 10, 40).unwrap_err();
        assert!(e.contains("U32") && e.contains("F32"), "{e}");
        let e = check_buffer(f32, f32, false, 10, 40).unwrap_err();
        assert!(e.contains("contiguous"), "{e}");
        let e = check_buffer(f32, f32, true, 10, 39).unwrap_err();
        assert!(e.contains("39") && e.contains("40"), "{e}");
        assert!(check_buffer(f32, f32, true, usize::MAX, u64::MAX).is_err());
    }

    #[test]
    fn cuda_ordinal_names_cuda_devices_only() {
        assert_eq!(cuda_ordinal(&Device::flex()), None);
        assert_eq!(cuda_ordinal(&Device::flex().autodiff()), None);
        // Naming a device opens nothing: no GPU needed.
        assert_eq!(cuda_ordinal(&Device::cuda(3)), Some(3));
        assert_eq!(cuda_ordinal(&Device::cuda(1).autodiff()), Some(1));
    }

    #[test]
    fn a_host_tensor_has_no_device_address() {
        let flex = DispatchDevice::Flex(FlexDevice);
        let bucket = Dispatch::float_from_data(TensorData::new(vec![1.0f32, 2.0], [2]), &flex);
        let e = with_float_ptr(&bucket, |_| Ok(())).unwrap_err();
        assert!(e.to_string().contains("CUDA"), "{e}");
    }

    /// CUDA device 0 (as a bucket's device), or why these tests cannot run here.
    fn cuda_device() -> Option<DispatchDevice> {
        match check_cuda_available(0) {
            Ok(_) => Some(DispatchDevice::Cube(CubeDevice::Cuda(CudaDevice::new(0)))),
            Err(e) => {
                crate::testing::skip(Needs::Gpu, &format!("no usable CUDA device: {e}"));
                None
            }
        }
    }

    fn read_f32(tensor: FloatTensor<Dispatch>) -> Vec<f32> {
        let data = burn::tensor::read_sync(Dispatch::float_into_data(tensor)).expect("read");
        host_values::<f32>(data).expect("f32")
    }

    /// The address from `with_float_ptr` is the tensor's first element — for a view at a
    /// non-zero offset too — and writes through it are what Burn reads afterwards.
    #[test]
    fn device_ptr_addresses_the_tensor_and_writes_are_seen_by_burn() {
        let Some(device) = cuda_device() else { return };
        let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let bucket = Dispatch::float_from_data(TensorData::new(values.clone(), [1000]), &device);
        // Views at an aligned, non-zero offset into one buffer (the kernel's outputs).
        let shapes = [Shape::new([3]), Shape::new([997])];
        let mut views = Dispatch::unpack_bucket(bucket, &shapes, 1.0);
        let second = views.pop().expect("two views");
        if let Ok(BackendTensor::Float(primitive)) = cube_primitive(&second, "test") {
            if let Some(plain) = (primitive as &dyn std::any::Any).downcast_ref::<CubeTensor>() {
                assert!(
                    plain.handle.offset_start.unwrap_or(0) > 0,
                    "the second view should start at an offset: {:?}",
                    plain.handle
                );
            }
        }
        let ctx = cudarc::driver::CudaContext::new(0).expect("CUDA context");
        let replacement: Vec<f32> = (0..997).map(|i| -(i as f32)).collect();
        with_float_ptr(&second, |ptr| {
            ctx.bind_to_thread().expect("bind");
            let mut read = vec![0f32; 997];
            // SAFETY: `ptr` addresses 997 f32 of the live view on device 0 (the contract of
            // `with_float_ptr`); the copies are synchronous.
            unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut read, ptr) }.expect("dtoh");
            assert_eq!(
                read,
                values[3..].to_vec(),
                "read through the device address"
            );
            // SAFETY: as above; nothing else uses the view during the closure.
            unsafe { cudarc::driver::result::memcpy_htod_sync(ptr, &replacement) }.expect("htod");
            Ok(())
        })
        .expect("with_float_ptr");
        assert_eq!(
            read_f32(second),
            replacement,
            "Burn sees what was written at the address"
        );
    }

    #[derive(Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
        c: Linear,
    }

    impl Net {
        /// 16 → 32 → 8 → 3: six gradients of 512, 32, 256, 8, 24 and 3 elements.
        fn new(device: &Device) -> Self {
            Self {
                a: LinearConfig::new(16, 32).init(device),
                b: LinearConfig::new(32, 8).init(device),
                c: LinearConfig::new(8, 3).init(device),
            }
        }
    }

    /// The autodiff CUDA device 0 where NCCL can run too, or why these tests cannot run here.
    fn nccl_device() -> Option<Device> {
        cuda_device()?;
        match check_nccl_available() {
            Ok(_) => Some(Device::cuda(0).autodiff()),
            Err(e) => {
                crate::testing::skip(Needs::Gpu, &format!("no usable NCCL: {e}"));
                None
            }
        }
    }

    /// The weights' gradients of `net` in `grads`, as host values.
    fn read_weights(net: &Net, grads: &GradientsParams) -> Vec<Vec<f32>> {
        [net.a.weight.id, net.b.weight.id, net.c.weight.id]
            .iter()
            .map(|&id| {
                let grad = grads.get::<2>(id).expect("gradient");
                host_values::<f32>(grad.into_data()).expect("f32")
            })
            .collect()
    }

    /// A one-rank NCCL group: the mean over one rank is the gradient itself, bit for bit, and
    /// every bucket of the plan goes through pack → address → NCCL → unpack; compressed, it is
    /// the gradient rounded to bf16 / fp16.
    #[test]
    fn one_rank_nccl_reducer_leaves_gradients_unchanged_or_rounded() {
        let Some(device) = nccl_device() else { return };
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let mut group = NcclProcessGroup::new(store, 0, 1, 0, Duration::from_secs(60))
            .expect("a one-rank NCCL group");
        let net = Net::new(&device);

        for compression in [None, Some(HalfFormat::Bf16), Some(HalfFormat::F16)] {
            let x = Tensor::<2>::random(
                [5, 16],
                burn::tensor::Distribution::Normal(0.0, 1.0),
                &device,
            );
            let y = net.c.forward(net.b.forward(net.a.forward(x)));
            let mut grads = GradientsParams::from_grads(y.powi_scalar(2).sum().backward(), &net);
            let before = read_weights(&net, &grads);
            let count = grads.len();

            // 300 elements per bucket: several buckets, and a weight (512) alone in its own.
            let mut reducer = Reducer::new(300.0 * 4.0 / (1u64 << 20) as f64, compression);
            let check = reducer
                .sync(&mut NcclBuckets(&mut group), &net, &mut grads)
                .expect("NCCL sync");
            assert!(check.all_finite(), "{check:?}");
            let numels = [512, 32, 256, 8, 24, 3];
            let element_bytes = if compression.is_some() { 2 } else { 4 };
            assert_eq!(
                reducer.stats(),
                ReducerStats {
                    syncs: 1,
                    bucket_all_reduces: plan_buckets(&numels, 300).len() as u64,
                    bytes_reduced: numels.iter().sum::<usize>() as u64 * element_bytes,
                }
            );
            assert_eq!(grads.len(), count, "every gradient is back");
            let want: Vec<Vec<f32>> = match compression {
                None => before,
                Some(format) => before
                    .iter()
                    .map(|g| g.iter().map(|&x| format.widen(format.round(x))).collect())
                    .collect(),
            };
            assert_eq!(read_weights(&net, &grads), want, "{compression:?}");
        }
    }

    /// Host staging forced through its whole path at world size 1 (the reducer skips a
    /// one-rank job otherwise), to compare with NCCL bit for bit.
    struct Alone<'a, G>(HostStaging<'a, G>);

    impl<G: crate::group::ProcessGroup> BucketComm for Alone<'_, G> {
        fn world_size(&self) -> usize {
            self.0.world_size()
        }
        fn reduces_alone(&self) -> bool {
            true
        }
        fn all_reduce_f32(
            &mut self,
            bucket: FloatTensor<Dispatch>,
            scan: &mut FiniteScan,
        ) -> Result<FloatTensor<Dispatch>, DdpError> {
            self.0.all_reduce_f32(bucket, scan)
        }
        fn all_reduce_half(
            &mut self,
            words: IntTensor<Dispatch>,
            len: usize,
            format: HalfFormat,
            scan: &mut FiniteScan,
        ) -> Result<IntTensor<Dispatch>, DdpError> {
            self.0.all_reduce_half(words, len, format, scan)
        }
        fn gather_flags(&mut self, local: bool) -> Result<Vec<bool>, DdpError> {
            self.0.gather_flags(local)
        }
    }

    /// On the GPU, the host-staging path and NCCL give the same gradients bit for bit (f32,
    /// bf16, fp16), and both find a NaN the same way (device check vs host scan).
    #[test]
    fn host_staging_and_nccl_agree_bit_for_bit_on_cuda() {
        use crate::group::{TcpGroupOptions, TcpProcessGroup};
        let Some(device) = nccl_device() else { return };
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let mut nccl = NcclProcessGroup::new(store.clone(), 0, 1, 0, Duration::from_secs(60))
            .expect("a one-rank NCCL group");
        let mut tcp = TcpProcessGroup::new(store, 0, 1, TcpGroupOptions::default())
            .expect("a one-rank TCP group");
        let net = Net::new(&device);
        let grads_for = |poison: f32| {
            device.seed(3);
            let x = Tensor::<2>::random(
                [5, 16],
                burn::tensor::Distribution::Normal(0.0, 1.0),
                &device,
            )
            .add_scalar(poison);
            let y = net.c.forward(net.b.forward(net.a.forward(x)));
            GradientsParams::from_grads(y.powi_scalar(2).sum().backward(), &net)
        };
        let bits = |grads: &GradientsParams| -> Vec<Vec<u32>> {
            read_weights(&net, grads)
                .iter()
                .map(|values| values.iter().map(|v| v.to_bits()).collect())
                .collect()
        };
        for compression in [None, Some(HalfFormat::Bf16), Some(HalfFormat::F16)] {
            let mut reducer = Reducer::new(300.0 * 4.0 / (1u64 << 20) as f64, compression);
            let (mut on_gpu, mut via_host) = (grads_for(0.0), grads_for(0.0));
            reducer
                .sync(&mut NcclBuckets(&mut nccl), &net, &mut on_gpu)
                .expect("NCCL sync");
            reducer
                .sync(&mut Alone(HostStaging(&mut tcp)), &net, &mut via_host)
                .expect("host sync");
            assert_eq!(bits(&on_gpu), bits(&via_host), "{compression:?}");

            let (mut on_gpu, mut via_host) = (grads_for(f32::NAN), grads_for(f32::NAN));
            let gpu_check = reducer
                .sync(&mut NcclBuckets(&mut nccl), &net, &mut on_gpu)
                .expect("NCCL sync");
            let host_check = reducer
                .sync(&mut Alone(HostStaging(&mut tcp)), &net, &mut via_host)
                .expect("host sync");
            assert_eq!(gpu_check.nonfinite_ranks, [0], "{compression:?}");
            assert_eq!(host_check.nonfinite_ranks, [0], "{compression:?}");
        }
    }
}
