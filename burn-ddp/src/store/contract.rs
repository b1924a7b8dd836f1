//! The contract of every store: the [`Store`] trait.

use std::time::Duration;

use crate::error::StoreError;

/// A key-value store shared by all ranks of a job.
///
/// None of these calls is collective: any rank may call any of them at any time. Calls that wait
/// take a timeout and return [`StoreError::Timeout`] when it passes; the others use the client's
/// default timeout for the round trip.
pub trait Store: Send + Sync {
    /// Stores `value` under `key`, replacing any previous value, and wakes every waiter.
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// Returns the value under `key`, waiting up to `timeout` for some rank to set it.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError>;
    /// Atomically adds `delta` to the counter under `key` (absent counts as 0); returns the new
    /// value. Counters are stored as decimal text, so `get` reads them too.
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError>;
    /// Waits up to `timeout` until every key in `keys` is set.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError>;
    /// Whether every key in `keys` is set, without waiting.
    fn check(&self, keys: &[&str]) -> Result<bool, StoreError>;
    /// Removes `key`; returns whether it was present.
    fn delete_key(&self, key: &str) -> Result<bool, StoreError>;
}
