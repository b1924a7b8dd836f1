//! `trainer doctor`: whether this machine and configuration can run a job, and what to fix.

use std::process::ExitCode;

use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct DoctorArgs {}

pub fn doctor_command(args: &DoctorArgs) -> anyhow::Result<ExitCode> {
    let _ = args;
    anyhow::bail!("not yet")
}
