//! The rendezvous store: a small key-value service every rank can reach, used to exchange ring
//! addresses, world sizes, config hashes and (on GPUs) the NCCL unique id before any collective
//! runs. The role of PyTorch's `TCPStore`.
//!
//! - [`wire`]: the frame format (pure encode/decode).
//! - [`memory`]: [`MemoryStore`], the state and its blocking semantics, usable in-process.
//! - [`server`]: [`TcpStoreServer`], a [`MemoryStore`] served over TCP (hosted by rank 0 or by the
//!   launcher).
//! - [`client`]: [`TcpStore`], the client every rank uses.
//! - [`c10d`]: [`C10dStore`], a client of PyTorch's c10d `TCPStore` (torchrun's agent store).
//! - [`host`]: [`StoreHost`], who hosts the job's store, from the launcher's variables.
//! - [`prefix`]: [`PrefixStore`], one namespace of a store (a group's keys), so several groups and
//!   job attempts can share one store.
//! - `heartbeat`: a counter beaten in the store by a process the others wait for (rank 0
//!   writing a checkpoint, a joiner on its way in, every rank of a group with peer heartbeats),
//!   and the pure watch that calls it gone.
//! - `contract`: the [`Store`] trait every store implements.
//! - `backoff`: the capped back-off of every retry loop in the crate.

pub(crate) mod backoff;
pub mod c10d;
pub mod client;
mod connection;
mod contract;
pub(crate) mod heartbeat;
pub mod host;
pub mod memory;
pub mod prefix;
pub mod server;
pub mod wire;

pub use c10d::C10dStore;
pub use client::TcpStore;
pub use contract::Store;
pub use host::StoreHost;
pub use memory::MemoryStore;
pub use prefix::PrefixStore;
pub use server::TcpStoreServer;

#[cfg(test)]
pub(crate) mod conformance {
    //! One contract suite, run against every [`Store`] implementation.
    use super::*;
    use crate::error::StoreError;
    use std::sync::Arc;
    use std::time::Duration;

    pub fn run_all<S: Store + 'static>(make: impl Fn() -> (Arc<S>, Arc<S>)) {
        set_get_overwrite(make());
        get_waits_for_a_later_set(make());
        get_times_out_with_the_key_in_the_message(make());
        add_is_atomic(make());
        wait_and_check(make());
        delete(make());
    }

    fn set_get_overwrite<S: Store + 'static>((a, b): (Arc<S>, Arc<S>)) {
        a.set("k", b"one").unwrap();
        assert_eq!(b.get("k", Duration::from_secs(5)).unwrap(), b"one");
        b.set("k", b"").unwrap();
        assert_eq!(a.get("k", Duration::from_secs(5)).unwrap(), b"");
    }

    fn get_waits_for_a_later_set<S: Store + 'static>((a, b): (Arc<S>, Arc<S>)) {
        let setter = std::thread::spawn(move || {
            // Waits until the getter is registered as waiting, so the set really is later.
            a.wait(&["getter-ready"], Duration::from_secs(30)).unwrap();
            a.set("late", b"v").unwrap();
        });
        b.set("getter-ready", b"").unwrap();
        assert_eq!(b.get("late", Duration::from_secs(30)).unwrap(), b"v");
        setter.join().unwrap();
    }

    fn get_times_out_with_the_key_in_the_message<S: Store + 'static>((a, _): (Arc<S>, Arc<S>)) {
        let err = a.get("never", Duration::from_millis(50)).unwrap_err();
        assert!(matches!(err, StoreError::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("never"), "{err}");
    }

    fn add_is_atomic<S: Store + 'static>((a, b): (Arc<S>, Arc<S>)) {
        let handles: Vec<_> = [a.clone(), b.clone()]
            .into_iter()
            .map(|s| {
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        s.add("counter", 1).unwrap();
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(a.add("counter", 0).unwrap(), 400);
        assert_eq!(b.get("counter", Duration::from_secs(1)).unwrap(), b"400");
        assert_eq!(a.add("counter", -401).unwrap(), -1);
    }

    fn wait_and_check<S: Store + 'static>((a, b): (Arc<S>, Arc<S>)) {
        assert!(a.check(&[]).unwrap());
        assert!(!a.check(&["x", "y"]).unwrap());
        b.set("x", b"1").unwrap();
        assert!(!a.check(&["x", "y"]).unwrap());
        let err = a.wait(&["x", "y"], Duration::from_millis(50)).unwrap_err();
        assert!(err.to_string().contains('y'), "{err}");
        b.set("y", b"2").unwrap();
        a.wait(&["x", "y"], Duration::from_secs(5)).unwrap();
        assert!(a.check(&["x", "y"]).unwrap());
    }

    fn delete<S: Store + 'static>((a, b): (Arc<S>, Arc<S>)) {
        a.set("d", b"1").unwrap();
        assert!(b.delete_key("d").unwrap());
        assert!(!b.delete_key("d").unwrap());
        assert!(!a.check(&["d"]).unwrap());
    }
}
