//! The all-reduce check: N real local ranks, started by the launcher ([`launch::launch`]) as
//! `trainer doctor --allreduce-worker DIR`, form the job's kind of group (TCP ring, with shared
//! memory between them unless `BURN_DDP_SHM=0`), run about a second of 4 MiB all-reduces, check
//! one result, and each write a [`RankReport`] to `DIR/rank-N.json`. [`super::checks::allreduce`]
//! judges them.
//!
//! Deadlines, innermost first: set-up and each collective [`GROUP_TIMEOUT`]; a rank still
//! running after [`RANK_DEADLINE`] reports that and exits (the launcher then stops the others);
//! the doctor waits [`RUN_DEADLINE`] for the launcher, and past it reports the check as failed
//! (the ranks die with the doctor: the launcher gives them `PR_SET_PDEATHSIG`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use burn_ddp::{Distributed, ProcessGroup, ReduceOp, TcpGroupOptions};

use super::checks::{AllReduceRun, RankReport};
use crate::error::describe_error;
use crate::launcher::launch::{self, LaunchArgs, Program};
use crate::launcher::nodes::NodeRange;
use crate::launcher::worker_env::RANK_VAR;

/// Elements of each all-reduce: 4 MiB of `f32`, the order of a gradient bucket.
const ELEMENTS: usize = 1 << 20;
/// About how long the timed all-reduces run.
const MEASURE: Duration = Duration::from_secs(1);
/// At most this many timed all-reduces (a very fast machine stops here before [`MEASURE`]).
const MAX_ITERATIONS: usize = 100_000;
/// Deadline of the group's set-up and of each collective.
const GROUP_TIMEOUT: Duration = Duration::from_secs(20);
/// A rank that has not finished by then reports so and exits.
const RANK_DEADLINE: Duration = Duration::from_secs(30);
/// How long the doctor waits for the launcher: a rank's deadline, the launcher's grace period
/// for stopping the other ranks (10 s), and a margin.
const RUN_DEADLINE: Duration = Duration::from_secs(45);

/// The hidden option that makes `trainer doctor` one rank of this check.
pub const WORKER_FLAG: &str = "--allreduce-worker";

/// Runs the check across `ranks` local processes. Blocks for at most [`RUN_DEADLINE`].
pub fn run(ranks: usize) -> AllReduceRun {
    let failed = |problem: String| AllReduceRun::Ran {
        ranks,
        reports: Vec::new(),
        problem: Some(problem),
    };
    let unique = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = std::env::temp_dir().join(format!("trainer-doctor-{}-{unique}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        return failed(format!("cannot create {}: {e}", dir.display()));
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return failed(format!("cannot find this program's path: {e}")),
    };
    let program = Program {
        exe,
        args: vec![
            OsString::from("doctor"),
            OsString::from(WORKER_FLAG),
            dir.clone().into_os_string(),
        ],
    };
    // Loopback and a port the OS picks: this check never collides with a job.
    let args = LaunchArgs {
        nproc_per_node: Some(ranks),
        nnodes: NodeRange::exactly(1),
        master_addr: Some("127.0.0.1".into()),
        ..LaunchArgs::default()
    };
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(launch::launch(&args, &program).map_err(|e| describe_error(&e)));
    });
    let problem = match rx.recv_timeout(RUN_DEADLINE) {
        Ok(Ok(code)) if code == ExitCode::SUCCESS => None,
        Ok(Ok(_)) => Some("a rank failed (the launcher's report is above)".into()),
        Ok(Err(e)) => Some(format!("the ranks could not be launched: {e}")),
        Err(_) => Some(format!(
            "no result within {} s (set-up or an all-reduce hung)",
            RUN_DEADLINE.as_secs()
        )),
    };
    let reports = (0..ranks).map(|rank| read_report(&dir, rank)).collect();
    let _ = std::fs::remove_dir_all(&dir);
    AllReduceRun::Ran {
        ranks,
        reports,
        problem,
    }
}

/// One rank of the check (`trainer doctor --allreduce-worker DIR`, started by [`run`]): writes
/// its [`RankReport`] to `DIR/rank-N.json`, and exits 1 when it failed.
pub fn worker(dir: &Path) -> anyhow::Result<ExitCode> {
    let rank = std::env::var(RANK_VAR)
        .ok()
        .and_then(|r| r.parse::<usize>().ok())
        .context(
            "trainer doctor --allreduce-worker runs as a rank of the doctor's launcher only",
        )?;
    let path = report_path(dir, rank);
    let late = path.clone();
    std::thread::spawn(move || {
        std::thread::sleep(RANK_DEADLINE);
        let why = format!(
            "no result within {} s (set-up or an all-reduce hung)",
            RANK_DEADLINE.as_secs()
        );
        let _ = write_report(&late, &failure(rank, why));
        std::process::exit(1);
    });
    let report = measure().unwrap_or_else(|e| failure(rank, describe_error(&e)));
    write_report(&path, &report)?;
    Ok(if report.error.is_none() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Forms the group from the launcher's variables and times the all-reduces. Collective: every
/// rank makes the same calls in the same order (when to stop timing is agreed on).
fn measure() -> anyhow::Result<RankReport> {
    let options = TcpGroupOptions {
        timeout: GROUP_TIMEOUT,
        ..Default::default()
    };
    let mut dist = Distributed::from_env_or_standalone(options)?;
    let group = &mut dist.group;
    let (rank, world) = (group.rank(), group.world_size());
    let mut buf = vec![0f32; ELEMENTS];

    // 1. Warm up: the first calls pay for page faults and connection start-up.
    for _ in 0..2 {
        group.all_reduce(&mut buf, ReduceOp::Sum)?;
    }
    // 2. Time rounds of all-reduces (1, then as many as the time left needs, at most doubling)
    //    until MEASURE has passed. The slowest rank's time of each round is agreed on (a max
    //    all-reduce), so every rank sizes its rounds alike and stops after the same one.
    group.barrier()?;
    let (mut iterations, mut seconds, mut round) = (0usize, 0f64, 1usize);
    while seconds < MEASURE.as_secs_f64() && iterations < MAX_ITERATIONS {
        let start = Instant::now();
        for _ in 0..round {
            group.all_reduce(&mut buf, ReduceOp::Sum)?;
        }
        let mut took = [start.elapsed().as_secs_f64()];
        group.all_reduce(&mut took, ReduceOp::Max)?;
        iterations += round;
        seconds += took[0];
        // Enough for the time left at the rate so far, at most twice as many as before (the
        // same on every rank: computed from agreed values).
        let left = MEASURE.as_secs_f64() - seconds;
        let rate = seconds / iterations as f64;
        round = ((left / rate.max(1e-9)).ceil() as usize).clamp(1, 2 * iterations);
    }
    // 4. One result checked: rank r contributes r + 1 everywhere.
    buf.fill((rank + 1) as f32);
    group.all_reduce(&mut buf, ReduceOp::Sum)?;
    let expected = (world * (world + 1) / 2) as f32;
    if let Some(i) = buf.iter().position(|&v| v != expected) {
        bail!(
            "the all-reduce gave {} at element {i}, expected {expected}",
            buf[i]
        );
    }
    group.barrier()?;
    Ok(RankReport {
        rank,
        world_size: world,
        bytes: ELEMENTS * std::mem::size_of::<f32>(),
        iterations,
        seconds,
        error: None,
    })
}

fn failure(rank: usize, error: String) -> RankReport {
    RankReport {
        rank,
        world_size: 0,
        bytes: 0,
        iterations: 0,
        seconds: 0.0,
        error: Some(error),
    }
}

fn report_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.json"))
}

/// Writes `report` whole or not at all (a temporary file, then a rename).
fn write_report(path: &Path, report: &RankReport) -> anyhow::Result<()> {
    let text = serde_json::to_string(report)?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

fn read_report(dir: &Path, rank: usize) -> Option<RankReport> {
    let text = std::fs::read_to_string(report_path(dir, rank)).ok()?;
    serde_json::from_str(&text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_survives_the_round_trip_and_a_missing_one_is_none() {
        let dir = std::env::temp_dir().join(format!("doctor-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let report = failure(3, "rank 1 never joined".into());
        write_report(&report_path(&dir, 3), &report).unwrap();
        assert_eq!(read_report(&dir, 3), Some(report));
        assert_eq!(read_report(&dir, 4), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
