//! A tiny deterministic generator for the synthetic data sets.
//!
//! The data sets compute item `index` from `(seed, index)` alone, so they need
//! a generator that is cheap to start anywhere and identical on every
//! platform; it is not for anything security related.

/// SplitMix64 (Steele, Lea and Flood, 2014): a 64-bit counter passed through
/// a bijective mixing function.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix64 {
    state: u64,
}

/// The golden-ratio increment of SplitMix64.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijection of `u64` that mixes every bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SplitMix64 {
    /// The generator for stream `stream` of `seed`: streams of one seed (and
    /// the same stream of different seeds) are unrelated sequences.
    pub(crate) fn stream(seed: u64, stream: u64) -> Self {
        Self {
            state: mix(seed ^ mix(stream.wrapping_add(GAMMA))),
        }
    }

    /// The next 64 uniformly distributed bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        mix(self.state)
    }

    /// Uniform in `[0, 1)`, with 24 random bits (every such `f32` is exact).
    pub(crate) fn unit_f32(&mut self) -> f32 {
        // 24 bits fit an f32 mantissa exactly, so the conversion is lossless.
        (self.next_u64() >> 40) as f32 / (1u32 << 24) as f32
    }

    /// Uniform in `[-1, 1)`.
    pub(crate) fn symmetric_f32(&mut self) -> f32 {
        2.0 * self.unit_f32() - 1.0
    }

    /// Uniform in `0..n` (Lemire's multiply-shift; the bias is below
    /// `n / 2^64`). `n = 0` gives 0.
    pub(crate) fn below(&mut self, n: usize) -> usize {
        // `usize` is at most 64 bits wide, so both conversions are lossless.
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let draw = |seed, stream| {
            let mut rng = SplitMix64::stream(seed, stream);
            [rng.next_u64(), rng.next_u64()]
        };
        assert_eq!(draw(1, 2), draw(1, 2));
        assert_ne!(draw(1, 2), draw(1, 3));
        assert_ne!(draw(1, 2), draw(2, 2));
    }

    #[test]
    fn ranges() {
        let mut rng = SplitMix64::stream(0, 0);
        for _ in 0..1000 {
            assert!((0.0..1.0).contains(&rng.unit_f32()));
            assert!((-1.0..1.0).contains(&rng.symmetric_f32()));
            assert!(rng.below(7) < 7);
        }
        assert_eq!(rng.below(0), 0);
        let hits = (0..1000).filter(|_| rng.below(2) == 1).count();
        assert!((400..600).contains(&hits), "{hits}");
    }
}
