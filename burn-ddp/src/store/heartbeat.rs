//! Heartbeats through the job's store: a process that others wait for, while it cannot answer
//! over the group (rank 0 writing a checkpoint, a joiner on its way into the job), adds 1 to a
//! counter every interval; a waiting process reads the counter and tells a slow party from a
//! dead one within the failure detection time instead of at the wait's deadline.
//!
//! [`beat_while`] beats for the length of a call; [`Heartbeat`] for the life of a value;
//! [`Silence`] (pure) says when a counter has stood still too long.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::contract::Store;

/// Adds 1 to `key` every `interval` until `stop` is dropped or sent to. Store errors are
/// ignored: the waiting side's verdict says what went wrong.
fn beat(store: &dyn Store, key: &str, interval: Duration, stop: &mpsc::Receiver<()>) {
    loop {
        let _ = store.add(key, 1);
        match stop.recv_timeout(interval) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            _ => return,
        }
    }
}

/// Runs `action` while a helper thread beats `key` every `interval`.
pub(crate) fn beat_while<T>(
    store: &dyn Store,
    key: &str,
    interval: Duration,
    action: impl FnOnce() -> T,
) -> T {
    let (done, stop) = mpsc::channel::<()>();
    std::thread::scope(|scope| {
        scope.spawn(move || beat(store, key, interval, &stop));
        let result = action();
        drop(done);
        result
    })
}

/// A counter beaten every interval by a thread of its own, until this value is dropped.
pub(crate) struct Heartbeat {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Heartbeat {
    /// Starts beating `key` in `store` every `interval` (a first beat at once).
    pub fn start(store: Arc<dyn Store>, key: String, interval: Duration) -> Self {
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("burn-ddp-heartbeat".into())
            .spawn(move || beat(store.as_ref(), &key, interval, &stopped))
            .ok();
        Self {
            stop: Some(stop),
            thread,
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            // The thread ends at its next wake-up: within one store call and no sleep.
            let _ = thread.join();
        }
    }
}

/// How often a heartbeat of a job with failure detection time `detection` beats: four times
/// per detection time (at least every 10 ms apart). The one rule for every heartbeat (peers,
/// joiners, rank 0 during its action).
pub(crate) fn beat_period(detection: Duration) -> Duration {
    (detection / 4).max(Duration::from_millis(10))
}

/// How long a counter may stand still: `allowed` once it has moved under the watcher's eyes
/// (or was found beaten), `before_first` while it is still 0 (the beater may start a little
/// later than the watcher).
#[derive(Debug, Clone)]
pub(crate) struct Silence {
    allowed: Duration,
    before_first: Duration,
    last: Option<i64>,
    moved_at: Instant,
}

impl Silence {
    /// The one threshold rule of a job with failure detection time `detection`: a beater is
    /// gone after twice `detection` of silence (eight missed beats: a loaded machine may
    /// starve a live beating thread for a moment), eight times it before a first beat. Every
    /// watcher (peers in a collective, members while a generation forms, joiners, the wait
    /// for rank 0's action) uses it.
    pub fn after_detection(detection: Duration, now: Instant) -> Self {
        Self::new(detection * 2, detection * 8, now)
    }

    /// A watch that starts `now`.
    pub fn new(allowed: Duration, before_first: Duration, now: Instant) -> Self {
        Self {
            allowed,
            before_first,
            last: None,
            moved_at: now,
        }
    }

    /// Takes the counter's `value` read at `now`; returns how long it has stood still when
    /// that is longer than allowed (the beater is gone), else `None`.
    pub fn observe(&mut self, value: i64, now: Instant) -> Option<Duration> {
        if value != 0 && self.last != Some(value) {
            self.last = Some(value);
            self.moved_at = now;
        }
        let allowed = match self.last {
            Some(_) => self.allowed,
            None => self.before_first,
        };
        let silent = now.saturating_duration_since(self.moved_at);
        (silent > allowed).then_some(silent)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::{Heartbeat, Silence};
    use crate::store::contract::Store;
    use crate::store::memory::MemoryStore;

    /// A counter that moves keeps the watch quiet; one that stops is called silent once it has
    /// stood still longer than allowed; a counter never beaten gets the longer allowance.
    #[test]
    fn silence_is_called_after_the_allowed_time_without_a_beat() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut watch = Silence::new(ms(100), ms(400), t0);
        assert_eq!(
            watch.observe(0, t0 + ms(300)),
            None,
            "before the first beat"
        );
        assert_eq!(watch.observe(1, t0 + ms(350)), None);
        assert_eq!(watch.observe(2, t0 + ms(440)), None);
        assert_eq!(watch.observe(2, t0 + ms(530)), None);
        assert_eq!(watch.observe(2, t0 + ms(560)), Some(ms(120)));
        let mut never = Silence::new(ms(100), ms(400), t0);
        assert_eq!(never.observe(0, t0 + ms(401)), Some(ms(401)));
    }

    /// A heartbeat beats from its start and stops when dropped.
    #[test]
    fn a_heartbeat_beats_until_dropped() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let beat = Heartbeat::start(Arc::clone(&store), "b".into(), Duration::from_millis(5));
        while store.add("b", 0).unwrap_or(0) < 3 {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(beat);
        let stopped = store.add("b", 0).unwrap_or(-1);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(store.add("b", 0).unwrap_or(-1), stopped);
    }
}
