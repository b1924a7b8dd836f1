//! The launcher ↔ worker contract: every environment variable the launcher sets in a rank's
//! environment, and the fault-injection variables the workers read. Nothing else in the
//! trainer should spell these names.
//!
//! The launcher ([`crate::launcher::launch`]) sets each of [`LAUNCHER_VARS`] for every rank it starts,
//! whatever the program (`trainer` itself or `trainer launch -- PROGRAM`); the names and
//! meanings of the first seven are torchrun's, so a worker can equally run under torchrun, and
//! `burn_ddp::env` reads them (or SLURM's / Open MPI's) to form the group.

/// This rank's index in the job, `0..WORLD_SIZE` (`node_rank * LOCAL_WORLD_SIZE + LOCAL_RANK`).
pub const RANK_VAR: &str = "RANK";

/// How many ranks the job has, on every node together.
pub const WORLD_SIZE_VAR: &str = "WORLD_SIZE";

/// This rank's index on its machine, `0..LOCAL_WORLD_SIZE` (picks the GPU, for example).
pub const LOCAL_RANK_VAR: &str = "LOCAL_RANK";

/// How many ranks run on this machine (`--nproc-per-node`).
pub const LOCAL_WORLD_SIZE_VAR: &str = "LOCAL_WORLD_SIZE";

/// This machine's index in the job (`--node-rank`; torchrun's name).
pub const GROUP_RANK_VAR: &str = "GROUP_RANK";

/// The host of the rendezvous store: node 0's address (`--master-addr`).
pub const MASTER_ADDR_VAR: &str = "MASTER_ADDR";

/// The port of the rendezvous store on node 0 (the port the launcher actually bound, also when
/// the OS picked it).
pub const MASTER_PORT_VAR: &str = "MASTER_PORT";

/// The job's secret: the store and the ring refuse peers that do not present it. Taken from the
/// launcher's own environment when set (it must be the same on every node), else generated per
/// job by the launcher.
pub use burn_ddp::init::TOKEN_VAR;

/// `"1"` when the launcher hosts the rendezvous store itself (node 0; torchrun's agent store),
/// so rank 0 does not start one; `"0"` on the other nodes.
pub use burn_ddp::init::AGENT_STORE_VAR;

/// With `--survivors-continue`: this process's identity, unique over the job's life, by which
/// the job asks its launcher to end it once it was left out (burn-ddp's
/// `elastic::fencing`).
pub use burn_ddp::elastic::fencing::FENCE_ID_VAR;

/// Threads per rank for the CPU backend: the machine's cores shared among the local ranks (like
/// torchrun's `OMP_NUM_THREADS`), or the launcher's own value when it has one.
pub const THREADS_VAR: &str = "RAYON_NUM_THREADS";

/// Always `"1"` in a rank's environment: "you are a rank, do not launch again" — a `trainer`
/// started with `--nproc-per-node` then trains instead of launching. Harmless for other programs.
pub const WORKER_VAR: &str = "TRAINER_WORKER";

/// How many times the launcher has restarted the job (`--max-restarts`): `"0"` on the first
/// attempt (torchrun's `TORCHELASTIC_RESTART_COUNT`). Fault injection only fires when it is
/// `"0"` or absent, so a restarted job can succeed.
pub const RESTART_COUNT_VAR: &str = "TRAINER_RESTART_COUNT";

/// `"1"` in the environment of a rank the launcher restarted with `--survivors-continue` (and
/// `--max-restarts`): the job trains on without it, so it joins the job at a step boundary and
/// takes the training state from a live rank (`[fault_tolerance]`), instead of starting it.
pub const JOINING_VAR: &str = "TRAINER_JOINING";

/// The launcher's restart count of this rank ([`RESTART_COUNT_VAR`], or torchrun's
/// `TORCHELASTIC_RESTART_COUNT`): 0 on the first attempt and without a launcher.
pub fn restart_count() -> u64 {
    std::env::var(RESTART_COUNT_VAR)
        .or_else(|_| std::env::var("TORCHELASTIC_RESTART_COUNT"))
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Whether the launcher restarted this rank to join the running job ([`JOINING_VAR`]).
pub fn joining() -> bool {
    std::env::var(JOINING_VAR).is_ok_and(|v| v.trim() == "1")
}

/// With `--nnodes MIN:MAX` only: the fewest ranks the job trains with, `MIN` times
/// `LOCAL_WORLD_SIZE`; a trainer stops below it (exit code 2), as below
/// `fault_tolerance.min_world_size`, whichever is larger.
pub const MIN_WORLD_SIZE_VAR: &str = "TRAINER_MIN_WORLD_SIZE";

/// With `--nnodes MIN:MAX` only: the most ranks the job grows to, `MAX` times
/// `LOCAL_WORLD_SIZE`; a trainer's rank 0 refuses the joiners beyond it, as beyond
/// `fault_tolerance.max_world_size`, whichever is smaller.
pub const MAX_WORLD_SIZE_VAR: &str = "TRAINER_MAX_WORLD_SIZE";

/// This rank's bounds on the job's world size, [`MIN_WORLD_SIZE_VAR`] and
/// [`MAX_WORLD_SIZE_VAR`], each when its launcher set it.
///
/// # Errors
/// A [`UsageError`](crate::error::UsageError) naming the variable when it is not a number.
pub fn world_size_bounds() -> Result<(Option<usize>, Option<usize>), crate::error::UsageError> {
    Ok((
        world_size_bound(MIN_WORLD_SIZE_VAR)?,
        world_size_bound(MAX_WORLD_SIZE_VAR)?,
    ))
}

fn world_size_bound(var: &str) -> Result<Option<usize>, crate::error::UsageError> {
    match std::env::var(var) {
        Err(_) => Ok(None),
        Ok(value) => value.trim().parse().map(Some).map_err(|_| {
            crate::error::UsageError(format!(
                "{var}={value:?} is not a number of ranks (the launcher's --nnodes MIN:MAX sets it)"
            ))
        }),
    }
}

/// Every variable the launcher sets in each rank's environment (the launch plan's tests hold
/// the plan to it).
#[cfg(test)]
pub const LAUNCHER_VARS: [&str; 12] = [
    RANK_VAR,
    WORLD_SIZE_VAR,
    LOCAL_RANK_VAR,
    LOCAL_WORLD_SIZE_VAR,
    GROUP_RANK_VAR,
    MASTER_ADDR_VAR,
    MASTER_PORT_VAR,
    TOKEN_VAR,
    AGENT_STORE_VAR,
    THREADS_VAR,
    WORKER_VAR,
    RESTART_COUNT_VAR,
];

/// Fault injection (tests only; read by the worker, never set by the launcher): SIGKILL the
/// rank right after optimizer step N and its checkpoint, on the first attempt only (see
/// [`RESTART_COUNT_VAR`]) — what `kill -9` at that point does. A list `N0,N1,…` kills attempt
/// `k` after step `Nk` (`crate::engine::fault_injection::crash_point`).
pub const CRASH_AFTER_STEP_VAR: &str = "TRAINER_CRASH_AFTER_STEP";

/// Fault injection: with [`CRASH_AFTER_STEP_VAR`] or [`CRASH_IN_STEP_VAR`], only this rank
/// crashes (default: every rank), named as launched (`RANK`: a job that re-formed without a
/// lost rank renumbers the others, not its processes); a list `R0,R1,…` names attempt `k`'s
/// rank.
pub const CRASH_RANK_VAR: &str = "TRAINER_CRASH_RANK";

/// Fault injection: SIGKILL rank 0 in the middle of writing the checkpoint of step N (after the
/// weights are written, before the checkpoint is complete), on the first attempt only.
pub const CRASH_IN_CHECKPOINT_VAR: &str = "TRAINER_CRASH_IN_CHECKPOINT";

/// Fault injection: `"STEP"` kills the rank(s) of [`CRASH_RANK_VAR`] (default every rank)
/// with SIGKILL in the middle of optimizer step STEP (counted from 1): after its micro-batches'
/// forward and backward, before its gradients are summed. First attempt only.
pub const CRASH_IN_STEP_VAR: &str = "TRAINER_CRASH_IN_STEP";

/// Fault injection (the scripted resize of `[fault_tolerance]`'s tests): `"STEP:R[+R…]"` makes
/// ranks R (of the group at that step) leave the job cleanly right after optimizer step STEP,
/// and the others re-form their group without them, as after a failure at that boundary.
pub const LEAVE_AFTER_STEP_VAR: &str = "TRAINER_LEAVE_AFTER_STEP";

/// Fault injection (the scripted grow of `[fault_tolerance]`'s tests): `"STEP"` makes the job
/// admit a joining process right after optimizer step STEP, every rank waiting there for one
/// to ask (instead of admitting one after the next step once it asks). A rank that left by
/// [`LEAVE_AFTER_STEP_VAR`] then joins again in the same process, as a restarted one would.
pub const JOIN_AFTER_STEP_VAR: &str = "TRAINER_JOIN_AFTER_STEP";

/// Fault injection: `"asked"` kills a rank on its first restart as a joiner right after it
/// asked the job to admit it (the job admits a dead process: the members must give up on it
/// within the failure detection time); `"admitted"` once it is in the grown group, before
/// rank 0 has handed it the training state (the hand-over fails on the members).
pub const CRASH_WHILE_JOINING_VAR: &str = "TRAINER_CRASH_WHILE_JOINING";

/// Fault injection: `"R"` kills the rank launched as R (`RANK`) with SIGKILL after the
/// survivors of a failure agreed that it carries on, right before it forms their next group
/// with them (a death while the survivors re-form). First attempt only.
pub const CRASH_WHILE_REGROUPING_VAR: &str = "TRAINER_CRASH_WHILE_REGROUPING";

/// Fault injection: `"R"` kills the rank launched as R (`RANK`) with SIGKILL at a step
/// boundary where joiners are due, right before it forms the grown group with them (a
/// member's death while a joiner is admitted). First attempt only.
pub const CRASH_WHILE_ADMITTING_VAR: &str = "TRAINER_CRASH_WHILE_ADMITTING";

/// Fault injection: `"STEP:R"` stops the rank launched as R (`RANK`) with SIGSTOP right after
/// optimizer step STEP, never to resume (a hung driver, a machine that stopped answering):
/// under `[fault_tolerance] on_rank_failure = "continue"` the others leave it out, and its
/// launcher ends it (fencing). First attempt only.
pub const FREEZE_AFTER_STEP_VAR: &str = "TRAINER_FREEZE_AFTER_STEP";

/// Fault injection: `"STEP:SECS"` makes the rank(s) of [`STALL_RANK_VAR`] (default every
/// rank) sleep SECS seconds right after optimizer step STEP — a straggler, so that the other
/// ranks' stall warning (`distributed.stall_warning_secs`) can be seen in a live job.
pub const STALL_AFTER_STEP_VAR: &str = "TRAINER_STALL_AFTER_STEP";

/// Fault injection: with [`STALL_AFTER_STEP_VAR`], only this rank sleeps.
pub const STALL_RANK_VAR: &str = "TRAINER_STALL_RANK";

/// Fault injection: `"RANK:MS"` makes rank RANK spend MS more milliseconds computing in every
/// optimizer step (a sleep inside the forward/backward phase) — a straggler for the step-time
/// report (`slowest rank`).
pub const SLOW_STEP_VAR: &str = "TRAINER_SLOW_STEP";

/// Fault injection: `"1"` seeds each rank's freshly initialised model with `training.seed +
/// rank` instead of `training.seed`, so the replicas start different (the config, and so its
/// fingerprint, stays the same on every rank). The start-up broadcast of rank 0's weights must
/// then make them equal; tests use it to show that it does.
pub const SEED_BY_RANK_VAR: &str = "TRAINER_SEED_BY_RANK";

/// The memory (bytes) the pre-flight takes as available on this machine instead of what the
/// system reports: to check a config for a smaller machine (or a device's memory) here, and
/// for the tests of the pre-flight.
pub const MEMORY_AVAILABLE_VAR: &str = "TRAINER_MEMORY_AVAILABLE";

/// Rendezvous-store key under which rank 0 reports the checkpoint of optimizer step `step`
/// (`ok`, or the error) to the ranks waiting for it.
pub fn checkpoint_key(step: usize) -> String {
    format!("trainer/checkpoint/{step}")
}
