//! This machine's compute and memory against the job: cores against ranks x threads, and the
//! memory pre-flight's estimate against what is available.

use super::units::{plural, size};
use crate::engine::memory::MemoryEstimate;
use crate::finding::Finding;

/// Where the threads of each rank come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadsFrom {
    /// `RAYON_NUM_THREADS` is set: every rank uses that many.
    Env,
    /// `trainer --nproc-per-node` shares the cores among its ranks.
    LauncherShare,
    /// Another launcher (torchrun, SLURM, Open MPI) without `RAYON_NUM_THREADS`: each rank
    /// starts one compute thread per core.
    OnePerCore,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoreFacts {
    /// Cores this process may use (affinity and cgroup quota included).
    pub cores: usize,
    /// Ranks on this machine.
    pub ranks: usize,
    pub threads_per_rank: usize,
    pub threads_from: ThreadsFrom,
    /// `training.num_workers`: item-reading threads per rank (mostly waiting on I/O).
    pub loader_threads: usize,
}

/// Cores against ranks x compute threads: more threads than cores slows every step down.
pub fn cores(f: &CoreFacts) -> Finding {
    const CHECK: &str = "cores";
    let share = (f.cores / f.ranks.max(1)).max(1);
    let from = match f.threads_from {
        ThreadsFrom::Env => "RAYON_NUM_THREADS",
        ThreadsFrom::LauncherShare => "the launcher's share of the cores",
        ThreadsFrom::OnePerCore => "one per core: no RAYON_NUM_THREADS under this launcher",
    };
    let compute = f.ranks * f.threads_per_rank;
    if f.ranks > f.cores {
        return Finding::warn(
            CHECK,
            format!(
                "{} on {}: ranks take turns on the cores, and every step waits for the slowest",
                plural(f.ranks, "rank"),
                plural(f.cores, "core")
            ),
            format!(
                "run at most {} ranks per machine (--nproc-per-node {})",
                f.cores, f.cores
            ),
        );
    }
    if compute > f.cores {
        let advice = match f.threads_from {
            ThreadsFrom::Env => format!(
                "set RAYON_NUM_THREADS={share}, or unset it (`trainer --nproc-per-node` then shares the cores)"
            ),
            _ => format!("export RAYON_NUM_THREADS={share} in every rank's environment"),
        };
        return Finding::warn(
            CHECK,
            format!(
                "{} x {} = {compute} compute threads on {} ({from}): they oversubscribe the cores",
                plural(f.ranks, "rank"),
                plural(f.threads_per_rank, "thread"),
                plural(f.cores, "core")
            ),
            advice,
        );
    }
    Finding::ok(
        CHECK,
        format!(
            "{}; {} x {} ({from}), plus {} each (training.num_workers)",
            plural(f.cores, "core"),
            plural(f.ranks, "rank"),
            plural(f.threads_per_rank, "thread"),
            plural(f.loader_threads, "loader thread")
        ),
    )
}

/// The memory pre-flight's estimate ([`MemoryEstimate`]) against what is available.
/// `estimate` is `Err(why not)` when there is none (no config, not a CPU run, ...).
pub fn memory(
    estimate: &Result<MemoryEstimate, String>,
    ranks: usize,
    available: Option<(u64, &str)>,
) -> Finding {
    const CHECK: &str = "memory";
    let estimate = match estimate {
        Ok(estimate) => estimate,
        Err(why) => return Finding::skip(CHECK, why.clone()),
    };
    let Some((available, source)) = available else {
        return Finding::skip(CHECK, "cannot read the available memory (/proc/meminfo)");
    };
    match estimate.check(ranks, available, source) {
        Ok(()) => Finding::ok(
            CHECK,
            format!(
                "{} parameters: at least {} per rank, {} for {}; {} available ({source})",
                estimate.parameters,
                size(estimate.per_rank_bytes()),
                size(estimate.per_rank_bytes().saturating_mul(ranks as u64)),
                plural(ranks, "rank"),
                size(available)
            ),
        ),
        Err(e) => Finding::fail(
            CHECK,
            e.0,
            "run fewer ranks per machine (--nproc-per-node), or make the model smaller in [model]",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OptimizerConfig;
    use crate::finding::Status;

    #[test]
    fn more_ranks_or_threads_than_cores_is_a_warning() {
        let facts = CoreFacts {
            cores: 4,
            ranks: 2,
            threads_per_rank: 2,
            threads_from: ThreadsFrom::LauncherShare,
            loader_threads: 1,
        };
        assert_eq!(cores(&facts).status, Status::Ok);
        let crowded = cores(&CoreFacts {
            ranks: 8,
            threads_per_rank: 1,
            ..facts.clone()
        });
        assert_eq!(crowded.status, Status::Warn);
        assert!(crowded.advice.unwrap().contains("--nproc-per-node 4"));
        let per_core = cores(&CoreFacts {
            threads_per_rank: 4,
            threads_from: ThreadsFrom::OnePerCore,
            ..facts
        });
        assert_eq!(per_core.status, Status::Warn);
        assert!(per_core.advice.unwrap().contains("RAYON_NUM_THREADS=2"));
    }

    #[test]
    fn memory_uses_the_preflight_estimate() {
        let estimate = MemoryEstimate::new(1_000_000, &OptimizerConfig::default());
        let fits = memory(&Ok(estimate), 2, Some((1 << 30, "MemAvailable")));
        assert_eq!(fits.status, Status::Ok, "{}", fits.detail);
        let tight = memory(&Ok(estimate), 2, Some((1 << 20, "MemAvailable")));
        assert_eq!(tight.status, Status::Fail);
        assert_eq!(
            memory(&Err("no --config".into()), 2, None).status,
            Status::Skip
        );
    }
}
