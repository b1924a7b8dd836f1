//! The survivors of a failure agree, through the job's rendezvous store, on who carries on
//! and at which step (the decision itself is [`Survivors::decide`], pure).
//!
//! Keys, in the namespace of the group that failed (each generation of a job has its own):
//! `survivors/step/{rank}` (the steps a survivor applied), `survivors/arrivals` (a counter: its
//! first incrementer decides) and `survivors/decision` ([`Survivors::encode`]). The deciding
//! rank waits until every rank of the old group has announced itself or is known gone (the
//! group's post-mortem names the ranks that died without a word), at most
//! [`AgreementOptions::arrival_window`]; every survivor then reads the one decision, so all
//! of them re-form the same group. The store's host is the one party that must live (the
//! launcher of node 0, or rank 0 under plain `RANK`/`MASTER_*` variables).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::survivors::Survivors;
use crate::error::DdpError;
use crate::store::Store;

/// How long the agreement waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgreementOptions {
    /// How long the deciding rank waits for a rank of the old group that has neither announced
    /// itself nor been found gone; a rank later than that is left out.
    pub arrival_window: Duration,
    /// How much longer than `arrival_window` the other survivors wait for the decision (the
    /// decider's store round trips); past it they fail: the decider died too.
    pub grace: Duration,
}

impl Default for AgreementOptions {
    /// The agreement of a job whose groups have the default failure detection
    /// ([`crate::group::DEFAULT_FAILURE_DETECTION`]).
    fn default() -> Self {
        Self::after_detection(crate::group::DEFAULT_FAILURE_DETECTION)
    }
}

impl AgreementOptions {
    /// The agreement of a job whose groups name a rank dead after `detection` (their
    /// failure detection): a survivor that lost only a messenger learns the root cause within
    /// it, so twice that covers every live rank.
    pub fn after_detection(detection: Duration) -> Self {
        Self {
            arrival_window: detection * 2,
            grace: Duration::from_secs(5),
        }
    }
}

/// How often the decider looks for announcements.
const POLL: Duration = Duration::from_millis(20);
/// The deadline of one store read of a value known to be there.
const READ: Duration = Duration::from_secs(2);
const ARRIVALS: &str = "survivors/arrivals";
const DECISION: &str = "survivors/decision";

fn step_key(rank: usize) -> String {
    format!("survivors/step/{rank}")
}

/// Announces that rank `rank` of the failed `world`-rank group survived having applied `step`
/// optimizer steps, and returns what the survivors agreed ([`Survivors`], the same on each).
/// `known_gone`: the ranks this rank's failure found dead (they are not waited for).
/// Collective over the survivors, through `store` (the failed group's namespace); bounded by
/// `options`.
///
/// # Errors
/// [`DdpError::Store`] when the store fails; [`DdpError::Membership`] when this rank was left
/// out (too late), the decision cannot be read, or the survivors stand more than a step apart.
pub fn agree_on_survivors(
    store: &dyn Store,
    rank: usize,
    world: usize,
    step: u64,
    known_gone: &[usize],
    options: &AgreementOptions,
) -> Result<Survivors, DdpError> {
    store.set(&step_key(rank), step.to_string().as_bytes())?;
    if store.add(ARRIVALS, 1)? == 1 {
        let announced = collect(
            store,
            (rank, step),
            world,
            known_gone,
            options.arrival_window,
        )?;
        store.set(DECISION, &Survivors::encode(&announced))?;
    }
    let bytes = store.get(DECISION, options.arrival_window + options.grace)?;
    let announced = Survivors::decode(&bytes).ok_or_else(|| {
        DdpError::Membership(format!(
            "the survivors' decision in the store cannot be read: {:?}",
            String::from_utf8_lossy(&bytes)
        ))
    })?;
    if !announced.contains_key(&rank) {
        return Err(DdpError::Membership(format!(
            "rank {rank} announced itself after the survivors' decision ({} ms window): the others carry on without it",
            options.arrival_window.as_millis()
        )));
    }
    Survivors::decide(world, &announced)
}

/// The decider's wait: every rank's announced step, until each rank of `world` has announced
/// or is in `known_gone`, or `window` has passed.
fn collect(
    store: &dyn Store,
    (rank, step): (usize, u64),
    world: usize,
    known_gone: &[usize],
    window: Duration,
) -> Result<BTreeMap<usize, u64>, DdpError> {
    let deadline = Instant::now() + window;
    let mut announced = BTreeMap::from([(rank, step)]);
    loop {
        let awaited: Vec<usize> = (0..world)
            .filter(|r| !announced.contains_key(r) && !known_gone.contains(r))
            .collect();
        for other in &awaited {
            let key = step_key(*other);
            if store.check(&[&key])? {
                let value = store.get(&key, READ)?;
                let theirs = std::str::from_utf8(&value)
                    .ok()
                    .and_then(|s| s.parse::<u64>().ok());
                if let Some(theirs) = theirs {
                    announced.insert(*other, theirs);
                }
            }
        }
        let waiting = (0..world).any(|r| !announced.contains_key(&r) && !known_gone.contains(&r));
        if !waiting || Instant::now() >= deadline {
            return Ok(announced);
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::{agree_on_survivors, AgreementOptions};
    use crate::store::{MemoryStore, Store};

    /// Three of four ranks announce (rank 1 is dead but not known to be): all three read the
    /// same decision once the window has passed; a late fourth is told it was left out.
    #[test]
    fn the_survivors_read_one_decision_and_a_late_rank_is_left_out() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let options = AgreementOptions {
            arrival_window: Duration::from_millis(300),
            grace: Duration::from_secs(5),
        };
        let started = Instant::now();
        let threads: Vec<_> = [0usize, 2, 3]
            .into_iter()
            .map(|rank| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || {
                    agree_on_survivors(store.as_ref(), rank, 4, 9, &[], &options)
                        .map(|s| (s.members, s.step, s.lost))
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        for t in threads {
            let got = t.join().map_err(|_| "panicked".to_string());
            assert_eq!(got, Ok(Ok((vec![0, 2, 3], 9, vec![1]))));
        }
        assert!(started.elapsed() >= Duration::from_millis(300));
        let late = agree_on_survivors(store.as_ref(), 1, 4, 9, &[], &options)
            .err()
            .map(|e| e.to_string());
        assert!(
            late.as_deref()
                .is_some_and(|e| e.contains("carry on without it")),
            "{late:?}"
        );
    }

    /// A rank known gone is not waited for: the decision comes at once.
    #[test]
    fn a_rank_known_gone_is_not_waited_for() {
        let store = MemoryStore::new();
        let options = AgreementOptions {
            arrival_window: Duration::from_secs(60),
            grace: Duration::from_secs(5),
        };
        let survivors = agree_on_survivors(&store, 0, 2, 3, &[1], &options);
        assert_eq!(
            survivors
                .map(|s| (s.members, s.lost))
                .map_err(|e| e.to_string()),
            Ok((vec![0], vec![1]))
        );
    }
}
