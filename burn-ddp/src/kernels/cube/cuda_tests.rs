use cubecl::device::CudaDevice;

use super::super::fallback::conformance::*;
use super::*;
use crate::cuda::check_cuda_available;
use crate::testing::{skip, Needs};

/// The plain CubeBackend (the kernels), whatever `burn-cubecl`'s `fusion` feature makes of
/// `burn_cubecl::Cube`.
type Cuda = CubeBackend;

/// CUDA device 0, or `None` after recording why these tests cannot run here.
fn device() -> Option<CubeDevice> {
    match check_cuda_available(0) {
        Ok(_) => Some(CubeDevice::Cuda(CudaDevice::new(0))),
        Err(e) => {
            skip(Needs::Gpu, &format!("no usable CUDA device: {e}"));
            None
        }
    }
}

/// Through [`Dispatch`](burn::backend::Dispatch): the routing to `Cube`.
#[test]
fn cuda_dispatch_pack_unpack_round_trip() {
    let Some(device) = device() else { return };
    let device = DispatchDevice::Cube(device);
    pack_unpack_round_trip::<burn::backend::Dispatch>(&device);
    compress_bit_exact::<burn::backend::Dispatch>(&device, HalfFormat::Bf16);
}

#[test]
fn cuda_pack_unpack_round_trip() {
    let Some(device) = device() else { return };
    pack_unpack_round_trip::<Cuda>(&device);
}

/// Empty buckets and empty tensors in a bucket (what the round trip's first cases hold),
/// apart, so that a failure says which.
#[test]
fn cuda_empty_buckets_and_empty_tensors() {
    let Some(device) = device() else { return };
    let empty = Cuda::pack_bucket(Vec::new(), &device);
    assert_eq!(empty.shape(), Shape::new([0]));
    let outs = Cuda::unpack_bucket(empty, &[Shape::new([0]), Shape::new([4, 0])], 0.5);
    assert_eq!(outs.len(), 2);
    let values = vec![1.0f32, 2.0, 3.0];
    let tensors = vec![
        float_tensor::<Cuda>(Vec::new(), Shape::new([0]), &device),
        float_tensor::<Cuda>(values.clone(), Shape::new([3]), &device),
    ];
    let bucket = Cuda::pack_bucket(tensors, &device);
    assert_eq!(read_f32::<Cuda>(bucket), values);
}

#[test]
fn cuda_pack_non_contiguous() {
    let Some(device) = device() else { return };
    pack_non_contiguous::<Cuda>(&device);
}

#[test]
fn cuda_pack_converts_other_float_dtypes() {
    let Some(device) = device() else { return };
    pack_converts_other_float_dtypes::<Cuda>(&device, FloatDType::F16);
    pack_converts_other_float_dtypes::<Cuda>(&device, FloatDType::BF16);
}

#[test]
fn cuda_bf16_and_f16_bit_exact() {
    let Some(device) = device() else { return };
    compress_bit_exact::<Cuda>(&device, HalfFormat::Bf16);
    compress_bit_exact::<Cuda>(&device, HalfFormat::F16);
}

#[test]
fn cuda_decompress_every_pattern() {
    let Some(device) = device() else { return };
    decompress_every_pattern::<Cuda>(&device, HalfFormat::Bf16);
    decompress_every_pattern::<Cuda>(&device, HalfFormat::F16);
}

#[test]
fn cuda_compress_round_trip_error() {
    let Some(device) = device() else { return };
    compress_round_trip_error::<Cuda>(&device, HalfFormat::Bf16);
    compress_round_trip_error::<Cuda>(&device, HalfFormat::F16);
}

/// Pack + unpack throughput against the device-to-device copy of the same bytes, measured
/// in the same run (the ceiling of a kernel that is pure memory traffic). Both count the
/// bytes read and written.
#[test]
#[ignore = "a GPU benchmark: cargo test --features cuda -- --ignored cuda_pack_unpack_against_device_copy"]
fn cuda_pack_unpack_against_device_copy() {
    use cudarc::driver::CudaContext;
    let Some(device) = device() else { return };
    let context = CudaContext::new(0).expect("CUDA context of device 0");
    let stream = context.default_stream();
    println!(
        "{:>12} {:>8} {:>14} {:>14} {:>8}",
        "bytes", "tensors", "pack+unpack", "d2d copy", "ratio"
    );
    for (bytes, tensors) in [
        (4usize << 20, 64usize),
        (64 << 20, 64),
        (256 << 20, 64),
        (256 << 20, 8),
    ] {
        let kernels =
            crate::kernels::bench::measure_pack_unpack::<Cuda>(&device, bytes, tensors, 20)
                .expect("device sync");
        let src = stream.alloc_zeros::<f32>(bytes / 4).expect("alloc");
        let mut dst = stream.alloc_zeros::<f32>(bytes / 4).expect("alloc");
        stream.memcpy_dtod(&src, &mut dst).expect("warm-up copy");
        stream.synchronize().expect("sync");
        let start = std::time::Instant::now();
        for _ in 0..20 {
            stream.memcpy_dtod(&src, &mut dst).expect("copy");
        }
        stream.synchronize().expect("sync");
        let copy = (2 * bytes * 20) as f64 / start.elapsed().as_secs_f64() / 1e9;
        println!(
            "{bytes:>12} {tensors:>8} {:>10.1} GB/s {copy:>9.1} GB/s {:>8.3}",
            kernels.gb_per_s,
            kernels.gb_per_s / copy
        );
        assert!(kernels.gb_per_s > 0.0 && copy > 0.0);
    }
}
