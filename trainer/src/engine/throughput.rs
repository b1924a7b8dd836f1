//! Training throughput as the `train` lines of `metrics.jsonl` report it: global samples per
//! second since the last line, with the time spent outside training (validation) left out.

use std::time::{Duration, Instant};

/// Global samples per second since the window began (the last log line).
pub struct ThroughputWindow {
    samples: usize,
    start: Instant,
}

impl ThroughputWindow {
    pub fn new() -> Self {
        Self {
            samples: 0,
            start: Instant::now(),
        }
    }
    pub fn add(&mut self, global_samples: usize) {
        self.samples += global_samples;
    }
    pub fn rate(&self) -> f64 {
        self.samples as f64 / self.start.elapsed().as_secs_f64().max(1e-9)
    }
    /// Leaves time that is not training (validation) out of the rate.
    pub fn exclude(&mut self, elapsed: Duration) {
        self.start += elapsed.min(self.start.elapsed());
    }
}

impl Default for ThroughputWindow {
    fn default() -> Self {
        Self::new()
    }
}
