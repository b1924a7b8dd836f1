//! Which stage of a pipeline a rank builds: what an app's stage builder is told, and what
//! names a stage's checkpoints.

/// Stage `stage` of `stages` (counted from 0: the first reads the batch's inputs, the last
/// its targets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageOf {
    pub stage: usize,
    pub stages: usize,
}

impl StageOf {
    pub fn is_first(&self) -> bool {
        self.stage == 0
    }

    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }
}
