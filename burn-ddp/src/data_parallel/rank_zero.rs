//! Rank 0's actions the others wait for through the store (a checkpoint write): rank 0 beats
//! a counter while it works, so a waiting rank tells a slow disk from a dead rank 0 within the
//! failure detection time instead of at the action's deadline.

use std::time::{Duration, Instant};

use crate::error::{DdpError, StoreError};
use crate::store::heartbeat::{beat_period, Silence};
use crate::store::Store;

/// Waits for rank 0's verdict under `key`, up to `timeout`; fails with
/// [`DdpError::RankZeroGone`] once `beat_key` has stood still as long as the one threshold
/// rule allows ([`Silence::after_detection`]: twice `detection` after a first beat, eight
/// times before any: rank 0 may reach the action a little later).
pub(super) fn wait_for_verdict(
    store: &dyn Store,
    (key, beat_key): (&str, &str),
    what: &str,
    timeout: Duration,
    detection: Duration,
) -> Result<Vec<u8>, DdpError> {
    let started = Instant::now();
    let deadline = started + timeout;
    let slice = beat_period(detection);
    let mut silence = Silence::after_detection(detection, started);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left <= slice {
            return Ok(store.get(key, left)?);
        }
        match store.get(key, slice) {
            Ok(status) => return Ok(status),
            Err(StoreError::Timeout { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        let beat = store.add(beat_key, 0)?;
        if let Some(silent) = silence.observe(beat, Instant::now()) {
            return Err(DdpError::RankZeroGone {
                what: what.to_string(),
                silent,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::wait_for_verdict;
    use crate::error::DdpError;
    use crate::store::heartbeat::beat_while as with_heartbeat;
    use crate::store::{MemoryStore, Store};

    /// A slow action that beats is waited for; one that stopped beating is named gone within
    /// the detection time, long before the deadline.
    #[test]
    fn a_beating_rank_zero_is_waited_for_and_a_silent_one_is_gone() {
        let store = MemoryStore::new();
        let detection = Duration::from_millis(200);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                with_heartbeat(&store, "k/beat", detection / 4, || {
                    std::thread::sleep(detection * 3);
                });
                let _ = store.set("k", b"ok");
            });
            let verdict = wait_for_verdict(
                &store,
                ("k", "k/beat"),
                "a slow write",
                Duration::from_secs(60),
                detection,
            );
            assert_eq!(verdict.map_err(|e| e.to_string()), Ok(b"ok".to_vec()));
        });
        // Beats once, then silence (rank 0 died mid-write).
        let _ = store.add("gone/beat", 1);
        let started = std::time::Instant::now();
        let verdict = wait_for_verdict(
            &store,
            ("gone", "gone/beat"),
            "a write",
            Duration::from_secs(60),
            detection,
        );
        assert!(
            matches!(verdict, Err(DdpError::RankZeroGone { .. })),
            "{verdict:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}
