//! SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014):
//! the one random generator of this project.
//!
//! Written out rather than taken from a crate because what it draws is part of the checkpoint
//! contract: sample orders, the train/validation split and synthetic data must be identical on
//! every rank, platform and version of this project, and `rand`'s generators and sampling
//! algorithms are not guaranteed stable across releases. Not for anything security related.

/// A 64-bit counter passed through a bijective mixing function: cheap to start anywhere
/// ([`SplitMix64::stream`]), so item `i` of a synthetic data set can be computed from
/// `(seed, i)` alone.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

/// The golden-ratio increment.
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// The output function: a bijection of `u64` that mixes every bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl SplitMix64 {
    /// The sequence of `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// Stream `stream` of `seed`: streams of one seed (and the same stream of different seeds)
    /// are unrelated sequences.
    pub fn stream(seed: u64, stream: u64) -> Self {
        Self {
            state: mix(seed ^ mix(stream.wrapping_add(GAMMA))),
        }
    }

    /// The next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        mix(self.state)
    }

    /// Uniform in `0..bound` without modulo bias (Lemire's multiply-shift with rejection);
    /// `bound = 0` gives 0.
    pub fn below(&mut self, bound: u64) -> u64 {
        if bound == 0 {
            return 0;
        }
        let threshold = bound.wrapping_neg() % bound;
        loop {
            let product = u128::from(self.next_u64()) * u128::from(bound);
            if (product as u64) >= threshold {
                return (product >> 64) as u64;
            }
        }
    }

    /// Uniform index in `0..len`; `len = 0` gives 0.
    pub fn index(&mut self, len: usize) -> usize {
        // usize is at most 64 bits wide, and the result is below `len`.
        self.below(len as u64) as usize
    }

    /// Uniform in `[0, 1)` from the top 53 bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[0, 1)` from the top 24 bits (all an `f32` mantissa holds, so every value
    /// is exact).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u32 << 24) as f32
    }

    /// Uniform in `[-1, 1)`, exact like [`next_f32`](Self::next_f32).
    pub fn symmetric_f32(&mut self) -> f32 {
        2.0 * self.next_f32() - 1.0
    }

    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.index(i + 1);
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_sequence() {
        // SplitMix64 seeded with 0 (Vigna's reference implementation's first output).
        assert_eq!(SplitMix64::new(0).next_u64(), 0xe220_a839_7b1d_cdaf);
    }

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
            assert!((0.0..1.0).contains(&rng.unit()));
            assert!((0.0..1.0).contains(&rng.next_f32()));
            assert!((-1.0..1.0).contains(&rng.symmetric_f32()));
            assert!(rng.below(7) < 7);
        }
        assert_eq!(rng.below(0), 0);
        let hits = (0..1000).filter(|_| rng.below(2) == 1).count();
        assert!((400..600).contains(&hits), "{hits}");
    }

    #[test]
    fn shuffle_is_a_permutation() {
        let mut items: Vec<usize> = (0..50).collect();
        SplitMix64::new(3).shuffle(&mut items);
        assert_ne!(items, (0..50).collect::<Vec<_>>());
        items.sort_unstable();
        assert_eq!(items, (0..50).collect::<Vec<_>>());
    }
}
