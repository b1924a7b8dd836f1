//! FNV-1a, 64-bit (Fowler, Noll and Vo): the one hash of this project for every fingerprint
//! and checksum that must come out the same on every rank, platform, run and Rust version
//! (std's `DefaultHasher` is not stable across releases): checkpoint file checksums and config
//! fingerprints (both stored in checkpoint manifests, so this function may never change),
//! replica checksums, ports derived from a job id, and the layout fingerprint of uneven
//! collectives. A detector of accidents — flipped bytes, truncation, different inputs — and no
//! defence against tampering.

/// FNV-1a 64 fed piece by piece: `Fnv1a64::new().write(a).write(b).finish()` equals
/// [`fnv1a64`] of `a` followed by `b`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fnv1a64(u64);

const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME: u64 = 0x0000_0100_0000_01b3;

impl Fnv1a64 {
    pub const fn new() -> Self {
        Self(OFFSET_BASIS)
    }

    /// Mixes in `bytes`, in order.
    pub fn write(&mut self, bytes: &[u8]) -> &mut Self {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(PRIME);
        }
        self
    }

    pub fn finish(&self) -> u64 {
        self.0
    }
}

impl Default for Fnv1a64 {
    fn default() -> Self {
        Self::new()
    }
}

/// FNV-1a 64 of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    Fnv1a64::new().write(bytes).finish()
}

/// FNV-1a 64 of `bytes` as 16 lower-case hex digits (the form manifests store).
pub fn fnv1a64_hex(bytes: &[u8]) -> String {
    format!("{:016x}", fnv1a64(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_test_vectors() {
        // From the FNV reference test suite (Landon Curt Noll's fnv_test.c).
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(fnv1a64_hex(b"a"), "af63dc4c8601ec8c");
    }

    #[test]
    fn pieces_hash_like_the_whole() {
        let whole = fnv1a64(b"checkpoint");
        assert_eq!(
            Fnv1a64::new().write(b"check").write(b"point").finish(),
            whole
        );
        assert_ne!(fnv1a64(b"checkpoinT"), whole);
    }
}
