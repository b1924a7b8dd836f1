//! `trainer plot RUN_DIR`: PNG charts of a run from its `metrics.jsonl`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct PlotArgs {
    /// The run's output directory (`output.dir`), holding `metrics.jsonl`.
    pub run_dir: PathBuf,
}

pub fn plot_command(args: &PlotArgs) -> anyhow::Result<ExitCode> {
    let _ = args;
    anyhow::bail!("not yet")
}
