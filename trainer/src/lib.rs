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
//! | folder / module | owns |
//! |---|---|
//! | [`app`] | the user's contract, one trait: `App` (config tables, data sets, model, batcher, metrics) |
//! | [`run`] | tier 1: an app's whole command line (train, launch, eval); `main_with_stages` with a pipeline split |
//! | [`config`] | the engine's TOML sections, one default per field, validation |
//! | `engine/` | the training engine: the one loop over step kinds (`fit/`, with the rank's reporter of its events), [`pipeline`] stages, the step plan, schedule, loader, checkpoints, validation, the pre-flight, the memory estimate, fault injection, the training device (`device`, cargo features `wgpu` and `cuda`) |
//! | `launcher/` | spawning and supervising local ranks (`--nproc-per-node`, `trainer launch`, like torchrun): the pure launch plan, the launcher ↔ worker environment contract, this machine's limits, rank logs, orphans, torchrun's error file |
//! | `report/` | what a run reports (below the engine, which consumes its own events into it): [`metrics`] summed across ranks, step times, the `metrics.jsonl` records, TensorBoard files, [`plot`] charts |
//! | `tools/` | tools beside training: `trainer doctor`, the collectives self-test and all-reduce benchmark, the engine's benchmarks (`bench`, `bench_link`) |
//! | `finding` | one check's result and the report they make (the doctor's and the launcher's refusals) |
//! | `features` | the optional parts (`sqlite`, `image-folder`, `plots`, `tensorboard`, all in the default features): whether this build has one, the error naming a missing one, and the rule that places each beside its user with a stand-in |
//! | `error` | `UsageError` (exit code 2), error reports and exit codes |
//! | [`builtin`] | the reference models as apps: classifiers on digits, regression, transformer text |
//! | `data` | the digits and synthetic classification data, batching |
//! | `sources` | the user's data for the built-in apps: CSV, SQLite (burn-dataset's format), image folders, read per shard (SQLite and images behind their cargo features) |
//! | [`alloc`] | allocation failures as a one-line error |
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
pub mod builtin;
pub mod cli;
pub mod config;
mod data;
mod engine;
mod error;
mod features;
mod finding;
mod launcher;
mod report;
pub mod run;
mod sources;
mod tools;

pub use engine::pipeline;
pub use report::{metrics, plot};
