//! [`DeviceReducer`]: averages gradients across ranks without leaving the GPU (feature `cuda`).
//!
//! The same job as [`Reducer`](super::Reducer), with NCCL instead of the host:
//!
//! ```text
//! loss.backward() ─▶ GradientsParams ─▶ take each gradient out, in visit order (device tensors)
//!                                    ─▶ plan buckets (bucket.rs, the same plan as the host path)
//!   for each bucket:
//!     1. pack      BucketOps::pack_bucket: one fresh contiguous f32 buffer, on Burn's stream
//!     2. address   client.get_resource(handle) ─▶ CUdeviceptr (pool offset + view offset)
//!     3. fence     B::sync(device): this thread's CubeCL stream has finished the pack
//!     4. reduce    NcclProcessGroup::all_reduce_device(ptr, numel, F32, Avg), in place, on the
//!                  group's own stream; it returns once that stream is idle
//!     5. unpack    BucketOps::unpack_bucket(bucket, shapes, 1.0) on Burn's stream
//!   ─▶ register the averaged gradients back ─▶ optimizer.step()
//! ```
//!
//! # Why this ordering is enough (read from burn-cubecl 0.21.0, cubecl 0.10.0)
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
//! - **After NCCL.** [`NcclProcessGroup::all_reduce_device`] returns only after its stream has
//!   finished the all-reduce (it polls `cuStreamQuery`), so the result is complete in device
//!   memory before the unpack kernel is even enqueued on Burn's stream.
//! - **Threads.** Everything happens on the calling thread: the CubeCL stream synchronised in
//!   step 3 is the one the training loop's kernels ran on. The NCCL group binds the same primary
//!   context to the thread before each call.
//!
//! # Differences from the host [`Reducer`](super::Reducer)
//! - It does **not** return early with a world size of 1: a one-rank NCCL group runs every step
//!   above, which is how a machine with a single GPU tests this path (NCCL refuses two ranks on
//!   one GPU). A training loop that wants the free no-op for a job of one uses the host path.
//! - Each bucket costs one host wait for Burn's stream (step 3) and one for NCCL's (step 4):
//!   communication does not overlap computation yet. Overlap needs CUDA events between the two
//!   streams, or Burn's `distributed` autodiff hooks (see the notes on the GPU path).
//! - A bucket holding a single gradient is still packed (a copy), so that NCCL never writes into
//!   a buffer that another tensor may share.
//!
//! # Not yet: bf16 on the wire
//! `gradient_compression = "bf16"` would `BucketOps::compress_bf16` each bucket, all-reduce the
//! packed words as `ncclBfloat16` (NCCL ≥ 2.10 with CUDA ≥ 11; `ncclAvg` works for it) and
//! `decompress_bf16` them. It needs a `DataType::BF16` in `group/mod.rs` (the TCP group would
//! refuse it with `CollectiveError::InvalidArgument`, as it cannot reduce bf16) and its mapping in
//! `group/nccl.rs`. TODO.

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{DType, FloatDType, Shape, TensorMetadata, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::cuda::CudaRuntime;

use super::bucket::plan_buckets;
use super::reducer::ReducerStats;
use crate::error::DdpError;
use crate::group::nccl::NcclProcessGroup;
use crate::group::{DataType, ReduceOp};
use crate::kernels::BucketOps;

/// A backend whose float tensors live in CUDA device memory that NCCL can address: what
/// [`DeviceReducer`] needs on top of [`BucketOps`].
///
/// Implemented for Burn's plain CUDA backend, `CubeBackend<CudaRuntime, F, I, BT>` (what
/// `burn::backend::Cuda` is with this workspace's features). Burn-version-specific code stays in
/// this file.
pub trait CudaBuffers: BucketOps {
    /// Calls `f` with the device address of `tensor`'s first element, at a point where every
    /// device operation this thread enqueued on the backend (the one that wrote `tensor`
    /// included) has finished. The memory stays allocated, and is not handed to another tensor,
    /// until `f` returns.
    ///
    /// Local (not collective). `f` may read and write the `numel × 4` bytes at the address (the
    /// caller must then not have given `tensor` to anything else).
    ///
    /// # Errors
    /// [`DdpError::Device`] when `tensor` is not a contiguous `f32` tensor, when the backend
    /// cannot give its address, or when device work failed before this point; otherwise what
    /// `f` returns.
    fn with_device_ptr<T>(
        tensor: &FloatTensor<Self>,
        f: impl FnOnce(u64) -> Result<T, DdpError>,
    ) -> Result<T, DdpError>;
}

impl<F, I, BT> CudaBuffers for CubeBackend<CudaRuntime, F, I, BT>
where
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn with_device_ptr<T>(
        tensor: &CubeTensor<CudaRuntime>,
        f: impl FnOnce(u64) -> Result<T, DdpError>,
    ) -> Result<T, DdpError> {
        let bytes = check_buffer(
            tensor.dtype,
            tensor.is_contiguous(),
            tensor.shape().num_elements(),
            tensor.handle.size_in_used(),
        )
        .map_err(DdpError::Device)?;
        // Pins the allocation for as long as `resource` lives (module docs, "Lifetimes").
        let resource = tensor
            .client
            .get_resource(tensor.handle.clone())
            .map_err(|e| {
                DdpError::Device(format!("cannot get the device address of a bucket: {e}"))
            })?;
        let gpu = resource.resource();
        if gpu.size < bytes as u64 {
            return Err(DdpError::Device(format!(
                "the bucket's device buffer holds {} bytes, less than its {bytes} bytes of data",
                gpu.size
            )));
        }
        let ptr = gpu.ptr;
        // Module docs, "Before NCCL": waits for this thread's CubeCL stream.
        <Self as Backend>::sync(&tensor.device).map_err(|e| {
            DdpError::Device(format!(
                "device work before the gradient all-reduce failed: {e:?}"
            ))
        })?;
        let result = f(ptr);
        drop(resource);
        result
    }
}

/// Checks that a tensor can be handed to NCCL as one dense `f32` array and returns its size in
/// bytes (pure, so it is tested without a GPU).
fn check_buffer(
    dtype: DType,
    contiguous: bool,
    numel: usize,
    handle_bytes: u64,
) -> Result<usize, String> {
    if dtype != DType::F32 {
        return Err(format!("a gradient bucket must be f32, got {dtype:?}"));
    }
    if !contiguous {
        return Err("a gradient bucket must be contiguous".into());
    }
    let bytes = numel
        .checked_mul(4)
        .ok_or_else(|| format!("a bucket of {numel} f32 elements overflows usize"))?;
    if handle_bytes < bytes as u64 {
        return Err(format!(
            "the bucket's handle covers {handle_bytes} bytes, less than its {bytes} bytes of data"
        ));
    }
    Ok(bytes)
}

/// Averages gradients across the ranks of an [`NcclProcessGroup`], on the device, in buckets.
/// See the module docs.
#[derive(Debug, Clone)]
pub struct DeviceReducer {
    bucket_cap_elems: usize,
    stats: ReducerStats,
}

impl DeviceReducer {
    /// `bucket_cap_mb`: largest bucket in MiB of f32 gradients (PyTorch's default is 25). The
    /// same value gives the same buckets as [`Reducer::new`](super::Reducer::new).
    pub fn new(bucket_cap_mb: f64) -> Self {
        Self {
            bucket_cap_elems: super::bucket::cap_elements(bucket_cap_mb),
            stats: ReducerStats::default(),
        }
    }

    pub fn stats(&self) -> ReducerStats {
        self.stats
    }

    /// Replaces every gradient in `grads` with its mean over the ranks of `group`.
    ///
    /// Collective: every rank calls it once per optimizer step, with gradients of the same
    /// model, so that every rank issues the same all-reduces in the same order (the bucket plan
    /// is a function of the parameter sizes in visit order). Parameters without a gradient are
    /// skipped; which parameters have one must be the same on every rank (a difference shows as
    /// a length mismatch with `check_collectives`, else as an NCCL hang until the timeout).
    ///
    /// Gradients stay on the device. They come back as `f32` tensors cast to their original
    /// dtype, with their original shapes; their buffers are new. Unlike
    /// [`Reducer::sync`](super::Reducer::sync), a world size of 1 runs the full path (module
    /// docs).
    ///
    /// # Errors
    /// [`DdpError::Collective`] when NCCL fails or times out (the group is then aborted and
    /// every later call fails); [`DdpError::Device`] when CubeCL cannot give a bucket's address
    /// or device work failed. `grads` may then have lost gradients: stop training.
    ///
    /// # Panics
    /// If one parameter has more than 2^31 - 1 elements (the bucket kernels index with 32 bits).
    pub fn sync<B, M>(
        &mut self,
        group: &mut NcclProcessGroup,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<(), DdpError>
    where
        B: AutodiffBackend,
        B::InnerBackend: CudaBuffers,
        M: AutodiffModule<B>,
    {
        self.stats.syncs += 1;
        let mut taker = TakeGrads::<B> {
            grads,
            taken: Vec::new(),
        };
        model.visit(&mut taker);
        let mut taken = taker.taken;

        let numels: Vec<usize> = taken.iter().map(|g| g.shape.num_elements()).collect();
        for bucket in plan_buckets(&numels, self.bucket_cap_elems) {
            let mut inputs = Vec::with_capacity(bucket.params.len());
            let mut shapes = Vec::with_capacity(bucket.params.len());
            for &p in &bucket.params {
                // Each parameter is in exactly one bucket (bucket.rs), so it is still here.
                let Some(tensor) = taken[p].tensor.take() else {
                    unreachable!("parameter {p} planned into two buckets");
                };
                inputs.push(tensor);
                shapes.push(taken[p].shape.clone());
            }
            let device = B::InnerBackend::float_device(&inputs[0]);

            // Steps 1–4 of the module docs.
            let packed = B::InnerBackend::pack_bucket(inputs, &device);
            B::InnerBackend::with_device_ptr(&packed, |ptr| {
                // SAFETY: `ptr` addresses `packed`, a contiguous f32 tensor of `bucket.numel`
                // elements (checked by `with_device_ptr`; `pack_bucket` sums the plan's sizes) in
                // a buffer of this process's CUDA device that `with_device_ptr` keeps allocated
                // until this closure returns. Nothing else reads or writes it meanwhile: a CubeCL
                // `pack_bucket` returns a freshly allocated buffer no other tensor refers to, and
                // Burn's work on it has finished (the sync in `with_device_ptr`). The group's
                // device is Burn's: the trainer forms it with the ordinal of the `CudaDevice`.
                unsafe { group.all_reduce_device(ptr, bucket.numel, DataType::F32, ReduceOp::Avg) }
                    .map_err(DdpError::from)
            })?;

            // Step 5: NCCL already averaged, so no scaling here.
            let outputs = B::InnerBackend::unpack_bucket(packed, &shapes, 1.0);
            for (&p, out) in bucket.params.iter().zip(outputs) {
                let out = if taken[p].dtype == DType::F32 {
                    out
                } else {
                    B::InnerBackend::float_cast(out, FloatDType::from(taken[p].dtype))
                };
                taken[p].tensor = Some(out);
            }
            self.stats.bucket_all_reduces += 1;
            self.stats.bytes_reduced += bucket.numel as u64 * 4;
        }

        let mut putter = PutGrads::<B> {
            grads,
            taken: taken.into_iter().peekable(),
        };
        model.visit(&mut putter);
        Ok(())
    }
}

/// A gradient taken out of `GradientsParams`, still on the device.
struct TakenGrad<B: Backend> {
    id: ParamId,
    /// `None` only while its bucket is being reduced.
    tensor: Option<FloatTensor<B>>,
    shape: Shape,
    dtype: DType,
}

/// Removes every float parameter's gradient, in visit order.
struct TakeGrads<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    taken: Vec<TakenGrad<B::InnerBackend>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for TakeGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let shape = grad.shape();
            let dtype = grad.dtype();
            self.taken.push(TakenGrad {
                id: param.id,
                tensor: Some(grad.into_primitive().tensor()),
                shape,
                dtype,
            });
        }
    }
}

/// Puts the (averaged) gradients back, matching them to parameters by visit order.
struct PutGrads<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    taken: std::iter::Peekable<std::vec::IntoIter<TakenGrad<B::InnerBackend>>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for PutGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.taken.peek().is_some_and(|g| g.id == param.id) {
            if let Some(TakenGrad {
                tensor: Some(tensor),
                ..
            }) = self.taken.next()
            {
                let tensor =
                    Tensor::<B::InnerBackend, D>::from_primitive(TensorPrimitive::Float(tensor));
                self.grads.register(param.id, tensor);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Without a GPU only the pure checks run; with CUDA (and NCCL) the device tests below run
    //! too, and print `skipped: ...` where the machine lacks them.
    use std::sync::Arc;
    use std::time::Duration;

    use burn::backend::cuda::CudaDevice;
    use burn::backend::{Autodiff, Cuda};
    use burn::nn::{Linear, LinearConfig};

    use super::*;
    use crate::cuda::{check_cuda_available, check_nccl_available};
    use crate::store::{MemoryStore, Store};

    #[test]
    fn buffers_must_be_dense_f32() {
        assert_eq!(check_buffer(DType::F32, true, 10, 40), Ok(40));
        assert_eq!(check_buffer(DType::F32, true, 10, 64), Ok(40));
        assert_eq!(check_buffer(DType::F32, true, 0, 0), Ok(0));
        let e = check_buffer(DType::F16, true, 10, 40).unwrap_err();
        assert!(e.contains("f32") && e.contains("F16"), "{e}");
        let e = check_buffer(DType::F32, false, 10, 40).unwrap_err();
        assert!(e.contains("contiguous"), "{e}");
        let e = check_buffer(DType::F32, true, 10, 39).unwrap_err();
        assert!(e.contains("39") && e.contains("40"), "{e}");
        assert!(check_buffer(DType::F32, true, usize::MAX, u64::MAX).is_err());
    }

    #[test]
    fn bucket_cap_matches_the_host_reducer() {
        assert_eq!(DeviceReducer::new(1.0).bucket_cap_elems, 1 << 18);
        assert_eq!(DeviceReducer::new(0.0).bucket_cap_elems, 1);
        assert_eq!(DeviceReducer::new(1.0).stats(), ReducerStats::default());
    }

    /// The CUDA device 0, or why these tests cannot run here.
    fn cuda_device() -> Option<CudaDevice> {
        match check_cuda_available(0) {
            Ok(_) => Some(CudaDevice::new(0)),
            Err(e) => {
                eprintln!("skipped: no usable CUDA device: {e}");
                None
            }
        }
    }

    /// The address from `with_device_ptr` is the tensor's first element — for a view at a
    /// non-zero offset too — and writes through it are what Burn reads afterwards.
    #[test]
    fn device_ptr_addresses_the_tensor_and_writes_are_seen_by_burn() {
        type B = Cuda;
        let Some(device) = cuda_device() else { return };
        let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let bucket = B::float_from_data(
            burn::tensor::TensorData::new(values.clone(), [1000]),
            &device,
        );
        // Views at an aligned, non-zero offset into one buffer.
        let shapes = [Shape::new([3]), Shape::new([997])];
        let mut views = B::unpack_bucket(bucket, &shapes, 1.0);
        let second = views.pop().expect("two views");
        assert!(
            second.handle.offset_start.unwrap_or(0) > 0,
            "the second view should start at an offset: {:?}",
            second.handle
        );
        let ctx = cudarc::driver::CudaContext::new(0).expect("CUDA context");
        let replacement: Vec<f32> = (0..997).map(|i| -(i as f32)).collect();
        B::with_device_ptr(&second, |ptr| {
            ctx.bind_to_thread().expect("bind");
            let mut read = vec![0f32; 997];
            // SAFETY: `ptr` addresses 997 f32 of the live view on device 0 (the contract of
            // `with_device_ptr`); the copies are synchronous.
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
        .expect("with_device_ptr");
        let seen = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(second))
            .into_data()
            .to_vec::<f32>()
            .expect("f32");
        assert_eq!(
            seen, replacement,
            "Burn sees what was written at the address"
        );
    }

    #[derive(Module, Debug)]
    struct Net<B: Backend> {
        a: Linear<B>,
        b: Linear<B>,
        c: Linear<B>,
    }

    /// A one-rank NCCL group: the mean over one rank is the gradient itself, bit for bit, and
    /// every bucket of the plan goes through pack → address → NCCL → unpack.
    #[test]
    fn one_rank_device_reducer_leaves_gradients_unchanged() {
        type B = Autodiff<Cuda>;
        let Some(device) = cuda_device() else { return };
        if let Err(e) = check_nccl_available() {
            eprintln!("skipped: no usable NCCL: {e}");
            return;
        }
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let mut group = NcclProcessGroup::new(store, 0, 1, 0, Duration::from_secs(60))
            .expect("a one-rank NCCL group");
        let net = Net::<B> {
            a: LinearConfig::new(16, 32).init(&device),
            b: LinearConfig::new(32, 8).init(&device),
            c: LinearConfig::new(8, 3).init(&device),
        };
        let x = Tensor::<B, 2>::random(
            [5, 16],
            burn::tensor::Distribution::Normal(0.0, 1.0),
            &device,
        );
        let y = net.c.forward(net.b.forward(net.a.forward(x)));
        let mut grads = GradientsParams::from_grads(y.powi_scalar(2).sum().backward(), &net);

        let ids = [net.a.weight.id, net.b.weight.id, net.c.weight.id];
        let before: Vec<Vec<f32>> = ids
            .iter()
            .map(|&id| {
                grads
                    .get::<Cuda, 2>(id)
                    .expect("gradient")
                    .into_data()
                    .to_vec::<f32>()
                    .expect("f32")
            })
            .collect();
        let count = grads.len();

        // 300 elements per bucket: several buckets, and a weight (512) alone in its own.
        let mut reducer = DeviceReducer::new(300.0 * 4.0 / (1u64 << 20) as f64);
        reducer
            .sync::<B, _>(&mut group, &net, &mut grads)
            .expect("device sync");
        let numels = [512, 32, 256, 8, 24, 3];
        let planned = plan_buckets(&numels, 300).len() as u64;
        assert_eq!(
            reducer.stats(),
            ReducerStats {
                syncs: 1,
                bucket_all_reduces: planned,
                bytes_reduced: numels.iter().sum::<usize>() as u64 * 4,
            }
        );
        assert_eq!(grads.len(), count, "every gradient is back");
        for (id, want) in ids.iter().zip(before) {
            let got = grads
                .get::<Cuda, 2>(*id)
                .expect("gradient")
                .into_data()
                .to_vec::<f32>()
                .expect("f32");
            assert_eq!(got, want);
        }
    }
}
