//! Fencing: once the job has left a rank out, the rank's launcher ends its process, so that a
//! rank that froze (a hung driver, a machine that stopped answering, `SIGSTOP`) never holds
//! the job: the survivors train on without it, and the launcher that waits for its processes
//! does not wait for it forever. A rank that wakes before its launcher acts leaves or rejoins
//! as before (it is told it was left out).
//!
//! The contract with a launcher, through the job's store:
//! - the launcher gives each process it starts an identity of its own in
//!   [`FENCE_ID_VAR`] ([`DistEnv::fence_id`](crate::DistEnv::fence_id)), unique over the job's
//!   life (a restarted process gets a new one);
//! - each rank records it in every generation it forms, under `process/{rank}` in the
//!   generation's namespace ([`register`]);
//! - when the job decides to carry on without ranks, the new group's rank 0 writes
//!   `fenced/{identity}` in the job's store (the root namespace) for each of them, with the
//!   reason ([`fence`]);
//! - the launcher looks for `fenced/{identity}` of each process it still waits for
//!   ([`fenced`]) and ends it with `SIGKILL`.
//!
//! Without the variable (torchrun, a launcher of the user's own) nothing is recorded and
//! nothing is fenced: a frozen rank then holds its launcher as before.

use crate::error::StoreError;
use crate::store::Store;

pub use crate::env::FENCE_ID_VAR;

/// Where a generation records the identity of its rank `rank` (in its namespace).
fn process_key(rank: usize) -> String {
    format!("process/{rank}")
}

/// Where the job records that the process `identity` was left out (in the job's store).
pub fn fenced_key(identity: &str) -> String {
    format!("fenced/{identity}")
}

/// Records that rank `rank` of the generation whose namespace is `generation` is the process
/// `identity`. One store write; not collective.
pub(crate) fn register(
    generation: &dyn Store,
    rank: usize,
    identity: &str,
) -> Result<(), StoreError> {
    generation.set(&process_key(rank), identity.as_bytes())
}

/// Asks the launchers to end the processes of `lost` (ranks of the generation whose namespace
/// is `generation`), each with `why`, in `root`, the job's store. A rank whose identity was
/// never recorded (no fencing launcher) is skipped. Idempotent; not collective (one rank
/// calls it per decision). Advisory: a store that fails is logged, not returned, since the
/// other survivors re-form without waiting for it (the re-forming reports a store that is
/// really gone).
pub(crate) fn fence(generation: &dyn Store, root: &dyn Store, lost: &[usize], why: &str) {
    if let Err(e) = try_fence(generation, root, lost, why) {
        tracing::warn!("cannot ask the launchers to end lost rank(s) {lost:?}: {e}");
    }
}

fn try_fence(
    generation: &dyn Store,
    root: &dyn Store,
    lost: &[usize],
    why: &str,
) -> Result<(), StoreError> {
    for &rank in lost {
        let key = process_key(rank);
        if !generation.check(&[&key])? {
            continue;
        }
        let identity = generation.get(&key, READ)?;
        let identity = String::from_utf8_lossy(&identity);
        root.set(&fenced_key(&identity), why.as_bytes())?;
        tracing::info!("rank {rank} (process {identity}) is fenced: {why}");
    }
    Ok(())
}

/// Why the job left the process `identity` out, if it did (the launcher's question). One
/// store round trip, two when fenced.
pub fn fenced(root: &dyn Store, identity: &str) -> Result<Option<String>, StoreError> {
    let key = fenced_key(identity);
    if !root.check(&[&key])? {
        return Ok(None);
    }
    let why = root.get(&key, READ)?;
    Ok(Some(String::from_utf8_lossy(&why).into_owned()))
}

/// The deadline of one store read of a value known to be there.
const READ: std::time::Duration = std::time::Duration::from_secs(2);

#[cfg(test)]
mod tests {
    use super::{fence, fenced, register};
    use crate::store::{MemoryStore, PrefixStore, Store};
    use std::sync::Arc;

    /// Ranks 1 and 2 of generation 3 are lost: the process recorded for rank 1 is fenced with
    /// the reason, rank 2 (recorded by nobody) is skipped, rank 0's process is untouched.
    #[test]
    fn a_lost_rank_s_process_is_fenced_and_the_others_are_not() {
        let root: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let generation = PrefixStore::new("gen-3", Arc::clone(&root));
        let registered = register(&generation, 0, "a-0-0").and(register(&generation, 1, "a-1-0"));
        assert!(registered.is_ok());
        fence(&generation, root.as_ref(), &[1, 2], "silent for 2.0 s");
        let seen = |id| fenced(root.as_ref(), id).map_err(|e| e.to_string());
        assert_eq!(seen("a-1-0"), Ok(Some("silent for 2.0 s".into())));
        assert_eq!(seen("a-0-0"), Ok(None));
    }
}
