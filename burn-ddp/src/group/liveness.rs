//! Peer heartbeats ([`TcpGroupOptions::peer_heartbeats`](crate::TcpGroupOptions)): each rank of
//! the group beats `alive/{rank}` in the group's namespace of the store from a thread of its
//! own, and a collective that waits on its peers reads their counters once it has waited the
//! failure detection time. A rank whose counter stood still for twice that (eight missed beats:
//! a loaded machine may starve a live rank's beating thread for a moment) is gone (dead,
//! frozen, or cut off from the store and so from the job): the call fails naming it, within
//! about three times the detection time, instead of at the collective's deadline. A live rank
//! that is slow (a long validation, a checkpoint write) beats on, so it is waited for as
//! before.
//!
//! What a rank's silence cannot tell apart: a link cut between two ranks while both still reach
//! the store (neither is named; the collective's deadline still holds).

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::store::heartbeat::{beat_period, Heartbeat, Silence};
use crate::store::Store;

fn beat_key(rank: usize) -> String {
    format!("alive/{rank}")
}

/// Starts rank `rank`'s heartbeat in `store` (the group's namespace): every quarter of
/// `detection`, until dropped.
pub(crate) fn start_beating(store: Arc<dyn Store>, rank: usize, detection: Duration) -> Heartbeat {
    let every = beat_period(detection);
    Heartbeat::start(store, beat_key(rank), every)
}

/// One call's watch over its peers' heartbeats (module docs).
pub(crate) struct PeerLiveness<'a> {
    store: &'a dyn Store,
    /// The ranks watched.
    peers: Vec<usize>,
    detection: Duration,
    next_check: Instant,
    /// Each peer's watch, from the first check on.
    watches: Vec<(usize, Silence)>,
}

impl<'a> PeerLiveness<'a> {
    /// The watch of a call that started at `start`: the first check is due after `detection`.
    pub fn new(
        store: &'a dyn Store,
        (rank, world_size): (usize, usize),
        detection: Duration,
        start: Instant,
    ) -> Self {
        let peers = (0..world_size).filter(|&r| r != rank).collect();
        Self::watching(store, peers, detection, start)
    }

    /// A watch over `peers` alone, from `start`: the first check is due after `detection`.
    pub fn watching(
        store: &'a dyn Store,
        peers: Vec<usize>,
        detection: Duration,
        start: Instant,
    ) -> Self {
        Self {
            store,
            peers,
            detection,
            next_check: start + detection,
            watches: Vec::new(),
        }
    }

    /// When the next check is due (a waiting loop should wake up by then).
    pub fn next_check(&self) -> Instant {
        self.next_check
    }

    /// If a check is due at `now`: the peers whose heartbeat stood still for longer than twice
    /// the detection time, and the longest silence, when there are any. Store errors count as no
    /// news (the collective's deadline still holds).
    pub fn silent_peers(&mut self, now: Instant) -> Option<(Vec<usize>, Duration)> {
        if now < self.next_check {
            return None;
        }
        self.next_check = now + beat_period(self.detection);
        if self.watches.is_empty() {
            let detection = self.detection;
            self.watches = self
                .peers
                .iter()
                .map(|&r| (r, Silence::after_detection(detection, now)))
                .collect();
        }
        let mut silent = Vec::new();
        let mut longest = Duration::ZERO;
        for (peer, watch) in &mut self.watches {
            let Ok(beats) = self.store.add(&beat_key(*peer), 0) else {
                return None;
            };
            if let Some(quiet) = watch.observe(beats, Instant::now()) {
                silent.push(*peer);
                longest = longest.max(quiet);
            }
        }
        (!silent.is_empty()).then_some((silent, longest))
    }
}

/// Watches `peers`' heartbeats in `store` (a group's namespace) from now until one has stood
/// still for twice `detection` — returns them and the longest silence — or until `until`
/// says stop (a message, or its sender dropped) — returns `None`. For a party that waits on
/// those peers outside a collective (the survivors forming their next group).
pub(crate) fn wait_for_silence(
    store: &dyn Store,
    peers: Vec<usize>,
    detection: Duration,
    until: &Receiver<()>,
) -> Option<(Vec<usize>, Duration)> {
    let mut watch = PeerLiveness::watching(store, peers, detection, Instant::now());
    loop {
        let wait = watch.next_check().saturating_duration_since(Instant::now());
        match until.recv_timeout(wait) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return None,
        }
        if let Some(silent) = watch.silent_peers(Instant::now()) {
            return Some(silent);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::{start_beating, wait_for_silence, PeerLiveness};
    use crate::store::{MemoryStore, Store};

    /// A beating peer is never named; one whose heartbeat stopped is, after twice the
    /// detection time; nothing is read before the first check is due.
    #[test]
    fn a_peer_that_stops_beating_is_named_and_a_beating_one_is_not() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let detection = Duration::from_millis(100);
        let one = start_beating(Arc::clone(&store), 1, detection);
        let two = start_beating(Arc::clone(&store), 2, detection);
        let start = Instant::now();
        let mut watch = PeerLiveness::new(store.as_ref(), (0, 3), detection, start);
        assert_eq!(watch.silent_peers(start), None, "not due yet");
        drop(two);
        let named = loop {
            let now = Instant::now();
            if let Some((silent, _)) = watch.silent_peers(now) {
                break silent;
            }
            assert!(now - start < Duration::from_secs(20), "never named");
            std::thread::sleep(Duration::from_millis(5));
        };
        assert_eq!(named, vec![2]);
        drop(one);
    }

    /// Only the peers watched count: rank 3 never beats and is not watched; rank 2 stops and
    /// is named; a watch told to stop returns nothing.
    #[test]
    fn a_watch_over_some_peers_names_the_one_that_stops() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let detection = Duration::from_millis(100);
        let one = start_beating(Arc::clone(&store), 1, detection);
        let two = start_beating(Arc::clone(&store), 2, detection);
        let (stop, until) = std::sync::mpsc::channel();
        let watcher = {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                wait_for_silence(store.as_ref(), vec![1, 2], detection, &until)
            })
        };
        drop(two);
        let named = watcher.join().ok().flatten().map(|(silent, _)| silent);
        assert_eq!(named, Some(vec![2]));
        drop(stop);

        let (stop, until) = std::sync::mpsc::channel();
        let watcher = {
            let store = Arc::clone(&store);
            std::thread::spawn(move || wait_for_silence(store.as_ref(), vec![1], detection, &until))
        };
        assert!(stop.send(()).is_ok());
        assert_eq!(watcher.join().ok().flatten(), None);
        drop(one);
    }
}
