//! Tier 1, "your own binary, the whole CLI": [`main`] turns an [`App`](crate::app::App) into a complete
//! `trainer`-like program. The built-in `trainer` binary is the same thing for the reference
//! models.
//!
//! ```text
//! my-trainer --config cfg.toml                          # one process
//! my-trainer --config cfg.toml --nproc-per-node 4       # 4 local ranks, like torchrun
//! my-trainer --config cfg.toml --nproc-per-node 8 --nnodes 2 --node-rank 0 --master-addr A
//! my-trainer eval --config cfg.toml --checkpoint runs/x/checkpoints
//! ```
//! Under torchrun, SLURM or Open MPI variables (or `trainer launch -- my-trainer ...`) each
//! process is one rank. Exit codes: 0 success, 2 bad input (with a message naming the key or
//! file), 1 other failures, or the failing rank's code from the launcher.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::app::App;
use crate::engine::fit;
use crate::engine::pipeline::{self, StageSplit};
use crate::engine::preflight::{preflight, Splitting};
use crate::error::{describe_error, UsageError};
use crate::launcher::launch::{self, LaunchArgs, Program};
use crate::launcher::worker_env::WORKER_VAR;

/// The training command line shared by `trainer` and every app's binary.
#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// The TOML configuration (see configs/).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Start from scratch even if the checkpoint directory holds checkpoints.
    #[arg(long)]
    pub no_resume: bool,
    #[command(flatten)]
    pub launch: LaunchArgs,
}

/// An app's command line: train (the default), or `eval`.
#[derive(Parser, Debug)]
#[command(
    args_conflicts_with_subcommands = true,
    about = "Trains this program's model (the default) or evaluates a checkpoint; one process, or many ranks with --nproc-per-node (burn-ddp)"
)]
struct AppCli {
    #[command(subcommand)]
    command: Option<AppCommand>,
    #[command(flatten)]
    train: TrainArgs,
}

#[derive(Subcommand, Debug)]
enum AppCommand {
    /// Evaluate a checkpoint on the validation set.
    Eval(EvalArgs),
    /// Join a ZeRO stage-3 checkpoint's shards into one whole checkpoint.
    Consolidate(ConsolidateArgs),
}

/// `consolidate` options.
#[derive(Args, Debug, Clone)]
pub struct ConsolidateArgs {
    /// The run's `checkpoint.dir`: its newest ZeRO stage-3 checkpoint (every rank's part,
    /// under `zero3-world-N/`) is written whole as `step-…/` there, for `eval`, a resume at
    /// any stage, and Burn's own loaders.
    pub checkpoint_dir: PathBuf,
}

/// `consolidate`: prints where the whole checkpoint is.
pub fn consolidate(args: &ConsolidateArgs) -> anyhow::Result<ExitCode> {
    let dir = crate::engine::sharded_checkpoint::consolidate(&args.checkpoint_dir)?;
    println!("consolidated checkpoint: {}", dir.display());
    Ok(ExitCode::SUCCESS)
}

/// `eval` options.
#[derive(Args, Debug, Clone)]
pub struct EvalArgs {
    #[arg(long)]
    pub config: PathBuf,
    /// A checkpoint directory (`.../step-00000120`), or the checkpoint root for the newest.
    #[arg(long)]
    pub checkpoint: PathBuf,
}

/// What a program built on [`main_with`] calls itself in `--help` and `--version`.
/// [`program_info!`](crate::program_info) fills it from the calling crate.
#[derive(Debug, Clone, Copy)]
pub struct ProgramInfo {
    pub name: &'static str,
    pub version: &'static str,
}

/// The [`ProgramInfo`] of the binary being compiled: its name and its crate's version
/// (`CARGO_BIN_NAME`, `CARGO_PKG_VERSION` of the crate that expands it).
#[macro_export]
macro_rules! program_info {
    () => {
        $crate::run::ProgramInfo {
            name: env!("CARGO_BIN_NAME"),
            version: env!("CARGO_PKG_VERSION"),
        }
    };
}

/// The whole CLI for `app`, named after this binary's file and without `--version` (use
/// [`main_with`] and [`program_info!`](crate::program_info) to give yours). Call it from
/// `fn main() -> ExitCode`.
pub fn main<A: App>(app: A) -> ExitCode {
    let name = std::env::args_os()
        .next()
        .map(PathBuf::from)
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "trainer".into());
    let command = AppCli::command().bin_name(name);
    run_app(app, None, command)
}

/// The whole CLI for `app`, as `info` names it: parses the command line, sets up logging, and
/// trains, launches or evaluates. Call it from `fn main() -> ExitCode` as
/// `trainer::run::main_with(MyApp, trainer::program_info!())`.
pub fn main_with<A: App>(app: A, info: ProgramInfo) -> ExitCode {
    run_app(app, None, program_command(info))
}

/// [`main_with`] for an app whose model also trains as pipeline stages
/// (`[distributed] pipeline_stages > 1`), cut as `stages` says. Call it from
/// `fn main() -> ExitCode` as
/// `trainer::run::main_with_stages(MyApp, my_stages(), trainer::program_info!())`.
pub fn main_with_stages<A: App>(app: A, stages: StageSplit<A>, info: ProgramInfo) -> ExitCode {
    run_app(app, Some(stages), program_command(info))
}

fn program_command(info: ProgramInfo) -> clap::Command {
    AppCli::command()
        .name(info.name)
        .bin_name(info.name)
        .version(info.version)
}

fn run_app<A: App>(app: A, stages: Option<StageSplit<A>>, command: clap::Command) -> ExitCode {
    // clap prints usage errors itself and exits with 2.
    let cli = AppCli::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit());
    init_logging();
    report(match cli.command {
        Some(AppCommand::Eval(args)) => {
            crate::engine::eval::evaluate(app, &args.config, &args.checkpoint)
        }
        Some(AppCommand::Consolidate(args)) => consolidate(&args),
        None => match cli.train.config.clone() {
            Some(config) => train_or_launch(app, stages, &config, &cli.train),
            None => Err(UsageError("missing --config FILE (try `--help`)".into()).into()),
        },
    })
}

/// With any launcher option (`--nproc-per-node`, `--nnodes`, `--max-restarts`, …; see
/// [`LaunchArgs::requested`](crate::launcher::launch_plan::LaunchArgs::requested)) and not already a
/// rank: check the config once, then start and supervise the local ranks, each running this
/// same program. Otherwise: train as one rank, data-parallel or, with `pipeline_stages > 1`,
/// as one stage cut by `stages` (refused without it).
pub fn train_or_launch<A: App>(
    app: A,
    stages: Option<StageSplit<A>>,
    config: &Path,
    args: &TrainArgs,
) -> anyhow::Result<ExitCode> {
    let is_worker = std::env::var_os(WORKER_VAR).is_some();
    let splitting = match stages {
        Some(_) => Splitting::Possible,
        None => Splitting::Impossible,
    };
    if args.launch.requested() && !is_worker {
        let ranks_here = args.launch.ranks_here();
        let world_size = ranks_here.saturating_mul(args.launch.nnodes.max);
        let checked = preflight(&app, config, ranks_here, world_size, splitting)?;
        let mut launch_args = args.launch.clone();
        // The config's fault tolerance decides what a rank's failure does to the others.
        launch_args.survivors_continue |= checked
            .fault_tolerance
            .survivors_continue(&checked.distributed);
        launch::launch(&launch_args, &Program::this_process()?)
    } else {
        // Started by another launcher (torchrun, mpirun, srun): die with it. (A parent of pid
        // 1 cannot be told apart from a container's init that started this rank, so that
        // case is not watched.)
        if !is_worker
            && burn_ddp::DistEnv::is_present()
            && !crate::launcher::orphan::die_with_parent()
        {
            tracing::debug!("the parent is pid 0 or 1: not watching for the launcher's death");
        }
        let start = match fit::start(app, config, args.no_resume, splitting) {
            Err(e) if fit::job_ended(&e) => return Ok(fit::ended_before_joining()),
            start => start?,
        };
        match stages {
            Some(stages) if start.config.distributed.pipeline_stages > 1 => {
                pipeline::train(start, stages)
            }
            _ => fit::train(start),
        }
    }
}

/// The exit code of a command's result, printing its error (tagged with the rank) first.
pub fn report(result: anyhow::Result<ExitCode>) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(e) => {
            let rank = burn_ddp::DistEnv::rank_from_env()
                .map(|r| format!("[rank {r}] "))
                .unwrap_or_default();
            let message = describe_error(&e);
            eprintln!("{rank}error: {message}");
            crate::launcher::torchelastic::record_failure(&message);
            ExitCode::from(exit_code(&e))
        }
    }
}

/// Logs go to stderr, tagged with the rank; `RUST_LOG` overrides the level (default: info on
/// rank 0, warnings elsewhere so N ranks do not print N copies of everything).
pub fn init_logging() {
    use tracing_subscriber::EnvFilter;
    // Whichever launcher set the rank: torchrun's RANK, srun's SLURM_PROCID, mpirun's
    // OMPI_COMM_WORLD_RANK.
    let default = match burn_ddp::DistEnv::rank_from_env() {
        None | Some(0) => "info",
        Some(_) => "warn",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .try_init();
}

/// The exit code of a failure: 2 for input problems (the user must fix a command line, config, data or checkpoint), 1 for
/// everything else.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    let usage = e.chain().any(|c| {
        c.is::<UsageError>()
            || c.is::<crate::config::ConfigError>()
            || c.is::<crate::app::AppError>()
            || c.is::<crate::data::DataError>()
            || c.is::<models::ModelError>()
            || c.is::<crate::engine::checkpoint::CheckpointMismatch>()
            || c.is::<burn_ddp::InitError>()
            || c.downcast_ref::<burn_ddp::DdpError>()
                .is_some_and(burn_ddp::DdpError::is_usage)
    });
    if usage {
        2
    } else {
        1
    }
}
