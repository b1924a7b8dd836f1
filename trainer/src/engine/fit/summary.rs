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

/// The end of a run's closing line for the times the job re-formed its group without ranks
/// that left or died: nothing when it never did.
pub(crate) fn regroups(membership: &Membership) -> String {
    let lost = match membership.regroups {
        0 => String::new(),
        n => format!(
            "; the job re-formed {n} time{} without the ranks it lost ({} step{} in flight dropped, {:.2} s recovering)",
            if n == 1 { "" } else { "s" },
            membership.dropped_steps,
            if membership.dropped_steps == 1 { "" } else { "s" },
            membership.recovery_secs
        ),
    };
    let joined = match membership.joins {
        0 => String::new(),
        n => format!(
            "; ranks joined it {n} time{} ({:.2} s handing them the training state)",
            if n == 1 { "" } else { "s" },
            membership.join_secs
        ),
    };
    lost + &joined
}

/// What membership changes cost a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Membership {
    /// Times the job re-formed its group.
    pub regroups: usize,
    /// Steps dropped because a rank died during them.
    pub dropped_steps: usize,
    /// Seconds from the start of each failed step (or boundary) to the re-formed group, summed.
    pub recovery_secs: f64,
    /// Times ranks joined the job (a restarted rank, or a new one).
    pub joins: usize,
    /// Seconds the job spent admitting them (the grown group formed, the state handed over),
    /// summed.
    pub join_secs: f64,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Summary {
    /// The final validation metrics, `None` without a validation set.
    pub validation: Option<Validation>,
    pub steps: usize,
    /// Optimizer steps skipped for non-finite gradients (`training.on_nonfinite = "skip"`).
    pub skipped_steps: usize,
    /// What re-forming the job without lost ranks cost (`[fault_tolerance]`).
    pub membership: Membership,
    /// Where the time of this process's steps went, over the ranks (`None` without steps).
    pub time: Option<String>,
}

impl Summary {
    /// The line rank 0 prints at the end of a run.
    pub fn line(&self, world_size: usize) -> String {
        format!(
            "{}{}{}",
            self.result_line(world_size),
            skipped_steps(self.skipped_steps),
            regroups(&self.membership)
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
