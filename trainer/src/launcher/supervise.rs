//! The launcher's supervision of its ranks, once started: waiting for them, the first failure
//! stopping the others (and named, its likely cause first), or with `--survivors-continue`
//! each failed rank reported while the others go on, started again to join them while
//! `--max-restarts` lasts, and a rank the job left out ended (fencing); SIGINT and SIGTERM stop
//! every rank. What to start is [`super::launch`]'s.

use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ExitStatus};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::launcher::fencing::Fencing;
use crate::launcher::launch_plan::{LaunchPlan, USAGE_EXIT_CODE};
use crate::launcher::ranklog::RankLog;

/// How long ranks get to exit after SIGTERM before SIGKILL.
const GRACE: Duration = Duration::from_secs(10);

/// A started rank: its process and, when its stderr is piped, the forwarder of its lines.
pub(super) struct Rank {
    pub(super) local_rank: usize,
    pub(super) rank: usize,
    pub(super) child: Child,
    pub(super) log: Option<RankLog>,
    /// Its identity for fencing (`--survivors-continue`).
    pub(super) fence_id: Option<String>,
    /// This launcher ended it because the job left it out.
    pub(super) fenced: bool,
}

/// What `--survivors-continue`'s supervision works with besides the ranks.
pub(super) struct SurvivorSupervision<'a> {
    pub(super) plan: &'a LaunchPlan,
    pub(super) fencing: &'a mut Fencing,
    /// Restarts so far (of one rank each), against `--max-restarts`.
    pub(super) restarts: &'a mut usize,
    /// Starts a failed rank again to join the others: local rank, restart count.
    pub(super) rejoin: &'a mut dyn FnMut(usize, usize, &mut Fencing) -> anyhow::Result<Rank>,
}

/// How a launched group ended.
pub(super) enum Outcome {
    Success,
    /// A rank failed; the others were stopped. `code` is what the launcher exits with.
    Failed {
        code: u8,
    },
    /// The launcher got this signal; every rank was stopped.
    Interrupted(usize),
}

/// Waits for every rank; on the first failure stops the rest and reports it.
///
/// The likely cause is reported first ([`likely_cause_first`]). After an error exit, other
/// ranks get up to [`SETTLE`] to show such a crash before they are stopped.
pub(super) fn supervise(mut children: Vec<Rank>, interrupted: &AtomicUsize) -> Outcome {
    let mut done: Vec<Option<ExitStatus>> = vec![None; children.len()];
    loop {
        if let Some(outcome) = stop_if_interrupted(&mut children, &done, interrupted) {
            return outcome;
        }
        let mut failed: Vec<(usize, ExitStatus)> = Vec::new();
        reap(&mut children, &mut done, &mut failed);
        // A rank that exits with an error may only be reacting to a peer that crashed: the
        // peer's socket or shared memory closed before we could reap it. Give such a crash a
        // moment to show up, so that it, not its messenger, is named as the cause.
        let settle = Instant::now() + SETTLE;
        while !failed.is_empty()
            && failed.iter().all(|(_, status)| status.signal().is_none())
            && done.iter().any(Option::is_none)
            && Instant::now() < settle
        {
            std::thread::sleep(Duration::from_millis(20));
            reap(&mut children, &mut done, &mut failed);
        }
        failed.sort_by_key(likely_cause_first);
        if let Some(&(rank, status)) = failed.first() {
            stop_all(&mut children, &done);
            for &(other, other_status) in &failed[1..] {
                eprintln!(
                    "trainer launcher: rank {other} also failed: {}",
                    describe(other_status)
                );
            }
            // The failing rank's last words come last, where the user looks: every other
            // rank's output is forwarded in full before them.
            let failing = children.iter().position(|r| r.rank == rank);
            let tail = failing
                .and_then(|i| children.swap_remove(i).log)
                .map(RankLog::last_lines);
            flush_logs(children);
            eprintln!(
                "\ntrainer launcher: rank {rank} failed: {}; stopped the other ranks.",
                describe(status)
            );
            match tail {
                Some((_, lines)) if !lines.is_empty() => {
                    eprintln!("---- last lines of rank {rank} ----");
                    for line in lines {
                        eprintln!("{line}");
                    }
                }
                _ => eprintln!("Its messages are above."),
            }
            return Outcome::Failed {
                code: status.code().map(|c| c.clamp(1, 255) as u8).unwrap_or(1),
            };
        }
        if done.iter().all(Option::is_some) {
            flush_logs(children);
            return Outcome::Success;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `--survivors-continue`: waits for every rank; a failed rank is reported as it fails and the
/// others go on without it, and while `--max-restarts` allows it is started again to join
/// them. A rank the job left out (it froze) is ended with SIGKILL, then treated as failed.
/// The job ends as the last rank to exit ends (the survivors' verdict: success, or 2 when too
/// few ranks were left); among ranks that exit together, a failure.
pub(super) fn supervise_survivors(
    mut children: Vec<Rank>,
    interrupted: &AtomicUsize,
    survivors: SurvivorSupervision<'_>,
) -> Outcome {
    let SurvivorSupervision {
        plan,
        fencing,
        restarts,
        rejoin,
    } = survivors;
    let mut done: Vec<Option<ExitStatus>> = vec![None; children.len()];
    let mut last: Option<ExitStatus> = None;
    loop {
        if let Some(outcome) = stop_if_interrupted(&mut children, &done, interrupted) {
            return outcome;
        }
        let before = done.clone();
        let mut failed: Vec<(usize, ExitStatus)> = Vec::new();
        reap(&mut children, &mut done, &mut failed);
        // Of the ranks that exited since the last look, a failure speaks for them; a rank this
        // launcher ended because the job left it out speaks for nobody.
        let mut exited: Vec<ExitStatus> = (done.iter().zip(&before).zip(&children))
            .filter(|(_, child)| !child.fenced)
            .filter_map(|((now, was), _)| now.filter(|_| was.is_none()))
            .collect();
        exited.sort_by_key(ExitStatus::success);
        if let Some(&status) = exited.first() {
            last = Some(status);
        }
        for (rank, status) in failed {
            let still_running = done.iter().filter(|d| d.is_none()).count();
            let how = match children.iter().any(|r| r.rank == rank && r.fenced) {
                true => "ended, left out by the job",
                false => "failed",
            };
            eprintln!(
                "trainer launcher: rank {rank} {how}: {}; {still_running} rank(s) carry on without it (--survivors-continue)",
                describe(status)
            );
            let code = status.code().map(|c| c.clamp(0, 255) as u8);
            if still_running == 0 || !plan.restarts_after(code, *restarts) {
                continue;
            }
            let Some(i) = children.iter().position(|r| r.rank == rank) else {
                continue;
            };
            *restarts += 1;
            match rejoin(children[i].local_rank, *restarts, fencing) {
                Ok(started) => {
                    eprintln!(
                        "trainer launcher: started rank {rank} again to join the others ({} of {} restarts)",
                        *restarts, plan.max_restarts
                    );
                    let old = std::mem::replace(&mut children[i], started);
                    flush_logs(vec![old]);
                    done[i] = None;
                }
                Err(e) => eprintln!("trainer launcher: cannot start rank {rank} again: {e:#}"),
            }
        }
        // After the reap: a rank that exited on its own is never taken for a fenced one.
        end_fenced(&mut children, &done, fencing);
        if done.iter().all(Option::is_some) {
            flush_logs(children);
            return match last {
                Some(status) if !status.success() => Outcome::Failed {
                    code: status.code().map(|c| c.clamp(1, 255) as u8).unwrap_or(1),
                },
                _ => Outcome::Success,
            };
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Ends with SIGKILL each running rank that the job left out (burn-ddp's fencing), saying why;
/// the next reap finds it killed.
fn end_fenced(children: &mut [Rank], done: &[Option<ExitStatus>], fencing: &mut Fencing) {
    let running = children
        .iter()
        .enumerate()
        .filter(|(i, r)| done[*i].is_none() && !r.fenced)
        .filter_map(|(i, r)| Some((i, r.fence_id.as_deref()?)));
    for (i, why) in fencing.left_out(running) {
        let Rank { rank, child, .. } = &mut children[i];
        let rank = *rank;
        eprintln!(
            "trainer launcher: the job left rank {rank} out ({why}); ending it (SIGKILL) so that it cannot hold the job"
        );
        if let Err(e) = child.kill() {
            tracing::warn!("cannot end rank {rank}: {e}");
        }
        children[i].fenced = true;
    }
}

/// When the launcher got a signal: every rank stopped, its output flushed, and the outcome.
fn stop_if_interrupted(
    children: &mut Vec<Rank>,
    done: &[Option<ExitStatus>],
    interrupted: &AtomicUsize,
) -> Option<Outcome> {
    let sig = interrupted.load(Ordering::SeqCst);
    if sig == 0 {
        return None;
    }
    stop_all(children, done);
    flush_logs(std::mem::take(children));
    Some(Outcome::Interrupted(sig))
}

/// The sort key that puts the likely cause of a failure first: a rank killed by a signal (its
/// peers then fail with "connection lost"), then a rank that refused bad input (exit code 2:
/// its peers fail only because it left, and the job must end with 2 and not be restarted),
/// then the lowest rank.
fn likely_cause_first(&(rank, status): &(usize, ExitStatus)) -> (bool, bool, usize) {
    let bad_input = status.code() == Some(i32::from(USAGE_EXIT_CODE));
    (status.signal().is_none(), !bad_input, rank)
}

/// Waits until every rank's forwarded output has reached our stderr (their pipes close when
/// they exit), so that no line is lost when the launcher exits.
fn flush_logs(children: Vec<Rank>) {
    for log in children.into_iter().filter_map(|r| r.log) {
        let _ = log.last_lines();
    }
}

/// How long a rank's error exit waits for a crash of another rank to show (see `supervise`).
const SETTLE: Duration = Duration::from_secs(1);

/// Records the ranks that have exited since the last call; failures go to `failed`.
fn reap(
    children: &mut [Rank],
    done: &mut [Option<ExitStatus>],
    failed: &mut Vec<(usize, ExitStatus)>,
) {
    for (i, Rank { rank, child, .. }) in children.iter_mut().enumerate() {
        if done[i].is_none() {
            match child.try_wait() {
                Ok(Some(status)) => {
                    done[i] = Some(status);
                    if !status.success() {
                        failed.push((*rank, status));
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::warn!("cannot query rank {rank}: {e}"),
            }
        }
    }
}

pub(super) fn stop_all(children: &mut [Rank], done: &[Option<ExitStatus>]) {
    for (i, Rank { child, .. }) in children.iter_mut().enumerate() {
        if done[i].is_none() {
            // SAFETY: kill(2) on our own child's pid; the child has not been reaped (try_wait
            // returned None), so the pid still names it.
            unsafe {
                libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
            }
        }
    }
    let deadline = Instant::now() + GRACE;
    for (i, Rank { child, .. }) in children.iter_mut().enumerate() {
        if done[i].is_some() {
            continue;
        }
        loop {
            match child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// "exit code 3" or "killed by signal 9 (SIGKILL)".
pub fn describe(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exit code {code}");
    }
    match status.signal() {
        Some(sig) => {
            let name = match sig {
                libc::SIGKILL => " (SIGKILL: killed, e.g. by the OOM killer or kill -9)",
                libc::SIGSEGV => " (SIGSEGV: crashed)",
                libc::SIGABRT => " (SIGABRT: aborted)",
                libc::SIGTERM => " (SIGTERM)",
                libc::SIGINT => " (SIGINT)",
                _ => "",
            };
            format!("killed by signal {sig}{name}")
        }
        None => format!("{status}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_crash_then_bad_input_then_the_lowest_rank_is_named_as_the_cause() {
        // Wait statuses as waitpid(2) gives them: exit code in the second byte, signal in the
        // first.
        let exited = |code: i32| ExitStatus::from_raw(code << 8);
        let killed = |signal: i32| ExitStatus::from_raw(signal);
        let first = |mut failed: Vec<(usize, ExitStatus)>| {
            failed.sort_by_key(likely_cause_first);
            failed[0].0
        };
        // Rank 0 lost its peer (exit 1) because rank 1 refused its data file (exit 2): the
        // job ends with 2, unretried.
        assert_eq!(first(vec![(0, exited(1)), (1, exited(2))]), 1);
        assert_eq!(
            first(vec![(0, exited(1)), (2, exited(2)), (1, killed(9))]),
            1
        );
        assert_eq!(first(vec![(3, exited(1)), (1, exited(1))]), 1);
        assert_eq!(first(vec![(3, exited(2)), (1, exited(2))]), 1);
    }
}
