//! 16-bit floats on the host CPU, whole slices at a time: rounding from `f32`, widening to
//! `f32`, and the ring's 16-bit sums (pure).
//!
//! Every function here gives the bits the `half` crate's scalar conversions give, element by
//! element (`bf16::from_f32`, `f16::from_f32`, `to_f32`, and `a + b`, which `half` computes as
//! `from_f32(a.to_f32() + b.to_f32())`): the same rounding (to nearest, ties to even), in the
//! same order, so a compressed all-reduce sums exactly as before. Only the speed differs:
//! - **bf16** is rounded and widened with branch-free integer arithmetic the compiler turns into
//!   vector instructions (`half` has no SIMD path for bf16, and its scalar `from_f32` branches);
//! - **f16** goes through `half`'s slice conversions ([`HalfFloatSliceExt`]), which use the
//!   CPU's conversion instructions (x86 F16C, aarch64 FP16) several values at a time where the
//!   CPU has them — the very instructions `half`'s scalar conversions use one value at a time
//!   after a feature check per call — and `half`'s software conversion elsewhere.
//!
//! The one thing not pinned down is the payload of a NaN that an addition of two NaNs produces
//! (IEEE leaves it to the hardware, and the compiler may swap the operands); a NaN stays a quiet
//! NaN with the sign and payload rules of `half`'s rounding. A gradient with a NaN is reported
//! by the finite check and never applied.
//!
//! Tested against `half` bit for bit: every 16-bit pattern widened, every rounding case of the
//! `f32` inputs (all high halves with the low halves that decide the rounding, plus random and
//! special values), and sums of every special value with every other; `#[ignore]`d tests go
//! through all 2^32 `f32` inputs and all 2^32 pairs of 16-bit values.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::half_format::HalfFormat;

/// Values converted per step through a stack buffer (4 KiB of `f32`: stays in L1).
const CHUNK: usize = 1024;

/// `bf16::from_f32(x).to_bits()` without branches: round to nearest, ties to even (add
/// `0x7fff` plus the lowest kept bit, then truncate); a NaN keeps its sign and the high bits of
/// its payload, made quiet.
#[inline(always)]
pub fn bf16_round(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((b >> 16) | 0x0040) as u16;
    if b & 0x7fff_ffff > 0x7f80_0000 {
        quiet_nan
    } else {
        rounded
    }
}

/// `bf16::from_bits(h).to_f32()` without branches: the bits shifted up; a NaN made quiet.
#[inline(always)]
pub fn bf16_widen(h: u16) -> f32 {
    let w = u32::from(h) << 16;
    f32::from_bits(if h & 0x7fff > 0x7f80 {
        w | 0x0040_0000
    } else {
        w
    })
}

/// `dst[i] = round(src[i] * scale)` to `format` (one `f32` multiply, then the rounding of
/// [`HalfFormat::round`]).
///
/// # Panics
/// If the slices differ in length.
pub fn round_scaled(format: HalfFormat, src: &[f32], scale: f32, dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len(), "round_scaled: lengths differ");
    match format {
        HalfFormat::Bf16 => {
            for (d, &x) in dst.iter_mut().zip(src) {
                *d = bf16_round(x * scale);
            }
        }
        HalfFormat::F16 => {
            let mut buf = [0f32; CHUNK];
            for (s, d) in src.chunks(CHUNK).zip(dst.chunks_mut(CHUNK)) {
                let buf = &mut buf[..s.len()];
                for (b, &x) in buf.iter_mut().zip(s) {
                    *b = x * scale;
                }
                as_f16_mut(d).convert_from_f32_slice(buf);
            }
        }
    }
}

/// `dst[i] = widen(src[i])` from `format` ([`HalfFormat::widen`]; exact).
///
/// # Panics
/// If the slices differ in length.
pub fn widen(format: HalfFormat, src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen: lengths differ");
    match format {
        HalfFormat::Bf16 => {
            for (d, &h) in dst.iter_mut().zip(src) {
                *d = bf16_widen(h);
            }
        }
        HalfFormat::F16 => as_f16(src).convert_to_f32_slice(dst),
    }
}

/// `dst[i] = dst[i] + src[i]` as `half` adds two values of `format`: both widened to `f32`,
/// added, rounded back. The ring's reduction of compressed buckets.
///
/// # Panics
/// If the slices differ in length.
pub fn sum_into(format: HalfFormat, dst: &mut [u16], src: &[u16]) {
    assert_eq!(src.len(), dst.len(), "sum_into: lengths differ");
    match format {
        HalfFormat::Bf16 => {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = bf16_round(bf16_widen(*d) + bf16_widen(s));
            }
        }
        HalfFormat::F16 => {
            let (mut a, mut b) = ([0f32; CHUNK], [0f32; CHUNK]);
            for (d, s) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)) {
                let (a, b) = (&mut a[..d.len()], &mut b[..d.len()]);
                as_f16(d).convert_to_f32_slice(a);
                as_f16(s).convert_to_f32_slice(b);
                for (x, &y) in a.iter_mut().zip(b.iter()) {
                    *x += y;
                }
                as_f16_mut(d).convert_from_f32_slice(a);
            }
        }
    }
}

fn as_f16(bits: &[u16]) -> &[f16] {
    bytemuck::cast_slice(bits)
}

fn as_f16_mut(bits: &mut [u16]) -> &mut [f16] {
    bytemuck::cast_slice_mut(bits)
}

/// The `half` crate's scalar conversions, the reference of the tests (and of the module docs).
#[cfg(test)]
pub(crate) mod reference {
    use super::*;

    pub fn round(format: HalfFormat, x: f32) -> u16 {
        match format {
            HalfFormat::Bf16 => half::bf16::from_f32(x).to_bits(),
            HalfFormat::F16 => f16::from_f32(x).to_bits(),
        }
    }

    pub fn sum(format: HalfFormat, a: u16, b: u16) -> u16 {
        match format {
            HalfFormat::Bf16 => (half::bf16::from_bits(a) + half::bf16::from_bits(b)).to_bits(),
            HalfFormat::F16 => (f16::from_bits(a) + f16::from_bits(b)).to_bits(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::reference;
    use super::*;
    use crate::kernels::fallback::conformance::{special_values, SplitMix64};

    const FORMATS: [HalfFormat; 2] = [HalfFormat::Bf16, HalfFormat::F16];

    fn is_nan16(format: HalfFormat, h: u16) -> bool {
        format.widen(h).is_nan()
    }

    /// Compares slices, reporting the first difference with its input.
    fn check_round(format: HalfFormat, inputs: &[f32], scale: f32) {
        let mut got = vec![0u16; inputs.len()];
        round_scaled(format, inputs, scale, &mut got);
        for (x, g) in inputs.iter().zip(&got) {
            let want = reference::round(format, x * scale);
            assert_eq!(
                *g,
                want,
                "{} x {scale}: {:#010x} rounds to {g:#06x}, half says {want:#06x}",
                format.name(),
                x.to_bits()
            );
        }
    }

    #[test]
    fn widening_matches_half_on_every_pattern() {
        for format in FORMATS {
            let all: Vec<u16> = (0..=u16::MAX).collect();
            let mut got = vec![0f32; all.len()];
            widen(format, &all, &mut got);
            for (&h, g) in all.iter().zip(&got) {
                assert_eq!(
                    g.to_bits(),
                    format.widen(h).to_bits(),
                    "{} {h:#06x}",
                    format.name()
                );
            }
        }
    }

    /// Every high half with the low halves that decide the rounding of bf16 (ties, just below
    /// and above, the lowest kept bit) and of f16 (which keeps 13 fewer bits, more in its
    /// subnormal range): both formats see the ties and near-ties of every exponent and sign,
    /// NaN (quiet and signalling), the infinities, subnormals and zeros.
    #[test]
    fn rounding_matches_half_on_every_rounding_case() {
        let lows: [u32; 16] = [
            0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x2000, 0x3fff, 0x4000, 0x7fff, 0x8000, 0x8001,
            0xbfff, 0xc000, 0xe000, 0xfffe, 0xffff,
        ];
        let inputs: Vec<f32> = (0..=0xffffu32)
            .flat_map(|hi| lows.iter().map(move |lo| f32::from_bits(hi << 16 | lo)))
            .collect();
        let mut rng = SplitMix64::new(0x5eed_0016);
        let random: Vec<f32> = (0..1 << 20)
            .map(|_| f32::from_bits(rng.next_u64() as u32))
            .collect();
        for format in FORMATS {
            for scale in [1.0f32, 0.5, 1.0 / 3.0] {
                check_round(format, &inputs, scale);
                check_round(format, &random, scale);
                check_round(format, &special_values(), scale);
            }
            // Odd lengths and the chunk boundary.
            for len in [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5] {
                check_round(format, &random[..len], 1.0);
            }
        }
    }

    fn check_sums(format: HalfFormat, a: &[u16], b: &[u16]) {
        let mut got = a.to_vec();
        sum_into(format, &mut got, b);
        for i in 0..a.len() {
            let want = reference::sum(format, a[i], b[i]);
            let same = got[i] == want || (is_nan16(format, got[i]) && is_nan16(format, want));
            assert!(
                same,
                "{}: {:#06x} + {:#06x} = {:#06x}, half says {want:#06x}",
                format.name(),
                a[i],
                b[i],
                got[i]
            );
        }
    }

    #[test]
    fn sums_match_half() {
        let mut rng = SplitMix64::new(0x5eed_0017);
        for format in FORMATS {
            // Every special value (rounded to the format) with every other.
            let specials: Vec<u16> = special_values()
                .iter()
                .map(|&x| reference::round(format, x))
                .chain([
                    0x0001, 0x8001, 0x03ff, 0x0400, 0x007f, 0x0080, 0x7bff, 0x7f7f,
                ])
                .collect();
            let (a, b): (Vec<u16>, Vec<u16>) = specials
                .iter()
                .flat_map(|&x| specials.iter().map(move |&y| (x, y)))
                .unzip();
            check_sums(format, &a, &b);
            // Random bit patterns, and random gradients of nearby magnitudes (carries, ties).
            let n = 1 << 20;
            let a: Vec<u16> = (0..n).map(|_| rng.next_u64() as u16).collect();
            let b: Vec<u16> = (0..n).map(|_| rng.next_u64() as u16).collect();
            check_sums(format, &a, &b);
            let a: Vec<u16> = (0..n)
                .map(|_| reference::round(format, rng.symmetric_f32() * 1e-3))
                .collect();
            let b: Vec<u16> = (0..n)
                .map(|_| reference::round(format, rng.symmetric_f32() * 1e-3))
                .collect();
            check_sums(format, &a, &b);
            for len in [0, 1, CHUNK - 1, CHUNK + 1] {
                check_sums(format, &a[..len], &b[..len]);
            }
        }
    }

    /// All 2^32 `f32` inputs (about a minute in release): `cargo test --release -p burn-ddp
    /// --lib host16 -- --ignored`.
    #[test]
    #[ignore]
    fn rounding_matches_half_on_every_f32() {
        for format in FORMATS {
            let mut inputs = vec![0f32; 1 << 20];
            let mut got = vec![0u16; 1 << 20];
            for block in 0..1u32 << 12 {
                for (i, x) in inputs.iter_mut().enumerate() {
                    *x = f32::from_bits(block << 20 | i as u32);
                }
                round_scaled(format, &inputs, 1.0, &mut got);
                for (x, g) in inputs.iter().zip(&got) {
                    assert_eq!(*g, reference::round(format, *x), "{:#010x}", x.to_bits());
                }
            }
        }
    }

    /// All 2^32 pairs of 16-bit values (about a minute in release), as above.
    #[test]
    #[ignore]
    fn sums_match_half_on_every_pair() {
        for format in FORMATS {
            let b: Vec<u16> = (0..=u16::MAX).collect();
            for x in 0..=u16::MAX {
                check_sums(format, &vec![x; b.len()], &b);
            }
        }
    }
}
