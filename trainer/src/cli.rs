//! The command line. `trainer --config cfg.toml` trains; with `--nproc-per-node N` it first
//! becomes a launcher that starts N ranks of itself (like `torchrun`); under torchrun, SLURM or
//! Open MPI variables it is one rank of a job started by them.
//!
//! Exit codes: 0 success, 1 failure while running, 2 bad input (command line, config, data,
//! checkpoint), or the failing rank's code when a launcher's rank fails.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::config::ConfigError;
use crate::launch::{self, LaunchArgs};
use crate::tools;
use crate::train;

/// Set by the launcher in its children's environment: "you are a rank, do not launch again".
pub const WORKER_VAR: &str = "TRAINER_WORKER";

#[derive(Parser, Debug)]
#[command(
    name = "trainer",
    version,
    about = "Data-parallel training of Burn models: one process per CPU rank or GPU",
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub train: TrainArgs,
}

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

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Evaluate a checkpoint on the validation set.
    Eval {
        #[arg(long)]
        config: PathBuf,
        /// A checkpoint directory (`.../step-00000120`), or the checkpoint root for the newest.
        #[arg(long)]
        checkpoint: PathBuf,
    },
    /// Run collectives on deterministic data and check every result (a network self-test).
    Collectives(tools::CollectiveArgs),
    /// Print an all-reduce bandwidth table (like nccl-tests) and this machine's ceilings.
    BenchAllreduce(tools::BenchArgs),
    /// Measure the trainer against a plain Burn loop, and scaling from 1 to 2 processes.
    BenchTrain(crate::bench::BenchTrainArgs),
}

/// A problem with the user's input: exit code 2, message only.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

pub fn main() -> ExitCode {
    let cli = Cli::parse(); // clap prints usage errors itself and exits with 2
    init_logging();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            let rank = std::env::var("RANK")
                .map(|r| format!("[rank {r}] "))
                .unwrap_or_default();
            eprintln!("{rank}error: {}", describe_error(&e));
            ExitCode::from(exit_code(&e))
        }
    }
}

/// The error and its causes, each cause once: library errors already include their source in
/// their message, so a cause whose text is already shown is not repeated.
pub fn describe_error(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if !text.contains(&s) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&s);
        }
    }
    text
}

/// 2 for input problems, 1 for everything else.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    let usage = e.chain().any(|c| {
        c.is::<UsageError>()
            || c.is::<ConfigError>()
            || c.is::<crate::data::DataError>()
            || c.is::<models::ModelError>()
            || c.is::<crate::checkpoint::CheckpointMismatch>()
            || c.is::<burn_ddp::InitError>()
            || matches!(
                c.downcast_ref::<burn_ddp::DdpError>(),
                Some(burn_ddp::DdpError::Init(_))
            )
    });
    if usage {
        2
    } else {
        1
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let is_worker = std::env::var_os(WORKER_VAR).is_some();
    match cli.command {
        Some(Command::Eval { config, checkpoint }) => train::evaluate(&config, &checkpoint),
        Some(Command::Collectives(args)) => {
            if args.launch.nproc_per_node.is_some() && !is_worker {
                launch::launch(&args.launch, None)
            } else {
                tools::collectives(&args)
            }
        }
        Some(Command::BenchAllreduce(args)) => {
            if args.launch.nproc_per_node.is_some() && !is_worker {
                launch::launch(&args.launch, None)
            } else {
                tools::bench_allreduce(&args)
            }
        }
        Some(Command::BenchTrain(args)) => crate::bench::bench_train(&args),
        None => {
            let Some(config) = cli.train.config else {
                return Err(
                    UsageError("missing --config FILE (try `trainer --help`)".into()).into(),
                );
            };
            if cli.train.launch.nproc_per_node.is_some() && !is_worker {
                launch::launch(&cli.train.launch, Some(&config))
            } else {
                train::run(&config, cli.train.no_resume)
            }
        }
    }
}

/// Logs go to stderr, tagged with the rank; `RUST_LOG` overrides the level (default: info on
/// rank 0, warnings elsewhere so N ranks do not print N copies of everything).
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let rank = std::env::var("RANK").ok();
    let default = match rank.as_deref() {
        None | Some("0") => "info",
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
