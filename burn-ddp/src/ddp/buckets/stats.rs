//! [`ReducerStats`]: what gradient synchronisation did, counted wherever buckets are sent
//! (the reducer, ZeRO's exchanges, the overlap).

/// Counters a test or a metrics line can read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReducerStats {
    /// Gradient synchronisations (one per optimizer step, whatever the accumulation).
    pub syncs: u64,
    /// Bucket all-reduces issued.
    pub bucket_all_reduces: u64,
    /// Bytes of gradient buckets all-reduced, as sent: 4 per element, 2 when compressed.
    pub bytes_reduced: u64,
}
