//! The configuration's schema: the engine's TOML sections, each field's one default, and the
//! fingerprints compared across ranks.

use std::path::PathBuf;

use burn_ddp::ddp::BufferSync;
use burn_ddp::kernels::HalfFormat;
use burn_ddp::pipeline::PipelineSchedule;
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
    pub fault_tolerance: FaultToleranceConfig,
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
/// ([`PipelineLayout`](burn_ddp::pipeline::PipelineLayout)).
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
    #[serde(with = "burn_ddp::ddp::options::config_names::compression")]
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
    #[serde(with = "burn_ddp::ddp::options::config_names::buffers")]
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

/// `[fault_tolerance]`: what a rank's death does to the job.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct FaultToleranceConfig {
    /// `"restart"` (torchrun's model): the launcher stops every rank, and `--max-restarts`
    /// starts them all again from the newest checkpoint. `"continue"` (torchft's): the other
    /// ranks drop the step in flight, re-form their group without the dead rank, re-shard the
    /// rest of the epoch over themselves and train on, without a restart. With ZeRO stages 1
    /// to 3 a dead rank's shard of the training state is only in the checkpoint, so a failure
    /// still restarts every rank (the run's first lines say so). Not with pipeline stages.
    pub on_rank_failure: OnRankFailure,
    /// The fewest ranks the job trains with (`"continue"`): below it the survivors stop,
    /// exit code 2, saying how many are left.
    pub min_world_size: usize,
    /// The most ranks the job grows to (`"continue"`): a process that asks to join a job this
    /// large is refused, told why. Absent: no bound. The launcher's `--nnodes MIN:MAX` sets
    /// both bounds for its ranks (`MIN` and `MAX` times `--nproc-per-node`), within these.
    pub max_world_size: Option<usize>,
    /// Seconds a rank that lost a peer waits for the other ranks' failure reports before it
    /// names the silent ones dead (1.0, burn-ddp's `DEFAULT_FAILURE_DETECTION`); under
    /// `"continue"` a peer silent for twice this is dead too: how long the survivors stall
    /// before they re-form, about torchft's best measured heartbeat. A live rank slower than
    /// this to notice the failure (a loaded machine) is left out of the re-formed job.
    pub detection_secs: f64,
}

/// `fault_tolerance.on_rank_failure`: see [`FaultToleranceConfig::on_rank_failure`].
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnRankFailure {
    #[default]
    Restart,
    Continue,
}

impl Default for FaultToleranceConfig {
    fn default() -> Self {
        Self {
            on_rank_failure: OnRankFailure::Restart,
            min_world_size: 1,
            max_world_size: None,
            detection_secs: burn_ddp::DEFAULT_FAILURE_DETECTION.as_secs_f64(),
        }
    }
}

impl FaultToleranceConfig {
    /// These settings within a launcher's bounds on the job's world size (`--nnodes MIN:MAX`
    /// tells its ranks `MIN` and `MAX` times `--nproc-per-node`): the larger minimum, the
    /// smaller maximum.
    pub fn within(mut self, min: Option<usize>, max: Option<usize>) -> Self {
        self.min_world_size = self.min_world_size.max(min.unwrap_or(0));
        self.max_world_size = match (self.max_world_size, max) {
            (Some(ours), Some(theirs)) => Some(ours.min(theirs)),
            (ours, theirs) => ours.or(theirs),
        };
        self
    }

    /// Whether the survivors of a failure carry on in this job: `"continue"`, at ZeRO stage 0
    /// (a sharded state is only whole in the checkpoint).
    pub fn survivors_continue(&self, distributed: &DistributedConfig) -> bool {
        self.on_rank_failure == OnRankFailure::Continue
            && !distributed.zero_stage.shards_optimizer_state()
    }
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
