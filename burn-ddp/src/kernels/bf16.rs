//! The bf16 wire format on the host: rounding and packing, pure functions.
//!
//! These are the reference the kernels are tested against bit for bit, and what the
//! [`fallback`](super::fallback) uses. bf16 is the upper half of an `f32` (sign, 8 exponent bits,
//! 7 mantissa bits), so rounding is integer arithmetic on the `f32` bits.

/// Rounds `x` to the nearest bf16, ties to even, and returns its bits.
///
/// NaN stays NaN: the top half of its bits with the quiet bit set (sign and the top of the payload
/// kept; a plain truncation could turn a NaN whose payload sits in the low bits into infinity).
/// ±inf and ±0 are exact; finite values beyond bf16's largest finite value round to ±inf;
/// subnormals are rounded like any other value (bf16 has the same exponent range as `f32`).
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits >> 16) | 0x0040) as u16;
    }
    // Adding 0x7fff rounds half-way cases down; the extra lsb of the kept part turns that into
    // ties-to-even. No overflow: the largest non-NaN pattern is 0xff80_0000.
    let rounding_bias = 0x7fff + ((bits >> 16) & 1);
    ((bits + rounding_bias) >> 16) as u16
}

/// Widens bf16 bits to the `f32` they denote (exact).
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Number of `u32` words that hold `len` packed bf16 values.
pub fn packed_len(len: usize) -> usize {
    len.div_ceil(2)
}

/// Rounds and packs `values` into words: element `2k` in the low half of word `k`, element
/// `2k + 1` in the high half (0 when `values.len()` is odd).
pub fn compress(values: &[f32]) -> Vec<u32> {
    values
        .chunks(2)
        .map(|pair| {
            let lo = u32::from(f32_to_bf16(pair[0]));
            let hi = pair.get(1).map_or(0, |&x| u32::from(f32_to_bf16(x)));
            lo | (hi << 16)
        })
        .collect()
}

/// Unpacks the first `len` bf16 values from `words` (the layout of [`compress`]).
///
/// # Panics
/// If `words.len() != packed_len(len)`: the caller lost track of the length.
pub fn decompress(words: &[u32], len: usize) -> Vec<f32> {
    assert_eq!(
        words.len(),
        packed_len(len),
        "{} packed words cannot hold exactly {len} bf16 values",
        words.len()
    );
    (0..len)
        .map(|i| bf16_to_f32((words[i / 2] >> (16 * (i % 2))) as u16))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `half` crate (re-exported by Burn) is an independent implementation to agree with.
    fn half_bits(x: f32) -> u16 {
        burn::tensor::bf16::from_f32(x).to_bits()
    }

    #[test]
    fn rounding_matches_the_half_crate_on_special_and_boundary_values() {
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            f32::from_bits(1),           // smallest subnormal
            f32::from_bits(0x0000_8000), // subnormal exactly half-way
            f32::from_bits(0x0001_8000), // subnormal half-way, odd kept part: rounds up
            f32::from_bits(0x3f80_8000), // 1 + half an ulp: tie, rounds to even (down)
            f32::from_bits(0x3f81_8000), // tie with odd kept part: rounds up
            f32::from_bits(0x3f80_8001), // just past the tie: rounds up
            f32::from_bits(0x7f7f_ffff), // rounds past bf16's max: +inf
            f32::from_bits(0x7f7f_7fff), // stays at bf16's max
        ];
        for x in specials {
            assert_eq!(
                f32_to_bf16(x),
                half_bits(x),
                "x = {x:e} ({:#010x})",
                x.to_bits()
            );
        }
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f7f_ffff)), 0x7f80);
    }

    #[test]
    fn nan_stays_nan_with_its_sign() {
        // A NaN whose payload is only in the low half: truncation would give infinity.
        for bits in [
            0x7f80_0001u32,
            0xff80_0001,
            0x7fc0_0000,
            0xffff_ffff,
            0x7fa0_0000,
        ] {
            let out = f32_to_bf16(f32::from_bits(bits));
            assert!(bf16_to_f32(out).is_nan(), "{bits:#010x} -> {out:#06x}");
            assert_eq!(
                out & 0x8000,
                (bits >> 16) as u16 & 0x8000,
                "sign of {bits:#010x}"
            );
            assert_eq!(out, half_bits(f32::from_bits(bits)), "{bits:#010x}");
        }
    }

    #[test]
    fn rounding_matches_the_half_crate_on_a_sweep_of_bit_patterns() {
        // Every 997th bit pattern: all exponents, many mantissas, both signs.
        for bits in (0..=u32::MAX).step_by(997) {
            let x = f32::from_bits(bits);
            assert_eq!(f32_to_bf16(x), half_bits(x), "{bits:#010x}");
        }
    }

    #[test]
    fn compress_packs_low_half_first_and_round_trips() {
        let values = [1.0f32, -2.0, 3.5];
        let words = compress(&values);
        assert_eq!(words, vec![0xc000_3f80, 0x0000_4060]);
        assert_eq!(decompress(&words, 3), values.to_vec());
        assert!(compress(&[]).is_empty());
        assert!(decompress(&[], 0).is_empty());
    }

    #[test]
    #[should_panic(expected = "cannot hold exactly")]
    fn decompress_rejects_a_wrong_length() {
        decompress(&[0, 0], 5);
    }
}
