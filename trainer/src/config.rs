//! The TOML configuration: schema, defaults and validation. Every error names the file and the
//! field, and is a usage error (exit code 2).

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A whole configuration file: the app's own `[model]` and `[data]` tables (`M`, `D`: see
/// [`crate::app::App`]) and the engine's sections. Unknown keys are errors everywhere (the
/// app's tables decide for themselves with `deny_unknown_fields`). Every engine field has one
/// default, in its section's `Default` impl, used for a missing key and a missing section alike.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(
    deny_unknown_fields,
    bound(
        serialize = "M: Serialize, D: Serialize",
        deserialize = "M: DeserializeOwned, D: DeserializeOwned"
    )
)]
pub struct Config<M, D> {
    pub model: M,
    pub data: D,
    #[serde(default)]
    pub optimizer: OptimizerConfig,
    #[serde(default)]
    pub training: TrainingConfig,
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    #[serde(default)]
    pub distributed: DistributedConfig,
    #[serde(default)]
    pub output: OutputConfig,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerName {
    Sgd,
    Adam,
    AdamW,
}

/// How the learning rate grows with the world size (Goyal et al.: linear; Krizhevsky/Hoffer:
/// square root). `None` keeps the configured rate.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum LrScaling {
    #[default]
    None,
    Linear,
    Sqrt,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    #[default]
    Constant,
    /// Cosine decay to zero over the whole run (after the warm-up).
    Cosine,
    /// Burn's `NoamLrScheduler` (the Transformer paper's): `learning_rate` is its factor,
    /// with `warmup_steps` (at least 1) and `model_size`.
    Noam,
}

impl LrScaling {
    /// The factor for `world_size` ranks.
    pub fn factor(self, world_size: usize) -> f64 {
        match self {
            Self::None => 1.0,
            Self::Linear => world_size as f64,
            Self::Sqrt => (world_size as f64).sqrt(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct OptimizerConfig {
    pub name: OptimizerName,
    pub learning_rate: f64,
    /// SGD momentum (0 disables it).
    pub momentum: f64,
    pub weight_decay: f64,
    pub lr_scaling: LrScaling,
    pub schedule: LrSchedule,
    /// Linear warm-up from 0 over this many optimizer steps (Noam: its warm-up).
    pub warmup_steps: usize,
    /// `schedule = "noam"` only: the model width in its `model_size^-0.5` factor.
    pub model_size: usize,
}

impl OptimizerConfig {
    /// The learning rate of optimizer step `step` (0-based) in a run of `total_steps` steps on
    /// `world_size` ranks: the configured rate, scaled by the world size as `lr_scaling` says,
    /// with a linear warm-up and the configured decay. A pure function of its inputs, so a
    /// resumed run continues the same schedule.
    pub fn learning_rate(&self, world_size: usize, step: usize, total_steps: usize) -> f64 {
        let base = self.learning_rate * self.lr_scaling.factor(world_size);
        if step < self.warmup_steps {
            return base * (step + 1) as f64 / self.warmup_steps as f64;
        }
        match self.schedule {
            // Noam is stateful: `crate::engine::schedule` steps Burn's scheduler instead.
            LrSchedule::Constant | LrSchedule::Noam => base,
            LrSchedule::Cosine => {
                let span = total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
                let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
                base * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            name: OptimizerName::Adam,
            learning_rate: 1e-3,
            momentum: 0.0,
            weight_decay: 0.0,
            lr_scaling: LrScaling::None,
            schedule: LrSchedule::Constant,
            warmup_steps: 0,
            model_size: 512,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TrainingConfig {
    pub epochs: usize,
    /// Samples per rank per micro-batch; the global batch is this x world size x accumulation.
    pub batch_size: usize,
    /// Micro-batches per optimizer step; gradients are communicated once per step.
    pub accumulation_steps: usize,
    pub seed: u64,
    /// Drop the tail of each epoch that does not fill every rank equally (else pad, as PyTorch).
    pub drop_last: bool,
    /// Shuffle the training order every epoch (seeded by seed + epoch).
    pub shuffle: bool,
    /// Draw training samples with probability inversely proportional to their class's
    /// frequency (with replacement, as many draws per epoch as samples) instead of a shuffle.
    pub balance_classes: bool,
    /// Stop after this many optimizer steps in total (for tests and benchmarks).
    pub max_steps: Option<usize>,
    /// Log (and average across ranks) the training loss every this many steps.
    pub log_every: usize,
    /// Compare a checksum of the parameters across ranks every this many steps (0: never).
    pub check_replicas_every: usize,
    /// Threads that read items (`Dataset::get`) ahead of the training thread, like PyTorch's
    /// `DataLoader(num_workers=...)`; 0 reads them on the training thread. The batcher always
    /// runs on the training thread.
    pub num_workers: usize,
    /// What to do when a rank's gradients hold a NaN or an infinity: `"stop"` (the default:
    /// fail naming the step and the ranks, without updating the model or writing a
    /// checkpoint) or `"skip"` (leave the model unchanged for that step and count it, like
    /// PyTorch's `GradScaler` skipping `optimizer.step()`).
    pub on_nonfinite: OnNonFinite,
}

/// `training.on_nonfinite`: see [`TrainingConfig::on_nonfinite`].
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnNonFinite {
    #[default]
    Stop,
    Skip,
}

impl Default for TrainingConfig {
    fn default() -> Self {
        Self {
            epochs: 10,
            batch_size: 32,
            accumulation_steps: 1,
            seed: 0,
            drop_last: false,
            shuffle: true,
            balance_classes: false,
            max_steps: None,
            log_every: 10,
            check_replicas_every: 0,
            num_workers: 1,
            on_nonfinite: OnNonFinite::Stop,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Where rank 0 writes checkpoints; `None` disables them.
    pub dir: Option<PathBuf>,
    /// Also checkpoint every this many optimizer steps (0: only at the end of epochs).
    pub every_steps: usize,
    /// Checkpoint at the end of every this many epochs (0: never at epoch ends).
    pub every_epochs: usize,
    /// Keep this many newest checkpoints.
    pub keep_last: usize,
    /// Resume from the newest complete checkpoint in `dir` when there is one.
    pub resume: bool,
    /// How long ranks other than 0 wait for rank 0 to finish writing.
    pub timeout_secs: u64,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            dir: None,
            every_steps: 0,
            every_epochs: 1,
            keep_last: 3,
            resume: true,
            timeout_secs: 600,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DistributedConfig {
    /// Largest gradient bucket in MiB (PyTorch's default, 25).
    pub bucket_cap_mb: f64,
    /// Deadline of set-up and of every collective.
    pub timeout_secs: u64,
    /// Warn about ranks that have not arrived after this long in one collective.
    pub stall_warning_secs: u64,
    /// Where gradients are averaged: `"auto"`, `"host"` or `"nccl"` (see [`GradientSyncMode`]).
    pub gradient_sync: GradientSyncMode,
    /// How gradient buckets travel: `"none"` (f32), `"bf16"` or `"fp16"` (see
    /// [`GradientCompression`]).
    pub gradient_compression: GradientCompression,
    /// ZeRO stage: 0 = every rank holds the whole optimizer state (plain DDP); 1 = each
    /// parameter's optimizer state lives on one rank, which steps it and sends the new values
    /// to the others (DeepSpeed's stage 1, PyTorch's `ZeroRedundancyOptimizer`).
    pub zero_stage: u8,
    /// How buffers (BatchNorm running statistics, any `RunningState`, frozen parameters) are
    /// kept equal across ranks: `"broadcast"`, `"average"` or `"off"` (see [`SyncBuffers`]).
    pub sync_buffers: SyncBuffers,
    /// Pipeline stages the model is cut into (1: none, plain data parallelism). With `P > 1`
    /// the world size must be a multiple of `P`: `world / P` replicas of the pipeline train
    /// data-parallel, and `training.accumulation_steps` is the micro-batch count. Needs a
    /// program that says how its model splits ([`StageSplit`](crate::engine::pipeline::StageSplit)).
    pub pipeline_stages: usize,
    /// The order of micro-batches on each stage: `"gpipe"` or `"1f1b"` (see
    /// [`PipelineScheduleName`]).
    pub pipeline_schedule: PipelineScheduleName,
}

/// `distributed.pipeline_schedule`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
pub enum PipelineScheduleName {
    /// Every micro-batch forward, then every one backward: each stage holds all the step's
    /// activations at once.
    #[default]
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward (PipeDream-flush): a stage holds at most `stages − stage`
    /// micro-batches' activations; the same bubble and the same weights as GPipe.
    #[serde(rename = "1f1b")]
    OneForwardOneBackward,
}

impl PipelineScheduleName {
    /// burn-ddp's schedule.
    pub fn schedule(self) -> burn_ddp::pipeline::PipelineSchedule {
        match self {
            Self::GPipe => burn_ddp::pipeline::PipelineSchedule::GPipe,
            Self::OneForwardOneBackward => {
                burn_ddp::pipeline::PipelineSchedule::OneForwardOneBackward
            }
        }
    }
}

/// `distributed.sync_buffers`: after every optimizer step, the ranks' buffers are made equal,
/// so that replicas are identical at every step boundary (replica checks, checkpoints,
/// validation).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum SyncBuffers {
    /// Rank 0's buffers to every rank: PyTorch DDP's default (`broadcast_buffers=True`).
    #[default]
    Broadcast,
    /// The mean over the ranks: a running mean becomes what one process with the global batch
    /// computes; a running variance the mean of the ranks' batch variances.
    Average,
    /// Each rank keeps its own (they drift apart; checkpoints hold rank 0's).
    Off,
}

impl Default for DistributedConfig {
    fn default() -> Self {
        Self {
            bucket_cap_mb: 25.0,
            timeout_secs: 300,
            stall_warning_secs: 60,
            gradient_sync: GradientSyncMode::default(),
            gradient_compression: GradientCompression::default(),
            zero_stage: 0,
            sync_buffers: SyncBuffers::default(),
            pipeline_stages: 1,
            pipeline_schedule: PipelineScheduleName::default(),
        }
    }
}

/// `distributed.gradient_sync`: how gradients are averaged across ranks. Metrics, checkpoint
/// barriers and the initial parameter broadcast always use the TCP process group.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum GradientSyncMode {
    /// `nccl` for a job of several ranks on `output.device = "cuda"`, else `host`. A job of
    /// one rank has nothing to average, so it needs no NCCL library.
    #[default]
    Auto,
    /// Copy gradients to the host and all-reduce them over the TCP process group (any device).
    Host,
    /// Keep gradients on the GPU and all-reduce them with NCCL (`output.device = "cuda"` only,
    /// and a build with `--features cuda`). Also with one rank: a one-GPU machine tests the
    /// NCCL path this way.
    Nccl,
}

impl GradientSyncMode {
    /// What `Auto` means for `device` and `world_size`; `Host` and `Nccl` stay as they are
    /// (validation refuses `Nccl` on a device other than CUDA).
    pub fn resolve(self, device: DeviceKind, world_size: usize) -> Self {
        match self {
            Self::Auto if device == DeviceKind::Cuda && world_size > 1 => Self::Nccl,
            Self::Auto => Self::Host,
            explicit => explicit,
        }
    }
}

/// `distributed.gradient_compression`: the precision of gradient buckets on the wire, on every
/// path (host and NCCL): what PyTorch's `bf16_compress_hook` / `fp16_compress_hook` do.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum GradientCompression {
    /// `f32`: the average is exact up to `f32` summation order.
    #[default]
    None,
    /// bfloat16: half the bytes; `f32`'s range, 8 significant bits.
    Bf16,
    /// IEEE half: half the bytes; 11 significant bits, but magnitudes past 65504 overflow and
    /// those up to 2^-25 (3e-8) become 0 (each rank divides by the world size before rounding,
    /// so the sum overflows only where the mean would).
    Fp16,
}

impl GradientCompression {
    /// The wire format, `None` for no compression.
    pub fn format(self) -> Option<burn_ddp::kernels::HalfFormat> {
        use burn_ddp::kernels::HalfFormat;
        match self {
            Self::None => None,
            Self::Bf16 => Some(HalfFormat::Bf16),
            Self::Fp16 => Some(HalfFormat::F16),
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
    Wgpu,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct OutputConfig {
    /// Metrics (`metrics.jsonl`) and per-rank logs go here.
    pub dir: PathBuf,
    pub device: DeviceKind,
    /// Write each rank's visited sample indices to `samples-rank<R>.txt` (for tests).
    pub log_samples: bool,
    /// Write PNG charts of the run to `<dir>/plots/` when training ends (`trainer plot DIR`
    /// writes them at any time).
    pub plots: bool,
    /// Also write TensorBoard event files to `<dir>/tensorboard/`.
    pub tensorboard: bool,
}

impl Default for OutputConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("runs/default"),
            device: DeviceKind::Cpu,
            log_samples: false,
            plots: true,
            tensorboard: false,
        }
    }
}

/// A fingerprint as hex: stable across runs, platforms and Rust versions (std's hasher is not).
fn fnv_hex(text: &str) -> String {
    burn_ddp::hash::fnv1a64_hex(text.as_bytes())
}

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
        if self.distributed.gradient_sync == GradientSyncMode::Nccl
            && self.output.device != DeviceKind::Cuda
        {
            return invalid(
                "distributed.gradient_sync",
                format!(
                    "= \"nccl\" needs output.device = \"cuda\" (got \"{}\"); use \"auto\" or \"host\"",
                    format!("{:?}", self.output.device).to_lowercase()
                ),
            );
        }
        if self.distributed.zero_stage > 1 {
            return invalid(
                "distributed.zero_stage",
                format!(
                    "must be 0 (plain DDP) or 1 (sharded optimizer state), got {}; stages 2 and 3 (sharded gradients, parameters) are not implemented",
                    self.distributed.zero_stage
                ),
            );
        }
        if self.distributed.pipeline_stages == 0 {
            return invalid(
                "distributed.pipeline_stages",
                "must be at least 1 (got 0; 1 is plain data parallelism)".into(),
            );
        }
        if self.checkpoint.keep_last == 0 {
            return invalid("checkpoint.keep_last", "must be at least 1 (got 0)".into());
        }
        Ok(())
    }
}

impl<M: Serialize, D: Serialize> Config<M, D> {
    /// A stable hash of the settings that shape the model, its training and its communication
    /// (bucket sizes, gradient sync), compared across ranks at start-up: ranks with different
    /// settings refuse to start.
    pub fn fingerprint(&self) -> String {
        // JSON, not TOML: a TOML document must be a table, and a tuple of sections is not one.
        fnv_hex(
            &serde_json::to_string(&(
                &self.model,
                &self.data,
                &self.optimizer,
                &self.training,
                &self.distributed,
            ))
            .unwrap_or_default(),
        )
    }

    /// A stable hash of the model section alone: a checkpoint can only be loaded into a model
    /// with the same fingerprint.
    pub fn model_fingerprint(&self) -> String {
        fnv_hex(&serde_json::to_string(&self.model).unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for an app's tables.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Model {
        hidden: Vec<usize>,
    }
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Data {
        source: String,
    }
    type TestConfig = Config<Model, Data>;

    const MINIMAL: &str = r#"
[model]
hidden = [32]
[data]
source = "digits"
[training]
epochs = 1
batch_size = 8
seed = 1
"#;

    fn parse(text: &str) -> Result<TestConfig, ConfigError> {
        Config::parse(text, Path::new("test.toml"))
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.model.hidden, vec![32]);
        assert_eq!(c.training.accumulation_steps, 1);
        assert_eq!(c.distributed.bucket_cap_mb, 25.0);
        assert_eq!(c.checkpoint.dir, None);
    }

    #[test]
    fn one_default_per_field_with_or_without_its_section() {
        let without = parse("[model]\nhidden = []\n[data]\nsource = \"x\"\n").unwrap();
        let with = parse(
            "[model]\nhidden = []\n[data]\nsource = \"x\"\n[training]\n[optimizer]\n[checkpoint]\n[distributed]\n[output]\n",
        )
        .unwrap();
        assert_eq!(without, with);
        assert_eq!(without.training, TrainingConfig::default());
        assert_eq!(without.optimizer, OptimizerConfig::default());
        let partial = parse(&MINIMAL.replace("epochs = 1\n", "")).unwrap();
        assert_eq!(partial.training.epochs, TrainingConfig::default().epochs);
    }

    #[test]
    fn errors_name_the_field() {
        let err = parse(&format!("{MINIMAL}\n[distributed]\nbucket_cap = 3\n"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("bucket_cap") && err.contains("test.toml"),
            "{err}"
        );
        let err = parse(&MINIMAL.replace("epochs = 1", "epochs = \"one\""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("epochs"), "{err}");
        let err = parse(&MINIMAL.replace("batch_size = 8", "batch_size = 0"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("training.batch_size"), "{err}");
        // The app's own table: an unknown key is named.
        let err = parse(&MINIMAL.replace("hidden = [32]", "hidden = [32]\nhiden = 3"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("hiden"), "{err}");
    }

    #[test]
    fn gradient_sync_defaults_to_auto_and_nccl_needs_cuda() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.distributed.gradient_sync, GradientSyncMode::Auto);
        let auto = GradientSyncMode::Auto;
        assert_eq!(auto.resolve(DeviceKind::Cuda, 2), GradientSyncMode::Nccl);
        assert_eq!(auto.resolve(DeviceKind::Cuda, 1), GradientSyncMode::Host);
        assert_eq!(auto.resolve(DeviceKind::Cpu, 2), GradientSyncMode::Host);
        assert_eq!(auto.resolve(DeviceKind::Wgpu, 4), GradientSyncMode::Host);
        let host = GradientSyncMode::Host;
        assert_eq!(host.resolve(DeviceKind::Cuda, 2), GradientSyncMode::Host);
        let nccl = GradientSyncMode::Nccl;
        assert_eq!(nccl.resolve(DeviceKind::Cuda, 1), GradientSyncMode::Nccl);

        let with = |sync: &str, device: &str| {
            parse(&format!(
                "{MINIMAL}\n[distributed]\ngradient_sync = \"{sync}\"\n[output]\ndevice = \"{device}\"\n"
            ))
        };
        assert_eq!(
            with("nccl", "cuda").unwrap().distributed.gradient_sync,
            GradientSyncMode::Nccl
        );
        assert_eq!(
            with("host", "cuda").unwrap().distributed.gradient_sync,
            GradientSyncMode::Host
        );
        let err = with("nccl", "cpu").unwrap_err();
        assert!(matches!(err, ConfigError::Invalid { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("distributed.gradient_sync") && msg.contains("cpu"),
            "{msg}"
        );
        let err = with("gloo", "cpu").unwrap_err().to_string();
        assert!(err.contains("gloo"), "{err}");
    }

    #[test]
    fn gradient_compression_names() {
        use burn_ddp::kernels::HalfFormat;
        let with = |value: &str| {
            parse(&format!(
                "{MINIMAL}\n[distributed]\ngradient_compression = \"{value}\"\n"
            ))
            .map(|c| c.distributed.gradient_compression.format())
        };
        assert_eq!(with("none").unwrap(), None);
        assert_eq!(with("bf16").unwrap(), Some(HalfFormat::Bf16));
        assert_eq!(with("fp16").unwrap(), Some(HalfFormat::F16));
        let err = with("fp8").unwrap_err().to_string();
        assert!(err.contains("fp8") && err.contains("bf16"), "{err}");
        let default = parse(MINIMAL).unwrap();
        assert_eq!(default.distributed.gradient_compression.format(), None);
    }

    #[test]
    fn learning_rate_schedule() {
        let mut o = OptimizerConfig {
            learning_rate: 0.1,
            lr_scaling: LrScaling::Linear,
            warmup_steps: 4,
            schedule: LrSchedule::Cosine,
            ..Default::default()
        };
        assert!((o.learning_rate(2, 0, 100) - 0.05).abs() < 1e-12);
        assert!((o.learning_rate(2, 4, 100) - 0.2).abs() < 1e-12);
        assert!(o.learning_rate(2, 100, 100).abs() < 1e-12);
        o.lr_scaling = LrScaling::Sqrt;
        o.schedule = LrSchedule::Constant;
        assert!((o.learning_rate(4, 50, 100) - 0.2).abs() < 1e-12);
    }

    #[test]
    fn fingerprint_tracks_training_settings_only() {
        let a = parse(MINIMAL).unwrap();
        let mut b = a.clone();
        b.output.dir = "elsewhere".into();
        assert_eq!(a.fingerprint(), b.fingerprint());
        b.training.seed = 2;
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_eq!(a.model_fingerprint(), b.model_fingerprint());
        b.model.hidden = vec![];
        assert_ne!(a.model_fingerprint(), b.model_fingerprint());
    }
}
