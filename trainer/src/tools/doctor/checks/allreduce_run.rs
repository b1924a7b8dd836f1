//! The all-reduce check's verdict on an [`AllReduceRun`]: every rank joined and agreed, and its
//! bus bandwidth against one core's copy bandwidth. Under [`SLOW_ALLREDUCE_FRACTION`] of it is a
//! warning, not a failure: the machine may just be busy.

use serde::{Deserialize, Serialize};

use super::units::size;
use crate::finding::Finding;

/// Below this fraction of the copy bandwidth, an all-reduce is reported as slow.
pub const SLOW_ALLREDUCE_FRACTION: f64 = 0.05;

/// What one rank of the all-reduce check reports (a JSON file per rank).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankReport {
    pub rank: usize,
    pub world_size: usize,
    /// Bytes of each all-reduce.
    pub bytes: usize,
    /// All-reduces timed.
    pub iterations: usize,
    /// Seconds they took on the slowest rank (the same on every rank).
    pub seconds: f64,
    /// Why this rank failed, if it did.
    pub error: Option<String>,
}

/// How the all-reduce check went, before judgement.
#[derive(Debug, Clone, PartialEq)]
pub enum AllReduceRun {
    /// Not run, and why.
    Skipped(String),
    /// `ranks` were started; each one's report, if it wrote one; and a problem of the whole
    /// run (could not start, no result within the deadline), if any.
    Ran {
        ranks: usize,
        reports: Vec<Option<RankReport>>,
        problem: Option<String>,
    },
}

/// Bus bandwidth of an all-reduce (nccl-tests' definition): `bytes / time x 2(n-1)/n`.
pub fn bus_bandwidth(bytes: usize, seconds_each: f64, world_size: usize) -> f64 {
    let n = world_size as f64;
    bytes as f64 / seconds_each * 2.0 * (n - 1.0) / n
}

/// The all-reduce check: every rank joined and agreed, and its bandwidth against the copy
/// bandwidth of one core (`copy_bandwidth`, bytes per second).
pub fn allreduce(run: &AllReduceRun, copy_bandwidth: f64) -> Finding {
    const CHECK: &str = "all-reduce";
    let (ranks, reports, problem) = match run {
        AllReduceRun::Skipped(why) => return Finding::skip(CHECK, why.clone()),
        AllReduceRun::Ran {
            ranks,
            reports,
            problem,
        } => (*ranks, reports, problem),
    };
    let advice = format!(
        "the error names the cause; `trainer collectives --nproc-per-node {ranks}` repeats the check with each rank's log"
    );
    if let Some((rank, error)) = reports
        .iter()
        .flatten()
        .find_map(|r| r.error.as_ref().map(|e| (r.rank, e)))
    {
        return Finding::fail(
            CHECK,
            format!("{ranks} local ranks: rank {rank} failed: {error}"),
            advice,
        );
    }
    if let Some(problem) = problem {
        return Finding::fail(CHECK, format!("{ranks} local ranks: {problem}"), advice);
    }
    let missing: Vec<String> = (0..ranks)
        .filter(|&r| reports.get(r).is_none_or(Option::is_none))
        .map(|r| r.to_string())
        .collect();
    if !missing.is_empty() {
        return Finding::fail(
            CHECK,
            format!(
                "{ranks} local ranks: rank(s) {} never reported (did not start, or were stopped)",
                missing.join(", ")
            ),
            advice,
        );
    }
    let Some(Some(r)) = reports.first() else {
        return Finding::fail(CHECK, "no report from rank 0", advice);
    };
    if r.iterations == 0 || r.seconds.is_nan() || r.seconds <= 0.0 {
        return Finding::fail(CHECK, "rank 0 timed no all-reduce", advice);
    }
    let each = r.seconds / r.iterations as f64;
    let busbw = bus_bandwidth(r.bytes, each, r.world_size);
    let fraction = busbw / copy_bandwidth;
    let detail = format!(
        "{} local ranks: {} f32 sums x {} in {:.2} s, results correct; bus bandwidth {:.2} GB/s = {:.0}% of one core's copy bandwidth ({:.1} GB/s)",
        r.world_size,
        size(r.bytes as u64),
        r.iterations,
        r.seconds,
        busbw / 1e9,
        fraction * 100.0,
        copy_bandwidth / 1e9
    );
    if fraction < SLOW_ALLREDUCE_FRACTION {
        Finding::warn(
            CHECK,
            format!("{detail}: slow"),
            format!(
                "the machine may be busy (`top`); same-host ranks use shared memory unless /dev/shm failed above or BURN_DDP_SHM=0; `trainer bench-allreduce --nproc-per-node {ranks}` measures every size"
            ),
        )
    } else {
        Finding::ok(CHECK, detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::finding::Status;

    fn report(rank: usize, error: Option<&str>) -> Option<RankReport> {
        Some(RankReport {
            rank,
            world_size: 2,
            bytes: 4 << 20,
            iterations: 100,
            seconds: 1.0,
            error: error.map(String::from),
        })
    }

    #[test]
    fn all_reduce_bandwidth_is_judged_against_the_copy_bandwidth() {
        // 4 MiB x 100 in 1 s on 2 ranks: 0.42 GB/s of bus bandwidth.
        let busbw = bus_bandwidth(4 << 20, 0.01, 2);
        assert!((busbw - 419_430_400.0).abs() < 1.0, "{busbw}");
        let ran = AllReduceRun::Ran {
            ranks: 2,
            reports: vec![report(0, None), report(1, None)],
            problem: None,
        };
        let ok = allreduce(&ran, 4e9);
        assert_eq!(ok.status, Status::Ok, "{}", ok.detail);
        assert!(
            ok.detail.contains("10% of one core's copy bandwidth"),
            "{}",
            ok.detail
        );
        assert_eq!(
            allreduce(&ran, 20e9).status,
            Status::Warn,
            "2% of the copy bandwidth"
        );

        let failed = AllReduceRun::Ran {
            ranks: 2,
            reports: vec![None, report(1, Some("rank 0 never joined"))],
            problem: Some("the launcher exited with an error".into()),
        };
        let f = allreduce(&failed, 4e9);
        assert_eq!(f.status, Status::Fail);
        assert!(
            f.detail.contains("rank 1 failed: rank 0 never joined"),
            "{}",
            f.detail
        );
        let silent = AllReduceRun::Ran {
            ranks: 2,
            reports: vec![report(0, None), None],
            problem: None,
        };
        assert!(allreduce(&silent, 4e9)
            .detail
            .contains("rank(s) 1 never reported"));
        let skipped = AllReduceRun::Skipped("one rank".into());
        assert_eq!(allreduce(&skipped, 4e9).status, Status::Skip);
    }
}
