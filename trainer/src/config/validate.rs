//! Reading a configuration file: parsed against the schema, then validated across fields.
//! Every error names the file and the field, and is a usage error (exit code 2).

use std::path::{Path, PathBuf};

use burn_ddp::pipeline::PipelineLayout;
use serde::de::DeserializeOwned;

use super::schema::{Config, DeviceKind, OnRankFailure};

/// A configuration problem: the user must fix the file (exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("config file {path}: {field} {problem}")]
    Invalid {
        path: PathBuf,
        field: &'static str,
        problem: String,
    },
}

impl<M: DeserializeOwned, D: DeserializeOwned> Config<M, D> {
    /// Reads, parses and validates `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses and validates `text`; `path` is only used in messages.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
        config.validate(path)?;
        Ok(config)
    }
}

impl<M, D> Config<M, D> {
    fn validate(&self, path: &Path) -> Result<(), ConfigError> {
        let invalid = |field: &'static str, problem: String| {
            Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                field,
                problem,
            })
        };
        let t = &self.training;
        if t.batch_size == 0 {
            return invalid("training.batch_size", "must be at least 1 (got 0)".into());
        }
        if t.accumulation_steps == 0 {
            return invalid(
                "training.accumulation_steps",
                "must be at least 1 (got 0)".into(),
            );
        }
        if t.log_every == 0 {
            return invalid("training.log_every", "must be at least 1 (got 0)".into());
        }
        let lr = self.optimizer.learning_rate;
        if !(lr.is_finite() && lr > 0.0) {
            return invalid(
                "optimizer.learning_rate",
                format!("must be a positive number (got {lr})"),
            );
        }
        if self.distributed.bucket_cap_mb.is_nan() || self.distributed.bucket_cap_mb <= 0.0 {
            return invalid(
                "distributed.bucket_cap_mb",
                format!("must be positive (got {})", self.distributed.bucket_cap_mb),
            );
        }
        if self.distributed.timeout_secs == 0 {
            return invalid(
                "distributed.timeout_secs",
                "must be at least 1 (got 0)".into(),
            );
        }
        // burn-ddp's rule (NCCL needs a CUDA device), in the config's words.
        let cuda = self.output.device == DeviceKind::Cuda;
        if self.distributed.gradient_sync.check_device(cuda).is_err() {
            return invalid(
                "distributed.gradient_sync",
                format!(
                    "= \"nccl\" needs output.device = \"cuda\" (got \"{}\"); use \"auto\" or \"host\"",
                    format!("{:?}", self.output.device).to_lowercase()
                ),
            );
        }
        if PipelineLayout::check_stages(self.distributed.pipeline_stages).is_err() {
            return invalid(
                "distributed.pipeline_stages",
                "must be at least 1 (got 0; 1 is plain data parallelism)".into(),
            );
        }
        if self.distributed.zero_stage.shards_parameters() && self.distributed.pipeline_stages > 1 {
            return invalid(
                "distributed.zero_stage",
                format!(
                    "= 3 cannot be combined with pipeline_stages = {} yet (stage 3 shards a whole model's marked blocks); use zero_stage = 2 with pipeline stages, or zero_stage = 3 without",
                    self.distributed.pipeline_stages
                ),
            );
        }
        let ft = &self.fault_tolerance;
        if ft.on_rank_failure == OnRankFailure::Continue && self.distributed.pipeline_stages > 1 {
            return invalid(
                "fault_tolerance.on_rank_failure",
                format!(
                    "= \"continue\" cannot be combined with pipeline_stages = {} yet (a lost stage leaves its replica without that part of the model); use \"restart\" with --max-restarts",
                    self.distributed.pipeline_stages
                ),
            );
        }
        if !(ft.detection_secs.is_finite() && ft.detection_secs > 0.0) {
            return invalid(
                "fault_tolerance.detection_secs",
                format!(
                    "must be a positive number of seconds (got {})",
                    ft.detection_secs
                ),
            );
        }
        if ft.min_world_size == 0 {
            return invalid(
                "fault_tolerance.min_world_size",
                "must be at least 1 (got 0)".into(),
            );
        }
        if let Some(max) = ft.max_world_size.filter(|&max| max < ft.min_world_size) {
            return invalid(
                "fault_tolerance.max_world_size",
                format!(
                    "must be at least fault_tolerance.min_world_size = {} (got {max})",
                    ft.min_world_size
                ),
            );
        }
        if self.checkpoint.keep_last == 0 {
            return invalid("checkpoint.keep_last", "must be at least 1 (got 0)".into());
        }
        Ok(())
    }
}
