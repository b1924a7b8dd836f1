//! This machine's limits against a job: open files (`RLIMIT_NOFILE`), this user's threads
//! (`RLIMIT_NPROC`) and the kernel's task cap. The launcher refuses a job beyond them before it
//! starts a process; `trainer doctor` shows them with its other checks.
//!
//! | module | owns |
//! |---|---|
//! | this one | [`JobShape`] and [`limit_checks`]: measure, then judge |
//! | [`checks`] | the judgements (pure): what a job needs, against the limits |
//! | [`probe`] | the measurements: `getrlimit`, `/proc` |

pub mod checks;
pub mod probe;

use crate::finding::Finding;

/// A job as this machine's limits see it.
#[derive(Debug, Clone, Copy)]
pub struct JobShape {
    pub local_ranks: usize,
    pub world_size: usize,
    pub threads_per_rank: usize,
    pub loader_threads: usize,
    /// Whether this machine's launcher hosts the store (one connection and thread per rank).
    pub hosts_store: bool,
}

/// This machine's limits, measured now, against a job of this shape: open files
/// (`RLIMIT_NOFILE`), this user's threads (`RLIMIT_NPROC`) and the kernel's task cap. The
/// launcher refuses a job that fails any of them, before it starts a process; the doctor shows
/// them.
pub fn limit_checks(job: &JobShape) -> [Finding; 3] {
    let threads = checks::threads_needed(
        job.local_ranks,
        job.world_size,
        job.threads_per_rank,
        job.loader_threads,
        job.hosts_store,
    );
    [
        checks::open_files(
            &probe::open_file_limit(),
            checks::fds_needed(job.local_ranks, job.world_size, job.hosts_store),
        ),
        checks::processes(&probe::process_limit(), threads, probe::is_root()),
        checks::kernel_tasks(&probe::kernel_tasks(), threads),
    ]
}
