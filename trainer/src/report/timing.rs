//! Where each optimizer step's time goes, on every rank, and who the straggler is.
//!
//! Every rank splits its wall-clock time into [`Phase`]s with a [`PhaseClock`]; at each log line
//! the ranks exchange their per-step means (one small all-gather, done by the caller) and
//! [`StepTime::across_ranks`] gives min / median / max over ranks and the slowest rank. The
//! arithmetic here is pure; the clock reads only `Instant`.
//!
//! In data-parallel training every rank waits for the slowest one inside the gradient
//! all-reduce, so a straggler shows as *less* communication time and more of everything else:
//! the slowest rank is the one with the most time outside the all-reduce ("busy" time).

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// A part of an optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for the next batch from the loader (its reads and batching run ahead on worker
    /// threads; this is the part they did not hide).
    Data,
    /// Forward and backward of every micro-batch, gradient accumulation.
    Compute,
    /// Gradient averaging across ranks: bucketing, the all-reduces, and waiting for the other
    /// ranks to get there.
    Sync,
    /// The optimizer's update of the parameters.
    Optimizer,
    /// Writing (rank 0) or waiting for (other ranks) a checkpoint.
    Checkpoint,
}

impl Phase {
    pub const ALL: [Phase; 5] = [
        Phase::Data,
        Phase::Compute,
        Phase::Sync,
        Phase::Optimizer,
        Phase::Checkpoint,
    ];

    fn index(self) -> usize {
        self as usize
    }

    /// The name in `metrics.jsonl` and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Data => "data",
            Phase::Compute => "compute",
            Phase::Sync => "sync",
            Phase::Optimizer => "optimizer",
            Phase::Checkpoint => "checkpoint",
        }
    }
}

/// One rank's time per optimizer step over a window of steps, in seconds: each phase's mean
/// and the mean wall time of a whole step (phases + the rest: metrics, logging).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RankTimes {
    pub phases: [f64; 5],
    pub step: f64,
}

impl RankTimes {
    /// Length of [`RankTimes::to_row`].
    pub const ROW: usize = 6;

    /// Seconds outside the gradient all-reduce: what makes a rank slow.
    pub fn busy(&self) -> f64 {
        (self.step - self.phases[Phase::Sync.index()]).max(0.0)
    }

    pub fn phase(&self, phase: Phase) -> f64 {
        self.phases[phase.index()]
    }

    /// The values exchanged between ranks.
    pub fn to_row(self) -> [f64; Self::ROW] {
        let p = self.phases;
        [p[0], p[1], p[2], p[3], p[4], self.step]
    }

    pub fn from_row(row: &[f64]) -> Self {
        let mut phases = [0.0; 5];
        for (dst, src) in phases.iter_mut().zip(row) {
            *dst = *src;
        }
        Self {
            phases,
            step: row.get(5).copied().unwrap_or(0.0),
        }
    }
}

/// Splits one rank's wall time into phases, step by step. Local; no communication.
#[derive(Debug)]
pub struct PhaseClock {
    totals: [Duration; 5],
    steps: usize,
    since: Instant,
    /// Time inside windows already taken: the run's totals.
    run: RunTotals,
}

#[derive(Debug, Clone, Copy, Default)]
struct RunTotals {
    phases: [f64; 5],
    wall: f64,
    steps: usize,
}

impl Default for PhaseClock {
    fn default() -> Self {
        Self::new()
    }
}

impl PhaseClock {
    pub fn new() -> Self {
        Self {
            totals: [Duration::ZERO; 5],
            steps: 0,
            since: Instant::now(),
            run: RunTotals::default(),
        }
    }

    /// Runs `work`, counting its time to `phase`.
    pub fn time<R>(&mut self, phase: Phase, work: impl FnOnce() -> R) -> R {
        let start = Instant::now();
        let out = work();
        self.add(phase, start.elapsed());
        out
    }

    pub fn add(&mut self, phase: Phase, elapsed: Duration) {
        self.totals[phase.index()] += elapsed;
    }

    /// One more optimizer step in the current window.
    pub fn end_step(&mut self) {
        self.steps += 1;
    }

    /// Leaves time out of the window's wall time (validation, which is not part of a step).
    pub fn exclude(&mut self, elapsed: Duration) {
        self.since += elapsed.min(self.since.elapsed());
    }

    /// Per-step means since the last call (zeros for a window without steps), and starts a new
    /// window.
    pub fn take_window(&mut self) -> RankTimes {
        let wall = self.since.elapsed().as_secs_f64();
        let steps = self.steps.max(1) as f64;
        let mut phases = [0.0; 5];
        for (mean, total) in phases.iter_mut().zip(&self.totals) {
            *mean = total.as_secs_f64() / steps;
        }
        for (run, total) in self.run.phases.iter_mut().zip(&self.totals) {
            *run += total.as_secs_f64();
        }
        self.run.wall += wall;
        self.run.steps += self.steps;
        self.totals = [Duration::ZERO; 5];
        self.steps = 0;
        self.since = Instant::now();
        RankTimes {
            phases,
            step: wall / steps,
        }
    }

    /// Per-step means over every window taken so far (the whole run of this process).
    pub fn run_means(&self) -> RankTimes {
        let steps = self.run.steps.max(1) as f64;
        let mut phases = self.run.phases;
        for p in &mut phases {
            *p /= steps;
        }
        RankTimes {
            phases,
            step: self.run.wall / steps,
        }
    }

    /// Steps in the windows taken so far.
    pub fn run_steps(&self) -> usize {
        self.run.steps
    }
}

/// A quantity over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    /// Min, median (the mean of the two middle values for an even count) and max; zeros for
    /// no values.
    pub fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let mut v: Vec<f64> = values.into_iter().collect();
        if v.is_empty() {
            return Self::default();
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Self {
            min: v[0],
            median,
            max: v[n - 1],
        }
    }
}

/// Seconds per optimizer step, each phase over the ranks: the `time` of a `train` line of
/// `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepTime {
    pub data: Spread,
    pub compute: Spread,
    pub sync: Spread,
    pub optimizer: Spread,
    pub checkpoint: Spread,
    /// Wall time of a whole step (the phases and the rest: metrics, logging).
    pub step: Spread,
    /// The rank with the most time outside the gradient all-reduce (the lowest such rank on a
    /// tie); the others wait for it.
    pub slowest_rank: usize,
}

impl StepTime {
    /// Combines one [`RankTimes`] per rank, in rank order.
    pub fn across_ranks(ranks: &[RankTimes]) -> Self {
        let spread = |phase: Phase| Spread::of(ranks.iter().map(|r| r.phase(phase)));
        let slowest_rank = ranks
            .iter()
            .enumerate()
            .fold(None::<(usize, f64)>, |best, (rank, r)| match best {
                Some((_, busy)) if busy >= r.busy() => best,
                _ => Some((rank, r.busy())),
            })
            .map_or(0, |(rank, _)| rank);
        Self {
            data: spread(Phase::Data),
            compute: spread(Phase::Compute),
            sync: spread(Phase::Sync),
            optimizer: spread(Phase::Optimizer),
            checkpoint: spread(Phase::Checkpoint),
            step: Spread::of(ranks.iter().map(|r| r.step)),
            slowest_rank,
        }
    }

    pub fn phase(&self, phase: Phase) -> Spread {
        match phase {
            Phase::Data => self.data,
            Phase::Compute => self.compute,
            Phase::Sync => self.sync,
            Phase::Optimizer => self.optimizer,
            Phase::Checkpoint => self.checkpoint,
        }
    }

    /// The end-of-run report: each phase's share of the median step time (medians over
    /// ranks), and with more than one rank the straggler, e.g.
    /// `time per step 12.1 ms: compute 81%, communication 6%, optimizer 4%, data 1%,
    /// checkpoint 2%; slowest rank 1 (busy 11.9 ms per step, median 8.0 ms)`.
    pub fn describe(&self, ranks: &[RankTimes]) -> String {
        let total = self.step.median.max(1e-12);
        let share = |phase: Phase| 100.0 * self.phase(phase).median / total;
        let mut line = format!(
            "time per step {}: compute {:.0}%, communication {:.0}%, optimizer {:.0}%, data {:.0}%, checkpoint {:.0}%",
            millis(self.step.median),
            share(Phase::Compute),
            share(Phase::Sync),
            share(Phase::Optimizer),
            share(Phase::Data),
            share(Phase::Checkpoint),
        );
        if let (true, Some(slowest)) = (ranks.len() > 1, ranks.get(self.slowest_rank)) {
            // The slowest rank hardly waits in the all-reduce: its sync time is the
            // communication itself; the others' extra is waiting for it.
            let busy = Spread::of(ranks.iter().map(RankTimes::busy));
            line.push_str(&format!(
                "; slowest rank {} (busy {} per step, median over ranks {}); communication without waiting (on rank {}) {:.0}%",
                self.slowest_rank,
                millis(slowest.busy()),
                millis(busy.median),
                self.slowest_rank,
                100.0 * slowest.phase(Phase::Sync) / total,
            ));
        }
        line
    }
}

fn millis(secs: f64) -> String {
    format!("{:.1} ms", secs * 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(data: f64, compute: f64, sync: f64, step: f64) -> RankTimes {
        RankTimes {
            phases: [data, compute, sync, 0.0, 0.0],
            step,
        }
    }

    #[test]
    fn median_of_an_even_count_is_the_mean_of_the_middle_two() {
        let s = Spread::of([4.0, 1.0, 3.0, 2.0]);
        assert_eq!((s.min, s.median, s.max), (1.0, 2.5, 4.0));
        assert_eq!(Spread::of([5.0, 1.0, 3.0]).median, 3.0);
        assert_eq!(Spread::of([]), Spread::default());
    }

    #[test]
    fn the_straggler_is_the_rank_the_others_wait_for() {
        // Rank 1 computes 30 ms; ranks 0 and 2 compute 10 ms and wait 20 ms in the all-reduce.
        let ranks = [
            rank(0.0, 0.010, 0.021, 0.032),
            rank(0.0, 0.030, 0.001, 0.032),
            rank(0.0, 0.010, 0.021, 0.032),
        ];
        let t = StepTime::across_ranks(&ranks);
        assert_eq!(t.slowest_rank, 1);
        assert_eq!(t.compute.max, 0.030);
        assert_eq!(t.sync.min, 0.001);
        let line = t.describe(&ranks);
        assert!(line.contains("slowest rank 1"), "{line}");
        assert!(line.contains("busy 31.0 ms"), "{line}");
    }

    #[test]
    fn a_slow_loader_makes_a_straggler_too() {
        let ranks = [
            rank(0.020, 0.010, 0.001, 0.032),
            rank(0.0, 0.010, 0.021, 0.032),
        ];
        assert_eq!(StepTime::across_ranks(&ranks).slowest_rank, 0);
    }

    #[test]
    fn one_rank_names_no_straggler() {
        let ranks = [rank(0.001, 0.008, 0.0, 0.010)];
        let line = StepTime::across_ranks(&ranks).describe(&ranks);
        assert_eq!(
            line,
            "time per step 10.0 ms: compute 80%, communication 0%, optimizer 0%, data 10%, checkpoint 0%"
        );
    }

    #[test]
    fn rows_round_trip() {
        let r = rank(1.0, 2.0, 3.0, 7.0);
        assert_eq!(RankTimes::from_row(&r.to_row()), r);
    }

    #[test]
    fn a_window_gives_means_per_step_and_the_run_keeps_totals() {
        let mut clock = PhaseClock::new();
        clock.add(Phase::Compute, Duration::from_millis(30));
        clock.add(Phase::Sync, Duration::from_millis(10));
        clock.end_step();
        clock.end_step();
        let w = clock.take_window();
        assert!((w.phase(Phase::Compute) - 0.015).abs() < 1e-12);
        assert!((w.phase(Phase::Sync) - 0.005).abs() < 1e-12);
        clock.add(Phase::Compute, Duration::from_millis(60));
        clock.end_step();
        let _ = clock.take_window();
        assert_eq!(clock.run_steps(), 3);
        assert!((clock.run_means().phase(Phase::Compute) - 0.030).abs() < 1e-12);
    }
}
