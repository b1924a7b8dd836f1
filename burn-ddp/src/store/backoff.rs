//! [`Backoff`]: capped exponential back-off between retries (PyTorch's `Backoff.hpp`).
//!
//! One type for every retry loop of the crate (connecting to the store, connecting to a ring
//! neighbour, polling NCCL), so each is bounded the same way: pauses double from `first` up to
//! `max`, and no pause runs past the caller's deadline.

use std::time::{Duration, Instant};

/// Pauses that double from a first length up to a cap. Pure bookkeeping plus a sleep; the
/// caller owns the deadline and decides when to give up.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// Pauses of `first`, `2 first`, `4 first`, ..., at most `max` each.
    pub fn new(first: Duration, max: Duration) -> Self {
        Self {
            next: first.min(max),
            max,
        }
    }

    /// The length of the next pause; the one after it is twice as long (capped).
    pub fn next_pause(&mut self) -> Duration {
        let pause = self.next;
        self.next = (self.next * 2).min(self.max);
        pause
    }

    /// Sleeps for the next pause, but not past `deadline` (no sleep once it has passed).
    pub fn sleep(&mut self, deadline: Instant) {
        let pause = self.next_pause();
        let left = deadline.saturating_duration_since(Instant::now());
        std::thread::sleep(pause.min(left));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_up_to_the_cap() {
        let mut b = Backoff::new(Duration::from_millis(10), Duration::from_millis(50));
        let pauses: Vec<u128> = (0..5).map(|_| b.next_pause().as_millis()).collect();
        assert_eq!(pauses, [10, 20, 40, 50, 50]);
        let mut b = Backoff::new(Duration::from_secs(5), Duration::from_secs(1));
        assert_eq!(b.next_pause(), Duration::from_secs(1));
    }

    #[test]
    fn sleep_stops_at_the_deadline() {
        let mut b = Backoff::new(Duration::from_secs(10), Duration::from_secs(10));
        let start = Instant::now();
        b.sleep(start + Duration::from_millis(20));
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}
