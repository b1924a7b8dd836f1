//! The burn-ddp engine and the `trainer` binary: train any Burn model data-parallel, one
//! process per CPU rank or GPU.
//!
//! **Bring your own model** (three ways in, see `docs/bring-your-own-model.md`):
//! 1. your own binary, the whole CLI: implement the one trait [`app::App`] and call
//!    [`run::main_with`] with [`program_info!`] (its `--help` and `--version` name your
//!    binary; [`run::main_with_stages`] for a model that also trains as pipeline stages)
//!    (compiled example: `examples/custom-model/`);
//! 2. your own loop: [`burn_ddp::DataParallel`] (compiled example: `burn-ddp/examples/own_loop.rs`);
//! 3. the built-in models: `trainer --config configs/digits-mlp.toml`.
//!
//! | module | owns |
//! |---|---|
//! | [`app`] | the user's contract, one trait: `App` (config tables, data sets, model, batcher, metrics) |
//! | [`run`] | tier 1: an app's whole command line (train, launch, eval); `main_with_stages` with a pipeline split |
//! | [`pipeline`] | pipeline stages: how a model splits (`StageSplit`, `StageOf`), the pipeline step kind of the one loop, stage checkpoints |
//! | `parallel` | `[distributed]` as `burn_ddp::DdpOptions`, and the collectives of the engine's checkpoints (latest, save: rank 0 writes, the others wait) |
//! | `fit` | the one training loop, over step kinds (data parallel, pipeline stages), and the events its reporter consumes |
//! | `eval` | validation over every sample once, and the `eval` command |
//! | `preflight` | the check before any rank starts: config, app tables, device; never the data |
//! | `plan` | the step plan (pure): steps, logs, checkpoints, validations |
//! | `schedule` | the learning-rate schedule: a Burn `LrScheduler` whose state is checkpointed |
//! | `loader` | items read ahead of the training thread (`training.num_workers`) |
//! | `backend` | every device and cargo feature: the run-time training device, what the doctor needs to know of the devices |
//! | [`config`] | the engine's TOML sections, one default per field, validation |
//! | `checkpoint` | rank-0 checkpoints: atomic save, manifest, resume |
//! | [`metrics`] | burn-train metrics summed across ranks with counts, progress bar, metrics file |
//! | `record` | the records of `metrics.jsonl` (the schema TensorBoard files and charts read back) |
//! | `launch` | spawning and supervising local ranks (`--nproc-per-node`, `trainer launch`), like torchrun |
//! | `launch_plan` | the launcher's pure decisions: ranks, each rank's environment, threads, port |
//! | `limits` | this machine's limits (open files, threads, kernel tasks) against a job: the launcher refuses, the doctor shows |
//! | `worker_env` | the launcher ↔ worker contract: every environment variable and rendezvous key |
//! | `orphan` | a rank started by another launcher (torchrun, mpirun, srun) dies with it |
//! | `ranklog` | each rank's stderr, tagged and kept for the failure report |
//! | `error` | `UsageError` (exit code 2), error reports and exit codes |
//! | `fault_injection` | crashes, stalls and stragglers asked for by tests' environment variables |
//! | [`builtin`] | the reference models as apps: classifiers on digits, regression, transformer text |
//! | `data` | the digits and synthetic classification data, batching |
//! | `sources` | the user's data for the built-in apps: CSV, SQLite (burn-dataset's format), image folders, read per shard |
//! | `tools` | collective self-test and all-reduce benchmark |
//! | `torchelastic` | torchrun's error file, written by a failing rank |
//! | `bench` | the engine's overhead and scaling benchmark, ZeRO stages and peak memory |
//! | `bench_link` | training between network namespaces on a shaped link, against the link's bounds |
//! | `throughput` | samples per second since the last log line, validation left out |
//! | `timing` | where each step's time goes, per rank and across ranks (pure) |
//! | [`plot`] | PNG charts of a run from its metrics file |
//! | `tensorboard` | the metrics records as TensorBoard event files (`output.tensorboard`) |
//! | `doctor` | `trainer doctor`: can this machine and config run a job, and what to fix |
//! | [`cli`] | the `trainer` binary's command line (imported by `main` only) |

// The public API is what users and the `trainer` binary need: `app`, `run`, `pipeline`,
// `metrics`, `config` (the TOML schema) and `alloc` (with `program_info!`), burn-ddp itself, the
// reference models as apps (`builtin`) and the charts of a run (`plot`), and `cli` for the
// binary. The rest is the engine, private.

/// burn-ddp, as this engine is built with it: `trainer::burn_ddp::SyncBatchNorm` and the rest
/// without a second dependency, and without the risk of two builds of it in one program.
pub use burn_ddp;
pub mod alloc;
pub mod app;
mod backend;
mod bench;
mod bench_link;
pub mod builtin;
mod checkpoint;
pub mod cli;
pub mod config;
mod data;
mod doctor;
mod error;
mod eval;
mod fault_injection;
mod fit;
mod launch;
mod launch_plan;
mod limits;
mod loader;
mod memory;
pub mod metrics;
mod orphan;
mod parallel;
pub mod pipeline;
mod plan;
pub mod plot;
mod preflight;
mod ranklog;
mod record;
pub mod run;
mod schedule;
mod sources;
mod tensorboard;
mod throughput;
mod timing;
mod tools;
mod torchelastic;
mod worker_env;
