use burn::backend::Dispatch;
use cubecl::device::WgpuDevice;

use super::super::fallback::conformance::*;
use super::*;

/// The plain CubeBackend (the kernels), whatever `burn-cubecl`'s `fusion` feature makes of
/// `burn_cubecl::Cube`.
type Wgpu = CubeBackend;

/// The default device, failing loudly (not skipping) when there is no adapter.
fn device() -> CubeDevice {
    let device = CubeDevice::Wgpu(WgpuDevice::default());
    let probe = device.clone();
    match std::panic::catch_unwind(move || probe.client()) {
        Ok(client) => {
            let properties = client.properties();
            eprintln!(
                "wgpu: max_bindings {}, memory alignment {} bytes, {} inputs per pack launch",
                properties.hardware.max_bindings,
                properties.memory.alignment,
                max_inputs_per_launch(&client)
            );
        }
        Err(_) => panic!(
            "no wgpu adapter: these tests need a Vulkan, Metal or DX12 device; \
             on a machine without a GPU install Mesa's lavapipe (apt-get install \
             mesa-vulkan-drivers) — see the panic above for wgpu's own message"
        ),
    }
    device
}

/// The same device, as the runtime backend the crate's callers use.
fn dispatch_device() -> DispatchDevice {
    DispatchDevice::Cube(device())
}

/// Through [`Dispatch`]: the routing to `Cube` (the kernels, or the fallback under fusion).
#[test]
fn wgpu_dispatch_pack_unpack_round_trip() {
    pack_unpack_round_trip::<Dispatch>(&dispatch_device());
    pack_non_contiguous::<Dispatch>(&dispatch_device());
}

#[test]
fn wgpu_dispatch_compress_bit_exact() {
    compress_bit_exact::<Dispatch>(&dispatch_device(), HalfFormat::Bf16);
    decompress_every_pattern::<Dispatch>(&dispatch_device(), HalfFormat::F16);
}

/// Where `Cube` is the plain CubeBackend (no `fusion` in this build), a [`Dispatch`] unpack
/// runs the kernel: its outputs are views at aligned offsets into one buffer, which the
/// fallback (a multiply, then slices) does not produce for a 3-element first tensor.
#[test]
fn wgpu_dispatch_runs_the_kernels_on_plain_tensors() {
    let device = dispatch_device();
    let values: Vec<f32> = (0..10).map(|i| i as f32).collect();
    let bucket = float_tensor::<Dispatch>(values, Shape::new([10]), &device);
    let mut outs = Dispatch::unpack_bucket(bucket, &[Shape::new([3]), Shape::new([7])], 2.0);
    let second = outs.pop().expect("two outputs");
    let Ok(second) = cube_float(second) else {
        panic!("a CubeCL bucket unpacks to CubeCL tensors");
    };
    match (&second as &dyn std::any::Any).downcast_ref::<CubeTensor>() {
        Some(plain) => assert!(
            plain.handle.offset_start.unwrap_or(0) > 0,
            "the kernel's outputs are views into one buffer: {:?}",
            plain.handle
        ),
        None => eprintln!("burn_cubecl::Cube is fused in this build: the fallback ran"),
    }
}

#[test]
fn wgpu_pack_unpack_round_trip() {
    pack_unpack_round_trip::<Wgpu>(&device());
}

#[test]
fn wgpu_pack_non_contiguous() {
    pack_non_contiguous::<Wgpu>(&device());
}

#[test]
fn wgpu_pack_converts_other_float_dtypes() {
    pack_converts_other_float_dtypes::<Wgpu>(&device(), FloatDType::F16);
}

#[test]
fn wgpu_bf16_bit_exact() {
    compress_bit_exact::<Wgpu>(&device(), HalfFormat::Bf16);
}

#[test]
fn wgpu_f16_bit_exact() {
    compress_bit_exact::<Wgpu>(&device(), HalfFormat::F16);
}

#[test]
fn wgpu_decompress_every_pattern() {
    decompress_every_pattern::<Wgpu>(&device(), HalfFormat::Bf16);
    decompress_every_pattern::<Wgpu>(&device(), HalfFormat::F16);
}

#[test]
fn wgpu_compress_round_trip_error() {
    compress_round_trip_error::<Wgpu>(&device(), HalfFormat::Bf16);
    compress_round_trip_error::<Wgpu>(&device(), HalfFormat::F16);
}

#[test]
fn wgpu_unpacked_views_work_as_inputs_of_further_ops() {
    // The optimizer reads unpacked gradients with ordinary kernels: the views must bind.
    let device = device();
    let shapes = [Shape::new([3]), Shape::new([5, 7]), Shape::new([1])];
    let values: Vec<f32> = (0..39).map(|i| i as f32).collect();
    let bucket = float_tensor::<Wgpu>(values.clone(), Shape::new([39]), &device);
    let outs = Wgpu::unpack_bucket(bucket, &shapes, 2.0);
    let mut offset = 0;
    for (out, shape) in outs.into_iter().zip(&shapes) {
        let len = shape.num_elements();
        let doubled = Wgpu::float_add(out.clone(), out);
        let want: Vec<f32> = values[offset..offset + len]
            .iter()
            .map(|x| x * 4.0)
            .collect();
        assert_eq!(read_f32::<Wgpu>(doubled), want, "shape {shape:?}");
        offset += len;
    }
}

#[test]
fn wgpu_bench_helper_runs() {
    let result =
        crate::kernels::bench::measure_pack_unpack::<Wgpu>(&device(), 1 << 20, 9, 3).expect("sync");
    assert!(result.gb_per_s > 0.0);
    let result =
        crate::kernels::bench::measure_pack_unpack::<Dispatch>(&dispatch_device(), 1 << 20, 9, 3)
            .expect("sync");
    eprintln!("wgpu pack+unpack: {result:?}");
    assert!(result.gb_per_s > 0.0);
}
