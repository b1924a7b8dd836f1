//! The judgements of this machine's limits: measured facts in, a [`Finding`] with advice out.
//! Pure, so every threshold is unit-tested here; [`super::probe`] measures.
//!
//! Assumptions behind the thresholds (stated in the findings too):
//! - **open files**: a rank holds at most about [`FDS_PER_RANK`] descriptors (standard streams,
//!   the store connection, the ring's listener and two links, six shared-memory ends, data,
//!   checkpoint and metrics files, the runtime's own); the launcher two pipes per rank and, on
//!   node 0, one store connection per rank of the job.
//! - **processes**: `RLIMIT_NPROC` counts threads; a rank runs its compute threads, its loader
//!   threads and about [`SERVICE_THREADS_PER_RANK`] more; the launcher one per local rank and,
//!   on node 0, one per store connection.
//! - **kernel tasks**: every process and thread takes one of the kernel's machine-wide tasks,
//!   root's too.

use crate::finding::Finding;

/// Descriptors one rank may hold at once (see the module docs).
pub const FDS_PER_RANK: u64 = 64;
/// Threads of a rank besides its compute and loader threads: main, store client, stall
/// reporter, log forwarding.
pub const SERVICE_THREADS_PER_RANK: u64 = 4;
/// A resource limit; `None` is unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub soft: Option<u64>,
    pub hard: Option<u64>,
}

fn limit_text(v: Option<u64>) -> String {
    v.map_or_else(|| "unlimited".into(), |v| v.to_string())
}

/// Descriptors the busiest process of the job on this machine needs: a rank, or the launcher
/// (two pipes per local rank and, when it hosts the store, one connection per rank of the job).
pub fn fds_needed(local_ranks: usize, world_size: usize, hosts_store: bool) -> u64 {
    let launcher = 16 + 2 * local_ranks as u64 + if hosts_store { world_size as u64 } else { 0 };
    FDS_PER_RANK.max(launcher)
}

/// `RLIMIT_NOFILE` (per process) against [`fds_needed`].
pub fn open_files(limit: &Result<Limit, String>, need: u64) -> Finding {
    const CHECK: &str = "open files";
    let limit = match limit {
        Ok(limit) => *limit,
        Err(e) => return Finding::skip(CHECK, format!("cannot read RLIMIT_NOFILE: {e}")),
    };
    let Some(soft) = limit.soft else {
        return Finding::ok(CHECK, "no limit (ulimit -n: unlimited)");
    };
    let raise = match limit.hard {
        Some(hard) if hard < 2 * need => format!(
            "the hard limit is {hard} too: raise it (limits.conf `nofile`, systemd `LimitNOFILE=`, `docker run --ulimit nofile=65536:65536`)"
        ),
        hard => format!(
            "raise it before starting the job: `ulimit -n {}`",
            hard.map_or(65536, |h| h.min(65536))
        ),
    };
    let detail = format!(
        "ulimit -n {soft} (hard {}); a process of this job needs about {need} (assumed: {FDS_PER_RANK} per rank, the launcher 2 per local rank + 1 per rank of the job)",
        limit_text(limit.hard)
    );
    if soft < need {
        Finding::fail(CHECK, detail, raise)
    } else if soft < 2 * need {
        Finding::warn(CHECK, format!("{detail}: little headroom"), raise)
    } else {
        Finding::ok(CHECK, detail)
    }
}

/// Threads the job starts on this machine (`RLIMIT_NPROC` counts threads).
pub fn threads_needed(
    local_ranks: usize,
    world_size: usize,
    threads_per_rank: usize,
    loader_threads: usize,
    hosts_store: bool,
) -> u64 {
    let per_rank = (threads_per_rank + loader_threads) as u64 + SERVICE_THREADS_PER_RANK;
    let launcher = 2
        + local_ranks as u64
        + if hosts_store {
            1 + world_size as u64
        } else {
            0
        };
    local_ranks as u64 * per_rank + launcher
}

/// `RLIMIT_NPROC` (this user's threads, machine-wide) against [`threads_needed`].
pub fn processes(limit: &Result<Limit, String>, need: u64, root: bool) -> Finding {
    const CHECK: &str = "processes";
    let limit = match limit {
        Ok(limit) => *limit,
        Err(e) => return Finding::skip(CHECK, format!("cannot read RLIMIT_NPROC: {e}")),
    };
    let shown = format!(
        "ulimit -u {} (hard {})",
        limit_text(limit.soft),
        limit_text(limit.hard)
    );
    if root {
        return Finding::ok(CHECK, format!("{shown}: not enforced for root"));
    }
    let Some(soft) = limit.soft else {
        return Finding::ok(
            CHECK,
            format!("{shown}; the job starts about {need} threads"),
        );
    };
    let detail = format!(
        "{shown}; the job starts about {need} threads, and the limit counts every thread of this user on the machine"
    );
    let advice = format!(
        "raise it: `ulimit -u {}` (or limits.conf `nproc`, systemd `TasksMax=`), or run fewer ranks or loader threads",
        (4 * need).max(4096)
    );
    if soft < need {
        Finding::fail(CHECK, detail, advice)
    } else if soft < 2 * need {
        Finding::warn(CHECK, format!("{detail}: little headroom"), advice)
    } else {
        Finding::ok(CHECK, detail)
    }
}

/// The kernel's machine-wide cap on tasks (every process and thread takes one), and how many
/// exist now. Binds root too, unlike `RLIMIT_NPROC`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelTasks {
    /// `kernel.pid_max`: a task needs a free process id.
    pub pid_max: u64,
    /// `kernel.threads-max`.
    pub threads_max: u64,
    /// Tasks on the machine now (`/proc/loadavg`).
    pub existing: u64,
}

/// [`threads_needed`] against the room the kernel has left for new tasks.
pub fn kernel_tasks(facts: &Result<KernelTasks, String>, need: u64) -> Finding {
    const CHECK: &str = "kernel tasks";
    let facts = match facts {
        Ok(facts) => *facts,
        Err(e) => {
            return Finding::skip(CHECK, format!("cannot read the kernel's task limits: {e}"))
        }
    };
    let cap = facts.pid_max.min(facts.threads_max);
    let room = cap.saturating_sub(facts.existing);
    let detail = format!(
        "the kernel allows {cap} tasks (kernel.pid_max {}, kernel.threads-max {}) and {} exist; the job starts about {need} threads",
        facts.pid_max, facts.threads_max, facts.existing
    );
    let advice = "run fewer ranks (--nproc-per-node) or loader threads, or raise `sysctl kernel.pid_max` / `kernel.threads-max`";
    if room < need {
        Finding::fail(CHECK, detail, advice)
    } else if room < 2 * need {
        Finding::warn(CHECK, format!("{detail}: little headroom"), advice)
    } else {
        Finding::ok(CHECK, detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::finding::Status;

    #[test]
    fn open_files_fail_below_the_need_and_warn_without_headroom() {
        let limit = |soft, hard| Ok(Limit { soft, hard });
        assert_eq!(fds_needed(2, 2, true), FDS_PER_RANK);
        assert_eq!(fds_needed(64, 128, true), 16 + 128 + 128);
        let need = fds_needed(2, 2, true);
        assert_eq!(
            open_files(&limit(Some(1024), Some(4096)), need).status,
            Status::Ok
        );
        assert_eq!(open_files(&limit(None, None), need).status, Status::Ok);
        let low = open_files(&limit(Some(100), Some(4096)), need);
        assert_eq!(low.status, Status::Warn);
        let too_low = open_files(&limit(Some(32), Some(32)), need);
        assert_eq!(too_low.status, Status::Fail);
        assert!(too_low.advice.unwrap().contains("hard limit is 32"));
        let raisable = open_files(&limit(Some(32), Some(4096)), need);
        assert!(raisable.advice.unwrap().contains("ulimit -n 4096"));
    }

    #[test]
    fn thread_limit_counts_compute_loader_and_service_threads() {
        let need = threads_needed(2, 2, 1, 1, true);
        assert_eq!(need, 2 * (1 + 1 + SERVICE_THREADS_PER_RANK) + 2 + 2 + 3);
        let limit = |soft| Ok(Limit { soft, hard: soft });
        assert_eq!(
            processes(&limit(Some(10)), need, false).status,
            Status::Fail
        );
        assert_eq!(processes(&limit(Some(10)), need, true).status, Status::Ok);
        assert_eq!(
            processes(&limit(Some(30)), need, false).status,
            Status::Warn
        );
        assert_eq!(processes(&limit(None), need, false).status, Status::Ok);
    }

    #[test]
    fn kernel_tasks_fail_when_the_job_outgrows_the_machine_wide_cap() {
        let facts = |existing| {
            Ok(KernelTasks {
                pid_max: 32768,
                threads_max: 192731,
                existing,
            })
        };
        assert_eq!(kernel_tasks(&facts(300), 100).status, Status::Ok);
        assert_eq!(kernel_tasks(&facts(32000), 500).status, Status::Warn);
        let over = kernel_tasks(&facts(300), 500_000);
        assert_eq!(over.status, Status::Fail);
        assert!(
            over.detail.contains("allows 32768 tasks"),
            "{}",
            over.detail
        );
        assert!(over.advice.unwrap().contains("--nproc-per-node"));
        assert_eq!(
            kernel_tasks(&Err("no /proc".into()), 10).status,
            Status::Skip
        );
    }
}
