//! The training engine: what runs on every rank between joining the job and leaving it.
//!
//! | module | owns |
//! |---|---|
//! | `fit/` | the one training loop over step kinds (data parallel, pipeline stages), its events |
//! | [`pipeline`] | pipeline stages: how a model splits (`StageSplit`, `StageOf`), the pipeline step kind, stage checkpoints |
//! | `parallel` | `[distributed]` as `burn_ddp::DdpOptions`, and the collectives of the engine's checkpoints (latest, save: rank 0 writes, the others wait) |
//! | `validation` | validation over every sample once, across the ranks |
//! | `eval` | the `eval` command: a checkpoint (or a pipeline's stage checkpoints) validated by one process |
//! | `device` | the device of `output.device` (cargo features `wgpu`, `cuda`), whether this build and machine can run it, the doctor's device facts |
//! | `preflight` | the check before any rank starts: config, app tables, device; never the data |
//! | `plan` | the step plan (pure): steps, logs, checkpoints, validations |
//! | `schedule` | the learning-rate schedule: a Burn `LrScheduler` whose state is checkpointed |
//! | `loader` | items read ahead of the training thread (`training.num_workers`) |
//! | `checkpoint` | rank-0 checkpoints: atomic save, manifest, resume |
//! | `sharded_checkpoint` | ZeRO stage 3's checkpoints: each rank's part, joined or re-cut on resume, consolidated |
//! | `memory` | the memory pre-flight: parameters, optimizer state and activations against the machine |
//! | `throughput` | samples per second since the last log line, validation left out |
//! | `process_age` | how long this process has lived (`/proc`): a restarted rank's report of its way back |
//! | `fault_injection` | crashes, stalls and stragglers asked for by tests' environment variables |

pub(crate) mod checkpoint;
pub(crate) mod device;
pub(crate) mod eval;
pub(crate) mod fault_injection;
pub(crate) mod fit;
pub(crate) mod loader;
pub(crate) mod memory;
pub(crate) mod parallel;
pub mod pipeline;
pub(crate) mod plan;
pub(crate) mod preflight;
pub(crate) mod process_age;
pub(crate) mod schedule;
pub(crate) mod sharded_checkpoint;
pub(crate) mod throughput;
pub(crate) mod validation;
