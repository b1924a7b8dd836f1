//! Why no charts could be written: [`PlotError`].

use std::path::PathBuf;

/// Why no charts could be written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error(
        "no metrics file {}: `trainer plot` reads the metrics.jsonl that training writes into \
         its output directory (`[output] dir` of the config); pass that directory, e.g. \
         `trainer plot runs/digits-mlp`, after training",
        path.display()
    )]
    NoMetrics { path: PathBuf },
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("line {line} of {}: {reason}", path.display())]
    BadLine {
        path: PathBuf,
        /// 1-based.
        line: usize,
        reason: String,
    },
    #[error(
        "{} has no training records (no line of kind \"train\"): nothing to plot yet; a run \
         writes one every `training.log_every` optimizer steps",
        path.display()
    )]
    NoTrainLines { path: PathBuf },
    #[error("cannot create {}: {source}", path.display())]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write the chart {}: {reason}", path.display())]
    Draw { path: PathBuf, reason: String },
    #[error("cannot load the embedded DejaVu Sans font")]
    Font,
    /// This build draws no charts (it lacks trainer's cargo feature `plots`); the message names
    /// the feature and how to turn it on.
    #[error("{0}")]
    NotBuilt(String),
}

impl From<crate::features::FeatureMissing> for PlotError {
    fn from(missing: crate::features::FeatureMissing) -> Self {
        PlotError::NotBuilt(missing.to_string())
    }
}

impl PlotError {
    /// A problem with what the user pointed at (a missing, unreadable or empty metrics
    /// file) or asked of a build without charts, not with this machine.
    pub fn is_input(&self) -> bool {
        matches!(
            self,
            PlotError::NoMetrics { .. }
                | PlotError::BadLine { .. }
                | PlotError::NoTrainLines { .. }
                | PlotError::NotBuilt(_)
        )
    }
}
