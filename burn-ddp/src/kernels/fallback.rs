//! [`BucketOps`] with plain Burn backend ops, for tensors without kernels of ours.
//!
//! Each function is generic over any [`Backend`]: [`BucketOps`] for [`Dispatch`] calls them for
//! every tensor that is not a plain CubeCL one ([`Flex`] above all), and a backend type gets
//! [`BucketOps`] from them with one line, `fallback_bucket_ops!` (as `Fusion` does in `cube.rs`).
//! Costs, per call:
//! - pack: a reshape per tensor and one `cat` (which most backends run as a copy per tensor);
//! - unpack: one multiply over the whole bucket, then a slice + reshape per tensor (views);
//! - compress / decompress: a round trip through host memory (Burn has no op that reinterprets float bits), which
//!   is free on a CPU backend and slow on a GPU one.
//!
//! [`Flex`]: burn::backend::Flex
//! [`Dispatch`]: burn::backend::Dispatch
//! [`BucketOps`]: super::bucket_ops::BucketOps

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, DType, FloatDType, Shape, Slice, TensorData, TensorMetadata};
use burn::tensor::read_sync;

use crate::host_values::host_values;

use super::bucket_ops::{check_len, BucketOpsError};
use super::half_format::HalfFormat;
use super::wire16;

/// [`BucketOps::pack_bucket`](super::bucket_ops::BucketOps::pack_bucket) with Burn ops.
pub fn pack_bucket<B: Backend>(tensors: Vec<FloatTensor<B>>, device: &B::Device) -> FloatTensor<B> {
    let mut flat: Vec<FloatTensor<B>> = tensors
        .into_iter()
        .filter(|tensor| tensor.shape().num_elements() > 0)
        .map(|tensor| {
            let len = tensor.shape().num_elements();
            B::float_reshape(to_f32::<B>(tensor), Shape::new([len]))
        })
        .collect();
    let total = flat.iter().map(|t| t.shape().num_elements()).sum();
    check_len("pack_bucket", total);
    match flat.len() {
        0 => B::float_empty(Shape::new([0]), device, FloatDType::F32),
        1 => flat.remove(0),
        _ => B::float_cat(flat, 0),
    }
}

/// [`BucketOps::unpack_bucket`](super::bucket_ops::BucketOps::unpack_bucket) with Burn ops.
pub fn unpack_bucket<B: Backend>(
    bucket: FloatTensor<B>,
    shapes: &[Shape],
    scale: f32,
) -> Vec<FloatTensor<B>> {
    let total = check_bucket("unpack_bucket", &bucket, shapes);
    let device = bucket.device();
    // A scale of 1 is no multiply: the values are already what `x * 1` gives (a signalling
    // NaN, which the multiply would quiet, is the one bit pattern that passes unchanged).
    let scaled = if total == 0 || scale == 1.0 {
        bucket
    } else {
        B::float_mul_scalar(bucket, scale.into())
    };
    let mut offset = 0;
    shapes
        .iter()
        .map(|shape| {
            let len = shape.num_elements();
            let start = offset;
            offset += len;
            if len == 0 {
                return B::float_empty(shape.clone(), &device, FloatDType::F32);
            }
            let piece = B::float_slice(scaled.clone(), &[Slice::from(start..start + len)]);
            B::float_reshape(piece, shape.clone())
        })
        .collect()
}

/// [`BucketOps::compress_bucket`](super::bucket_ops::BucketOps::compress_bucket) on the host: reads the bucket, scales and rounds with
/// [`wire16::compress`], uploads the words.
pub fn compress_bucket<B: Backend>(
    bucket: FloatTensor<B>,
    format: HalfFormat,
    scale: f32,
) -> Result<IntTensor<B>, BucketOpsError> {
    const OP: &str = "compress_bucket";
    let len = check_bucket_1d(OP, &bucket);
    let device = bucket.device();
    let data = read_sync(B::float_into_data(bucket))
        .map_err(|source| BucketOpsError::Read { op: OP, source })?;
    let values = host_values::<f32>(data).map_err(|err| BucketOpsError::Data {
        op: OP,
        reason: format!("{err:?}"),
    })?;
    let words = wire16::compress(&values, format, scale);
    let data = TensorData::new(words, [wire16::packed_len(len)]);
    Ok(B::int_from_data(data, &device))
}

/// [`BucketOps::decompress_bucket`](super::bucket_ops::BucketOps::decompress_bucket) on the host: reads the words, widens with
/// [`wire16::decompress`], uploads the `f32` values.
pub fn decompress_bucket<B: Backend>(
    words: IntTensor<B>,
    len: usize,
    format: HalfFormat,
) -> Result<FloatTensor<B>, BucketOpsError> {
    const OP: &str = "decompress_bucket";
    check_len(OP, len);
    check_words(OP, &words, len);
    let device = words.device();
    let data = read_sync(B::int_into_data(words))
        .map_err(|source| BucketOpsError::Read { op: OP, source })?;
    let words = host_values::<u32>(data).map_err(|err| BucketOpsError::Data {
        op: OP,
        reason: format!("{err:?}"),
    })?;
    let values = wire16::decompress(&words, len, format);
    Ok(B::float_from_data(TensorData::new(values, [len]), &device))
}

/// Converts to `f32` when needed (the bucket dtype).
pub(crate) fn to_f32<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    if tensor.dtype() == DType::F32 {
        tensor
    } else {
        B::float_cast(tensor, FloatDType::F32)
    }
}

/// Checks that `bucket` is a 1-D `f32` tensor and returns its length.
pub(crate) fn check_bucket_1d<T: TensorMetadata>(op: &str, bucket: &T) -> usize {
    let shape = bucket.shape();
    assert!(
        shape.num_dims() == 1 && bucket.dtype() == DType::F32,
        "{op}: the bucket must be a 1-D f32 tensor, got shape {shape:?} of {:?}",
        bucket.dtype()
    );
    let len = shape.num_elements();
    check_len(op, len);
    len
}

/// Checks the [`BucketOps::unpack_bucket`](super::bucket_ops::BucketOps::unpack_bucket) contract and returns the bucket length.
pub(crate) fn check_bucket<T: TensorMetadata>(op: &str, bucket: &T, shapes: &[Shape]) -> usize {
    let len = check_bucket_1d(op, bucket);
    let expected: usize = shapes.iter().map(Shape::num_elements).sum();
    assert_eq!(
        len,
        expected,
        "{op}: the bucket holds {len} elements but the {} shapes need {expected}",
        shapes.len()
    );
    len
}

/// Checks the [`BucketOps::decompress_bucket`](super::bucket_ops::BucketOps::decompress_bucket) contract on the packed words.
pub(crate) fn check_words<T: TensorMetadata>(op: &str, words: &T, len: usize) {
    let shape = words.shape();
    assert!(
        shape.num_dims() == 1
            && shape.num_elements() == wire16::packed_len(len)
            && words.dtype() == DType::U32,
        "{op}: {len} 16-bit values need a 1-D U32 tensor of {} words, got shape {shape:?} of {:?}",
        wire16::packed_len(len),
        words.dtype()
    );
}

/// `impl BucketOps for $backend` with the generic ops of this module, for backends without
/// kernels of ours: `fallback_bucket_ops!(impl[generics] for Type);` (with `BucketOps` in scope).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
macro_rules! fallback_bucket_ops {
    (impl[$($generics:tt)*] for $backend:ty) => {
        impl<$($generics)*> BucketOps for $backend {
            fn pack_bucket(
                tensors: Vec<burn::backend::tensor::FloatTensor<Self>>,
                device: &Self::Device,
            ) -> burn::backend::tensor::FloatTensor<Self> {
                $crate::kernels::fallback::pack_bucket::<Self>(tensors, device)
            }

            fn unpack_bucket(
                bucket: burn::backend::tensor::FloatTensor<Self>,
                shapes: &[burn::backend::Shape],
                scale: f32,
            ) -> Vec<burn::backend::tensor::FloatTensor<Self>> {
                $crate::kernels::fallback::unpack_bucket::<Self>(bucket, shapes, scale)
            }

            fn compress_bucket(
                bucket: burn::backend::tensor::FloatTensor<Self>,
                format: $crate::kernels::half_format::HalfFormat,
                scale: f32,
            ) -> Result<burn::backend::tensor::IntTensor<Self>, $crate::kernels::bucket_ops::BucketOpsError> {
                $crate::kernels::fallback::compress_bucket::<Self>(bucket, format, scale)
            }

            fn decompress_bucket(
                words: burn::backend::tensor::IntTensor<Self>,
                len: usize,
                format: $crate::kernels::half_format::HalfFormat,
            ) -> Result<burn::backend::tensor::FloatTensor<Self>, $crate::kernels::bucket_ops::BucketOpsError> {
                $crate::kernels::fallback::decompress_bucket::<Self>(words, len, format)
            }
        }
    };
}
#[cfg(any(feature = "wgpu", feature = "cuda"))]
pub(crate) use fallback_bucket_ops;

/// The conformance suite every [`BucketOps`] implementation runs (see the `tests` modules here and
/// in `cube.rs`): random data from a seeded generator, against plain-Rust references, bit for bit.
#[cfg(test)]
pub(crate) mod conformance {
    use burn::backend::Distribution;

    use super::*;
    pub use crate::kernels::bucket_ops::BucketOps;

    /// The tests' seeded generator, so failures replay exactly.
    pub use crate::rng::SplitMix64;

    /// The shapes of the tests: empty, size 1, odd sizes, 1-D to 3-D, one large.
    pub fn shapes() -> Vec<Shape> {
        let dims: Vec<Vec<usize>> = vec![
            vec![0],
            vec![1],
            vec![3],
            vec![7],
            vec![1023],
            vec![65537],
            vec![2, 3],
            vec![0, 5],
            vec![17, 31],
            vec![1, 1, 1],
            vec![3, 5, 7],
            vec![4, 0, 2],
            vec![2, 33, 9],
            vec![64, 257],
        ];
        dims.into_iter().map(Shape::from).collect()
    }

    /// `count` shapes drawn from [`shapes`], so buckets mix sizes in random orders.
    pub fn random_shapes(rng: &mut SplitMix64, count: usize) -> Vec<Shape> {
        let all = shapes();
        (0..count)
            .map(|_| all[rng.index(all.len())].clone())
            .collect()
    }

    pub fn random_values(rng: &mut SplitMix64, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.symmetric_f32()).collect()
    }

    pub fn float_tensor<B: Backend>(
        values: Vec<f32>,
        shape: Shape,
        device: &B::Device,
    ) -> FloatTensor<B> {
        if shape.num_elements() == 0 && shape.num_dims() > 1 {
            // Burn 0.21's CUDA backend refuses to upload an empty tensor of several dimensions
            // ("the provided strides are not supported"): upload it flat, then reshape.
            let flat = B::float_from_data(TensorData::new(values, [0]), device);
            return B::float_reshape(flat, shape);
        }
        B::float_from_data(TensorData::new(values, shape), device)
    }

    pub fn read_f32<B: Backend>(tensor: FloatTensor<B>) -> Vec<f32> {
        // Nothing to read; Burn 0.21's CUDA backend fails to read an empty tensor back.
        if tensor.shape().num_elements() == 0 {
            return Vec::new();
        }
        let flat = B::float_reshape(tensor.clone(), Shape::new([tensor.shape().num_elements()]));
        let data = read_sync(B::float_into_data(flat)).expect("read f32");
        assert_eq!(data.dtype(), DType::F32);
        crate::host_values::host_values::<f32>(data).expect("f32 data")
    }

    pub fn read_u32<B: Backend>(tensor: IntTensor<B>) -> Vec<u32> {
        let data = read_sync(B::int_into_data(tensor)).expect("read u32");
        assert_eq!(data.dtype(), DType::U32);
        crate::host_values::host_values::<u32>(data).expect("u32 data")
    }

    fn bits(values: &[f32]) -> Vec<u32> {
        values.iter().map(|x| x.to_bits()).collect()
    }

    /// Pack then unpack (scale 1 and 1/3) many random buckets, compared exactly with the host.
    pub fn pack_unpack_round_trip<B: BucketOps>(device: &B::Device) {
        let mut rng = SplitMix64::new(0x5eed_0001);
        // Bucket sizes: none, one, a few, and more than one pack launch holds (32).
        for (case, count) in [0usize, 1, 2, 5, 13, 40, 80].into_iter().enumerate() {
            let shapes = random_shapes(&mut rng, count);
            let host: Vec<Vec<f32>> = shapes
                .iter()
                .map(|s| random_values(&mut rng, s.num_elements()))
                .collect();
            let expected: Vec<f32> = host.iter().flatten().copied().collect();
            let tensors = host
                .iter()
                .zip(&shapes)
                .map(|(v, s)| float_tensor::<B>(v.clone(), s.clone(), device))
                .collect();

            let bucket = B::pack_bucket(tensors, device);
            assert_eq!(bucket.shape(), Shape::new([expected.len()]), "case {case}");
            assert_eq!(bucket.dtype(), DType::F32, "case {case}");
            assert_eq!(
                bits(&read_f32::<B>(bucket.clone())),
                bits(&expected),
                "pack, case {case}"
            );

            for scale in [1.0f32, 1.0 / 3.0] {
                let outs = B::unpack_bucket(bucket.clone(), &shapes, scale);
                assert_eq!(outs.len(), shapes.len(), "case {case}");
                for (i, ((out, shape), values)) in
                    outs.into_iter().zip(&shapes).zip(&host).enumerate()
                {
                    assert_eq!(out.shape(), *shape, "case {case}, tensor {i}");
                    assert_eq!(out.dtype(), DType::F32, "case {case}, tensor {i}");
                    let want: Vec<f32> = values.iter().map(|x| x * scale).collect();
                    assert_eq!(
                        bits(&read_f32::<B>(out)),
                        bits(&want),
                        "unpack, scale {scale}, case {case}, tensor {i} of shape {shape:?}"
                    );
                }
            }
        }
    }

    /// Non-contiguous inputs (transposed, sliced) are packed in logical (row-major) order.
    pub fn pack_non_contiguous<B: BucketOps>(device: &B::Device) {
        let mut rng = SplitMix64::new(0x5eed_0002);
        let (rows, cols) = (37, 19);
        let values = random_values(&mut rng, rows * cols);
        let matrix = float_tensor::<B>(values.clone(), Shape::new([rows, cols]), device);
        let transposed = B::float_swap_dims(matrix.clone(), 0, 1);
        let sliced = B::float_slice(matrix, &[Slice::from(3..20), Slice::from(2..17)]);
        let plain = random_values(&mut rng, 11);
        let tensors = vec![
            transposed,
            float_tensor::<B>(plain.clone(), Shape::new([11]), device),
            sliced,
        ];

        let mut expected = Vec::new();
        for c in 0..cols {
            for r in 0..rows {
                expected.push(values[r * cols + c]);
            }
        }
        expected.extend_from_slice(&plain);
        for r in 3..20 {
            expected.extend_from_slice(&values[r * cols + 2..r * cols + 17]);
        }
        let bucket = B::pack_bucket(tensors, device);
        assert_eq!(bits(&read_f32::<B>(bucket)), bits(&expected));
    }

    /// Inputs of another float dtype are converted to f32 (values exactly representable).
    pub fn pack_converts_other_float_dtypes<B: BucketOps>(device: &B::Device, dtype: FloatDType) {
        let values = vec![0.5f32, -1.25, 3.0, 0.0, 1024.0];
        let tensor = B::float_cast(
            float_tensor::<B>(values.clone(), Shape::new([5]), device),
            dtype,
        );
        let bucket = B::pack_bucket(vec![tensor], device);
        assert_eq!(bucket.dtype(), DType::F32);
        assert_eq!(read_f32::<B>(bucket), values);
    }

    /// Values that exercise every branch of the rounding: NaN, inf, subnormals, ties, overflow.
    pub fn special_values() -> Vec<f32> {
        [
            0x0000_0000u32,
            0x8000_0000,
            0x3f80_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0xffc0_0001,
            0x7f80_0001,
            0xff80_0001,
            0x7fa0_0000,
            0x0000_0001,
            0x8000_8000,
            0x0001_8000,
            0x007f_ffff,
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x7f7f_7fff,
            0x0080_0000,
            // f16: ties in the subnormal range (1.5 and 2.5 units of 2^-24), ties of normal
            // values (1 + 1/2 ulp, 1 + 3/2 ulp), the overflow tie (65520) and just below it,
            // the smallest normal and just below it (rounds up into it), 2^-25 and just above.
            0x33c0_0000,
            0x3420_0000,
            0x3f80_1000,
            0x3f80_3000,
            0x477f_f000,
            0x477f_efff,
            0x3880_0000,
            0x387f_f000,
            0x3300_0000,
            0xb300_0001,
        ]
        .into_iter()
        .map(f32::from_bits)
        .collect()
    }

    /// The reference rounding, written here from the `half` crate's own conversions (round to
    /// nearest, ties to even; NaN kept; overflow to infinity; subnormals rounded), not through
    /// [`wire16`]: the host fallback *is* `wire16`, so comparing it with `wire16` would prove
    /// nothing.
    fn half_round(format: HalfFormat, x: f32) -> u16 {
        match format {
            HalfFormat::Bf16 => half::bf16::from_f32(x).to_bits(),
            HalfFormat::F16 => half::f16::from_f32(x).to_bits(),
        }
    }

    /// The `f32` that 16-bit `bits` denote, by the `half` crate.
    fn half_widen(format: HalfFormat, bits: u16) -> f32 {
        match format {
            HalfFormat::Bf16 => half::bf16::from_bits(bits).to_f32(),
            HalfFormat::F16 => half::f16::from_bits(bits).to_f32(),
        }
    }

    /// The expected words of a compressed bucket: element `2k` (times `scale`, rounded by
    /// `half`) in the low 16 bits of word `k`, element `2k + 1` in the high 16 bits (0 past the
    /// end) — the layout of the module docs of [`wire16`], written out independently.
    fn expected_compressed(values: &[f32], format: HalfFormat, scale: f32) -> Vec<u32> {
        (0..values.len().div_ceil(2))
            .map(|k| {
                let low = u32::from(half_round(format, values[2 * k] * scale));
                let high = values
                    .get(2 * k + 1)
                    .map_or(0, |&x| u32::from(half_round(format, x * scale)));
                low | (high << 16)
            })
            .collect()
    }

    /// Whether two words hold the same two 16-bit values — or NaN where the other holds NaN:
    /// a device's multiply may return its own canonical NaN instead of keeping the input's
    /// payload (CUDA gives 0x7fffffff for NaN × 1/3), and a NaN is a NaN on the wire.
    fn same_halves(got: u32, want: u32, format: HalfFormat) -> bool {
        let nan_above = match format {
            HalfFormat::Bf16 => 0x7f80,
            HalfFormat::F16 => 0x7c00,
        };
        let is_nan = |h: u32| (h & 0x7fff) > nan_above;
        [0, 16].into_iter().all(|shift| {
            let (g, w) = ((got >> shift) & 0xffff, (want >> shift) & 0xffff);
            g == w || (is_nan(g) && is_nan(w))
        })
    }

    /// The expected widening of the words of [`expected_compressed`] (first `len` values).
    fn expected_decompressed(words: &[u32], len: usize, format: HalfFormat) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let word = words[i / 2];
                let bits = if i % 2 == 0 {
                    word & 0xffff
                } else {
                    word >> 16
                };
                half_widen(format, bits as u16)
            })
            .collect()
    }

    #[test]
    fn the_reference_is_the_half_crates_rounding() {
        // Spot values whose bits are known, so the reference cannot be wrong in the same way
        // as the code under test: ties to even, overflow, subnormals, NaN, the packing order.
        let bf16 = |x: f32| half_round(HalfFormat::Bf16, x);
        let f16 = |x: f32| half_round(HalfFormat::F16, x);
        assert_eq!(bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(f16(65520.0), 0x7c00);
        assert_eq!(f16(2f32.powi(-24)), 0x0001);
        assert!(half_widen(HalfFormat::Bf16, bf16(f32::NAN)).is_nan());
        assert_eq!(
            expected_compressed(&[1.0, -2.0, 3.5], HalfFormat::Bf16, 1.0),
            vec![0xc000_3f80, 0x0000_4060]
        );
    }

    /// Compress / decompress in `format`, bit-exact with the `half` crate's rounding and
    /// widening ([`expected_compressed`] / [`expected_decompressed`], not [`wire16`]), with
    /// scales 1 and 1/3.
    pub fn compress_bit_exact<B: BucketOps>(device: &B::Device, format: HalfFormat) {
        let mut rng = SplitMix64::new(0x5eed_0003);
        let mut cases: Vec<Vec<f32>> = vec![Vec::new(), vec![1.5], special_values()];
        for len in [3usize, 7, 1023, 65537] {
            cases.push(random_values(&mut rng, len));
        }
        // Arbitrary bit patterns: every exponent, every rounding case, many NaNs.
        cases.push(
            (0..100_001)
                .map(|_| f32::from_bits(rng.next_u64() as u32))
                .collect(),
        );
        // Magnitudes around f16's subnormal, normal and overflow boundaries.
        cases.push(
            (0..20_000)
                .map(|i| {
                    let exponent = [-26, -25, -24, -15, -14, -13, 15, 16][i % 8];
                    (1.0 + rng.symmetric_f32()) * 2f32.powi(exponent)
                })
                .collect(),
        );
        let name = format.name();
        for scale in [1.0f32, 1.0 / 3.0] {
            for (case, values) in cases.iter().enumerate() {
                // Devices that flush f32 subnormals (lavapipe) flush them in the multiply too:
                // keep the scaled values normal (a scale of 1 is no multiply, subnormals stay).
                let values: Vec<f32> = if scale == 1.0 {
                    values.clone()
                } else {
                    let tiny = 2f32.powi(-100);
                    values
                        .iter()
                        .map(|&x| if x.abs() < tiny { 0.0 } else { x })
                        .collect()
                };
                let values = &values;
                let len = values.len();
                let bucket = float_tensor::<B>(values.clone(), Shape::new([len]), device);
                let words = B::compress_bucket(bucket, format, scale).expect("compress");
                assert_eq!(
                    words.shape(),
                    Shape::new([wire16::packed_len(len)]),
                    "{name}, case {case}"
                );
                assert_eq!(words.dtype(), DType::U32, "{name}, case {case}");
                let expected_words = expected_compressed(values, format, scale);
                let got_words = read_u32::<B>(words.clone());
                let differs = |i: usize| !same_halves(got_words[i], expected_words[i], format);
                if let Some(i) = (0..got_words.len()).find(|&i| differs(i)) {
                    panic!(
                        "compress {name} x {scale}, case {case}: word {i} is {:#010x}, want \
                         {:#010x} (inputs {:#010x} {:#010x})",
                        got_words[i],
                        expected_words[i],
                        values[2 * i].to_bits(),
                        values.get(2 * i + 1).map_or(0, |x| x.to_bits()),
                    );
                }

                let back = B::decompress_bucket(words, len, format).expect("decompress");
                assert_eq!(back.shape(), Shape::new([len]), "{name}, case {case}");
                assert_eq!(
                    bits(&read_f32::<B>(back)),
                    bits(&expected_decompressed(&got_words, len, format)),
                    "decompress {name}, case {case}"
                );
            }
        }
    }

    /// Decompress of every one of the 65,536 16-bit patterns (NaNs with any payload, both
    /// infinities, subnormals), bit-exact with the `half` crate's widening.
    pub fn decompress_every_pattern<B: BucketOps>(device: &B::Device, format: HalfFormat) {
        let words: Vec<u32> = (0..1u32 << 15)
            .map(|k| (2 * k) | ((2 * k + 1) << 16))
            .collect();
        let expected = expected_decompressed(&words, 1 << 16, format);
        let tensor = B::int_from_data(TensorData::new(words, [1 << 15]), device);
        let got = read_f32::<B>(B::decompress_bucket(tensor, 1 << 16, format).expect("decompress"));
        if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != expected[i].to_bits()) {
            panic!(
                "{}: pattern {i:#06x} widens to {:#010x}, want {:#010x}",
                format.name(),
                got[i].to_bits(),
                expected[i].to_bits()
            );
        }
    }

    /// A random-normal bucket survives the round trip within the format's relative error.
    pub fn compress_round_trip_error<B: BucketOps>(device: &B::Device, format: HalfFormat) {
        let len = 4099;
        let bucket = B::float_random(
            Shape::new([len]),
            Distribution::Normal(0.0, 1.0),
            device,
            FloatDType::F32,
        );
        let values = read_f32::<B>(bucket.clone());
        let words = B::compress_bucket(bucket, format, 1.0).expect("compress");
        let back = read_f32::<B>(B::decompress_bucket(words, len, format).expect("decompress"));
        let (relative, absolute) = match format {
            HalfFormat::Bf16 => (1.0 / 256.0, 0.0),
            // Below 2^-14 f16 is subnormal: the error is absolute (half of 2^-24).
            HalfFormat::F16 => (1.0 / 2048.0, 2f32.powi(-25)),
        };
        for (x, y) in values.iter().zip(&back) {
            assert!(
                (x - y).abs() <= x.abs() * relative + absolute,
                "{}: {x} -> {y}",
                format.name()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Dispatch, DispatchDevice, FlexDevice};

    use super::conformance::*;
    use super::*;

    /// Burn's CPU backend, through the runtime backend the crate uses.
    fn flex() -> DispatchDevice {
        DispatchDevice::Flex(FlexDevice)
    }

    #[test]
    fn flex_pack_unpack_round_trip() {
        pack_unpack_round_trip::<Dispatch>(&flex());
    }

    #[test]
    fn flex_pack_non_contiguous() {
        pack_non_contiguous::<Dispatch>(&flex());
    }

    #[test]
    fn flex_pack_converts_other_float_dtypes() {
        pack_converts_other_float_dtypes::<Dispatch>(&flex(), FloatDType::F16);
    }

    #[test]
    fn flex_compress_bit_exact() {
        compress_bit_exact::<Dispatch>(&flex(), HalfFormat::Bf16);
        compress_bit_exact::<Dispatch>(&flex(), HalfFormat::F16);
    }

    #[test]
    fn flex_decompress_every_pattern() {
        decompress_every_pattern::<Dispatch>(&flex(), HalfFormat::Bf16);
        decompress_every_pattern::<Dispatch>(&flex(), HalfFormat::F16);
    }

    #[test]
    fn flex_compress_round_trip_error() {
        compress_round_trip_error::<Dispatch>(&flex(), HalfFormat::Bf16);
        compress_round_trip_error::<Dispatch>(&flex(), HalfFormat::F16);
    }

    #[test]
    fn flex_is_host_memory() {
        assert!(crate::kernels::host_memory(&flex()));
        assert!(crate::kernels::host_memory(
            burn::tensor::Device::flex().autodiff().as_dispatch()
        ));
    }

    #[test]
    #[should_panic(expected = "the bucket holds 4 elements but the 1 shapes need 6")]
    fn unpack_rejects_a_bucket_of_the_wrong_length() {
        let device = flex();
        let bucket = float_tensor::<Dispatch>(vec![0.0; 4], Shape::new([4]), &device);
        Dispatch::unpack_bucket(bucket, &[Shape::new([2, 3])], 1.0);
    }
}
