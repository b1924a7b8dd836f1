//! [`Rendezvous`]: how the ranks of a new group find each other through the store, shared by the
//! TCP and NCCL groups (the role of NCCL's `bootstrap`, apart from any data path).
//!
//! Every key lives in the group's namespace (a [`PrefixStore`] over the job's store), so several
//! groups — TCP and NCCL, a sub-group, a second attempt — share one store without colliding:
//!
//! | key | written by | value |
//! |---|---|---|
//! | `claims/{rank}` | `add` by the rank | how many processes claimed the rank (must be 1) |
//! | `world/{rank}` | the rank | its world size, decimal text |
//! | `world-read/{rank}` | a rank other than 0, once it has read rank 0's world size | `1` |
//! | `abort/claims` | `add` by a failing rank | how many ranks tried to publish an abort |
//! | `abort` | the first failing rank only | `rank R: <error>`, the first cause |
//! | `failed/{rank}` | the rank, when a collective fails | the peer it lost, and its error (see `super::postmortem`) |
//! | `judged/{rank}` | the rank, once it knows the cause | `1` |
//! | (group's own keys, e.g. `addr/{rank}`) | the group | through [`Rendezvous::publish`] |
//!
//! # Steps of [`Rendezvous::join`] and [`Rendezvous::wait_joined`]
//! 1. Claim the rank (`add`): a second claim means two processes were given the same rank (or
//!    two groups the same prefix).
//! 2. Publish the world size; a rank other than 0 compares it with rank 0's at once, so a
//!    mismatch fails both sides with both values named.
//! 3. Wait, until the group's deadline, for every rank's world size; rank 0 compares each. A rank
//!    that never arrives is named in the error. (A group may publish its own keys between
//!    steps 2 and 3, as the TCP group does with its address.) On a mismatch rank 0 returns only
//!    once the other rank has read rank 0's size (`world-read/{rank}`, at most
//!    [`MISMATCH_GRACE`]): rank 0 may host the store, and leaving at once would leave that rank
//!    with a lost connection instead of both sizes.
//!
//! Every wait is cut into one-second slices that look for a published abort in between, so when
//! one rank fails the others stop within a second instead of at their deadline.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use crate::error::{CollectiveError, StoreError};
use crate::store::{PrefixStore, Store};

/// How often a wait looks for an abort published by another rank.
pub(crate) const ABORT_CHECK_EVERY: Duration = Duration::from_secs(1);

/// How long rank 0 waits, on a world-size mismatch, for the other rank to read its size.
pub(crate) const MISMATCH_GRACE: Duration = Duration::from_secs(10);

const KEY_ABORT: &str = "abort";
const KEY_ABORT_CLAIMS: &str = "abort/claims";

/// Checks that `rank` is a rank of a group of `world_size` (before anything else is done).
pub(crate) fn check_member(rank: usize, world_size: usize) -> Result<(), CollectiveError> {
    if world_size == 0 || rank >= world_size {
        return Err(CollectiveError::Setup {
            rank,
            message: format!("rank {rank} is not in 0..{world_size}"),
        });
    }
    Ok(())
}

/// Publishes this rank's error for the other ranks of the group whose namespace is `store`,
/// unless a rank published one already: the first error is the cause, later ones are its echoes
/// (the claim is an atomic `add`, so two ranks failing at once cannot both win). Store failures
/// are ignored: the store may be what failed.
pub(crate) fn publish_abort(store: &dyn Store, rank: usize, why: &dyn std::fmt::Display) {
    if let Ok(1) = store.add(KEY_ABORT_CLAIMS, 1) {
        let _ = store.set(KEY_ABORT, format!("rank {rank}: {why}").as_bytes());
    }
}

/// The abort another rank published in the namespace `store`, if any (store errors count as
/// none: the store may already be gone at the end of a job).
pub(crate) fn published_abort(store: &dyn Store) -> Option<String> {
    match store.check(&[KEY_ABORT]) {
        Ok(true) => store
            .get(KEY_ABORT, ABORT_CHECK_EVERY)
            .ok()
            .map(|v| String::from_utf8_lossy(&v).into_owned()),
        _ => None,
    }
}

/// One rank's side of forming a group: the group's namespace of the store, its identity and the
/// deadline of the whole set-up. See the module docs.
pub(crate) struct Rendezvous {
    store: PrefixStore,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    deadline: Instant,
}

impl Rendezvous {
    /// Starts the set-up clock: every wait of this rendezvous ends by `now + timeout`. `store`
    /// is the group's namespace of the job's store.
    pub fn new(store: PrefixStore, rank: usize, world_size: usize, timeout: Duration) -> Self {
        Self {
            store,
            rank,
            world_size,
            timeout,
            deadline: Instant::now() + timeout,
        }
    }

    /// The group's namespace of the store.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the NCCL group's
    pub fn store(&self) -> &PrefixStore {
        &self.store
    }

    /// The end of the set-up.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    pub fn setup_error(&self, message: String) -> CollectiveError {
        CollectiveError::Setup {
            rank: self.rank,
            message,
        }
    }

    fn store_error(&self, source: StoreError) -> CollectiveError {
        CollectiveError::Store {
            rank: self.rank,
            source,
        }
    }

    /// Steps 1–2 (module docs): claims the rank, publishes the world size and, on a rank other
    /// than 0, checks it against rank 0's (waiting for rank 0 to join). Rank 0 does not wait
    /// here, so it can publish more (e.g. its address) before [`Rendezvous::wait_joined`].
    pub fn join(&self) -> Result<(), CollectiveError> {
        let rank = self.rank;
        let claims = self
            .store
            .add(&format!("claims/{rank}"), 1)
            .map_err(|e| self.store_error(e))?;
        if claims > 1 {
            return Err(self.setup_error(format!(
                "rank {rank} joined twice: two processes were started with RANK={rank} (or another group uses the store prefix {:?}: give it another)",
                self.store.prefix()
            )));
        }
        self.publish("world", self.world_size.to_string().as_bytes())?;
        if rank != 0 {
            let theirs = self.published("world", 0)?;
            // On a mismatch rank 0 leaves once this key is in its store (module docs), maybe
            // before the store's reply reaches us: the lost reply must not hide the mismatch.
            let read = self.publish("world-read", b"1");
            self.check_world_size(0, &theirs)?;
            read?;
        }
        Ok(())
    }

    /// Step 3 (module docs): returns once every rank has joined; rank 0 checks every world size.
    /// Fails naming the ranks that never arrived by the deadline, or the rank at fault.
    pub fn wait_joined(&self) -> Result<(), CollectiveError> {
        self.wait_published("world")?;
        if self.rank == 0 {
            for r in 1..self.world_size {
                let theirs = self.published("world", r)?;
                if let Err(mismatch) = self.check_world_size(r, &theirs) {
                    // Rank r fails too once it has read rank 0's size (module docs); whether it
                    // did in time changes nothing here.
                    let key = format!("world-read/{r}");
                    let _ = self.store.wait(&[key.as_str()], MISMATCH_GRACE);
                    return Err(mismatch);
                }
            }
        }
        Ok(())
    }

    fn check_world_size(&self, other: usize, theirs: &[u8]) -> Result<(), CollectiveError> {
        let ours = self.world_size.to_string();
        if theirs == ours.as_bytes() {
            return Ok(());
        }
        Err(self.setup_error(format!(
            "world size mismatch: rank {other} was started with WORLD_SIZE={}, rank {} with WORLD_SIZE={ours}",
            String::from_utf8_lossy(theirs),
            self.rank
        )))
    }

    /// Publishes this rank's `value` under `{what}/{rank}`. Not collective.
    pub fn publish(&self, what: &str, value: &[u8]) -> Result<(), CollectiveError> {
        self.store
            .set(&format!("{what}/{}", self.rank), value)
            .map_err(|e| self.store_error(e))
    }

    /// Listens on an OS-chosen port of `ip` and publishes the address under `addr/{rank}`, for
    /// the other ranks to connect to; the listener and its address. Not collective.
    pub fn listen_and_publish(
        &self,
        ip: IpAddr,
    ) -> Result<(TcpListener, SocketAddr), CollectiveError> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| self.setup_error(format!("cannot listen on {ip}: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| self.setup_error(format!("cannot read the listening address: {e}")))?;
        self.publish("addr", local.to_string().as_bytes())?;
        Ok((listener, local))
    }

    /// Waits until every rank has published `what`; the error names the ranks that did not by
    /// the deadline, or carries another rank's published abort.
    pub fn wait_published(&self, what: &str) -> Result<(), CollectiveError> {
        let keys: Vec<String> = (0..self.world_size)
            .map(|r| format!("{what}/{r}"))
            .collect();
        self.wait_keys(&keys, |missing| {
            let ranks: Vec<String> = missing.iter().map(|k| rank_of(k)).collect();
            let verb = if what == "world" {
                "never joined".to_string()
            } else {
                format!("never published their {what}")
            };
            format!(
                "rank(s) {} {verb} within {:?} (were all {} ranks started, with the same MASTER_ADDR/MASTER_PORT?)",
                ranks.join(", "),
                self.timeout,
                self.world_size
            )
        })
    }

    /// What rank `rank` published under `what`, waiting for it until the deadline (and stopping
    /// early on a published abort).
    pub fn published(&self, what: &str, rank: usize) -> Result<Vec<u8>, CollectiveError> {
        let key = format!("{what}/{rank}");
        self.wait_keys(std::slice::from_ref(&key), |_| {
            format!(
                "rank {rank} did not publish its {what} within {:?} (is rank {rank} running, and are MASTER_ADDR/MASTER_PORT the same on every rank?)",
                self.timeout
            )
        })?;
        self.store
            .get(&key, ABORT_CHECK_EVERY)
            .map_err(|e| self.store_error(e))
    }

    /// Publishes `why` as the cause of this rendezvous's failure, unless a rank was first.
    pub fn abort(&self, why: &CollectiveError) {
        publish_abort(&self.store, self.rank, why);
    }

    /// Waits for `keys` in slices of [`ABORT_CHECK_EVERY`], looking for a published abort in
    /// between; at the deadline fails with `timed_out(missing keys)`.
    fn wait_keys(
        &self,
        keys: &[String],
        timed_out: impl FnOnce(&[&String]) -> String,
    ) -> Result<(), CollectiveError> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            match self.store.wait(&refs, left.min(ABORT_CHECK_EVERY)) {
                Ok(()) => return Ok(()),
                Err(StoreError::Timeout { .. }) => {
                    if let Some(why) = published_abort(&self.store) {
                        return Err(
                            self.setup_error(format!("another rank aborted the rendezvous: {why}"))
                        );
                    }
                    if left.is_zero() {
                        let missing: Vec<&String> = keys
                            .iter()
                            .filter(|k| !self.store.check(&[k.as_str()]).unwrap_or(false))
                            .collect();
                        return Err(self.setup_error(timed_out(&missing)));
                    }
                }
                Err(e) => return Err(self.store_error(e)),
            }
        }
    }
}

/// The rank in a per-rank key `{what}/{rank}`.
fn rank_of(key: &str) -> String {
    key.rsplit('/').next().unwrap_or(key).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use std::sync::Arc;

    fn rendezvous(store: &Arc<dyn Store>, rank: usize, world: usize, ms: u64) -> Rendezvous {
        let ns = PrefixStore::new("pg/test", store.clone());
        Rendezvous::new(ns, rank, world, Duration::from_millis(ms))
    }

    #[test]
    fn the_first_abort_wins() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let ns = PrefixStore::new("pg/test", store.clone());
        assert_eq!(published_abort(&ns), None);
        publish_abort(&ns, 2, &"the cause");
        publish_abort(&ns, 0, &"an echo of it");
        assert_eq!(published_abort(&ns).as_deref(), Some("rank 2: the cause"));
        // Another group's namespace is untouched.
        assert_eq!(published_abort(&PrefixStore::new("pg/other", store)), None);
    }

    #[test]
    fn ranks_join_and_agree_on_the_world_size() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let r = rendezvous(&store, rank, 3, 10_000);
                std::thread::spawn(move || r.join().and_then(|()| r.wait_joined()))
            })
            .collect();
        for h in handles {
            h.join().unwrap().unwrap();
        }
        // One encoding of the world size, readable by any rank.
        assert_eq!(
            store
                .get("pg/test/world/2", Duration::from_secs(1))
                .unwrap(),
            b"3"
        );
    }

    #[test]
    fn a_missing_rank_is_named_at_the_deadline() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let start = Instant::now();
        let r = rendezvous(&store, 0, 3, 300);
        r.join().unwrap();
        let err = r.wait_joined().unwrap_err().to_string();
        assert!(err.contains("rank(s) 1, 2 never joined within"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(3), "{err}");
    }

    #[test]
    fn a_rank_claimed_twice_and_a_world_mismatch_are_named() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        store.add("pg/test/claims/1", 1).unwrap();
        let err = rendezvous(&store, 1, 2, 300)
            .join()
            .unwrap_err()
            .to_string();
        assert!(err.contains("rank 1 joined twice"), "{err}");
        assert!(err.contains("\"pg/test\""), "{err}");

        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let zero = rendezvous(&store, 0, 2, 10_000);
        let one = rendezvous(&store, 1, 3, 10_000);
        let t = std::thread::spawn(move || {
            let e = one.join().and_then(|()| one.wait_joined()).unwrap_err();
            one.abort(&e);
            e.to_string()
        });
        let err0 = zero
            .join()
            .and_then(|()| zero.wait_joined())
            .unwrap_err()
            .to_string();
        let err1 = t.join().unwrap();
        for err in [err0, err1] {
            assert!(
                err.contains("WORLD_SIZE=2") && err.contains("WORLD_SIZE=3"),
                "{err}"
            );
        }
    }

    #[test]
    fn an_abort_stops_the_waiting_ranks_early() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let waiting = rendezvous(&store, 0, 2, 30_000);
        let failing = rendezvous(&store, 1, 2, 30_000);
        failing.abort(&failing.setup_error("cannot listen".into()));
        let start = Instant::now();
        let err = waiting
            .join()
            .and_then(|()| waiting.wait_joined())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("another rank aborted the rendezvous: rank 1:")
                && err.contains("cannot listen"),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}
