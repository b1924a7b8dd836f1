//! What the training loop reports, as events (burn-train's `EventProcessor` pattern): the
//! loop emits them on every rank and knows no file, no progress bar and no chart; an
//! [`EventSink`] (the rank's reporter, or a test's recorder) decides what each becomes.

use burn_ddp::sampler::Sample;

use super::summary::Validation;
use crate::engine::checkpoint::TrainPosition;
use crate::report::metrics::MetricValue;
use crate::report::timing::StepTime;

/// What one rank holds of the training state at the end of the run, counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldState {
    /// Parameters it holds optimizer state for (all of them at ZeRO stage 0, its own at
    /// stages 1 and 2).
    pub optimizer_state_params: u64,
    /// Bytes of the tensors of that state.
    pub optimizer_state_bytes: u64,
    /// Bytes of the gradients its last optimizer step was given (its own only at stages 1
    /// and 2).
    pub gradient_bytes: u64,
    /// Bytes of the parameters it holds (its shards and the parameters outside marked
    /// blocks at ZeRO stage 3).
    pub parameter_bytes: u64,
    /// At ZeRO stage 3, the most bytes of whole parameters it held at once in a training
    /// forward and backward (blocks gathered for use, ahead, and again for a backward);
    /// 0 at other stages.
    pub gathered_peak_bytes: u64,
}

impl HeldState {
    /// The values one rank sends in the run's closing all-gather.
    pub const VALUES: usize = 5;

    pub fn to_values(self) -> [f64; Self::VALUES] {
        [
            self.optimizer_state_params as f64,
            self.optimizer_state_bytes as f64,
            self.gradient_bytes as f64,
            self.parameter_bytes as f64,
            self.gathered_peak_bytes as f64,
        ]
    }

    pub fn from_values(values: &[f64]) -> Self {
        let at = |i: usize| values.get(i).copied().unwrap_or(0.0) as u64;
        Self {
            optimizer_state_params: at(0),
            optimizer_state_bytes: at(1),
            gradient_bytes: at(2),
            parameter_bytes: at(3),
            gathered_peak_bytes: at(4),
        }
    }
}

/// One thing that happened in the loop, in the order it happened.
#[derive(Debug)]
pub(crate) enum Event<'a> {
    /// Training starts at `position`: fresh, or resumed from the checkpoint of step
    /// `resumed_from`.
    Started {
        position: TrainPosition,
        total_steps: usize,
        world_size: usize,
        resumed_from: Option<usize>,
    },
    /// An optimizer step was taken (or skipped); `samples` are this rank's.
    Stepped { epoch: usize, samples: &'a [Sample] },
    /// The training metrics and times of the steps since the last `Trained`, over the job.
    Trained {
        position: TrainPosition,
        lr: f64,
        samples_per_sec: f64,
        world_size: usize,
        metrics: &'a [MetricValue],
        time: StepTime,
    },
    /// The job re-formed its group at `position` without the ranks `lost` (of the previous
    /// group): this rank is now `rank` of `world_size`, and the run plans `total_steps`.
    Regrouped {
        position: TrainPosition,
        rank: usize,
        world_size: usize,
        previous_world_size: usize,
        lost: &'a [usize],
        joined: &'a [usize],
        dropped_steps: usize,
        recovery_secs: f64,
        total_steps: usize,
    },
    /// A validation during `epoch`; `epochs` when it ended that epoch (of that many), `None`
    /// for the final one of a run that stopped mid-epoch.
    Validated {
        epoch: usize,
        validation: &'a Validation,
        epochs: Option<usize>,
    },
    /// No more steps: what shows progress can go.
    StepsDone,
    /// Where the time of the run's steps went, over the job, and what each rank held: sent
    /// after the final checkpoint and validation, so that the peak memory counts them.
    Finished {
        step: usize,
        world_size: usize,
        time: StepTime,
        report: &'a str,
        peak_rss_bytes: Vec<u64>,
        /// What each rank holds of the training state, in rank order.
        held: Vec<HeldState>,
    },
    /// The run ended: the final checkpoint and validation are done.
    Ended,
}

/// Consumes the loop's events. An error stops the run (a reporter that cannot open its files
/// at the start); what must never stop a run (a full disk for metrics lines) it swallows.
pub(crate) trait EventSink {
    fn on(&mut self, event: Event<'_>) -> anyhow::Result<()>;
}
