//! [`MemoryStore`]: the store's state and its waiting semantics, in one process.
//!
//! The TCP server serves one of these; tests and single-process runs use it directly (the role
//! of PyTorch's `HashStore`).

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::contract::Store;
use crate::error::StoreError;

/// An in-process [`Store`]: a map behind a mutex, and a condition variable that wakes waiters
/// on every change.
#[derive(Default)]
pub struct MemoryStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    closed: Mutex<bool>,
}

/// How a wait ended when it did not succeed.
pub(crate) enum WaitOutcome {
    TimedOut { missing: Vec<String> },
    Closed,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A panic while holding this lock cannot leave the map half-updated (every update is a
        // single insert/remove), so a poisoned lock is still safe to use.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wakes every waiter and makes later waits fail at once; used by the server's shutdown.
    pub(crate) fn close(&self) {
        *self.closed.lock().unwrap_or_else(|p| p.into_inner()) = true;
        let _guard = self.lock();
        self.changed.notify_all();
    }

    fn is_closed(&self) -> bool {
        *self.closed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until all `keys` are present; returns the guard so the caller can read them.
    pub(crate) fn wait_for(
        &self,
        keys: &[&str],
        timeout: Duration,
    ) -> Result<MutexGuard<'_, HashMap<String, Vec<u8>>>, WaitOutcome> {
        let deadline = Instant::now() + timeout;
        let mut map = self.lock();
        loop {
            if self.is_closed() {
                return Err(WaitOutcome::Closed);
            }
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| !map.contains_key(**k))
                .map(|k| k.to_string())
                .collect();
            if missing.is_empty() {
                return Ok(map);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(WaitOutcome::TimedOut { missing });
            }
            map = self
                .changed
                .wait_timeout(map, deadline - now)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    pub(crate) fn add_counter(&self, key: &str, delta: i64) -> Result<i64, String> {
        let mut map = self.lock();
        let current = match map.get(key) {
            None => 0,
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| format!("key {key:?} holds a value that is not a counter"))?,
        };
        let next = current.wrapping_add(delta);
        map.insert(key.to_string(), next.to_string().into_bytes());
        self.changed.notify_all();
        Ok(next)
    }

    fn timeout_error(operation: String, timeout: Duration, outcome: WaitOutcome) -> StoreError {
        match outcome {
            WaitOutcome::TimedOut { missing } => StoreError::Timeout {
                addr: "in-process".into(),
                operation: format!("{operation} (missing: {})", missing.join(", ")),
                timeout,
            },
            WaitOutcome::Closed => StoreError::Refused {
                addr: "in-process".into(),
                operation,
                message: "the store is shutting down".into(),
            },
        }
    }
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.lock().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        match self.wait_for(&[key], timeout) {
            Ok(map) => Ok(map.get(key).cloned().unwrap_or_default()),
            Err(outcome) => Err(Self::timeout_error(
                format!("get({key:?})"),
                timeout,
                outcome,
            )),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.add_counter(key, delta)
            .map_err(|message| StoreError::Refused {
                addr: "in-process".into(),
                operation: format!("add({key:?})"),
                message,
            })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        self.wait_for(keys, timeout)
            .map(|_| ())
            .map_err(|o| Self::timeout_error(format!("wait({keys:?})"), timeout, o))
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let map = self.lock();
        Ok(keys.iter().all(|k| map.contains_key(*k)))
    }

    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        let removed = self.lock().remove(key).is_some();
        self.changed.notify_all();
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn memory_store_conformance() {
        super::super::conformance::run_all(|| {
            let s = Arc::new(MemoryStore::new());
            (s.clone(), s)
        });
    }
}
