//! The 16-bit wire formats of a compressed gradient bucket, on the host: pure functions.
//!
//! A compressed bucket is `len` 16-bit floats ([`HalfFormat::Bf16`] or [`HalfFormat::F16`])
//! packed two per `u32` word: element `2k` in the low 16 bits of word `k`, element `2k + 1` in
//! the high 16 bits (0 when `len` is odd). Read as little-endian bytes (every GPU and host Burn
//! runs on) that is exactly a dense array of `len` 16-bit floats, so a collective may treat it
//! as `bf16[len]` / `f16[len]` (NCCL's `ncclBfloat16` / `ncclFloat16`, the TCP ring's
//! [`DataType::BF16`](crate::group::DataType::BF16) / `F16`).
//!
//! The rounding here is the `half` crate's (round to nearest, ties to even; NaN kept quiet with
//! its sign; overflow to ±inf; subnormals rounded, not flushed): it is what the
//! [`fallback`](super::fallback) uses and what the kernels are tested against, bit for bit.

use half::{bf16, f16};

use super::host16;

/// A 16-bit float format for gradients on the wire (`distributed.gradient_compression`).
///
/// - `Bf16`: 8 exponent bits like `f32`, 8 significant bits: no overflow, relative error 2^-9.
/// - `F16`: 5 exponent bits (largest finite 65504), 11 significant bits: relative error 2^-12
///   but overflow past 65504, and magnitudes up to 2^-25 become 0; the reducer divides by the
///   world size *before* rounding (PyTorch's `fp16_compress_hook` rounds first, then divides)
///   so that a sum cannot overflow where the mean does not.
///
/// With feature `serde` it is written as its [`name`](HalfFormat::name); the trainer's
/// `distributed.gradient_compression` adds `"none"` for no compression
/// (`ddp::config_names::compression`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum HalfFormat {
    #[cfg_attr(feature = "serde", serde(rename = "bf16"))]
    Bf16,
    #[cfg_attr(feature = "serde", serde(rename = "fp16"))]
    F16,
}

impl HalfFormat {
    /// The bits of the 16-bit float nearest to `x` (ties to even).
    pub fn round(self, x: f32) -> u16 {
        match self {
            Self::Bf16 => bf16::from_f32(x).to_bits(),
            Self::F16 => f16::from_f32(x).to_bits(),
        }
    }

    /// The `f32` that 16-bit `bits` denote (exact: every bf16 and f16 is an `f32`).
    pub fn widen(self, bits: u16) -> f32 {
        match self {
            Self::Bf16 => bf16::from_bits(bits).to_f32(),
            Self::F16 => f16::from_bits(bits).to_f32(),
        }
    }

    /// The name used in configs and messages: `"bf16"`, `"fp16"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F16 => "fp16",
        }
    }
}

/// Number of `u32` words that hold `len` packed 16-bit values.
pub fn packed_len(len: usize) -> usize {
    len.div_ceil(2)
}

/// Multiplies each value by `scale` (one `f32` multiply), rounds it to `format` and packs the
/// results in the layout of the module docs. Vectorised ([`host16`]), bit for bit the rounding
/// of [`HalfFormat::round`].
pub fn compress(values: &[f32], format: HalfFormat, scale: f32) -> Vec<u32> {
    let mut words = vec![0u32; packed_len(values.len())];
    let mut halves = [0u16; PACK_CHUNK];
    for (src, dst) in values
        .chunks(PACK_CHUNK)
        .zip(words.chunks_mut(PACK_CHUNK / 2))
    {
        let halves = &mut halves[..src.len()];
        host16::round_scaled(format, src, scale, halves);
        pack(halves, dst);
    }
    words
}

/// Unpacks and widens the first `len` values from `words` (the layout of [`compress`]).
/// Vectorised ([`host16`]), bit for bit [`HalfFormat::widen`].
///
/// # Panics
/// If `words.len() != packed_len(len)`: the caller lost track of the length.
pub fn decompress(words: &[u32], len: usize, format: HalfFormat) -> Vec<f32> {
    assert_eq!(
        words.len(),
        packed_len(len),
        "{} packed words cannot hold exactly {len} {} values",
        words.len(),
        format.name()
    );
    let mut values = vec![0f32; len];
    let mut halves = [0u16; PACK_CHUNK];
    for (dst, src) in values
        .chunks_mut(PACK_CHUNK)
        .zip(words.chunks(PACK_CHUNK / 2))
    {
        let halves = &mut halves[..dst.len()];
        unpack(src, halves);
        host16::widen(format, halves, dst);
    }
    values
}

/// Values per step of [`compress`] / [`decompress`] through a stack buffer (even, so every
/// step but the last fills whole words).
const PACK_CHUNK: usize = 2048;

/// `words[k] = halves[2k] | halves[2k + 1] << 16` (the high half 0 past the end).
fn pack(halves: &[u16], words: &mut [u32]) {
    for (w, pair) in words.iter_mut().zip(halves.chunks(2)) {
        *w = u32::from(pair[0]) | pair.get(1).map_or(0, |&h| u32::from(h) << 16);
    }
}

/// The inverse of [`pack`] for `halves.len()` values.
fn unpack(words: &[u32], halves: &mut [u16]) {
    for (pair, &w) in halves.chunks_mut(2).zip(words) {
        pair[0] = w as u16;
        if let Some(h) = pair.get_mut(1) {
            *h = (w >> 16) as u16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_on_boundary_values() {
        use HalfFormat::{Bf16, F16};
        // bf16: a tie rounds to even, past the tie rounds up, past the largest finite is inf.
        assert_eq!(Bf16.round(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(Bf16.round(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(Bf16.round(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(Bf16.round(f32::MAX), 0x7f80);
        // f16: 65504 is the largest finite, 65520 (a tie with an odd mantissa) rounds to inf,
        // 2^-24 is the smallest subnormal and 2^-25 (a tie with 0) rounds to 0.
        assert_eq!(F16.round(65504.0), 0x7bff);
        assert_eq!(F16.round(65519.0), 0x7bff);
        assert_eq!(F16.round(65520.0), 0x7c00);
        assert_eq!(F16.round(2f32.powi(-24)), 0x0001);
        assert_eq!(F16.round(2f32.powi(-25)), 0x0000);
        assert_eq!(F16.round(-1.5 * 2f32.powi(-25)), 0x8001);
        for format in [Bf16, F16] {
            assert!(format.widen(format.round(f32::NAN)).is_nan());
            assert_eq!(format.widen(format.round(-0.0)).to_bits(), 0x8000_0000);
            assert_eq!(format.widen(format.round(f32::INFINITY)), f32::INFINITY);
        }
    }

    #[test]
    fn compress_scales_then_packs_low_half_first_and_round_trips() {
        let values = [1.0f32, -2.0, 3.5];
        let words = compress(&values, HalfFormat::Bf16, 1.0);
        assert_eq!(words, vec![0xc000_3f80, 0x0000_4060]);
        assert_eq!(decompress(&words, 3, HalfFormat::Bf16), values.to_vec());
        let words = compress(&values, HalfFormat::F16, 0.5);
        assert_eq!(words, vec![0xbc00_3800, 0x0000_3f00]);
        assert_eq!(
            decompress(&words, 3, HalfFormat::F16),
            vec![0.5, -1.0, 1.75]
        );
        assert!(compress(&[], HalfFormat::F16, 1.0).is_empty());
        assert!(decompress(&[], 0, HalfFormat::Bf16).is_empty());
    }

    /// The vectorised [`compress`] / [`decompress`] against their scalar definitions, bit for
    /// bit, on odd lengths and across the chunk boundary.
    #[test]
    fn vectorised_packing_equals_the_scalar_definition() {
        use crate::kernels::fallback::conformance::{special_values, SplitMix64};
        let mut rng = SplitMix64::new(0x5eed_0018);
        let mut values: Vec<f32> = special_values();
        values.extend((0..2 * PACK_CHUNK + 3).map(|_| f32::from_bits(rng.next_u64() as u32)));
        for format in [HalfFormat::Bf16, HalfFormat::F16] {
            for len in [
                0,
                1,
                2,
                3,
                PACK_CHUNK - 1,
                PACK_CHUNK,
                PACK_CHUNK + 1,
                values.len(),
            ] {
                let values = &values[..len];
                for scale in [1.0f32, 0.5] {
                    let round = |x: f32| u32::from(format.round(x * scale));
                    let scalar: Vec<u32> = values
                        .chunks(2)
                        .map(|p| round(p[0]) | p.get(1).map_or(0, |&x| round(x) << 16))
                        .collect();
                    let words = compress(values, format, scale);
                    assert_eq!(words, scalar, "{} len {len} x {scale}", format.name());
                    let widened: Vec<u32> = (0..len)
                        .map(|i| {
                            format
                                .widen((words[i / 2] >> (16 * (i % 2))) as u16)
                                .to_bits()
                        })
                        .collect();
                    let back: Vec<u32> = decompress(&words, len, format)
                        .iter()
                        .map(|x| x.to_bits())
                        .collect();
                    assert_eq!(back, widened, "{} len {len}", format.name());
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "cannot hold exactly")]
    fn decompress_rejects_a_wrong_length() {
        decompress(&[0, 0], 5, HalfFormat::Bf16);
    }
}
