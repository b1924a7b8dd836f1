//! Throughput of pack + unpack on a device, for benchmarks (not used by training).

use std::time::{Duration, Instant};

use burn::backend::{Distribution, ExecutionError, FloatDType, Shape};

use super::bucket_ops::BucketOps;

/// What [`measure_pack_unpack`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct PackUnpackThroughput {
    /// Bucket size in bytes (`f32` elements × 4).
    pub bytes: usize,
    /// Number of tensors packed into the bucket.
    pub tensors: usize,
    /// Timed iterations (one warm-up iteration, which compiles the kernels, is not counted).
    pub iterations: usize,
    /// Mean wall time of one pack + unpack, device work included.
    pub per_iteration: Duration,
    /// Memory traffic per second in GB/s (10^9 bytes): pack and unpack each read and write the
    /// bucket once, so one iteration moves `4 * bytes`.
    pub gb_per_s: f64,
}

/// Times `iterations` rounds of `pack_bucket` + `unpack_bucket` (scale 0.5) of `bytes` of `f32`
/// split into `tensors` near-equal 1-D tensors on `device`, synchronising before and after
/// (`B` is [`Dispatch`](burn::backend::Dispatch) for the `as_dispatch()` of a device without
/// autodiff: tensors an autodiff device tracks take the fallback ops, not the kernels).
///
/// The inputs are created once; each round allocates its bucket and outputs, as the reducer does.
///
/// # Errors
/// The device's error, if synchronising reports one.
///
/// # Panics
/// If `tensors` or `iterations` is 0, or `bytes / 4 < tensors`.
pub fn measure_pack_unpack<B: BucketOps>(
    device: &B::Device,
    bytes: usize,
    tensors: usize,
    iterations: usize,
) -> Result<PackUnpackThroughput, ExecutionError> {
    let len = bytes / 4;
    assert!(
        tensors > 0 && iterations > 0 && len >= tensors,
        "measure_pack_unpack needs at least one iteration and one element per tensor \
         (bytes {bytes}, tensors {tensors}, iterations {iterations})"
    );
    let shapes: Vec<Shape> = (0..tensors)
        .map(|i| Shape::new([len / tensors + usize::from(i < len % tensors)]))
        .collect();
    let inputs: Vec<_> = shapes
        .iter()
        .map(|shape| {
            B::float_random(
                shape.clone(),
                Distribution::Default,
                device,
                FloatDType::F32,
            )
        })
        .collect();
    let round = || {
        let bucket = B::pack_bucket(inputs.clone(), device);
        drop(B::unpack_bucket(bucket, &shapes, 0.5));
    };

    round();
    B::sync(device)?;
    let start = Instant::now();
    for _ in 0..iterations {
        round();
    }
    B::sync(device)?;
    let elapsed = start.elapsed();

    let per_iteration = elapsed.div_f64(iterations as f64);
    let gb_per_s = (4 * len * 4 * iterations) as f64 / elapsed.as_secs_f64().max(1e-12) / 1e9;
    Ok(PackUnpackThroughput {
        bytes: len * 4,
        tensors,
        iterations,
        per_iteration,
        gb_per_s,
    })
}

#[cfg(test)]
mod tests {
    use burn::backend::{Dispatch, DispatchDevice, FlexDevice};

    use super::*;

    #[test]
    fn measures_something_on_flex() {
        let device = DispatchDevice::Flex(FlexDevice);
        let result = measure_pack_unpack::<Dispatch>(&device, 1 << 16, 7, 2).expect("sync");
        assert_eq!(result.bytes, 1 << 16);
        assert_eq!(result.tensors, 7);
        assert!(result.gb_per_s > 0.0);
    }
}
