//! The TOML configuration: schema, defaults and validation. Every error names the file and the
//! field, and is a usage error (exit code 2).

use std::path::{Path, PathBuf};

use burn_ddp::ddp::BufferSync;
use burn_ddp::kernels::HalfFormat;
use burn_ddp::pipeline::{PipelineLayout, PipelineSchedule};
use burn_ddp::{DdpOptions, GradientTransport, ZeroStage};
use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize};

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

/// `[distributed]`: read straight into burn-ddp's option types (feature `serde` of burn-ddp
/// gives them their names here), so each rule about them has one home, in burn-ddp: what
/// `"auto"` means and that NCCL needs CUDA ([`GradientTransport`]), that ZeRO stages 0 to 3
/// exist ([`ZeroStage`]), that there is a stage and the stages divide the world
/// ([`PipelineLayout`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DistributedConfig {
    /// Largest gradient bucket in MiB (PyTorch's default, 25).
    pub bucket_cap_mb: f64,
    /// Deadline of set-up and of every collective.
    pub timeout_secs: u64,
    /// Warn about ranks that have not arrived after this long in one collective.
    pub stall_warning_secs: u64,
    /// Where gradients are averaged: `"auto"` (NCCL for a job of several ranks on
    /// `output.device = "cuda"`, else the host), `"host"` or `"nccl"` (`output.device =
    /// "cuda"` only, and a build with `--features cuda`). Metrics, checkpoint barriers and the
    /// initial parameter broadcast always use the TCP process group.
    pub gradient_sync: GradientTransport,
    /// How gradient buckets travel, on every path (host and NCCL): `"none"` (f32), `"bf16"`
    /// or `"fp16"` (see [`HalfFormat`]), what PyTorch's `bf16_compress_hook` /
    /// `fp16_compress_hook` do.
    #[serde(with = "burn_ddp::ddp::config_names::compression")]
    pub gradient_compression: Option<HalfFormat>,
    /// Whether the gradients of the blocks a model marks (`burn_ddp::mark_block`) go on the
    /// wire while backward runs (on the host path of plain DDP): the same weights either way
    /// (the same buckets, summed after backward when off). No effect on a model that marks
    /// nothing. The run's summary says how much of the communication was hidden.
    pub gradient_overlap: bool,
    /// ZeRO stage: 0 = every rank holds the whole optimizer state (plain DDP); 1 = each
    /// parameter's optimizer state lives on one rank, which steps it and sends the new values
    /// to the others (DeepSpeed's stage 1, PyTorch's `ZeroRedundancyOptimizer`); 2 = and each
    /// rank keeps only its own parameters' gradients: every bucket is reduce-scattered to the
    /// owners (during backward for marked blocks) and the rest dropped (DeepSpeed's stage 2);
    /// 3 = and each rank keeps only a shard of the weights of the blocks the model marks
    /// (`burn_ddp::mark_block`), gathered whole for each block's forward and backward
    /// (DeepSpeed's stage 3, PyTorch's FSDP); its checkpoints are every rank's part
    /// (`trainer consolidate` joins them).
    #[serde(deserialize_with = "zero_stage")]
    pub zero_stage: ZeroStage,
    /// How buffers (BatchNorm running statistics, any `RunningState`, frozen parameters) are
    /// kept equal across ranks after every optimizer step, so that replicas are identical at
    /// every step boundary (replica checks, checkpoints, validation): `"broadcast"` (rank 0's,
    /// PyTorch DDP's default), `"average"` (the mean over the ranks) or `"off"` (each rank
    /// keeps its own; checkpoints hold rank 0's).
    #[serde(with = "burn_ddp::ddp::config_names::buffers")]
    pub sync_buffers: Option<BufferSync>,
    /// Pipeline stages the model is cut into (1: none, plain data parallelism). With `P > 1`
    /// the world size must be a multiple of `P`: `world / P` replicas of the pipeline train
    /// data-parallel, and `training.accumulation_steps` is the micro-batch count. Needs a
    /// program that says how its model splits ([`StageSplit`](crate::engine::pipeline::StageSplit)).
    pub pipeline_stages: usize,
    /// The order of micro-batches on each stage: `"gpipe"` (every micro-batch forward, then
    /// every one backward) or `"1f1b"` (one forward, one backward: fewer activations held,
    /// the same bubble and weights); see [`PipelineSchedule`].
    pub pipeline_schedule: PipelineSchedule,
}

/// `distributed.zero_stage` as burn-ddp's serde reads it (a number, then
/// [`ZeroStage::try_from`]), with the key named in the refusal of another number (serde's
/// message knows the value only): `distributed.zero_stage must be 0 (plain DDP), 1 ...`.
fn zero_stage<'de, D: Deserializer<'de>>(d: D) -> Result<ZeroStage, D::Error> {
    ZeroStage::try_from(u8::deserialize(d)?)
        .map_err(|e| D::Error::custom(format_args!("distributed.zero_stage {e}")))
}

impl Default for DistributedConfig {
    /// [`DdpOptions`]' defaults (PyTorch DDP's), and no pipeline.
    fn default() -> Self {
        let ddp = DdpOptions::default();
        Self {
            bucket_cap_mb: ddp.bucket_cap_mb,
            timeout_secs: ddp.timeout.as_secs(),
            stall_warning_secs: ddp.stall_warning.as_secs(),
            gradient_sync: ddp.transport,
            gradient_compression: ddp.compression,
            gradient_overlap: ddp.overlap,
            zero_stage: ddp.zero_stage,
            sync_buffers: ddp.buffers,
            pipeline_stages: 1,
            pipeline_schedule: PipelineSchedule::default(),
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
    ///
    /// Default: on in builds with trainer's cargo feature `plots` (the `trainer` binary's
    /// default), off without it, where `true` is refused.
    pub plots: bool,
    /// Also write TensorBoard event files to `<dir>/tensorboard/` (cargo feature
    /// `tensorboard`).
    pub tensorboard: bool,
}

impl Default for OutputConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("runs/default"),
            device: DeviceKind::Cpu,
            log_samples: false,
            plots: crate::features::Feature::Plots.built(),
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
        // What "auto" means is burn-ddp's (`GradientTransport::resolve`, tested there).
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.distributed.gradient_sync, GradientTransport::Auto);
        let with = |sync: &str, device: &str| {
            parse(&format!(
                "{MINIMAL}\n[distributed]\ngradient_sync = \"{sync}\"\n[output]\ndevice = \"{device}\"\n"
            ))
        };
        assert_eq!(
            with("nccl", "cuda").unwrap().distributed.gradient_sync,
            GradientTransport::Nccl
        );
        assert_eq!(
            with("host", "cuda").unwrap().distributed.gradient_sync,
            GradientTransport::Host
        );
        assert_eq!(
            with("auto", "wgpu").unwrap().distributed.gradient_sync,
            GradientTransport::Auto
        );
        let err = with("nccl", "cpu").unwrap_err();
        assert!(matches!(err, ConfigError::Invalid { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("distributed.gradient_sync") && msg.contains("cpu"),
            "{msg}"
        );
        assert_eq!(
            msg,
            "config file test.toml: distributed.gradient_sync = \"nccl\" needs output.device = \"cuda\" (got \"cpu\"); use \"auto\" or \"host\""
        );
        let err = with("gloo", "cpu").unwrap_err().to_string();
        assert!(err.contains("gloo"), "{err}");
        assert!(
            err.contains("expected one of `auto`, `host`, `nccl`"),
            "{err}"
        );
    }

    #[test]
    fn gradient_compression_names() {
        let with = |value: &str| {
            parse(&format!(
                "{MINIMAL}\n[distributed]\ngradient_compression = \"{value}\"\n"
            ))
            .map(|c| c.distributed.gradient_compression)
        };
        assert_eq!(with("none").unwrap(), None);
        assert_eq!(with("bf16").unwrap(), Some(HalfFormat::Bf16));
        assert_eq!(with("fp16").unwrap(), Some(HalfFormat::F16));
        let err = with("fp8").unwrap_err().to_string();
        assert!(err.contains("fp8") && err.contains("bf16"), "{err}");
        let default = parse(MINIMAL).unwrap();
        assert_eq!(default.distributed.gradient_compression, None);
    }

    #[test]
    fn zero_stage_is_0_to_3_and_another_is_refused_naming_the_key() {
        let with =
            |stage: &str| parse(&format!("{MINIMAL}\n[distributed]\nzero_stage = {stage}\n"));
        assert_eq!(
            parse(MINIMAL).unwrap().distributed.zero_stage,
            ZeroStage::Off
        );
        assert_eq!(with("0").unwrap().distributed.zero_stage, ZeroStage::Off);
        assert_eq!(
            with("1").unwrap().distributed.zero_stage,
            ZeroStage::OptimizerState
        );
        assert_eq!(
            with("2").unwrap().distributed.zero_stage,
            ZeroStage::Gradients
        );
        assert_eq!(
            with("3").unwrap().distributed.zero_stage,
            ZeroStage::Parameters
        );
        let err = parse(&format!(
            "{MINIMAL}\n[distributed]\nzero_stage = 3\npipeline_stages = 2\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(err.contains("pipeline_stages = 2"), "{err}");
        for stage in [4, 5] {
            let err = with(&stage.to_string()).unwrap_err();
            assert!(matches!(err, ConfigError::Parse { .. }), "{err}");
            let msg = err.to_string();
            assert!(
                msg.contains(&format!(
                    "distributed.zero_stage must be 0 (plain DDP), 1 (sharded optimizer state), 2 (sharded gradients and optimizer state) or 3 (sharded parameters, gradients and optimizer state), got {stage}"
                )) && msg.contains("test.toml"),
                "{msg}"
            );
        }
        let err = with("-1").unwrap_err().to_string();
        assert!(err.contains("zero_stage = -1"), "{err}");
    }

    #[test]
    fn buffer_rules_and_pipeline_schedules_by_name() {
        let with = |key: &str, value: &str| {
            parse(&format!("{MINIMAL}\n[distributed]\n{key} = \"{value}\"\n"))
                .map(|c| c.distributed)
        };
        let rule = |value| with("sync_buffers", value).map(|d| d.sync_buffers);
        assert_eq!(
            rule("broadcast").unwrap(),
            Some(BufferSync::Broadcast { root: 0 })
        );
        assert_eq!(rule("average").unwrap(), Some(BufferSync::Average));
        assert_eq!(rule("off").unwrap(), None);
        let err = rule("mean").unwrap_err().to_string();
        assert!(err.contains("mean") && err.contains("average"), "{err}");
        let schedule = |value| with("pipeline_schedule", value).map(|d| d.pipeline_schedule);
        assert_eq!(schedule("gpipe").unwrap(), PipelineSchedule::GPipe);
        assert_eq!(
            schedule("1f1b").unwrap(),
            PipelineSchedule::OneForwardOneBackward
        );
        let err = schedule("zb").unwrap_err().to_string();
        assert!(err.contains("zb") && err.contains("1f1b"), "{err}");
        let err = parse(&format!("{MINIMAL}\n[distributed]\npipeline_stages = 0\n"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("distributed.pipeline_stages must be at least 1"),
            "{err}"
        );
    }

    #[test]
    fn distributed_spellings_are_stable_both_ways() {
        // The JSON of the fingerprint: the names of every value, as configs write them.
        let default = DistributedConfig::default();
        assert_eq!(
            serde_json::to_string(&default).unwrap(),
            r#"{"bucket_cap_mb":25.0,"timeout_secs":300,"stall_warning_secs":60,"gradient_sync":"auto","gradient_compression":"none","gradient_overlap":true,"zero_stage":0,"sync_buffers":"broadcast","pipeline_stages":1,"pipeline_schedule":"gpipe"}"#
        );
        let other = DistributedConfig {
            gradient_sync: GradientTransport::Nccl,
            gradient_compression: Some(HalfFormat::F16),
            gradient_overlap: false,
            zero_stage: ZeroStage::Gradients,
            sync_buffers: None,
            pipeline_stages: 2,
            pipeline_schedule: PipelineSchedule::OneForwardOneBackward,
            ..default
        };
        let text = toml::to_string(&other).unwrap();
        for line in [
            "gradient_sync = \"nccl\"",
            "gradient_compression = \"fp16\"",
            "gradient_overlap = false",
            "zero_stage = 2",
            "sync_buffers = \"off\"",
            "pipeline_schedule = \"1f1b\"",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        assert_eq!(toml::from_str::<DistributedConfig>(&text).unwrap(), other);
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
