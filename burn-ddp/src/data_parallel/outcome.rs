//! [`StepOutcome`]: what one DDP step did, the same on every rank.

/// What [`DataParallel::step`](crate::DataParallel::step) did: the same on every rank of the job.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a skipped step is the caller's to report or stop on"]
pub enum StepOutcome {
    /// The optimizer stepped with the gradients' mean over the ranks.
    Applied,
    /// The gradients of `ranks` (ascending) held a NaN or an infinity, so their mean was not
    /// finite: no rank stepped its optimizer (the parameters are as they were), and the
    /// buffers were still made equal. Stop, or go on to the next step, as you choose: every
    /// rank has the same outcome, so all choose alike.
    Skipped { ranks: Vec<usize> },
}

impl StepOutcome {
    pub fn is_applied(&self) -> bool {
        matches!(self, StepOutcome::Applied)
    }
}
