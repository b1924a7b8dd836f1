//! Fault injection for tests: the rank's fault plan, read from the environment once, at the
//! rank's start ([`install`]), and acted on at burn-ddp's named fault points
//! ([`burn_ddp::fault`]): the one seam through which a test reaches production code. A run
//! without the variables (named in [`crate::launcher::worker_env`]) has an empty plan, and
//! every point is a no-op.
//!
//! Besides the faults (crash, freeze, stall at a point), the plan holds a test's scenario
//! settings that the loop asks for as data: a scripted resize (`TRAINER_LEAVE_AFTER_STEP`,
//! `TRAINER_JOIN_AFTER_STEP`), a straggler (`TRAINER_SLOW_STEP`) and unequal initial weights
//! (`TRAINER_SEED_BY_RANK`). What to do is decided by pure functions (unit-tested here).

use std::sync::OnceLock;
use std::time::Duration;

use burn_ddp::fault::{FaultPoint, JoinStage};

use crate::launcher::worker_env::{
    restart_count, CRASH_AFTER_STEP_VAR, CRASH_IN_CHECKPOINT_VAR, CRASH_IN_STEP_VAR,
    CRASH_RANK_VAR, CRASH_WHILE_ADMITTING_VAR, CRASH_WHILE_JOINING_VAR, CRASH_WHILE_REGROUPING_VAR,
    FREEZE_AFTER_STEP_VAR, JOIN_AFTER_STEP_VAR, LEAVE_AFTER_STEP_VAR, RANK_VAR, SEED_BY_RANK_VAR,
    SLOW_STEP_VAR, STALL_AFTER_STEP_VAR, STALL_RANK_VAR,
};

/// The rank's fault plan: what its variables asked for, resolved for this attempt.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct FaultPlan {
    /// The rank this process was launched as (`RANK`): the faults name processes, which keep
    /// their launch rank when the job re-forms without a lost rank.
    launch_rank: Option<usize>,
    /// `TRAINER_CRASH_AFTER_STEP` (and `TRAINER_CRASH_RANK`) for this attempt: the step, the
    /// rank (`None`: every rank), and the variable's value for the message.
    crash_after_step: Option<(usize, Option<usize>, String)>,
    /// `TRAINER_CRASH_IN_STEP=STEP` with `TRAINER_CRASH_RANK=R[+R…]` (`None`: every rank);
    /// first attempt only.
    crash_in_step: Option<(usize, Option<Vec<usize>>)>,
    /// `TRAINER_CRASH_IN_CHECKPOINT=STEP`; first attempt only.
    crash_in_checkpoint: Option<usize>,
    /// `TRAINER_CRASH_WHILE_JOINING=asked|admitted`; on the first restart only.
    crash_while_joining: Option<JoinStage>,
    /// `TRAINER_CRASH_WHILE_REGROUPING=R`; first attempt only.
    crash_while_regrouping: Option<usize>,
    /// `TRAINER_CRASH_WHILE_ADMITTING=R`; first attempt only.
    crash_while_admitting: Option<usize>,
    /// `TRAINER_FREEZE_AFTER_STEP=STEP:R`: rank R stops itself (`SIGSTOP`) after step STEP and
    /// never resumes; first attempt only.
    freeze_after_step: Option<(usize, usize)>,
    /// `TRAINER_STALL_AFTER_STEP=STEP:SECS` (with `TRAINER_STALL_RANK=R`: that rank only).
    stall_after_step: Option<(usize, f64, Option<usize>, String)>,
    /// `TRAINER_LEAVE_AFTER_STEP=STEP:R[+R…]`: the scripted resize.
    leave_after_step: Option<(usize, Vec<usize>)>,
    /// `TRAINER_JOIN_AFTER_STEP=STEP`: the scripted grow.
    join_after_step: Option<usize>,
    /// `TRAINER_SLOW_STEP=RANK:MS`: a straggler.
    slow_step: Option<(usize, u64)>,
    /// `TRAINER_SEED_BY_RANK=1`.
    seed_by_rank: bool,
}

static PLAN: OnceLock<FaultPlan> = OnceLock::new();

/// Reads this rank's fault plan from the environment and installs it at burn-ddp's fault
/// points; the first call does, later ones return the same plan. Called once at the rank's
/// start, before it joins the job.
pub(crate) fn install() -> &'static FaultPlan {
    PLAN.get_or_init(|| {
        let plan = FaultPlan::from_lookup(|name| std::env::var(name).ok(), restart_count());
        if plan != FaultPlan::default() {
            let acting = plan.clone();
            burn_ddp::fault::install(Box::new(move |point| acting.at(point)));
        }
        plan
    })
}

/// This rank's fault plan ([`install`]).
pub(crate) fn plan() -> &'static FaultPlan {
    install()
}

impl FaultPlan {
    /// The plan the variables `lookup` reads ask for, at the launcher's restart count
    /// `attempt`; values that do not parse ask for nothing. Pure.
    pub(crate) fn from_lookup(lookup: impl Fn(&str) -> Option<String>, attempt: u64) -> Self {
        let number = |var: &str| lookup(var).and_then(|v| v.trim().parse::<usize>().ok());
        let first = attempt == 0;
        let crash_rank = lookup(CRASH_RANK_VAR);
        let crash_after_step = lookup(CRASH_AFTER_STEP_VAR).and_then(|steps| {
            let (step, rank) = crash_point(&steps, crash_rank.as_deref(), attempt)?;
            Some((step, rank, steps))
        });
        let crash_in_step = number(CRASH_IN_STEP_VAR).filter(|_| first).map(|step| {
            let ranks = crash_rank.as_deref().map(|list| {
                list.split('+')
                    .filter_map(|r| r.trim().parse().ok())
                    .collect()
            });
            (step, ranks)
        });
        let crash_while_joining = lookup(CRASH_WHILE_JOINING_VAR)
            .and_then(|stage| match stage.trim() {
                "asked" => Some(JoinStage::Asked),
                "admitted" => Some(JoinStage::Admitted),
                _ => None,
            })
            .filter(|_| attempt == 1);
        let stall_after_step = lookup(STALL_AFTER_STEP_VAR).and_then(|spec| {
            let (at, secs) = spec.split_once(':')?;
            let (at, secs) = (at.parse().ok()?, secs.parse().ok()?);
            Some((at, secs, number(STALL_RANK_VAR), spec))
        });
        let slow_step = lookup(SLOW_STEP_VAR).and_then(|spec| {
            let (who, millis) = spec.split_once(':')?;
            Some((who.trim().parse().ok()?, millis.trim().parse().ok()?))
        });
        Self {
            launch_rank: number(RANK_VAR),
            crash_after_step,
            crash_in_step,
            crash_in_checkpoint: number(CRASH_IN_CHECKPOINT_VAR).filter(|_| first),
            crash_while_joining,
            crash_while_regrouping: number(CRASH_WHILE_REGROUPING_VAR).filter(|_| first),
            crash_while_admitting: number(CRASH_WHILE_ADMITTING_VAR).filter(|_| first),
            freeze_after_step: lookup(FREEZE_AFTER_STEP_VAR)
                .and_then(|spec| step_and_ranks(&spec))
                .and_then(|(step, ranks)| match ranks[..] {
                    [rank] => Some((step, rank)),
                    _ => None,
                })
                .filter(|_| first),
            stall_after_step,
            leave_after_step: lookup(LEAVE_AFTER_STEP_VAR).and_then(|spec| step_and_ranks(&spec)),
            join_after_step: number(JOIN_AFTER_STEP_VAR),
            slow_step,
            seed_by_rank: lookup(SEED_BY_RANK_VAR).is_some_and(|v| v.trim() == "1"),
        }
    }

    /// The rank this process was launched as, else `rank` (of the current group).
    fn launch_rank(&self, rank: usize) -> usize {
        self.launch_rank.unwrap_or(rank)
    }

    /// What the plan does at fault point `point`: kill, freeze or stall this process, or
    /// nothing.
    fn at(&self, point: FaultPoint) {
        match point {
            FaultPoint::InStep { rank, step } => self.in_step(self.launch_rank(rank), step),
            FaultPoint::AfterStep { rank, step } => self.after_step(self.launch_rank(rank), step),
            FaultPoint::InCheckpoint { step } => {
                if self.crash_in_checkpoint == Some(step) {
                    kill_self(&format!(
                        "{CRASH_IN_CHECKPOINT_VAR}={step}: killing this process mid-checkpoint"
                    ));
                }
            }
            FaultPoint::Joining(stage) => {
                if self.crash_while_joining == Some(stage) {
                    kill_self(&format!(
                        "{CRASH_WHILE_JOINING_VAR}={}: killing this joining process",
                        stage.name()
                    ));
                }
            }
            FaultPoint::Regrouping => self.crash_if_named(
                self.crash_while_regrouping,
                CRASH_WHILE_REGROUPING_VAR,
                "while the survivors re-form",
            ),
            FaultPoint::Admitting => self.crash_if_named(
                self.crash_while_admitting,
                CRASH_WHILE_ADMITTING_VAR,
                "while the members admit joiners",
            ),
        }
    }

    /// `TRAINER_CRASH_IN_STEP`: killed in the middle of the step (its gradients computed, not
    /// yet summed).
    fn in_step(&self, rank: usize, step: usize) {
        let Some((at, ranks)) = &self.crash_in_step else {
            return;
        };
        if *at == step && ranks.as_ref().is_none_or(|r| r.contains(&rank)) {
            kill_self(&format!(
                "[rank {rank}] {CRASH_IN_STEP_VAR}={step}: killing this process in the middle of step {step}"
            ));
        }
    }

    /// Right after a step and its checkpoint: `TRAINER_CRASH_AFTER_STEP` kills (what
    /// `kill -9` at that point does), `TRAINER_FREEZE_AFTER_STEP` stops the process for good
    /// (what a hung driver or `kill -STOP` does), `TRAINER_STALL_AFTER_STEP` sleeps (the
    /// others wait for this rank in their next collective).
    fn after_step(&self, rank: usize, step: usize) {
        if let Some((at, who, steps)) = &self.crash_after_step {
            if *at == step && who.is_none_or(|r| r == rank) {
                kill_self(&format!(
                    "[rank {rank}] {CRASH_AFTER_STEP_VAR}={steps}: killing this process after step {step}, attempt {}",
                    restart_count()
                ));
            }
        }
        if self.freeze_after_step == Some((step, rank)) {
            eprintln!(
                "[rank {rank}] {FREEZE_AFTER_STEP_VAR}={step}:{rank}: stopping this process (SIGSTOP) after step {step}, never to resume (fault injection)"
            );
            // SAFETY: raise(3) with a signal number; no memory is involved.
            unsafe {
                libc::raise(libc::SIGSTOP);
            }
        }
        if let Some((at, secs, who, spec)) = &self.stall_after_step {
            if *at == step && who.is_none_or(|r| r == rank) {
                eprintln!(
                    "[rank {rank}] {STALL_AFTER_STEP_VAR}={spec}: sleeping (fault injection)"
                );
                std::thread::sleep(Duration::from_secs_f64(*secs));
            }
        }
    }

    /// Kills this process when `named` is the rank it was launched as.
    fn crash_if_named(&self, named: Option<usize>, var: &str, when: &str) {
        let rank = self.launch_rank(usize::MAX);
        if named == Some(rank) {
            kill_self(&format!("[rank {rank}] {var}: killing this process {when}"));
        }
    }

    /// The ranks that leave the job right after optimizer step `step` (the scripted resize),
    /// if any.
    pub(crate) fn leaving_after(&self, step: usize) -> Option<&[usize]> {
        match &self.leave_after_step {
            Some((at, ranks)) if *at == step => Some(ranks),
            _ => None,
        }
    }

    /// The step after which the job admits a joiner, waiting for one (the scripted grow).
    pub(crate) fn join_after_step(&self) -> Option<usize> {
        self.join_after_step
    }

    /// This rank's extra compute time in every optimizer step (a straggler), if any; said
    /// once.
    pub(crate) fn slow_step(&self, rank: usize) -> Option<Duration> {
        let (who, millis) = self.slow_step?;
        (who == rank).then(|| {
            eprintln!(
                "[rank {rank}] {SLOW_STEP_VAR}={who}:{millis}: {millis} ms more compute per step (fault injection)"
            );
            Duration::from_millis(millis)
        })
    }

    /// The seed of the model's initial weights: `training.seed`, or with
    /// `TRAINER_SEED_BY_RANK=1` `training.seed + rank`, so that only the start-up broadcast
    /// makes the replicas equal.
    pub(crate) fn init_seed(&self, seed: u64, rank: usize) -> u64 {
        if !self.seed_by_rank {
            return seed;
        }
        let seeded = seed.wrapping_add(rank as u64);
        eprintln!(
            "[rank {rank}] {SEED_BY_RANK_VAR}=1: initial weights seeded with {seeded} (fault injection)"
        );
        seeded
    }
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

/// `"STEP:R[+R…]"` as the step and its ranks; `None` when it does not parse.
fn step_and_ranks(spec: &str) -> Option<(usize, Vec<usize>)> {
    let (at, ranks) = spec.split_once(':')?;
    let ranks = ranks
        .split('+')
        .map(|r| r.trim().parse::<usize>().ok())
        .collect::<Option<Vec<_>>>()?;
    Some((at.trim().parse().ok()?, ranks))
}

/// Says `what` and kills this process with SIGKILL.
fn kill_self(what: &str) {
    eprintln!("{what} (fault injection)");
    // SAFETY: kill(2) on our own pid with a signal number; no memory is involved.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}

#[cfg(test)]
mod tests;
