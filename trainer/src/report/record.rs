//! The records of `metrics.jsonl`: the run's history as rank 0 writes it (and as TensorBoard
//! event files and the charts read it back). The schema alone; writing is `metrics::Reporter`'s.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::report::timing::StepTime;

/// One line of `metrics.jsonl`. Metric values are keyed by the burn-train metric's name
/// (`"Loss"`, `"Accuracy"`, ...), each the global mean over the samples it covers (`null` when
/// no sample was counted). Times are seconds.
///
/// A resumed or restarted run appends to the same file, after a `start` line of its own.
#[derive(Debug, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Record {
    /// A process (or the ranks of a job) started training: fresh, or resumed from a checkpoint.
    Start {
        /// The optimizer step it starts after (0 for a fresh run).
        step: usize,
        epoch: usize,
        world_size: usize,
        /// `Some(step)` when it resumed from a checkpoint of that step.
        resumed_from: Option<usize>,
        /// The launcher's restart count (`TORCHELASTIC_RESTART_COUNT`; 0 on the first attempt).
        restart: u64,
        /// Seconds since the Unix epoch.
        unix_time: f64,
    },
    /// Training metrics over the steps since the previous record, over all ranks.
    Train {
        epoch: usize,
        step: usize,
        lr: f64,
        samples_per_sec: f64,
        world_size: usize,
        metrics: BTreeMap<String, f64>,
        /// Seconds per optimizer step by phase, over the ranks (min / median / max), and the
        /// slowest rank.
        time: StepTime,
    },
    /// The job re-formed its group without ranks that left or died, after optimizer step
    /// `step`, and trains on at `world_size` (`[fault_tolerance] on_rank_failure =
    /// "continue"`); written by the new group's rank 0.
    Regroup {
        epoch: usize,
        step: usize,
        world_size: usize,
        previous_world_size: usize,
        /// The ranks (of the previous group) that are gone.
        lost: Vec<usize>,
        /// The ranks (of the new group) of the processes that joined.
        joined: Vec<usize>,
        /// Steps dropped so far because a rank died during them.
        dropped_steps: usize,
        /// Seconds from the start of the failed step (or boundary) to the re-formed group.
        recovery_secs: f64,
    },
    /// Validation over every validation sample exactly once.
    Valid {
        epoch: usize,
        step: usize,
        samples: usize,
        metrics: BTreeMap<String, f64>,
    },
    /// The end of a process's training: where the time went over all its steps.
    Finish {
        step: usize,
        world_size: usize,
        time: StepTime,
        /// The same, in words (what the final summary prints).
        report: String,
        /// Each rank's peak resident memory in bytes (0 where the system does not say).
        peak_rss_bytes: Vec<u64>,
        /// How many parameters each rank holds optimizer state for: all of them under ZeRO
        /// stage 0, its own under stages 1 and 2.
        optimizer_state_params: Vec<u64>,
        /// Bytes of each rank's optimizer state tensors.
        optimizer_state_bytes: Vec<u64>,
        /// Bytes of the gradients each rank's last optimizer step was given (its own only
        /// under stages 1 and 2).
        gradient_bytes: Vec<u64>,
        /// Bytes of each rank's parameters (its shards and the parameters outside marked
        /// blocks under stage 3).
        parameter_bytes: Vec<u64>,
        /// Under stage 3, the most bytes of whole (gathered) parameters each rank held at
        /// once in a training forward and backward; 0 under other stages.
        gathered_peak_bytes: Vec<u64>,
    },
}
