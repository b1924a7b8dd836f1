//! The CubeCL kernels behind [`BucketOps`]: its implementations for `CubeBackend` (any CubeCL
//! runtime: wgpu, CUDA, ...) and for `Fusion`, and the routing of [`Dispatch`] tensors to
//! whichever of the two `burn_cubecl::Cube` is in this build.
//!
//! ## The kernels
//! - [`pack_kernel`]: a group of inputs, each its own buffer binding, copied into the bucket.
//!   Cube row `y` serves input `y` of the group; the cubes of a row stride over that input.
//!   A kernel cannot index its bindings with a runtime value, so the input is chosen by an
//!   unrolled comparison of `CUBE_POS_Y` with each slot: the branch is uniform per cube, and a
//!   thread pays it once, not per element. The number of bindings per kernel is bounded by the
//!   device (`max_bindings`; a handful on some Vulkan drivers), hence groups.
//! - [`unpack_scale_kernel`]: one thread per bucket element finds its tensor by binary search in
//!   a table of bucket offsets, multiplies by `scale` and writes it at that tensor's place in
//!   one output buffer, where each tensor starts at the device's offset alignment; the outputs
//!   are then views into that buffer (what Burn's own `slice` does for aligned slices), so all
//!   tensors come out of a single launch and a single allocation.
//! - [`compress_kernel`] / [`decompress_kernel`]: one thread per output word / element, integer
//!   arithmetic on the `f32` bits (the rounding of the `half` crate, which the tests check bit
//!   for bit); bf16 or f16 chosen at compile time of the kernel.
//!
//! All launches are the checked kind (`launch`, not `launch_unchecked`): the bounds checks cost
//! little in kernels that are pure memory traffic, and no `unsafe` is needed.
//!
//! ## Fusion
//! `burn_cubecl::Cube` is `CubeBackend` unless a crate of the build turns on `burn-cubecl`'s
//! `fusion` feature (Burn's default features do; this crate does not), and then
//! `Fusion<CubeBackend>`. Both implement [`BucketOps`] here, so the routing below compiles and
//! works either way: plain tensors get the kernels, fused ones the [`fallback`] ops, which the
//! fusion stream records lazily (running the kernels there would take registering a fusion
//! custom operation, with Burn's IR types).
//!
//! [`Dispatch`]: burn::backend::Dispatch

use burn::backend::ops::{FloatTensorOps, IntTensorOps};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{
    BackendTensor, DType, DispatchAutodiffContext, DispatchDevice, DispatchTensor,
    DispatchTensorKind, FloatDType, IntDType, Shape, TensorMetadata,
};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{Cube, CubeBackend, CubeDevice};
use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::{calculate_cube_count_elemwise, CubeCount, CubeDim};

use super::bucket_ops::{check_len, BucketOps, BucketOpsError};
use super::fallback::{self, check_bucket, check_bucket_1d, check_words};
use super::half_format::HalfFormat;
use super::wire16;

/// Units per cube of every kernel here: the portable maximum (WebGPU's guaranteed limit).
const CUBE_SIZE: u32 = 256;
/// Cubes per input in a pack launch; beyond that a row's cubes loop. 1024 × 256 threads is about
/// a full H100 for one large input, and bounds the idle cubes that the small inputs of a group
/// cost (every row gets as many cubes as the longest input of the group).
const MAX_CUBES_PER_INPUT: usize = 1024;
/// Most inputs per pack launch. Each group size is a separately compiled kernel (the unrolled
/// slot comparison), so this bounds both compile time and the per-thread comparisons.
const MAX_INPUTS_PER_LAUNCH: usize = 32;
/// Bindings of a pack launch besides its inputs: the bucket and the metadata buffer, plus one
/// spare for runtimes that add a binding of their own.
const RESERVED_BINDINGS: usize = 3;

/// Copies input `y` of the group (`CUBE_POS_Y`) into `bucket[starts[y]..starts[y] + lens[y]]`.
#[cube(launch)]
fn pack_kernel(
    inputs: &Sequence<Box<[f32]>>,
    bucket: &mut [f32],
    starts: Sequence<usize>,
    lens: Sequence<usize>,
) {
    let slot = CUBE_POS_Y as usize;
    let stride = (CUBE_COUNT_X * CUBE_DIM_X) as usize;
    let group = comptime![inputs.len()];
    #[unroll]
    for j in 0..group {
        if slot == j {
            let input = inputs.index(j);
            let start = starts[j];
            let len = lens[j];
            let mut i = ABSOLUTE_POS_X as usize;
            while i < len {
                bucket[start + i] = input[i];
                i += stride;
            }
        }
    }
}

/// `out[out_starts[t] + k] = bucket[bucket_starts[t] + k] * scale` for every tensor `t` and
/// `k < bucket_starts[t + 1] - bucket_starts[t]`; one thread per bucket element.
#[cube(launch)]
fn unpack_scale_kernel(
    bucket: &[f32],
    bucket_starts: &[u32],
    out_starts: &[u32],
    out: &mut [f32],
    num_tensors: usize,
    scale: f32,
) {
    let pos = ABSOLUTE_POS;
    if pos >= bucket.len() {
        terminate!();
    }
    // The last tensor whose start is <= pos (tables hold non-empty tensors only, so it is the
    // one that contains pos). Invariant: bucket_starts[lo] <= pos < bucket_starts[hi].
    let mut lo = 0usize;
    let mut hi = num_tensors;
    while lo + 1 < hi {
        let mid = (lo + hi) / 2;
        if bucket_starts[mid] as usize <= pos {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let dst = out_starts[lo] as usize + (pos - bucket_starts[lo] as usize);
    out[dst] = bucket[pos] * scale;
}

/// `x * scale`, except that a scale of 1 leaves `x` untouched: devices that flush subnormals
/// (lavapipe does) would flush them in a multiply by 1 too.
#[cube]
fn scaled(x: f32, scale: f32) -> f32 {
    if scale == 1.0 {
        x
    } else {
        x * scale
    }
}

/// The bf16 nearest to `x` (ties to even), in the low 16 bits: the `half` crate's
/// `bf16::from_f32`, as integer arithmetic on the `f32` bits (bf16 is their upper half).
#[cube]
fn round_to_bf16(x: f32) -> u32 {
    let bits = u32::reinterpret(x);
    if (bits & 0x7fff_ffffu32) > 0x7f80_0000u32 {
        // NaN: keep sign and the top of the payload, force the quiet bit (a truncation could
        // turn a NaN whose payload sits in the low bits into infinity).
        (bits >> 16u32) | 0x0040u32
    } else {
        // Adding 0x7fff rounds half-way cases down; adding the kept part's lsb as well makes
        // ties go to even. No overflow: the largest non-NaN pattern is 0xff80_0000.
        (bits + 0x7fffu32 + ((bits >> 16u32) & 1u32)) >> 16u32
    }
}

/// The f16 nearest to `x` (ties to even), in the low 16 bits: the `half` crate's
/// `f16::from_f32`, as integer arithmetic on the `f32` bits.
#[cube]
fn round_to_f16(x: f32) -> u32 {
    let bits = u32::reinterpret(x);
    let sign = (bits >> 16u32) & 0x8000u32;
    let abs = bits & 0x7fff_ffffu32;
    // |x| <= 2^-25 (half of f16's smallest subnormal, a tie with an even 0) stays 0.
    let mut magnitude = 0u32;
    if abs > 0x7f80_0000u32 {
        // NaN: quiet, with the top of the payload.
        magnitude = 0x7e00u32 | ((abs >> 13u32) & 0x03ffu32);
    } else if abs >= 0x4780_0000u32 {
        // 2^16 and beyond, inf included.
        magnitude = 0x7c00u32;
    } else if abs >= 0x3880_0000u32 {
        // Normal in f16 (>= 2^-14): rebias the exponent (127 - 15 = 112) and round off 13
        // mantissa bits as for bf16; a carry runs into the exponent, up to inf past 65504.
        magnitude = (abs - 0x3800_0000u32 + 0x0fffu32 + ((abs >> 13u32) & 1u32)) >> 13u32;
    } else if abs > 0x3300_0000u32 {
        // Subnormal in f16: the significand, implicit bit included, in units of 2^-24 is the
        // significand shifted right by 126 - exponent (14 to 24 here); round to nearest even.
        let shift = 126u32 - (abs >> 23u32);
        let significand = (abs & 0x007f_ffffu32) | 0x0080_0000u32;
        let kept = significand >> shift;
        let rest = significand & ((1u32 << shift) - 1u32);
        let halfway = 1u32 << (shift - 1u32);
        magnitude = kept;
        if rest > halfway || (rest == halfway && (kept & 1u32) == 1u32) {
            magnitude = kept + 1u32;
        }
    }
    sign | magnitude
}

/// The `f32` that f16 bits `h` denote: the `half` crate's `f16::to_f32`.
#[cube]
fn widen_f16(h: u32) -> f32 {
    let sign = (h & 0x8000u32) << 16u32;
    let exponent = (h >> 10u32) & 0x1fu32;
    let mantissa = h & 0x03ffu32;
    let mut bits = sign;
    if exponent == 0x1fu32 {
        bits = sign | 0x7f80_0000u32 | (mantissa << 13u32);
        if mantissa != 0u32 {
            // NaN: quiet, as the `half` crate does.
            bits |= 0x0040_0000u32;
        }
    } else if exponent != 0u32 {
        bits = sign | ((exponent + 112u32) << 23u32) | (mantissa << 13u32);
    } else if mantissa != 0u32 {
        // Subnormal: mantissa × 2^-24, exact and normal in f32. A literal, not the bits
        // 0x3380_0000 reinterpreted: CUDA's code generator emits `reinterpret_cast` of a
        // constant, which NVRTC refuses (not an lvalue); the literal is exactly 2^-24.
        let two_pow_minus_24 = 5.960_464_5e-8f32;
        bits = sign | u32::reinterpret(f32::cast_from(mantissa) * two_pow_minus_24);
    }
    f32::reinterpret(bits)
}

/// The `f32` that bf16 bits `h` denote: the `half` crate's `bf16::to_f32` (NaN made quiet).
#[cube]
fn widen_bf16(h: u32) -> f32 {
    let mut bits = h << 16u32;
    if (h & 0x7fffu32) > 0x7f80u32 {
        bits |= 0x0040_0000u32;
    }
    f32::reinterpret(bits)
}

/// `x * scale` rounded to f16 (`f16 = true`) or bf16, in the low 16 bits.
#[cube]
fn round_to_half(x: f32, scale: f32, #[comptime] f16: bool) -> u32 {
    let x = scaled(x, scale);
    if f16 {
        round_to_f16(x)
    } else {
        round_to_bf16(x)
    }
}

/// `words[w]` = half(bucket[2w] × scale) | half(bucket[2w + 1] × scale) << 16 (0 past the end).
#[cube(launch)]
fn compress_kernel(bucket: &[f32], words: &mut [u32], scale: f32, #[comptime] f16: bool) {
    let w = ABSOLUTE_POS;
    if w >= words.len() {
        terminate!();
    }
    let lo = round_to_half(bucket[2 * w], scale, f16);
    let mut hi = 0u32;
    if 2 * w + 1 < bucket.len() {
        hi = round_to_half(bucket[2 * w + 1], scale, f16);
    }
    words[w] = lo | (hi << 16u32);
}

/// `out[i]` = the f16 (`f16 = true`) or bf16 in half `i % 2` of `words[i / 2]`, widened.
#[cube(launch)]
fn decompress_kernel(words: &[u32], out: &mut [f32], #[comptime] f16: bool) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let word = words[i / 2];
    let shift = ((i % 2) * 16) as u32;
    let half = (word >> shift) & 0xffffu32;
    if f16 {
        out[i] = widen_f16(half);
    } else {
        out[i] = widen_bf16(half);
    }
}

/// How many inputs one pack launch may bind on this client's device.
fn max_inputs_per_launch(client: &Client) -> usize {
    let max_bindings = client.properties().hardware.max_bindings as usize;
    max_bindings
        .saturating_sub(RESERVED_BINDINGS)
        .clamp(1, MAX_INPUTS_PER_LAUNCH)
}

/// Where each non-empty tensor of an unpack sits, in the bucket and in the padded output.
#[derive(Debug, PartialEq)]
struct UnpackLayout {
    /// Bucket offset of each non-empty tensor, then the bucket length (`n + 1` entries).
    bucket_starts: Vec<usize>,
    /// Output offset of each non-empty tensor, a multiple of the alignment (`n` entries).
    out_starts: Vec<usize>,
    /// Output offset of every tensor, empty ones included (`None` for those).
    placement: Vec<Option<usize>>,
    /// Length of the padded output buffer, in elements.
    out_len: usize,
}

impl UnpackLayout {
    /// Lays out `shapes` with each non-empty tensor starting at a multiple of `align` elements.
    fn new(shapes: &[Shape], align: usize) -> Self {
        let align = align.max(1);
        let mut layout = Self {
            bucket_starts: Vec::new(),
            out_starts: Vec::new(),
            placement: Vec::with_capacity(shapes.len()),
            out_len: 0,
        };
        let mut bucket_pos = 0usize;
        for shape in shapes {
            let len = shape.num_elements();
            if len == 0 {
                layout.placement.push(None);
                continue;
            }
            let out_pos = layout.out_len.next_multiple_of(align);
            layout.bucket_starts.push(bucket_pos);
            layout.out_starts.push(out_pos);
            layout.placement.push(Some(out_pos));
            bucket_pos += len;
            layout.out_len = out_pos + len;
        }
        layout.bucket_starts.push(bucket_pos);
        layout
    }
}

/// The offsets as the kernel reads them. Every offset is at most the output length, which the
/// caller checked against [`MAX_BUCKET_LEN`](super::bucket_ops::MAX_BUCKET_LEN), so this cannot truncate.
fn to_u32s(offsets: &[usize]) -> Vec<u32> {
    offsets
        .iter()
        .map(|&offset| {
            u32::try_from(offset)
                .unwrap_or_else(|_| panic!("bucket offset {offset} does not fit in u32"))
        })
        .collect()
}

/// A new contiguous tensor of `len` elements of `dtype` (4 bytes each), uninitialised.
fn new_1d(client: &Client, device: &CubeDevice, len: usize, dtype: DType) -> CubeTensor {
    CubeTensor::new_contiguous(
        client.clone(),
        device.clone(),
        Shape::new([len]),
        client.empty(len * dtype.size()),
        dtype,
    )
}

fn cube_dim_1d() -> CubeDim {
    CubeDim::new_1d(CUBE_SIZE)
}

/// The kernels, on a plain CubeCL tensor of any runtime.
impl BucketOps for CubeBackend {
    fn pack_bucket(tensors: Vec<CubeTensor>, device: &CubeDevice) -> CubeTensor {
        let inputs: Vec<CubeTensor> = tensors
            .into_iter()
            .filter(|tensor| tensor.shape().num_elements() > 0)
            .map(|tensor| into_contiguous(fallback::to_f32::<Self>(tensor)))
            .collect();
        let total: usize = inputs.iter().map(|t| t.shape().num_elements()).sum();
        check_len("pack_bucket", total);
        if total == 0 {
            return Self::float_empty(Shape::new([0]), device, FloatDType::F32);
        }

        let client = device.client();
        let bucket = new_1d(&client, device, total, DType::F32);
        let mut start = 0;
        for group in inputs.chunks(max_inputs_per_launch(&client)) {
            let mut arrays = SequenceArg::<Box<[f32]>>::new();
            let mut starts = SequenceArg::<usize>::new();
            let mut lens = SequenceArg::<usize>::new();
            let mut longest = 0;
            for input in group {
                input.assert_is_on_same_device(&bucket);
                let len = input.shape().num_elements();
                arrays.push(input.clone().into_buffer_arg());
                starts.push(start);
                lens.push(len);
                start += len;
                longest = longest.max(len);
            }
            let cubes_x = longest
                .div_ceil(CUBE_SIZE as usize)
                .min(MAX_CUBES_PER_INPUT);
            // Both fit in u32: cubes_x <= MAX_CUBES_PER_INPUT, the group <= MAX_INPUTS_PER_LAUNCH.
            let cube_count = CubeCount::Static(cubes_x as u32, group.len() as u32, 1);
            pack_kernel::launch(
                &client,
                cube_count,
                cube_dim_1d(),
                arrays,
                bucket.clone().into_buffer_arg(),
                starts,
                lens,
            );
        }
        bucket
    }

    fn unpack_bucket(bucket: CubeTensor, shapes: &[Shape], scale: f32) -> Vec<CubeTensor> {
        let len = check_bucket("unpack_bucket", &bucket, shapes);
        let device = bucket.device.clone();
        if len == 0 {
            return shapes
                .iter()
                .map(|shape| Self::float_empty(shape.clone(), &device, FloatDType::F32))
                .collect();
        }
        let bucket = into_contiguous(bucket);
        let client = bucket.client.clone();

        // Views must start at the device's offset alignment to be bound by later kernels.
        let align_bytes = client.properties().memory.alignment as usize;
        let layout = UnpackLayout::new(shapes, align_bytes.div_ceil(4));
        // Padding adds less than an alignment per tensor; only absurd counts of tiny tensors
        // could push the output past what the kernel can index.
        check_len(
            "unpack_bucket (output with alignment padding)",
            layout.out_len,
        );
        let out = client.empty(layout.out_len * 4);
        let bucket_starts = to_u32s(&layout.bucket_starts);
        let out_starts = to_u32s(&layout.out_starts);
        let bucket_starts = client.create_from_slice(bytemuck::cast_slice(&bucket_starts));
        let out_starts = client.create_from_slice(bytemuck::cast_slice(&out_starts));
        let num_tensors = layout.out_starts.len();

        let cube_dim = cube_dim_1d();
        unpack_scale_kernel::launch(
            &client,
            calculate_cube_count_elemwise(&client, len, cube_dim),
            cube_dim,
            bucket.into_buffer_arg(),
            // The handles hold exactly these many u32 values.
            new_from_handle(&client, &device, bucket_starts, num_tensors + 1, DType::U32)
                .into_buffer_arg(),
            new_from_handle(&client, &device, out_starts, num_tensors, DType::U32)
                .into_buffer_arg(),
            new_from_handle(&client, &device, out.clone(), layout.out_len, DType::F32)
                .into_buffer_arg(),
            num_tensors,
            scale,
        );

        let out_bytes = (layout.out_len * 4) as u64;
        shapes
            .iter()
            .zip(&layout.placement)
            .map(|(shape, placement)| match placement {
                None => Self::float_empty(shape.clone(), &device, FloatDType::F32),
                Some(out_pos) => {
                    let start = (out_pos * 4) as u64;
                    let end = start + (shape.num_elements() * 4) as u64;
                    let view = out.clone().offset_start(start).offset_end(out_bytes - end);
                    CubeTensor::new_contiguous(
                        client.clone(),
                        device.clone(),
                        shape.clone(),
                        view,
                        DType::F32,
                    )
                }
            })
            .collect()
    }

    fn compress_bucket(
        bucket: CubeTensor,
        format: HalfFormat,
        scale: f32,
    ) -> Result<CubeTensor, BucketOpsError> {
        let len = check_bucket_1d("compress_bucket", &bucket);
        let device = bucket.device.clone();
        if len == 0 {
            return Ok(Self::int_empty(Shape::new([0]), &device, IntDType::U32));
        }
        let bucket = into_contiguous(bucket);
        let client = bucket.client.clone();
        let words = new_1d(&client, &device, wire16::packed_len(len), DType::U32);

        let cube_dim = cube_dim_1d();
        compress_kernel::launch(
            &client,
            calculate_cube_count_elemwise(&client, wire16::packed_len(len), cube_dim),
            cube_dim,
            bucket.into_buffer_arg(),
            words.clone().into_buffer_arg(),
            scale,
            format == HalfFormat::F16,
        );
        Ok(words)
    }

    fn decompress_bucket(
        words: CubeTensor,
        len: usize,
        format: HalfFormat,
    ) -> Result<CubeTensor, BucketOpsError> {
        check_len("decompress_bucket", len);
        check_words("decompress_bucket", &words, len);
        let device = words.device.clone();
        if len == 0 {
            return Ok(Self::float_empty(Shape::new([0]), &device, FloatDType::F32));
        }
        let words = into_contiguous(words);
        let client = words.client.clone();
        let out = new_1d(&client, &device, len, DType::F32);

        let cube_dim = cube_dim_1d();
        decompress_kernel::launch(
            &client,
            calculate_cube_count_elemwise(&client, len, cube_dim),
            cube_dim,
            words.into_buffer_arg(),
            out.clone().into_buffer_arg(),
            format == HalfFormat::F16,
        );
        Ok(out)
    }
}

/// Wraps a raw handle of `len` elements of `dtype` as a 1-D tensor (to bind it as an array).
fn new_from_handle(
    client: &Client,
    device: &CubeDevice,
    handle: cubecl::server::Handle,
    len: usize,
    dtype: DType,
) -> CubeTensor {
    CubeTensor::new_contiguous(
        client.clone(),
        device.clone(),
        Shape::new([len]),
        handle,
        dtype,
    )
}

// `Cube` with `burn-cubecl`'s `fusion` feature on: the [`fallback`] ops, which the fusion stream
// records lazily (and may fuse). Running our kernels here would take registering a fusion custom
// operation, which needs `burn_ir` types this crate does not depend on (Burn's `ir` feature).
fallback::fallback_bucket_ops!(impl[B: burn_fusion::FusionBackend] for burn_fusion::Fusion<B>);

// ---- Routing of `Dispatch` tensors (module docs, "Fusion") ----
//
// The `Err` of these functions is the caller's own tensor handed back, moved once, for the
// fallback path: its size is the size of a tensor handle, not a copy of the data.

/// Whether `tensor` is a float tensor of Burn's CubeCL backend that autodiff does not track.
fn is_cube_float(tensor: &DispatchTensor) -> bool {
    matches!(
        tensor,
        DispatchTensor {
            kind: DispatchTensorKind::Cube(BackendTensor::Float(_)),
            autodiff: DispatchAutodiffContext::Disabled,
        }
    )
}

#[allow(clippy::result_large_err)]
/// The `Cube` primitive of `tensor` (see [`is_cube_float`]), or `tensor` back.
fn cube_float(tensor: DispatchTensor) -> Result<FloatTensor<Cube>, DispatchTensor> {
    match tensor {
        DispatchTensor {
            kind: DispatchTensorKind::Cube(BackendTensor::Float(tensor)),
            autodiff: DispatchAutodiffContext::Disabled,
        } => Ok(tensor),
        other => Err(other),
    }
}

#[allow(clippy::result_large_err)]
/// The `Cube` primitive of an int `tensor` of Burn's CubeCL backend, or `tensor` back.
fn cube_int(tensor: DispatchTensor) -> Result<IntTensor<Cube>, DispatchTensor> {
    match tensor {
        DispatchTensor {
            kind: DispatchTensorKind::Cube(BackendTensor::Int(tensor)),
            autodiff: DispatchAutodiffContext::Disabled,
        } => Ok(tensor),
        other => Err(other),
    }
}

fn dispatch_float(tensor: FloatTensor<Cube>) -> DispatchTensor {
    DispatchTensor {
        kind: DispatchTensorKind::Cube(BackendTensor::Float(tensor)),
        autodiff: DispatchAutodiffContext::Disabled,
    }
}

fn dispatch_int(tensor: IntTensor<Cube>) -> DispatchTensor {
    DispatchTensor {
        kind: DispatchTensorKind::Cube(BackendTensor::Int(tensor)),
        autodiff: DispatchAutodiffContext::Disabled,
    }
}

/// [`BucketOps::pack_bucket`] for [`Dispatch`](burn::backend::Dispatch) when `device` is a CubeCL
/// device and every tensor a CubeCL float tensor; the tensors back otherwise.
pub(super) fn pack_bucket(
    tensors: Vec<DispatchTensor>,
    device: &DispatchDevice,
) -> Result<DispatchTensor, Vec<DispatchTensor>> {
    let DispatchDevice::Cube(device) = device else {
        return Err(tensors);
    };
    if !tensors.iter().all(is_cube_float) {
        return Err(tensors);
    }
    let inputs = tensors
        .into_iter()
        .map(|tensor| match cube_float(tensor) {
            Ok(tensor) => tensor,
            Err(_) => unreachable!("every tensor was checked to be a CubeCL float tensor"),
        })
        .collect();
    Ok(dispatch_float(Cube::pack_bucket(inputs, device)))
}

#[allow(clippy::result_large_err)]
/// [`BucketOps::unpack_bucket`] for a CubeCL `bucket`; the bucket back otherwise.
pub(super) fn unpack_bucket(
    bucket: DispatchTensor,
    shapes: &[Shape],
    scale: f32,
) -> Result<Vec<DispatchTensor>, DispatchTensor> {
    let bucket = cube_float(bucket)?;
    Ok(Cube::unpack_bucket(bucket, shapes, scale)
        .into_iter()
        .map(dispatch_float)
        .collect())
}

#[allow(clippy::result_large_err)]
/// [`BucketOps::compress_bucket`] for a CubeCL `bucket`; the bucket back otherwise.
pub(super) fn compress_bucket(
    bucket: DispatchTensor,
    format: HalfFormat,
    scale: f32,
) -> Result<Result<DispatchTensor, BucketOpsError>, DispatchTensor> {
    let bucket = cube_float(bucket)?;
    Ok(Cube::compress_bucket(bucket, format, scale).map(dispatch_int))
}

#[allow(clippy::result_large_err)]
/// [`BucketOps::decompress_bucket`] for CubeCL `words`; the words back otherwise.
pub(super) fn decompress_bucket(
    words: DispatchTensor,
    len: usize,
    format: HalfFormat,
) -> Result<Result<DispatchTensor, BucketOpsError>, DispatchTensor> {
    let words = cube_int(words)?;
    Ok(Cube::decompress_bucket(words, len, format).map(dispatch_float))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpack_layout_aligns_non_empty_tensors_and_skips_empty_ones() {
        let shapes: Vec<Shape> = [vec![3], vec![0], vec![2, 2], vec![1], vec![0, 4], vec![64]]
            .into_iter()
            .map(Shape::from)
            .collect();
        let layout = UnpackLayout::new(&shapes, 16);
        assert_eq!(layout.bucket_starts, vec![0, 3, 7, 8, 72]);
        assert_eq!(layout.out_starts, vec![0, 16, 32, 48]);
        assert_eq!(
            layout.placement,
            vec![Some(0), None, Some(16), Some(32), None, Some(48)]
        );
        assert_eq!(layout.out_len, 112);

        let packed = UnpackLayout::new(&shapes, 1);
        assert_eq!(packed.out_starts, vec![0, 3, 7, 8]);
        assert_eq!(packed.out_len, 72);

        let none = UnpackLayout::new(&[], 16);
        assert_eq!(none.bucket_starts, vec![0]);
        assert_eq!(none.out_len, 0);
    }
}

/// The conformance suite on Burn's wgpu runtime (Mesa's lavapipe where there is no GPU).
#[cfg(all(test, feature = "wgpu"))]
mod wgpu_tests;

/// The same conformance suite on Burn's CUDA runtime: skipped (with the reason recorded) where
/// there is no CUDA device, so CI only compiles it; on a GPU machine `TESTS_MUST_RUN=gpu` makes
/// a skip a failure. The benchmark beside it is `#[ignore]`d: run it by name on a GPU.
#[cfg(all(test, feature = "cuda"))]
mod cuda_tests;
