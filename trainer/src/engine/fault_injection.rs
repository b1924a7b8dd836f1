//! Fault injection for tests: crashes, stalls, stragglers and unequal initial weights, each
//! asked for by an environment variable (named in [`crate::launcher::worker_env`]) and read by the rank.
//! A run without those variables is untouched. What to do is decided by pure functions
//! (unit-tested here); the hooks only read the environment and act.

use std::time::Duration;

use crate::launcher::worker_env::{
    CRASH_AFTER_STEP_VAR, CRASH_IN_CHECKPOINT_VAR, CRASH_IN_STEP_VAR, CRASH_RANK_VAR,
    CRASH_WHILE_ADMITTING_VAR, CRASH_WHILE_JOINING_VAR, CRASH_WHILE_REGROUPING_VAR, JOINING_VAR,
    JOIN_AFTER_STEP_VAR, LEAVE_AFTER_STEP_VAR, RANK_VAR, RESTART_COUNT_VAR, SEED_BY_RANK_VAR,
    SLOW_STEP_VAR, STALL_AFTER_STEP_VAR, STALL_RANK_VAR,
};

/// The rank this process was launched as (`RANK`), else `rank`: the crash and stall hooks
/// name processes, which keep their launch rank when the job re-forms without a lost rank.
fn launch_rank(rank: usize) -> usize {
    std::env::var(RANK_VAR)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(rank)
}

/// The launcher's restart count: 0 on the first attempt and without a launcher (ours, or
/// torchrun's `TORCHELASTIC_RESTART_COUNT`).
pub fn restart_count() -> u64 {
    std::env::var(RESTART_COUNT_VAR)
        .or_else(|_| std::env::var("TORCHELASTIC_RESTART_COUNT"))
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Which step attempt `attempt` is killed after, and on which rank (`None`: every rank), from
/// the values of `TRAINER_CRASH_AFTER_STEP` and `TRAINER_CRASH_RANK`: comma-separated lists
/// whose `k`-th entry is for attempt `k` (restart count `k`). One step means the first attempt
/// only; one rank means that rank in every attempt. `None` when attempt `attempt` is not
/// killed or a value does not parse.
pub fn crash_point(
    steps: &str,
    ranks: Option<&str>,
    attempt: u64,
) -> Option<(usize, Option<usize>)> {
    let nth = |list: &str, k: usize| {
        list.split(',')
            .nth(k)
            .map(str::trim)
            .map(str::parse::<usize>)
    };
    let attempt = usize::try_from(attempt).ok()?;
    let step = nth(steps, attempt)?.ok()?;
    let rank = match ranks {
        None => None,
        Some(ranks) if !ranks.contains(',') => Some(ranks.trim().parse().ok()?),
        Some(ranks) => Some(nth(ranks, attempt)?.ok()?),
    };
    Some((step, rank))
}

/// `TRAINER_CRASH_AFTER_STEP` / `TRAINER_CRASH_RANK` ([`crash_point`]): kills this process with
/// SIGKILL right after optimizer step `step` and its checkpoint — exactly what `kill -9` at that
/// point does. A restarted job gets past the steps of earlier attempts.
pub fn crash_after_step_if_asked(rank: usize, step: usize) {
    let Ok(steps) = std::env::var(CRASH_AFTER_STEP_VAR) else {
        return;
    };
    let rank = launch_rank(rank);
    let ranks = std::env::var(CRASH_RANK_VAR).ok();
    let attempt = restart_count();
    if let Some((at, who)) = crash_point(&steps, ranks.as_deref(), attempt) {
        if at == step && who.is_none_or(|r| r == rank) {
            eprintln!(
                "[rank {rank}] {CRASH_AFTER_STEP_VAR}={steps}: killing this process after step {step}, attempt {attempt} (fault injection)"
            );
            kill_self();
        }
    }
}

/// `TRAINER_CRASH_IN_CHECKPOINT=STEP`: kills rank 0 with SIGKILL after it wrote the weights of
/// the checkpoint of step `STEP` and before the checkpoint is complete — a crash in the middle
/// of a checkpoint write. First attempt only.
pub fn crash_in_checkpoint_if_asked(step: usize) {
    let at = std::env::var(CRASH_IN_CHECKPOINT_VAR)
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    if at == Some(step) && restart_count() == 0 {
        eprintln!(
            "{CRASH_IN_CHECKPOINT_VAR}={step}: killing this process mid-checkpoint (fault injection)"
        );
        kill_self();
    }
}

/// `TRAINER_CRASH_IN_STEP=STEP` (with `TRAINER_CRASH_RANK=R[+R…]`: those ranks at once):
/// kills this process with SIGKILL in the middle of optimizer step `step` (its gradients
/// computed, not yet summed). First attempt only.
pub fn crash_in_step_if_asked(rank: usize, step: usize) {
    let rank = launch_rank(rank);
    let at = std::env::var(CRASH_IN_STEP_VAR)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok());
    let who = std::env::var(CRASH_RANK_VAR).ok();
    let named = who
        .as_deref()
        .is_none_or(|list| list.split('+').any(|r| r.trim().parse() == Ok(rank)));
    if at == Some(step) && named && restart_count() == 0 {
        eprintln!(
            "[rank {rank}] {CRASH_IN_STEP_VAR}={step}: killing this process in the middle of step {step} (fault injection)"
        );
        kill_self();
    }
}

/// `TRAINER_LEAVE_AFTER_STEP=STEP:R[+R…]`: the ranks that leave the job right after optimizer
/// step `step` ([`leaving_ranks`]), if any.
pub fn leaving_after_step(step: usize) -> Option<Vec<usize>> {
    let spec = std::env::var(LEAVE_AFTER_STEP_VAR).ok()?;
    leaving_ranks(&spec, step)
}

/// The ranks `spec` (`"STEP:R[+R…]"`) makes leave after step `step`; `None` at another step or
/// when it does not parse.
pub fn leaving_ranks(spec: &str, step: usize) -> Option<Vec<usize>> {
    let (at, ranks) = spec.split_once(':')?;
    if at.trim().parse::<usize>().ok()? != step {
        return None;
    }
    ranks
        .split('+')
        .map(|r| r.trim().parse::<usize>().ok())
        .collect()
}

/// `TRAINER_JOIN_AFTER_STEP=STEP`: the step after which the job admits a joiner, waiting for
/// one (the scripted grow), if any.
pub fn join_after_step() -> Option<usize> {
    std::env::var(JOIN_AFTER_STEP_VAR)
        .ok()
        .and_then(|v| v.trim().parse().ok())
}

/// Where a joining process stands, for [`crash_while_joining_if_asked`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinStage {
    /// It asked the job to admit it and waits for the answer.
    Asked,
    /// It is in the grown group and about to take the training state from rank 0.
    Admitted,
}

impl JoinStage {
    fn name(self) -> &'static str {
        match self {
            JoinStage::Asked => "asked",
            JoinStage::Admitted => "admitted",
        }
    }
}

/// `TRAINER_CRASH_WHILE_JOINING=asked|admitted`: kills this process with SIGKILL at that
/// stage of its join, on its first restart only (the restart after that joins).
pub fn crash_while_joining_if_asked(stage: JoinStage) {
    let asked = std::env::var(CRASH_WHILE_JOINING_VAR).ok();
    if asked.as_deref().map(str::trim) == Some(stage.name()) && restart_count() == 1 {
        eprintln!(
            "{CRASH_WHILE_JOINING_VAR}={}: killing this joining process (fault injection)",
            stage.name()
        );
        kill_self();
    }
}

/// `TRAINER_CRASH_WHILE_REGROUPING=R`: kills this process with SIGKILL when it was launched as
/// rank R, right before it forms the survivors' next group with them; first attempt only.
pub fn crash_while_regrouping_if_asked() {
    crash_if_named(CRASH_WHILE_REGROUPING_VAR, "while the survivors re-form");
}

/// `TRAINER_CRASH_WHILE_ADMITTING=R`: kills this process with SIGKILL when it was launched as
/// rank R, right before it forms the grown group with the joiners due; first attempt only.
pub fn crash_while_admitting_if_asked() {
    crash_if_named(CRASH_WHILE_ADMITTING_VAR, "while the members admit joiners");
}

/// Kills this process with SIGKILL when `var` names the rank it was launched as and it was
/// not restarted; says so with `when`.
fn crash_if_named(var: &str, when: &str) {
    let asked = std::env::var(var).ok();
    let rank = asked
        .as_deref()
        .and_then(|r| r.trim().parse::<usize>().ok());
    if rank.is_some_and(|r| r == launch_rank(usize::MAX)) && restart_count() == 0 {
        eprintln!(
            "[rank {}] {var}: killing this process {when} (fault injection)",
            launch_rank(usize::MAX)
        );
        kill_self();
    }
}

/// Whether the launcher restarted this rank to join the running job (`TRAINER_JOINING=1`;
/// not fault injection, but read here with the launcher's other per-rank word).
pub fn joining() -> bool {
    std::env::var(JOINING_VAR).is_ok_and(|v| v.trim() == "1")
}

fn kill_self() {
    // SAFETY: kill(2) on our own pid with a signal number; no memory is involved.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}

/// `TRAINER_SLOW_STEP=RANK:MS`: rank RANK gets MS more milliseconds of compute in every
/// optimizer step (a straggler). Returns this rank's extra time, if any.
pub fn slow_step_if_asked(rank: usize) -> Option<Duration> {
    let spec = std::env::var(SLOW_STEP_VAR).ok()?;
    let (who, millis) = spec.split_once(':')?;
    let (who, millis) = (
        who.trim().parse::<usize>().ok()?,
        millis.trim().parse::<u64>().ok()?,
    );
    (who == rank).then(|| {
        eprintln!("[rank {rank}] {SLOW_STEP_VAR}={spec}: {millis} ms more compute per step (fault injection)");
        Duration::from_millis(millis)
    })
}

/// The seed of the model's initial weights: `training.seed`, or with `TRAINER_SEED_BY_RANK=1`
/// `training.seed + rank`, so that only the start-up broadcast makes the replicas equal.
pub fn init_seed(seed: u64, rank: usize) -> u64 {
    if std::env::var(SEED_BY_RANK_VAR).is_ok_and(|v| v.trim() == "1") {
        eprintln!(
            "[rank {rank}] {SEED_BY_RANK_VAR}=1: initial weights seeded with {} (fault injection)",
            seed.wrapping_add(rank as u64)
        );
        seed.wrapping_add(rank as u64)
    } else {
        seed
    }
}

/// `TRAINER_STALL_AFTER_STEP=STEP:SECS` (optionally with `TRAINER_STALL_RANK=R`): sleeps right
/// after optimizer step STEP, so the other ranks wait for this one in their next collective.
pub fn stall_if_asked(rank: usize, step: usize) {
    let Ok(spec) = std::env::var(STALL_AFTER_STEP_VAR) else {
        return;
    };
    let rank = launch_rank(rank);
    let parsed = spec
        .split_once(':')
        .and_then(|(at, secs)| Some((at.parse::<usize>().ok()?, secs.parse::<f64>().ok()?)));
    let who = std::env::var(STALL_RANK_VAR)
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    if let Some((at, secs)) = parsed {
        if at == step && who.is_none_or(|r| r == rank) {
            eprintln!("[rank {rank}] {STALL_AFTER_STEP_VAR}={spec}: sleeping (fault injection)");
            std::thread::sleep(Duration::from_secs_f64(secs));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{crash_point, leaving_ranks};

    #[test]
    fn a_scripted_resize_names_its_step_and_ranks() {
        assert_eq!(leaving_ranks("4:1+3", 4), Some(vec![1, 3]));
        assert_eq!(leaving_ranks("4:1", 5), None);
        assert_eq!(leaving_ranks("4:x", 4), None);
    }

    #[test]
    fn one_step_crashes_the_first_attempt_only() {
        assert_eq!(crash_point("15", None, 0), Some((15, None)));
        assert_eq!(crash_point("15", Some("1"), 0), Some((15, Some(1))));
        assert_eq!(crash_point("15", Some("1"), 1), None);
    }

    #[test]
    fn lists_give_each_attempt_its_step_and_rank() {
        let (steps, ranks) = ("10, 25,40", Some("2,0,1"));
        assert_eq!(crash_point(steps, ranks, 0), Some((10, Some(2))));
        assert_eq!(crash_point(steps, ranks, 1), Some((25, Some(0))));
        assert_eq!(crash_point(steps, ranks, 2), Some((40, Some(1))));
        assert_eq!(
            crash_point(steps, ranks, 3),
            None,
            "the last attempt runs through"
        );
        assert_eq!(crash_point(steps, Some("1"), 2), Some((40, Some(1))));
        assert_eq!(
            crash_point(steps, Some("2,0"), 2),
            None,
            "no rank for attempt 2"
        );
    }

    #[test]
    fn values_that_do_not_parse_crash_nothing() {
        assert_eq!(crash_point("x", None, 0), None);
        assert_eq!(crash_point("10,x", None, 1), None);
        assert_eq!(crash_point("10", Some("r"), 0), None);
    }
}
