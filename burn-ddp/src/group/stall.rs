//! [`StallReporter`]: stall detection for a call that makes no progress (Horovod's
//! `stall_inspector`), shared by the TCP and NCCL groups.
//!
//! A call that has waited `interval` without progress logs a warning, and again every
//! `interval` until its deadline. The warning says what this rank waits for and, through the
//! store, where the others are: each stalled rank records the sequence number of the call it is
//! stuck in under `stall/{rank}` (in the group's namespace), so a rank can tell the ranks stuck in
//! the same call from those that never entered it.

use std::fmt;
use std::time::{Duration, Instant};

use crate::store::Store;

/// How long a store read for the report may take.
const READ_TIMEOUT: Duration = Duration::from_secs(1);

/// The stall clock of one call, and the report of where the other ranks are.
pub(crate) struct StallReporter<'a> {
    /// The group's namespace of the store.
    store: &'a dyn Store,
    rank: usize,
    world_size: usize,
    interval: Duration,
    start: Instant,
    next: Instant,
}

impl<'a> StallReporter<'a> {
    /// The stall clock of a call that started at `start`: the first warning is due at
    /// `start + interval`.
    pub fn new(
        store: &'a dyn Store,
        rank: usize,
        world_size: usize,
        interval: Duration,
        start: Instant,
    ) -> Self {
        Self {
            store,
            rank,
            world_size,
            interval,
            start,
            next: start + interval,
        }
    }

    /// When the next warning is due (a waiting loop should wake up by then).
    pub fn next_warning(&self) -> Instant {
        self.next
    }

    /// Logs the stall warning if one is due at `now`: the call, how long it has waited, what
    /// for (`waiting_on`, only evaluated when due) and, for a collective (`seq`), where the other
    /// ranks are. Then schedules the next one.
    pub fn warn_if_due(
        &mut self,
        now: Instant,
        call: &dyn fmt::Display,
        seq: Option<u64>,
        waiting_on: impl FnOnce() -> String,
    ) {
        if now < self.next {
            return;
        }
        // Evaluated before the macro, which skips its arguments when warnings are not logged:
        // the position must reach the store either way, for the other ranks' reports.
        let positions = seq.map(|seq| self.positions(seq)).unwrap_or_default();
        let waiting_on = waiting_on();
        tracing::warn!(
            "rank {}: {call} has made no progress for {:?}: waiting for {waiting_on}. {positions}",
            self.rank,
            now - self.start,
        );
        self.next = now + self.interval;
    }

    /// Records that this rank is stuck in call `seq` and reports the others' positions (see
    /// [`positions`]).
    pub fn positions(&self, seq: u64) -> String {
        positions(self.store, self.rank, self.world_size, seq)
    }
}

/// Records under `stall/{rank}` of `store` (a group's namespace) that `rank` is stuck in call
/// `seq`, and reports the other ranks' positions. Ranks that have not reported are either still
/// computing (not yet in this call) or stalled for less time than this one.
pub(crate) fn positions(store: &dyn Store, rank: usize, world_size: usize, seq: u64) -> String {
    let ours = seq.to_string();
    if store
        .set(&format!("stall/{rank}"), ours.as_bytes())
        .is_err()
    {
        return "(the store is unreachable, so other ranks' positions are unknown)".into();
    }
    let mut stalled_here = Vec::new();
    let mut elsewhere = Vec::new();
    for r in (0..world_size).filter(|&r| r != rank) {
        let key = format!("stall/{r}");
        match store.check(&[&key]) {
            Ok(true) => match store.get(&key, READ_TIMEOUT) {
                Ok(v) if v == ours.as_bytes() => stalled_here.push(r.to_string()),
                Ok(v) => {
                    elsewhere.push(format!("{r} (stalled at #{})", String::from_utf8_lossy(&v)))
                }
                Err(_) => elsewhere.push(format!("{r} (unknown)")),
            },
            _ => elsewhere.push(r.to_string()),
        }
    }
    format!(
        "Ranks also stalled in #{seq}: [{}]; ranks not seen in it: [{}]",
        stalled_here.join(", "),
        elsewhere.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn the_report_names_who_is_stalled_and_who_was_not_seen() {
        let store = MemoryStore::new();
        store.set("stall/1", b"5").unwrap();
        store.set("stall/3", b"4").unwrap();
        let reporter = StallReporter::new(&store, 0, 4, Duration::from_secs(60), Instant::now());
        assert_eq!(
            reporter.positions(5),
            "Ranks also stalled in #5: [1]; ranks not seen in it: [2, 3 (stalled at #4)]"
        );
        assert_eq!(store.get("stall/0", Duration::from_secs(1)).unwrap(), b"5");
    }

    #[test]
    fn warnings_are_due_once_per_interval() {
        let store = MemoryStore::new();
        let start = Instant::now();
        let mut reporter = StallReporter::new(&store, 0, 2, Duration::from_secs(10), start);
        let mut asked = 0;
        reporter.warn_if_due(start + Duration::from_secs(9), &"x", None, || {
            asked += 1;
            String::new()
        });
        assert_eq!(asked, 0);
        reporter.warn_if_due(start + Duration::from_secs(11), &"x", Some(0), || {
            asked += 1;
            String::new()
        });
        assert_eq!(asked, 1);
        assert_eq!(reporter.next_warning(), start + Duration::from_secs(21));
        assert!(store.check(&["stall/0"]).unwrap());
    }
}
