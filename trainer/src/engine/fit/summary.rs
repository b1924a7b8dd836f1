//! What a finished run reports, and the error of a step with non-finite gradients.

use crate::report::metrics::{self, MetricValue};

/// The end of a run's closing line for `skipped` optimizer steps skipped for non-finite
/// gradients: nothing when there were none.
pub(crate) fn skipped_steps(skipped: usize) -> String {
    match skipped {
        0 => String::new(),
        n => format!("; skipped {n} optimizer steps with non-finite gradients"),
    }
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Summary {
    /// The final validation metrics, `None` without a validation set.
    pub validation: Option<Validation>,
    pub steps: usize,
    /// Optimizer steps skipped for non-finite gradients (`training.on_nonfinite = "skip"`).
    pub skipped_steps: usize,
    /// Where the time of this process's steps went, over the ranks (`None` without steps).
    pub time: Option<String>,
}

impl Summary {
    /// The line rank 0 prints at the end of a run.
    pub fn line(&self, world_size: usize) -> String {
        format!(
            "{}{}",
            self.result_line(world_size),
            skipped_steps(self.skipped_steps)
        )
    }

    fn result_line(&self, world_size: usize) -> String {
        match &self.validation {
            Some(v) => format!(
                "final validation: {} ({} samples, {} optimizer steps, world size {world_size})",
                metrics::describe(&v.metrics),
                v.samples,
                self.steps
            ),
            None => format!(
                "finished: {} optimizer steps, world size {world_size}; no validation set (data has none), so no validation metrics",
                self.steps
            ),
        }
    }
}

/// Validation results over all ranks.
#[derive(Debug, Clone)]
pub struct Validation {
    pub metrics: Vec<MetricValue>,
    pub samples: usize,
    /// The optimizer step it was measured after.
    pub step: usize,
}

/// A step whose gradients held a NaN or an infinity on some ranks (`training.on_nonfinite`).
#[derive(Debug, thiserror::Error)]
#[error(
    "non-finite gradients (NaN or Inf) at optimizer step {step}, first on rank(s) {ranks:?}: the model was not updated and no checkpoint was written{}; lower optimizer.learning_rate, check the data, or set training.on_nonfinite = \"skip\"",
    match last_checkpoint { Some(s) => format!(" (the newest checkpoint, of step {s}, is kept)"), None => String::new() }
)]
pub struct NonFiniteGradients {
    pub step: usize,
    pub ranks: Vec<usize>,
    pub last_checkpoint: Option<usize>,
}
