//! [`PrefixStore`]: a [`Store`] that owns one namespace of another store (PyTorch's
//! `PrefixStore`).
//!
//! Every key is stored as `{prefix}/{key}` in the inner store, so several users of one store —
//! the TCP group and the NCCL group of a job, a sub-group, a second job attempt — each see only
//! their own keys and cannot collide, even when they use the same key names (`claims/0`,
//! `abort`, ...). Prefixes nest: a `PrefixStore` over a `PrefixStore` joins both prefixes.

use std::sync::Arc;
use std::time::Duration;

use super::contract::Store;
use crate::error::StoreError;

/// A view of `inner` in which every key is `{prefix}/{key}`. Cheap to clone; the inner store
/// is shared.
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// The namespace `prefix` of `inner`. `prefix` should not end with `/` (one is added).
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        Self {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The prefix, as given.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The key under which `key` is stored in the inner store.
    pub fn full_key(&self, key: &str) -> String {
        format!("{}/{key}", self.prefix)
    }
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.inner.set(&self.full_key(key), value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        self.inner.get(&self.full_key(key), timeout)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.inner.add(&self.full_key(key), delta)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let full: Vec<String> = keys.iter().map(|k| self.full_key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&refs, timeout)
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let full: Vec<String> = keys.iter().map(|k| self.full_key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.check(&refs)
    }

    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.delete_key(&self.full_key(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn prefix_store_conformance() {
        super::super::conformance::run_all(|| {
            let inner: Arc<dyn Store> = Arc::new(MemoryStore::new());
            (
                Arc::new(PrefixStore::new("job/a", inner.clone())),
                Arc::new(PrefixStore::new("job/a", inner)),
            )
        });
    }

    #[test]
    fn namespaces_do_not_see_each_other() {
        let inner: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let a = PrefixStore::new("a", inner.clone());
        let b = PrefixStore::new("b", inner.clone());
        a.set("k", b"from a").unwrap();
        assert!(!b.check(&["k"]).unwrap());
        b.set("k", b"from b").unwrap();
        assert_eq!(a.get("k", Duration::from_secs(1)).unwrap(), b"from a");
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(b.add("n", 5).unwrap(), 5);
        assert_eq!(inner.get("a/k", Duration::from_secs(1)).unwrap(), b"from a");
        assert_eq!(inner.get("b/n", Duration::from_secs(1)).unwrap(), b"5");
        // Nested prefixes join.
        let nested = PrefixStore::new("sub", Arc::new(a.clone()));
        nested.set("x", b"1").unwrap();
        assert!(inner.check(&["a/sub/x"]).unwrap());
        assert!(nested.delete_key("x").unwrap());
        assert!(!a.check(&["sub/x"]).unwrap());
    }

    #[test]
    fn timeouts_name_the_full_key() {
        let a = PrefixStore::new("pg/x", Arc::new(MemoryStore::new()));
        let err = a.wait(&["addr/3"], Duration::from_millis(20)).unwrap_err();
        assert!(err.to_string().contains("pg/x/addr/3"), "{err}");
    }
}
