//! The `trainer` binary's command line: the engine's CLI ([`crate::run`]) for the built-in
//! apps ([`crate::builtin`], picked by `[model] name`), plus the tools. Nothing imports this
//! module but `main`.
//!
//! `trainer --config cfg.toml` trains; with `--nproc-per-node N` it first becomes a launcher
//! that starts N ranks of itself (like `torchrun`); under torchrun, SLURM or Open MPI variables
//! it is one rank of a job started by them. `trainer launch -- PROGRAM` launches any program.
//!
//! Exit codes: 0 success, 1 failure while running, 2 bad input (command line, config, data,
//! checkpoint), or the failing rank's code when a launcher's rank fails.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::app::App;
use crate::builtin::{self, WithApp};
use crate::engine::pipeline::StageSplit;
use crate::error::UsageError;
use crate::launcher::launch::{self, Program};
use crate::launcher::worker_env::WORKER_VAR;
use crate::report::plot;
use crate::run::{self, EvalArgs, TrainArgs};
use crate::tools::{bench, collectives as tools, doctor};

#[derive(Parser, Debug)]
#[command(
    name = "trainer",
    version,
    about = "Data-parallel training of Burn models: one process per CPU rank or GPU",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    train: TrainArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Evaluate a checkpoint on the validation set.
    Eval(EvalArgs),
    /// Join a ZeRO stage-3 checkpoint's shards into one whole checkpoint:
    /// `trainer consolidate runs/ckpt`.
    Consolidate(run::ConsolidateArgs),
    /// Run collectives on deterministic data and check every result (a network self-test).
    Collectives(tools::CollectiveArgs),
    /// Print an all-reduce bandwidth table (like nccl-tests) and this machine's ceilings.
    BenchAllreduce(tools::BenchArgs),
    /// Measure the engine against a plain Burn loop, and scaling from 1 to 2 processes.
    BenchTrain(bench::BenchTrainArgs),
    /// Train between network namespaces on a shaped link; samples/s against the link's bounds.
    BenchLink(crate::tools::bench_link::BenchLinkArgs),
    /// Start any program as N supervised ranks, like `torchrun --no-python`:
    /// `trainer launch --nproc-per-node N -- PROGRAM [ARGS...]`.
    Launch(launch::LaunchCommand),
    /// Write PNG charts of a run from its `metrics.jsonl`: `trainer plot runs/digits-mlp`.
    Plot(plot::PlotArgs),
    /// Check, without training, whether this machine and configuration can run a job.
    Doctor(doctor::DoctorArgs),
}

/// The `trainer` binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse(); // clap prints usage errors itself and exits with 2
    run::init_logging();
    run::report(dispatch(cli))
}

fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    let is_worker = std::env::var_os(WORKER_VAR).is_some();
    match cli.command {
        Some(Command::Eval(args)) => {
            struct Eval(EvalArgs);
            impl WithApp for Eval {
                type Output = anyhow::Result<ExitCode>;
                fn run<A: App + Clone>(
                    self,
                    app: A,
                    _stages: Option<StageSplit<A>>,
                ) -> Self::Output {
                    crate::engine::eval::evaluate(app, &self.0.config, &self.0.checkpoint)
                }
            }
            let config = args.config.clone();
            builtin::with_app(&config, Eval(args))?
        }
        Some(Command::Collectives(args)) => {
            if args.launch.requested() && !is_worker {
                launch::launch(&args.launch, &Program::this_process()?)
            } else {
                tools::collectives(&args)
            }
        }
        Some(Command::BenchAllreduce(args)) => {
            if args.launch.requested() && !is_worker {
                launch::launch(&args.launch, &Program::this_process()?)
            } else {
                tools::bench_allreduce(&args)
            }
        }
        Some(Command::BenchTrain(args)) => bench::bench_train(&args),
        Some(Command::BenchLink(args)) => crate::tools::bench_link::bench_link(&args),
        Some(Command::Plot(args)) => plot::plot_command(&args),
        Some(Command::Consolidate(args)) => run::consolidate(&args),
        Some(Command::Doctor(args)) => doctor::doctor_command(&args),
        Some(Command::Launch(cmd)) => launch::launch(&cmd.launch, &Program::resolve(&cmd.program)?),
        None => {
            let Some(config) = cli.train.config.clone() else {
                return Err(
                    UsageError("missing --config FILE (try `trainer --help`)".into()).into(),
                );
            };
            struct Train(PathBuf, TrainArgs);
            impl WithApp for Train {
                type Output = anyhow::Result<ExitCode>;
                fn run<A: App + Clone>(
                    self,
                    app: A,
                    stages: Option<StageSplit<A>>,
                ) -> Self::Output {
                    run::train_or_launch(app, stages, &self.0, &self.1)
                }
            }
            builtin::with_app(&config, Train(config.clone(), cli.train))?
        }
    }
}
