//! The real `torchrun` (PyTorch's launcher, named by `TORCHRUN`) starting `trainer` ranks with
//! `--no-python`: the ranks rendezvous through the agent's c10d `TCPStore` (no rank hosts one),
//! train like the trainer's own launcher, survive a restart, and die with torchrun. Without
//! `TORCHRUN` each test records a skip ([`Needs::Torch`]).

use std::path::{Path, PathBuf};
use std::process::Command;

use burn_ddp::testing::{skip, Needs};

use crate::common::*;

/// The path of `torchrun`, or `None` after recording the skip.
pub(crate) fn torchrun_path() -> Option<String> {
    let path = std::env::var("TORCHRUN").ok().filter(|p| !p.is_empty());
    if path.is_none() {
        skip(
            Needs::Torch,
            "TORCHRUN (PyTorch's launcher) is not set: no run under the real torchrun",
        );
    }
    path
}

/// `torchrun --nproc-per-node 2 <torchrun_args> --no-python trainer --config <config>`, with no
/// launcher identity inherited from the environment running the tests.
pub(crate) fn torchrun(torchrun: &str, torchrun_args: &[&str], config: &Path) -> Command {
    let mut cmd = Command::new(torchrun);
    cmd.current_dir(env!("CARGO_MANIFEST_DIR").to_string() + "/..")
        .args(["--nproc-per-node", "2"])
        .args(torchrun_args)
        .arg("--no-python")
        .arg(env!("CARGO_BIN_EXE_trainer"))
        .arg("--config")
        .arg(config)
        .env("PYTHONWARNINGS", "ignore");
    without_launcher_identity(&mut cmd);
    cmd
}

/// The digits run of these tests: Adam, 30 steps, a checkpoint every 10.
fn digits(dir: &Path, name: &str) -> PathBuf {
    let body = digits_config(ADAM, 8, "max_steps = 30").replace(
        "every_epochs = 0",
        "every_epochs = 0\nevery_steps = 10\nkeep_last = 3",
    );
    write_config(dir, name, &body)
}

fn final_line(out: &Output) -> &str {
    out.stdout
        .lines()
        .find(|l| l.starts_with("final validation:"))
        .unwrap_or_else(|| panic!("no final validation line:\n{}", out.all()))
}

/// Trains `name` under torchrun with `torchrun_args` and `env`, and checks that it ends as the
/// trainer's own launcher ends the same config (`reference`): same final validation, same
/// weights. Returns torchrun's output.
fn trains_like_the_trainer(
    dir: &Path,
    torchrun_args: &[&str],
    env: &[(&str, &str)],
    name: &str,
) -> Option<Output> {
    let tr = torchrun_path()?;
    let reference = train(&digits(dir, "reference"), 2);
    let mut cmd = torchrun(&tr, torchrun_args, &digits(dir, name));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = run(&mut cmd);
    assert_eq!(out.code, Some(0), "torchrun failed:\n{}", out.all());
    assert_says(
        &out.stderr,
        &["rendezvous through torchrun's agent store", "attempt-0/"],
        &out,
    );
    assert_eq!(final_line(&out), final_line(&reference), "{}", out.all());
    assert_same_weights(dir, "reference", name, 1e-6);
    Some(out)
}

#[test]
fn torchrun_ranks_train_like_the_trainers_own_launcher() {
    let dir = scratch("torchrun-static");
    trains_like_the_trainer(&dir, &[], &[], "torchrun");
}

#[test]
fn torchrun_with_the_c10d_rendezvous_backend_trains_the_same() {
    let dir = scratch("torchrun-c10d");
    let endpoint = format!("localhost:{}", unused_port());
    trains_like_the_trainer(
        &dir,
        &["--rdzv-backend", "c10d", "--rdzv-endpoint", &endpoint],
        &[],
        "torchrun",
    );
}

/// A rank SIGKILLed after step 15 in the first attempt: torchrun restarts both ranks, which
/// rendezvous again under the next attempt's keys of the same agent store, resume from the
/// checkpoint of step 10, and end with the weights of an uninterrupted run.
#[test]
fn torchrun_restarts_a_killed_rank_and_the_job_resumes_to_the_same_weights() {
    let dir = scratch("torchrun-restart");
    let Some(out) = trains_like_the_trainer(
        &dir,
        &["--max-restarts", "1"],
        &[
            ("TRAINER_CRASH_AFTER_STEP", "15"),
            ("TRAINER_CRASH_RANK", "1"),
        ],
        "restarted",
    ) else {
        return;
    };
    assert_says(
        &out.stderr,
        &[
            "TRAINER_CRASH_AFTER_STEP=15: killing this process",
            "keys under burn-ddp/attempt-1/",
        ],
        &out,
    );
    assert_resumed_at(&out, 10);
}

/// torchrun starts `--no-python` ranks as its own children and has no way to stop them once
/// it is SIGKILLed: the ranks' parent watch must.
#[test]
fn ranks_die_with_a_killed_torchrun() {
    let Some(tr) = torchrun_path() else { return };
    let dir = scratch("torchrun-killed");
    let config = write_config(&dir, "run", &digits_config(SGD, 8, "max_steps = 100"));
    let mut launcher = spawn(torchrun(&tr, &[], &config).env("TRAINER_STALL_AFTER_STEP", "1:600"));
    launcher.wait_for_lines("sleeping (fault injection)", 2);
    let ranks: Vec<u32> = tree_of(launcher.id())
        .into_iter()
        .filter(|&pid| rank_of(pid).is_some())
        .collect();
    kill_launcher_and_expect_gone(&mut launcher, &ranks);
    let out = launcher.finish();
    assert_eq!(out.signal, Some(libc::SIGKILL), "{}", out.all());
    assert_says(&out.stderr, &["is gone: stopping"], &out);
}

/// A rank that fails writes torchrun's error file (`TORCHELASTIC_ERROR_FILE`, the layout of
/// PyTorch's `@record`): torchrun's failure summary names the root cause with our message.
#[test]
fn torchrun_reports_a_failed_ranks_own_message() {
    let Some(tr) = torchrun_path() else { return };
    let dir = scratch("torchrun-error-file");
    let body = digits_config(SGD, 8, "max_steps = 5")
        .replace("path = \"{data}\"", "path = \"no-such-file.csv.gz\"");
    let config = write_config(&dir, "missing", &body);
    let out = run(&mut torchrun(&tr, &[], &config));
    assert_ne!(out.code, Some(0), "{}", out.all());
    // torchrun prints the root cause from the error file; without one it says `<N/A>`.
    assert_says(
        &out.stderr,
        &["Root Cause", "cannot open data file", "no-such-file.csv.gz"],
        &out,
    );
    assert!(!out.stderr.contains("error_file: <N/A>"), "{}", out.all());
}
