//! The doctor's judgements: measured facts in, a [`Finding`] with advice out. Pure, so every
//! threshold is unit-tested here; [`super::probe`] and [`super::allreduce`] gather the facts.
//!
//! Assumptions behind the thresholds (stated in the findings too):
//! - **/dev/shm**: every rank of a job of several ranks reserves one ring file of
//!   [`shm::FILE_BYTES`] (4 MiB + 4 KiB) there; a rank that cannot falls back to loopback TCP,
//!   silently and slower, so too little room is a failure of what the job asked for.
//! - **open files, processes, kernel tasks**: see `crate::launcher::limits` (the launcher checks them
//!   too).
//! - **all-reduce**: a bus bandwidth under [`SLOW_ALLREDUCE_FRACTION`] of one core's copy
//!   bandwidth is a warning, not a failure: the machine may just be busy.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use burn_ddp::group::shm;
use burn_ddp::{DistEnv, InitError};
use serde::{Deserialize, Serialize};

use crate::backend::{
    device_name, rebuild_advice, CudaFacts, CudaProblem, DeviceFacts, DeviceJob, WgpuAdapter,
    WgpuProblem,
};
use crate::config::DeviceKind;
use crate::engine::memory::MemoryEstimate;
use crate::finding::{Finding, Status};

/// Below this fraction of the copy bandwidth, an all-reduce is reported as slow.
pub const SLOW_ALLREDUCE_FRACTION: f64 = 0.05;
/// Below this much free space in an output directory, a warning.
pub const LOW_DISK_BYTES: u64 = 1 << 30;

/// `1536` as `1.5 KiB`: whole KiB below 1 MiB, one decimal above.
pub fn size(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if bytes < 1 << 10 {
        format!("{bytes} B")
    } else if bytes < 1 << 20 {
        format!("{:.0} KiB", b / KIB)
    } else if bytes < 1 << 30 {
        format!("{:.1} MiB", b / KIB / KIB)
    } else {
        format!("{:.1} GiB", b / KIB / KIB / KIB)
    }
}

fn plural(n: usize, word: &str) -> String {
    format!("{n} {word}{}", if n == 1 { "" } else { "s" })
}

// ---------------------------------------------------------------------------------------------
// cores

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

// ---------------------------------------------------------------------------------------------
// /dev/shm

/// Free and total bytes of a file system (`statvfs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsSpace {
    pub free: u64,
    pub total: u64,
}

/// `/dev/shm` bytes that `local_ranks` ranks of a job of `world_size` need: one ring file
/// each, none for a job of one.
pub fn shm_need(local_ranks: usize, world_size: usize) -> u64 {
    if world_size <= 1 {
        0
    } else {
        local_ranks as u64 * shm::FILE_BYTES as u64
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmFacts {
    /// Shared memory is on (`BURN_DDP_SHM` is not `0`).
    pub enabled: bool,
    pub local_ranks: usize,
    pub world_size: usize,
    /// `statvfs("/dev/shm")`, or why it failed.
    pub space: Result<FsSpace, String>,
}

const SHM_ADVICE: &str = "enlarge it (`mount -o remount,size=1G /dev/shm`; Docker: `--shm-size=1g` or `--ipc=host`; Kubernetes: an emptyDir with `medium: Memory` on /dev/shm), or set BURN_DDP_SHM=0 to use loopback TCP on purpose (slower)";

/// `/dev/shm` against what the shared-memory ring needs.
pub fn dev_shm(f: &ShmFacts) -> Finding {
    const CHECK: &str = "/dev/shm";
    let need = shm_need(f.local_ranks, f.world_size);
    if !f.enabled {
        return Finding::ok(
            CHECK,
            "not used: BURN_DDP_SHM=0 sends same-host ring data over loopback TCP",
        );
    }
    match &f.space {
        Err(e) if need == 0 => Finding::ok(
            CHECK,
            format!("cannot be read ({e}), but a job of one rank does not use it"),
        ),
        Err(e) => Finding::fail(
            CHECK,
            format!(
                "cannot be used ({e}): the ranks would fall back to loopback TCP, silently and slower"
            ),
            format!("mount a tmpfs on /dev/shm; {SHM_ADVICE}"),
        ),
        Ok(space) if need == 0 => Finding::ok(
            CHECK,
            format!(
                "{} free of {}; a job of one rank does not use the shared-memory ring",
                size(space.free),
                size(space.total)
            ),
        ),
        Ok(space) if space.free < need => Finding::fail(
            CHECK,
            format!(
                "{} free of {}, but the shared-memory ring needs {} for {} ({} each): the ranks would fall back to loopback TCP, silently and slower",
                size(space.free),
                size(space.total),
                size(need),
                plural(f.local_ranks, "local rank"),
                size(shm::FILE_BYTES as u64)
            ),
            SHM_ADVICE,
        ),
        Ok(space) => Finding::ok(
            CHECK,
            format!(
                "{} free of {}; the shared-memory ring needs {} for {}",
                size(space.free),
                size(space.total),
                size(need),
                plural(f.local_ranks, "local rank")
            ),
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// network

/// A connection to this machine through 127.0.0.1 (its round trip, or why it failed).
pub fn loopback(result: &Result<Duration, String>) -> Finding {
    const CHECK: &str = "loopback";
    match result {
        Ok(rtt) => Finding::ok(
            CHECK,
            format!(
                "127.0.0.1 works (connect and one byte there and back in {} us)",
                rtt.as_micros()
            ),
        ),
        Err(e) => Finding::fail(
            CHECK,
            format!("this machine cannot talk to itself over 127.0.0.1: {e}"),
            "bring the loopback interface up (`ip link set lo up`); in a container or network namespace, check that it has one",
        ),
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteFacts {
    pub master_addr: String,
    /// The addresses `master_addr` resolves to.
    pub resolved: Result<Vec<IpAddr>, String>,
    /// The local address (and its interface) that reaches the first of them; `None` when it
    /// did not resolve.
    pub route: Option<Result<(IpAddr, Option<String>), String>>,
    /// Whether the first resolved address belongs to this machine.
    pub master_is_here: bool,
    pub nnodes: usize,
    pub node_rank: usize,
}

/// How this machine reaches `MASTER_ADDR`, and whether every node can.
pub fn network(f: &RouteFacts) -> Finding {
    const CHECK: &str = "network";
    let addr = &f.master_addr;
    let ip = match &f.resolved {
        Ok(ips) if !ips.is_empty() => ips[0],
        Ok(_) => {
            return Finding::fail(
                CHECK,
                format!("MASTER_ADDR {addr} resolves to no address"),
                "use an IP address, or a name every node resolves (/etc/hosts, DNS)",
            )
        }
        Err(e) => {
            return Finding::fail(
                CHECK,
                format!("MASTER_ADDR {addr} does not resolve: {e}"),
                "use an IP address, or a name every node resolves (/etc/hosts, DNS); on one machine, 127.0.0.1",
            )
        }
    };
    let shown = if addr == &ip.to_string() {
        addr.clone()
    } else {
        format!("{addr} ({ip})")
    };
    let (source, interface) = match &f.route {
        Some(Ok((source, interface))) => (*source, interface.clone()),
        Some(Err(e)) => {
            return Finding::fail(
                CHECK,
                format!("no route from this machine to MASTER_ADDR {shown}: {e}"),
                format!("check the address, and this machine's routes (`ip route get {ip}`)"),
            )
        }
        None => {
            return Finding::skip(CHECK, format!("no route looked up for {shown}"));
        }
    };
    if f.nnodes > 1 && ip.is_loopback() {
        return Finding::fail(
            CHECK,
            format!(
                "MASTER_ADDR {shown} is a loopback address: the other {} cannot reach it",
                plural(f.nnodes - 1, "node")
            ),
            "set --master-addr (or MASTER_ADDR) to node 0's address on the network all nodes share",
        );
    }
    if f.nnodes > 1 && f.node_rank == 0 && !f.master_is_here {
        return Finding::warn(
            CHECK,
            format!(
                "MASTER_ADDR {shown} is not an address of this machine, but node 0 hosts the store"
            ),
            "run node 0 on the machine MASTER_ADDR names, or set --master-addr to one of this machine's addresses",
        );
    }
    let interface = interface.map_or_else(String::new, |i| format!(" ({i})"));
    Finding::ok(
        CHECK,
        format!(
            "MASTER_ADDR {shown} is reached from {source}{interface}: the ranks here listen there for their ring neighbours"
        ),
    )
}

/// What was tried with the store's port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortProbe {
    /// One machine and no port given: the launcher binds port 0 and the OS picks a free one.
    OsPicks,
    /// This machine hosts the store: binding `host:port`, and how it failed.
    Bind {
        host: String,
        result: Result<(), (std::io::ErrorKind, String)>,
    },
    /// Another process hosts the store: connecting to `endpoint`.
    Connect {
        endpoint: String,
        result: Result<(), String>,
    },
}

/// Whether the store's port can be used.
pub fn port(port: u16, probe: &PortProbe) -> Finding {
    const CHECK: &str = "port";
    match probe {
        PortProbe::OsPicks => Finding::ok(
            CHECK,
            "none given: on one machine the launcher lets the OS pick a free port",
        ),
        PortProbe::Bind { host, result: Ok(()) } => Finding::ok(
            CHECK,
            format!("{port} is free on {host}: the rendezvous store can listen there"),
        ),
        PortProbe::Bind {
            host,
            result: Err((std::io::ErrorKind::AddrInUse, _)),
        } => Finding::fail(
            CHECK,
            format!("{port} is in use on {host}: another process listens there"),
            format!(
                "pick another with --master-port or MASTER_PORT (the same on every node), or leave it out on one machine (the launcher then picks a free one); `ss -ltnp 'sport = :{port}'` shows who holds it"
            ),
        ),
        PortProbe::Bind {
            host,
            result: Err((std::io::ErrorKind::PermissionDenied, e)),
        } => Finding::fail(
            CHECK,
            format!("{port} cannot be bound on {host}: {e}"),
            "ports below 1024 need root: pick one from 1024 up with --master-port or MASTER_PORT",
        ),
        PortProbe::Bind {
            host,
            result: Err((_, e)),
        } => Finding::fail(
            CHECK,
            format!("{port} cannot be bound on {host}: {e}"),
            "pick another with --master-port or MASTER_PORT; on several nodes, node 0 must own MASTER_ADDR",
        ),
        PortProbe::Connect {
            endpoint,
            result: Ok(()),
        } => Finding::ok(
            CHECK,
            format!("{endpoint} accepts connections: the rendezvous store is up"),
        ),
        PortProbe::Connect {
            endpoint,
            result: Err(e),
        } => Finding::warn(
            CHECK,
            format!("nothing accepts connections at {endpoint} yet: {e}"),
            format!(
                "start node 0 (or rank 0), which hosts the store: ranks wait for it up to distributed.timeout_secs; if it runs, check firewalls for port {port} between the nodes"
            ),
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// launcher

/// Launchers and the variables each sets (those `trainer doctor` looks for).
pub const LAUNCHERS: [(&str, &[&str]); 6] = [
    (
        "trainer launcher",
        &["TRAINER_WORKER", "TRAINER_RESTART_COUNT"],
    ),
    (
        "torchrun",
        &[
            "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS",
            "TORCHELASTIC_USE_AGENT_STORE",
        ],
    ),
    (
        "SLURM",
        &[
            "SLURM_JOB_ID",
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "SLURM_LOCALID",
            "SLURM_NTASKS_PER_NODE",
            "SLURM_NNODES",
            "SLURM_JOB_NODELIST",
        ],
    ),
    (
        "Open MPI",
        &[
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ],
    ),
    ("PMIx", &["PMIX_RANK", "PMIX_NAMESPACE"]),
    (
        "torchrun-style variables",
        &[
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
        ],
    ),
];

/// Each launcher of [`LAUNCHERS`] with a variable set, and those variables.
pub fn launchers_seen(
    lookup: &impl Fn(&str) -> Option<String>,
) -> Vec<(&'static str, Vec<&'static str>)> {
    LAUNCHERS
        .iter()
        .filter_map(|(name, vars)| {
            let set: Vec<&'static str> = vars
                .iter()
                .copied()
                .filter(|v| lookup(v).is_some())
                .collect();
            (!set.is_empty()).then_some((*name, set))
        })
        .collect()
}

/// The launcher variables this process sees, and what burn-ddp derives from them
/// ([`DistEnv::from_lookup`], the same parsing a rank does).
pub fn launcher(lookup: impl Fn(&str) -> Option<String>) -> Finding {
    const CHECK: &str = "launcher";
    let seen = launchers_seen(&lookup);
    let seen_text = seen
        .iter()
        .map(|(name, vars)| format!("{name} ({})", vars.join(" ")))
        .collect::<Vec<_>>()
        .join(", ");
    let has = |name: &str| seen.iter().any(|(n, _)| *n == name);
    match DistEnv::from_lookup(&lookup) {
        Err(InitError::Missing { name: "RANK", .. }) => {
            if let Some(job) = lookup("SLURM_JOB_ID") {
                return Finding::warn(
                    CHECK,
                    format!("inside SLURM job {job}, but not one of its tasks (no SLURM_PROCID)"),
                    "start the ranks with `srun` (each task then has SLURM_PROCID), or run `trainer --nproc-per-node N` once per node",
                );
            }
            if has("PMIx") && !has("Open MPI") {
                return Finding::warn(
                    CHECK,
                    format!("{seen_text} seen, but burn-ddp reads torchrun's, SLURM's and Open MPI's variables only"),
                    "start the job with Open MPI's mpirun (it sets OMPI_COMM_WORLD_*), or export RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every rank",
                );
            }
            let master = if lookup("MASTER_ADDR").is_some() || lookup("MASTER_PORT").is_some() {
                "; MASTER_ADDR/MASTER_PORT from the environment are checked below (`trainer --nproc-per-node` itself takes --master-addr/--master-port)"
            } else {
                ""
            };
            Finding::ok(
                CHECK,
                format!("none: `trainer --nproc-per-node N` starts and numbers the ranks itself{master}"),
            )
        }
        Ok(env) => {
            let derived = format!(
                "rank {} of {}, local rank {} of {}, store at {}",
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size,
                env.master_endpoint()
            );
            let nodes = lookup("SLURM_NNODES")
                .and_then(|n| n.trim().parse::<usize>().ok())
                .unwrap_or(1);
            let local_unknown = lookup("SLURM_NTASKS_PER_NODE").is_none()
                && lookup("LOCAL_WORLD_SIZE").is_none()
                && lookup("OMPI_COMM_WORLD_LOCAL_SIZE").is_none();
            if has("SLURM") && nodes > 1 && local_unknown {
                return Finding::warn(
                    CHECK,
                    format!(
                        "{seen_text}: {derived}; on {nodes} nodes without SLURM_NTASKS_PER_NODE the local world size is taken to be the world size"
                    ),
                    "start the tasks with `srun --ntasks-per-node=K` (it sets SLURM_NTASKS_PER_NODE), or export LOCAL_WORLD_SIZE",
                );
            }
            Finding::ok(CHECK, format!("{seen_text}: {derived}"))
        }
        Err(e) => {
            let advice = match &e {
                InitError::Missing {
                    name: "MASTER_ADDR" | "MASTER_PORT",
                    ..
                }
                | InitError::Invalid {
                    name: "MASTER_ADDR" | "MASTER_PORT",
                    ..
                } => "export MASTER_ADDR (rank 0's host) and MASTER_PORT (a free port there) for every rank; in a SLURM batch script: `export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) MASTER_PORT=29500`",
                _ => "fix the variable named above, or unset the stray ones (a rank variable alone makes `trainer` a rank of a job)",
            };
            Finding::fail(CHECK, format!("{seen_text}: {e}"), advice)
        }
    }
}

// ---------------------------------------------------------------------------------------------
// memory and output

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

/// What was found where the job writes (`output.dir`, `checkpoint.dir`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirState {
    /// A file stands where the directory should be.
    IsFile,
    /// `existing` (the directory, or its nearest existing parent) can be written; `free`
    /// bytes there.
    Writable {
        existing: PathBuf,
        free: Option<u64>,
    },
    /// `existing` cannot be written, for `why`.
    NotWritable { existing: PathBuf, why: String },
}

/// The directories of the config the job writes to: `(config key, path, state)`.
pub fn output_dirs(dirs: &[(&'static str, PathBuf, DirState)]) -> Finding {
    const CHECK: &str = "output";
    if dirs.is_empty() {
        return Finding::skip(
            CHECK,
            "no --config: output.dir and checkpoint.dir not checked",
        );
    }
    let mut shown = Vec::new();
    let mut low = None;
    for (key, path, state) in dirs {
        let path_text = path.display();
        match state {
            DirState::IsFile => {
                return Finding::fail(
                    CHECK,
                    format!("{key} = \"{path_text}\" is a file, not a directory"),
                    format!("point {key} at a directory (it is created if missing)"),
                )
            }
            DirState::NotWritable { existing, why } => {
                return Finding::fail(
                    CHECK,
                    format!(
                        "{key} = \"{path_text}\": {} cannot be written ({why})",
                        existing.display()
                    ),
                    format!("point {key} at a directory you can write, or fix its permissions"),
                )
            }
            DirState::Writable { existing, free } => {
                let free_text = free.map_or_else(String::new, |f| format!(", {} free", size(f)));
                shown.push(format!("{key} = \"{path_text}\" writable{free_text}"));
                if free.is_some_and(|f| f < LOW_DISK_BYTES) {
                    low = Some((*key, existing.clone(), free.unwrap_or(0)));
                }
            }
        }
    }
    match low {
        Some((key, existing, free)) => Finding::warn(
            CHECK,
            format!(
                "{}: only {} free on {} ({key})",
                shown.join("; "),
                size(free),
                existing.display()
            ),
            "free some space, or point the directory elsewhere: checkpoints and metrics are written there",
        ),
        None => Finding::ok(CHECK, shown.join("; ")),
    }
}

// ---------------------------------------------------------------------------------------------
// all-reduce

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

/// The devices: this build's backends against the config's `output.device`, and in builds that
/// have them the CUDA driver, GPUs and NCCL, and the wgpu adapter. A problem fails the check for
/// the device the job uses, and is a warning for another.
pub fn devices(job: &DeviceJob, facts: &DeviceFacts) -> Vec<Finding> {
    let mut findings = vec![build(job, &facts.built)];
    if let Some(cuda) = &facts.cuda {
        findings.extend(cuda_devices(job, cuda, facts.nccl.as_ref()));
    }
    if let Some(wgpu) = &facts.wgpu {
        findings.push(wgpu_adapter(job, wgpu));
    }
    findings
}

/// Whether this build has the device the config asks for.
fn build(job: &DeviceJob, built: &[DeviceKind]) -> Finding {
    let here: Vec<String> = built
        .iter()
        .map(|&d| format!("\"{}\"", device_name(d)))
        .collect();
    let text = format!("this build trains on {}", here.join(", "));
    match job.device {
        Some(d) if !built.contains(&d) => {
            let name = device_name(d);
            Finding::fail(
                "build",
                format!("output.device = \"{name}\", but {text}"),
                // The doctor is a command of the `trainer` binary only.
                format!(
                    "{}, or set output.device = \"cpu\"",
                    rebuild_advice(d, "trainer")
                ),
            )
        }
        Some(d) => Finding::ok(
            "build",
            format!("{text}; the config uses \"{}\"", device_name(d)),
        ),
        None => Finding::ok("build", text),
    }
}

/// How a device problem counts: a failure for the device the job uses, else a warning.
fn severity(wanted: bool) -> Status {
    if wanted {
        Status::Fail
    } else {
        Status::Warn
    }
}

/// The CUDA driver, the GPUs the local ranks would use, and NCCL.
fn cuda_devices(
    job: &DeviceJob,
    cuda: &Result<CudaFacts, CudaProblem>,
    nccl: Option<&Result<String, String>>,
) -> Vec<Finding> {
    const CPU: &str = "or train on the CPU: output.device = \"cpu\"";
    let wanted = job.wants_cuda();
    let status = severity(wanted);
    let mut findings = Vec::new();
    match cuda {
        Ok(f) => {
            findings.push(Finding::ok(
                "cuda driver",
                format!(
                    "driver for CUDA {}.{} at {}",
                    f.driver_version.0, f.driver_version.1, f.library
                ),
            ));
            let detail = format!(
                "{} visible (CUDA_VISIBLE_DEVICES={}), device 0 is {}; {} local rank(s) use device(s) 0..{}",
                f.device_count, f.visible, f.first_device, job.local_ranks, f.needed
            );
            findings.push(if f.device_count >= f.needed {
                Finding::ok("gpus", detail)
            } else {
                Finding::new(
                    "gpus",
                    status,
                    format!("{detail}, but only {} exist", f.device_count),
                    Some(format!(
                        "run at most {0} ranks per machine (--nproc-per-node {0}), or expose more GPUs",
                        f.device_count
                    )),
                )
            });
        }
        Err(CudaProblem::DriverNotFound { tried, reason }) => findings.push(Finding::new(
            "cuda driver",
            status,
            format!("no CUDA driver was found (tried {tried}: {reason})"),
            Some(format!("install the NVIDIA driver and check that `nvidia-smi` works; in a container, start it with the GPUs exposed (`docker run --gpus all`); if the driver is in a non-standard folder, add it to LD_LIBRARY_PATH; {CPU}")),
        )),
        Err(CudaProblem::Other(message)) => findings.push(Finding::new(
            "cuda driver",
            status,
            message.clone(),
            Some(format!("do what the message says, {CPU}")),
        )),
    }
    let Some(nccl) = nccl.filter(|_| wanted) else {
        findings.push(Finding::skip(
            "nccl",
            "not used: the config trains on another device",
        ));
        return findings;
    };
    let nccl_needed = job.nccl_on_cuda();
    findings.push(match nccl {
        Ok(version) => Finding::ok("nccl", format!("NCCL {version}")),
        Err(e) if nccl_needed => Finding::fail(
            "nccl",
            e.clone(),
            "install NCCL as the message says, or set distributed.gradient_sync = \"host\" (gradients averaged through the host)",
        ),
        Err(e) => Finding::warn(
            "nccl",
            format!("{e} (this job averages gradients through the host, so it runs without)"),
            "install NCCL as the message says to average gradients on the GPU of a multi-rank CUDA job",
        ),
    });
    findings
}

/// The adapter Burn's wgpu backend would pick.
fn wgpu_adapter(job: &DeviceJob, adapter: &Result<WgpuAdapter, WgpuProblem>) -> Finding {
    const CHECK: &str = "wgpu adapter";
    let wanted = job.device == Some(DeviceKind::Wgpu);
    match adapter {
        Ok(a) if a.software && wanted => Finding::warn(
            CHECK,
            format!("{}: a software adapter, which runs on the CPU", a.description),
            "it works; for speed install the GPU's Vulkan driver, or compare with output.device = \"cpu\"",
        ),
        Ok(a) => Finding::ok(CHECK, a.description.clone()),
        Err(WgpuProblem::NotFound(why)) => Finding::new(
            CHECK,
            severity(wanted),
            format!("no adapter found: {why}"),
            Some("install a Vulkan driver (Mesa's lavapipe runs on any CPU: `apt-get install mesa-vulkan-drivers`), or set output.device = \"cpu\"".into()),
        ),
        Err(WgpuProblem::Timeout(secs)) => Finding::new(
            CHECK,
            severity(wanted),
            format!("no adapter within {secs} s"),
            Some("check the GPU driver (`vulkaninfo --summary`), or set output.device = \"cpu\"".into()),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OptimizerConfig;
    use crate::finding::Status;
    use std::collections::HashMap;
    use std::io::ErrorKind;

    const MIB: u64 = 1 << 20;

    fn shm_facts(free: u64, ranks: usize) -> ShmFacts {
        ShmFacts {
            enabled: true,
            local_ranks: ranks,
            world_size: ranks,
            space: Ok(FsSpace {
                free,
                total: free.max(64 << 10),
            }),
        }
    }

    #[test]
    fn sizes_read_naturally() {
        assert_eq!(size(512), "512 B");
        assert_eq!(size(64 << 10), "64 KiB");
        assert_eq!(size(8 * MIB + 8192), "8.0 MiB");
        assert_eq!(size(3 << 29), "1.5 GiB");
    }

    #[test]
    fn dev_shm_must_hold_one_ring_file_per_local_rank() {
        assert_eq!(shm_need(2, 2), 2 * (4 * MIB + 4096));
        assert_eq!(shm_need(1, 1), 0, "a job of one has no ring");
        assert_eq!(
            shm_need(1, 4),
            4 * MIB + 4096,
            "one rank here, others elsewhere"
        );

        let tiny = dev_shm(&shm_facts(64 << 10, 2));
        assert_eq!(tiny.status, Status::Fail);
        assert!(tiny.detail.contains("64 KiB free"), "{}", tiny.detail);
        assert!(
            tiny.detail.contains("needs 8.0 MiB for 2 local ranks"),
            "{}",
            tiny.detail
        );
        assert!(tiny.advice.unwrap().contains("--shm-size"));

        assert_eq!(dev_shm(&shm_facts(64 * MIB, 2)).status, Status::Ok);
        assert_eq!(
            dev_shm(&shm_facts(0, 1)).status,
            Status::Ok,
            "one rank needs none"
        );
        let off = ShmFacts {
            enabled: false,
            ..shm_facts(0, 2)
        };
        assert_eq!(dev_shm(&off).status, Status::Ok);
        let missing = ShmFacts {
            space: Err("No such file or directory".into()),
            ..shm_facts(0, 2)
        };
        assert_eq!(dev_shm(&missing).status, Status::Fail);
    }

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
    fn port_in_use_names_the_port_and_what_to_do() {
        let busy = port(
            29500,
            &PortProbe::Bind {
                host: "127.0.0.1".into(),
                result: Err((ErrorKind::AddrInUse, "Address in use".into())),
            },
        );
        assert_eq!(busy.status, Status::Fail);
        assert!(busy.detail.contains("29500 is in use"), "{}", busy.detail);
        assert!(busy.advice.unwrap().contains("--master-port"));
        let free = PortProbe::Bind {
            host: "0.0.0.0".into(),
            result: Ok(()),
        };
        assert_eq!(port(29500, &free).status, Status::Ok);
        assert_eq!(port(0, &PortProbe::OsPicks).status, Status::Ok);
        let nobody = PortProbe::Connect {
            endpoint: "10.0.0.1:29500".into(),
            result: Err("refused".into()),
        };
        assert_eq!(port(29500, &nobody).status, Status::Warn);
    }

    fn route(addr: &str, nnodes: usize, here: bool) -> RouteFacts {
        let ip: IpAddr = addr.parse().unwrap();
        RouteFacts {
            master_addr: addr.into(),
            resolved: Ok(vec![ip]),
            route: Some(Ok((ip, Some("eth0".into())))),
            master_is_here: here,
            nnodes,
            node_rank: 0,
        }
    }

    #[test]
    fn several_nodes_need_a_master_address_they_can_reach() {
        assert_eq!(network(&route("127.0.0.1", 1, true)).status, Status::Ok);
        assert_eq!(network(&route("127.0.0.1", 2, true)).status, Status::Fail);
        assert_eq!(network(&route("10.0.0.1", 2, true)).status, Status::Ok);
        assert_eq!(network(&route("10.0.0.1", 2, false)).status, Status::Warn);
        let unresolved = RouteFacts {
            resolved: Err("Name or service not known".into()),
            route: None,
            ..route("10.0.0.1", 1, false)
        };
        let f = network(&unresolved);
        assert_eq!(f.status, Status::Fail);
        assert!(f.detail.contains("does not resolve"), "{}", f.detail);
        let ok = network(&route("10.0.0.1", 2, true));
        assert!(ok.detail.contains("(eth0)"), "{}", ok.detail);
    }

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn launcher_variables_are_named_with_what_they_give() {
        assert_eq!(launcher(lookup(&[])).status, Status::Ok);
        let slurm = launcher(lookup(&[
            ("SLURM_JOB_ID", "7"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ]));
        assert_eq!(slurm.status, Status::Ok, "{slurm:?}");
        assert!(
            slurm.detail.contains("SLURM (SLURM_JOB_ID SLURM_PROCID"),
            "{}",
            slurm.detail
        );
        assert!(
            slurm
                .detail
                .contains("rank 1 of 2, local rank 1 of 2, store at node0:29500"),
            "{}",
            slurm.detail
        );
        let no_master = launcher(lookup(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]));
        assert_eq!(no_master.status, Status::Fail);
        assert!(
            no_master.detail.contains("MASTER_ADDR"),
            "{}",
            no_master.detail
        );
        assert!(no_master
            .advice
            .unwrap()
            .contains("scontrol show hostnames"));
        let batch_script = launcher(lookup(&[("SLURM_JOB_ID", "7")]));
        assert_eq!(batch_script.status, Status::Warn);
        assert!(batch_script.advice.unwrap().contains("srun"));
        let two_nodes = launcher(lookup(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_NNODES", "2"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ]));
        assert_eq!(two_nodes.status, Status::Warn);
        let mpi = launcher(lookup(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("PMIX_NAMESPACE", "x"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]));
        assert_eq!(mpi.status, Status::Ok);
        assert!(mpi.detail.contains("Open MPI") && mpi.detail.contains("PMIx"));
        let pmix_only = launcher(lookup(&[("PMIX_RANK", "0")]));
        assert_eq!(pmix_only.status, Status::Warn);
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

    #[test]
    fn output_directories_must_be_writable_with_room() {
        let writable = |free| DirState::Writable {
            existing: "/data".into(),
            free: Some(free),
        };
        assert_eq!(output_dirs(&[]).status, Status::Skip);
        let ok = output_dirs(&[("output.dir", "/data/run".into(), writable(10 << 30))]);
        assert_eq!(ok.status, Status::Ok);
        let low = output_dirs(&[("output.dir", "/data/run".into(), writable(MIB))]);
        assert_eq!(low.status, Status::Warn);
        let file = output_dirs(&[("checkpoint.dir", "/data/x".into(), DirState::IsFile)]);
        assert_eq!(file.status, Status::Fail);
        assert!(file.detail.contains("checkpoint.dir"));
        let locked = DirState::NotWritable {
            existing: "/".into(),
            why: "Permission denied".into(),
        };
        assert_eq!(
            output_dirs(&[("output.dir", "/run".into(), locked)]).status,
            Status::Fail
        );
    }

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

    fn device_job(device: Option<DeviceKind>, local_ranks: usize) -> DeviceJob {
        DeviceJob {
            device,
            local_ranks,
            world_size: local_ranks,
            gradient_sync: Default::default(),
        }
    }

    fn cpu_build() -> DeviceFacts {
        DeviceFacts {
            built: vec![DeviceKind::Cpu],
            cuda: None,
            nccl: None,
            wgpu: None,
        }
    }

    fn gpus(count: usize, needed: usize) -> CudaFacts {
        CudaFacts {
            driver_version: (12, 4),
            library: "libcuda.so.1".into(),
            device_count: count,
            first_device: "NVIDIA H100".into(),
            visible: "<unset>".into(),
            needed,
        }
    }

    fn statuses(findings: &[Finding]) -> Vec<(&'static str, Status)> {
        findings.iter().map(|f| (f.check, f.status)).collect()
    }

    #[test]
    fn a_device_the_build_lacks_fails_naming_the_feature() {
        let found = devices(&device_job(Some(DeviceKind::Cuda), 2), &cpu_build());
        assert_eq!(statuses(&found), vec![("build", Status::Fail)]);
        assert!(found[0].detail.contains("this build trains on \"cpu\""));
        assert!(found[0]
            .advice
            .as_deref()
            .unwrap_or("")
            .contains("--features cuda"));
        let ok = devices(&device_job(Some(DeviceKind::Cpu), 2), &cpu_build());
        assert_eq!(statuses(&ok), vec![("build", Status::Ok)]);
    }

    #[test]
    fn cuda_problems_fail_the_cuda_job_and_warn_another() {
        let facts = DeviceFacts {
            built: vec![DeviceKind::Cpu, DeviceKind::Cuda],
            cuda: Some(Err(CudaProblem::DriverNotFound {
                tried: "libcuda.so.1".into(),
                reason: "not found".into(),
            })),
            nccl: Some(Err("no NCCL".into())),
            wgpu: None,
        };
        let wanted = devices(&device_job(Some(DeviceKind::Cuda), 2), &facts);
        assert_eq!(
            statuses(&wanted),
            vec![
                ("build", Status::Ok),
                ("cuda driver", Status::Fail),
                ("nccl", Status::Fail)
            ]
        );
        let other = devices(&device_job(Some(DeviceKind::Cpu), 2), &facts);
        assert_eq!(
            statuses(&other),
            vec![
                ("build", Status::Ok),
                ("cuda driver", Status::Warn),
                ("nccl", Status::Skip)
            ]
        );
    }

    #[test]
    fn too_few_gpus_for_the_local_ranks_and_nccl_only_needed_for_several_ranks() {
        let facts = |count, needed, nccl: Result<String, String>| DeviceFacts {
            built: vec![DeviceKind::Cpu, DeviceKind::Cuda],
            cuda: Some(Ok(gpus(count, needed))),
            nccl: Some(nccl),
            wgpu: None,
        };
        let short = devices(
            &device_job(Some(DeviceKind::Cuda), 4),
            &facts(2, 4, Ok("2.21.5 at libnccl.so.2".into())),
        );
        assert_eq!(short[2].check, "gpus");
        assert_eq!(short[2].status, Status::Fail);
        assert!(
            short[2].detail.ends_with("but only 2 exist"),
            "{}",
            short[2].detail
        );
        assert_eq!(short[3].detail, "NCCL 2.21.5 at libnccl.so.2");
        // One rank averages nothing: a missing NCCL only warns.
        let alone = devices(
            &device_job(Some(DeviceKind::Cuda), 1),
            &facts(1, 1, Err("no NCCL".into())),
        );
        assert_eq!(
            statuses(&alone)[1..],
            [
                ("cuda driver", Status::Ok),
                ("gpus", Status::Ok),
                ("nccl", Status::Warn)
            ]
        );
    }

    #[test]
    fn a_software_wgpu_adapter_warns_only_a_wgpu_job() {
        let facts = DeviceFacts {
            built: vec![DeviceKind::Cpu, DeviceKind::Wgpu],
            cuda: None,
            nccl: None,
            wgpu: Some(Ok(WgpuAdapter {
                description: "llvmpipe (Vulkan, Cpu, driver Mesa)".into(),
                software: true,
            })),
        };
        let wgpu_job = devices(&device_job(Some(DeviceKind::Wgpu), 1), &facts);
        assert_eq!(wgpu_job[1].status, Status::Warn);
        let cpu_job = devices(&device_job(Some(DeviceKind::Cpu), 1), &facts);
        assert_eq!(cpu_job[1].status, Status::Ok);
        let timeout = DeviceFacts {
            wgpu: Some(Err(WgpuProblem::Timeout(60))),
            ..facts
        };
        let found = devices(&device_job(Some(DeviceKind::Wgpu), 1), &timeout);
        assert_eq!(found[1].status, Status::Fail);
        assert_eq!(found[1].detail, "no adapter within 60 s");
    }
}
