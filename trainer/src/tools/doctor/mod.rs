//! `trainer doctor`: whether this machine and configuration can run a job, and what to fix,
//! without training.
//!
//! It works out the job the launcher would start here (ranks, threads, store address and port:
//! the same [`LaunchPlan`] and the same parsing of torchrun / SLURM / Open MPI variables as a real
//! start), measures the machine, and prints one line per check with its result and, for every
//! warning or failure, what to do:
//!
//! | check | what is measured | fails when |
//! |---|---|---|
//! | launcher | launcher variables seen, what a rank derives from them | they do not parse or are incomplete |
//! | cores | cores against ranks x threads | never (a warning when oversubscribed) |
//! | memory | the pre-flight's lower bound for the config's model | the ranks cannot fit |
//! | /dev/shm | free space against one ring file per local rank | too small, or missing |
//! | open files, processes, kernel tasks | `RLIMIT_NOFILE`, `RLIMIT_NPROC`, the kernel's task cap (`pid_max`, `threads-max`) against the job's needs | below the need (the launcher then refuses the job too: [`limit_checks`]) |
//! | loopback | a connection through 127.0.0.1 | it fails |
//! | network | the address and interface that reach `MASTER_ADDR` | no resolution or route; loopback on several nodes |
//! | port | binding the store's port (or reaching it, where another process hosts it) | in use, or not allowed |
//! | output | the config's output and checkpoint directories | a file in the way, not writable |
//! | build, devices | this build's devices; CUDA driver, GPUs, NCCL; the wgpu adapter | the config's device cannot run |
//! | all-reduce | ~1 s of all-reduces across the local ranks, against the copy bandwidth | a rank fails or hangs (slow is a warning) |
//!
//! Exit code: 0 when nothing failed (warnings allowed), 1 otherwise, 2 for bad input (options,
//! config file).
//!
//! | file | owns |
//! |---|---|
//! | [`checks`] | facts → findings, with the thresholds (pure), one file per family of checks |
//! | [`probe`] | measuring the machine: file systems, limits, sockets, names |
//! | [`allreduce`] | the all-reduce check's ranks, started through the launcher |
//!
//! The device probes live with the devices' feature gates, in [`crate::engine::device::device_facts`];
//! [`checks::devices`] judges what they found.

pub mod allreduce;
pub mod checks;
pub mod probe;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use burn_ddp::DistEnv;
use clap::Args;

use self::checks::{
    AllReduceRun, CoreFacts, PortProbe, RingGroups, RouteFacts, ShmFacts, ThreadsFrom,
};
use crate::app::{App, AppConfig};
use crate::builtin::{self, WithApp};
use crate::config::{DeviceKind, DistributedConfig, TrainingConfig};
use crate::engine::device::{device_facts, DeviceJob};
use crate::engine::memory::{available_memory, MemoryEstimate};
use crate::engine::parallel;
use crate::engine::pipeline::StageSplit;
use crate::error::UsageError;
use crate::finding::{self, Finding};
use crate::launcher::launch_plan::{LaunchArgs, LaunchEnv, LaunchPlan};
use crate::launcher::limits::{limit_checks, JobShape};
use crate::launcher::nodes::NodeRange;
use crate::launcher::worker_env::{MASTER_ADDR_VAR, MASTER_PORT_VAR, THREADS_VAR};

#[derive(Args, Debug, Clone, Default)]
pub struct DoctorArgs {
    /// Check the job of this config file (its [training], [distributed] and [output] settings
    /// and its model's size); without it, the defaults.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Ranks this machine would run (default: LOCAL_WORLD_SIZE of the launcher that started
    /// this process, else 1). The all-reduce check starts this many.
    #[arg(long)]
    pub nproc_per_node: Option<usize>,
    /// Machines in the job, N or MIN:MAX (the checks take MAX; default 1, or what a
    /// launcher's variables say).
    #[arg(long)]
    pub nnodes: Option<NodeRange>,
    /// This machine's index, 0..nnodes (node 0 hosts the rendezvous store).
    #[arg(long)]
    pub node_rank: Option<usize>,
    /// Node 0's address (default: MASTER_ADDR, else 127.0.0.1 on one machine).
    #[arg(long)]
    pub master_addr: Option<String>,
    /// The rendezvous store's port (default: MASTER_PORT, else on one machine a free port the
    /// OS picks, on several 29500).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Leave out the 1-second all-reduce across the local ranks.
    #[arg(long)]
    pub skip_allreduce: bool,
    /// Internal: run as one rank of the all-reduce check, reporting to DIR.
    #[arg(long, hide = true, value_name = "DIR")]
    pub allreduce_worker: Option<PathBuf>,
}

/// `trainer doctor`: prints every check and returns 0 when none failed, 1 otherwise. Bad
/// options or a bad config file are errors (exit code 2).
pub fn doctor_command(args: &DoctorArgs) -> anyhow::Result<ExitCode> {
    if let Some(dir) = &args.allreduce_worker {
        return allreduce::worker(dir);
    }
    let settings = match &args.config {
        Some(path) => builtin::with_app(path, LoadSettings(path.clone()))??,
        None => Settings::defaults(),
    };
    let env = |name: &str| std::env::var(name).ok();
    let cores = probe::cores();
    let job = Job::new(args, cores, env)?;
    println!("trainer doctor: {}", job.describe(&settings));

    let mut findings = Vec::new();
    let mut show = |f: Finding| {
        print!("{}", finding::render(std::slice::from_ref(&f)));
        let _ = std::io::stdout().flush();
        findings.push(f);
    };
    show(checks::launcher(env));
    resource_checks(&job, &settings, cores, env, &mut show);
    show(checks::loopback(&probe::loopback_roundtrip()));
    show(checks::network(&route_facts(&job)));
    show(checks::port(job.port, &port_probe(&job)));
    let dirs: Vec<_> = settings
        .dirs
        .iter()
        .map(|(key, path)| (*key, path.clone(), probe::dir_state(path)))
        .collect();
    show(checks::output_dirs(&dirs));
    let device_job = DeviceJob {
        device: settings.device,
        local_ranks: job.nproc,
        world_size: job.world_size,
        gradient_sync: settings.distributed.gradient_sync,
    };
    for f in checks::devices(&device_job, &device_facts(&device_job)) {
        show(f);
    }
    show(allreduce_check(args, job.nproc));
    println!("{}", finding::summary(&findings));
    Ok(ExitCode::from(finding::exit_code(&findings)))
}

/// This machine's resources against the job: cores, memory, `/dev/shm`, open files and
/// processes.
fn resource_checks(
    job: &Job,
    settings: &Settings,
    cores: usize,
    env: impl Fn(&str) -> Option<String>,
    show: &mut impl FnMut(Finding),
) {
    show(checks::cores(&CoreFacts {
        cores,
        ranks: job.nproc,
        threads_per_rank: job.threads_per_rank,
        threads_from: job.threads_from,
        loader_threads: settings.training.num_workers,
    }));
    let estimate = settings
        .estimate
        .clone()
        .map(|e| e.with_zero_stage(settings.distributed.zero_stage, job.world_size));
    show(checks::memory(&estimate, job.nproc, available_memory()));
    show(checks::dev_shm(&ShmFacts {
        enabled: burn_ddp::env::shared_memory_from(env),
        local_ranks: job.nproc,
        world_size: job.world_size,
        groups: RingGroups::of(&parallel::ddp_options(
            &settings.distributed,
            // Fault tolerance forms no group of its own.
            &Default::default(),
        )),
        space: probe::fs_space(Path::new("/dev/shm")),
    }));
    let shape = JobShape {
        local_ranks: job.nproc,
        world_size: job.world_size,
        threads_per_rank: job.threads_per_rank,
        loader_threads: settings.training.num_workers,
        hosts_store: job.node_rank == 0,
    };
    for f in limit_checks(&shape) {
        show(f);
    }
}

/// The all-reduce over `nproc` local ranks, unless left out or there is only one.
fn allreduce_check(args: &DoctorArgs, nproc: usize) -> Finding {
    let (run, copy_bandwidth) = if args.skip_allreduce {
        (
            AllReduceRun::Skipped("left out (--skip-allreduce)".into()),
            0.0,
        )
    } else if nproc < 2 {
        let why =
            "one local rank: nothing to all-reduce (--nproc-per-node 2 or more checks the ring)";
        (AllReduceRun::Skipped(why.into()), 0.0)
    } else {
        // Measured first, while the machine is quiet.
        let copy = crate::tools::collectives::memcpy_bandwidth();
        (allreduce::run(nproc), copy)
    };
    checks::allreduce(&run, copy_bandwidth)
}

/// The job's settings the checks use: from `--config`, or the defaults.
struct Settings {
    path: Option<PathBuf>,
    training: TrainingConfig,
    distributed: DistributedConfig,
    /// `output.device`; `None` without a config (every device of the build counts as wanted).
    device: Option<DeviceKind>,
    /// The directories the job writes to, with their config keys.
    dirs: Vec<(&'static str, PathBuf)>,
    /// The memory pre-flight's estimate, or why there is none.
    estimate: Result<MemoryEstimate, String>,
}

impl Settings {
    fn defaults() -> Self {
        Self {
            path: None,
            training: TrainingConfig::default(),
            distributed: DistributedConfig::default(),
            device: None,
            dirs: Vec::new(),
            estimate: Err("no --config: the model's size is not known".into()),
        }
    }
}

/// Reads a config as a run would (engine sections, the app's tables and its own checks),
/// without the data.
struct LoadSettings(PathBuf);

impl WithApp for LoadSettings {
    type Output = anyhow::Result<Settings>;

    fn run<A: App + Clone>(self, app: A, _stages: Option<StageSplit<A>>) -> Self::Output {
        let config = AppConfig::<A>::load(&self.0)?;
        app.check(&config.model, &config.data)?;
        let estimate = if config.output.device != DeviceKind::Cpu {
            Err("estimated for output.device = \"cpu\" only".into())
        } else {
            app.parameter_count(&config.model, &config.data)
                .map(|p| MemoryEstimate::new(p, &config.optimizer))
                .ok_or_else(|| "this model does not report its size".to_string())
        };
        let mut dirs = vec![("output.dir", config.output.dir.clone())];
        if let Some(dir) = &config.checkpoint.dir {
            dirs.push(("checkpoint.dir", dir.clone()));
        }
        Ok(Settings {
            path: Some(self.0),
            training: config.training,
            distributed: config.distributed,
            device: Some(config.output.device),
            dirs,
            estimate,
        })
    }
}

/// Who hosts the rendezvous store, as seen from this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
enum StoreRole {
    /// One machine, no port given: the launcher binds port 0.
    OsPicks,
    /// This machine binds the port on this address.
    Bind(String),
    /// Another process hosts it (node 0, rank 0, or the launcher's agent store).
    Connect,
}

/// The job the launcher would start on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Job {
    nproc: usize,
    nnodes: usize,
    node_rank: usize,
    world_size: usize,
    master_addr: String,
    /// The store's port; 0 when the OS will pick it.
    port: u16,
    store: StoreRole,
    threads_per_rank: usize,
    threads_from: ThreadsFrom,
    /// Whether a launcher's variables made this process a rank of a job.
    under_launcher: bool,
}

impl Job {
    /// The options, else what a launcher's variables say (`lookup` reads them), else the
    /// launcher's defaults, validated by the launcher's own [`LaunchPlan`]. Pure.
    fn new(
        args: &DoctorArgs,
        cores: usize,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, UsageError> {
        let rank_of = DistEnv::from_lookup(&lookup).ok();
        let plan = Self::launch_plan(args, rank_of.as_ref(), cores, &lookup)?;
        let (threads_per_rank, threads_from) =
            Self::threads(&plan, rank_of.is_some(), cores, &lookup);
        let store = Self::store_role(&plan, rank_of.as_ref(), &lookup)?;
        Ok(Self {
            nproc: plan.nproc,
            nnodes: plan.nnodes,
            node_rank: plan.node_rank,
            world_size: plan.world_size,
            master_addr: plan.master_addr,
            port: plan.port,
            store,
            threads_per_rank,
            threads_from,
            under_launcher: rank_of.is_some(),
        })
    }

    /// The plan the launcher would make here: each option, else what this process's rank
    /// variables (`rank_of`) say, else the launcher's default.
    fn launch_plan(
        args: &DoctorArgs,
        rank_of: Option<&DistEnv>,
        cores: usize,
        lookup: &impl Fn(&str) -> Option<String>,
    ) -> Result<LaunchPlan, UsageError> {
        let from_env = |f: fn(&DistEnv) -> usize| rank_of.map(f);
        let nproc = args
            .nproc_per_node
            .or(from_env(|e| e.local_world_size))
            .unwrap_or(1);
        let nnodes = args
            .nnodes
            .map(|range| range.max)
            .or(from_env(|e| e.world_size.div_ceil(e.local_world_size)))
            .unwrap_or(1);
        let node_rank = args
            .node_rank
            .or(from_env(|e| e.rank / e.local_world_size))
            .unwrap_or(0);
        let master_addr = args
            .master_addr
            .clone()
            .or_else(|| lookup(MASTER_ADDR_VAR).filter(|a| !a.trim().is_empty()));
        let master_port = match (args.master_port, lookup(MASTER_PORT_VAR)) {
            (Some(port), _) => Some(port),
            (None, Some(v)) => Some(v.trim().parse::<u16>().map_err(|_| {
                UsageError(format!(
                    "MASTER_PORT={v:?} is not a TCP port number (0..=65535)"
                ))
            })?),
            (None, None) => None,
        };
        LaunchPlan::new(
            &LaunchArgs {
                nproc_per_node: Some(nproc),
                nnodes: NodeRange::exactly(nnodes),
                node_rank: Some(node_rank),
                master_addr,
                master_port,
                ..LaunchArgs::default()
            },
            &LaunchEnv {
                cores,
                threads: lookup(THREADS_VAR),
                token: String::new(),
                master_addr_is_here: false,
            },
        )
    }

    /// Each rank's compute threads and where that number comes from: `RAYON_NUM_THREADS`,
    /// else one per core under another launcher, else the launcher's share of the cores.
    fn threads(
        plan: &LaunchPlan,
        under_launcher: bool,
        cores: usize,
        lookup: &impl Fn(&str) -> Option<String>,
    ) -> (usize, ThreadsFrom) {
        let rayon = lookup(THREADS_VAR)
            .and_then(|t| t.trim().parse::<usize>().ok())
            .filter(|&t| t > 0);
        match rayon {
            Some(t) => (t, ThreadsFrom::Env),
            None if under_launcher => (cores, ThreadsFrom::OnePerCore),
            None => (
                plan.threads_per_rank.parse().unwrap_or(1),
                ThreadsFrom::LauncherShare,
            ),
        }
    }

    /// Who hosts the store, seen from here.
    fn store_role(
        plan: &LaunchPlan,
        rank_of: Option<&DistEnv>,
        lookup: &impl Fn(&str) -> Option<String>,
    ) -> Result<StoreRole, UsageError> {
        let host = plan.store_host.unwrap_or("0.0.0.0").to_string();
        // The same decision the ranks make: rank 0 hosts, unless the launcher (ours, or
        // torchrun's agent) does.
        let rank0_hosts = burn_ddp::store::StoreHost::from_lookup(lookup)
            .map_err(|e| UsageError(format!("launcher variables: {e}")))?
            .rank0_hosts();
        Ok(match rank_of {
            Some(env) if env.rank == 0 && rank0_hosts => StoreRole::Bind(host),
            Some(_) => StoreRole::Connect,
            None if plan.port == 0 => StoreRole::OsPicks,
            None if plan.store_host.is_some() => StoreRole::Bind(host),
            None => StoreRole::Connect,
        })
    }

    /// The header line: what is being checked.
    fn describe(&self, settings: &Settings) -> String {
        let store = if self.port == 0 {
            format!("{} (a free port the OS picks)", self.master_addr)
        } else {
            format!("{}:{}", self.master_addr, self.port)
        };
        let config = settings.path.as_ref().map_or_else(
            || "defaults (no --config)".to_string(),
            |p| p.display().to_string(),
        );
        format!(
            "{} local rank(s) on node {} of {} (world size {}{}), store at {store}, config {config}",
            self.nproc,
            self.node_rank,
            self.nnodes,
            self.world_size,
            if self.under_launcher {
                ", from the launcher's variables"
            } else {
                ""
            },
        )
    }
}

/// Resolves `MASTER_ADDR` and finds the local address that reaches it.
fn route_facts(job: &Job) -> RouteFacts {
    let resolved = probe::resolve(&job.master_addr);
    let first = resolved.as_ref().ok().and_then(|ips| ips.first().copied());
    RouteFacts {
        master_addr: job.master_addr.clone(),
        route: first.map(probe::route_to),
        master_is_here: first.is_some_and(probe::is_local_address),
        resolved,
        nnodes: job.nnodes,
        node_rank: job.node_rank,
    }
}

/// Binds the store's port where this machine hosts it, else connects to it.
fn port_probe(job: &Job) -> PortProbe {
    match &job.store {
        StoreRole::OsPicks => PortProbe::OsPicks,
        StoreRole::Bind(host) => probe::bind_port(host, job.port),
        StoreRole::Connect => probe::connect_port(&job.master_addr, job.port),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn job(args: &DoctorArgs, vars: &[(&str, &str)]) -> Result<Job, UsageError> {
        let map: HashMap<&str, &str> = vars.iter().copied().collect();
        Job::new(args, 8, |k| map.get(k).map(|v| v.to_string()))
    }

    #[test]
    fn alone_it_checks_the_launchers_defaults() {
        let two = DoctorArgs {
            nproc_per_node: Some(2),
            ..DoctorArgs::default()
        };
        let j = job(&two, &[]).unwrap();
        assert_eq!((j.nproc, j.nnodes, j.world_size, j.port), (2, 1, 2, 0));
        assert_eq!(j.master_addr, "127.0.0.1");
        assert_eq!(j.store, StoreRole::OsPicks);
        assert_eq!(
            (j.threads_per_rank, j.threads_from),
            (4, ThreadsFrom::LauncherShare)
        );

        let port = DoctorArgs {
            master_port: Some(29400),
            ..two.clone()
        };
        assert_eq!(
            job(&port, &[]).unwrap().store,
            StoreRole::Bind("127.0.0.1".into())
        );
        let from_env = job(
            &two,
            &[("MASTER_PORT", "29501"), ("RAYON_NUM_THREADS", "3")],
        )
        .unwrap();
        assert_eq!(from_env.port, 29501);
        assert_eq!(
            (from_env.threads_per_rank, from_env.threads_from),
            (3, ThreadsFrom::Env)
        );
        assert_eq!(job(&DoctorArgs::default(), &[]).unwrap().nproc, 1);
    }

    #[test]
    fn under_a_launcher_it_checks_what_the_ranks_derive() {
        let vars = [
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let j = job(&DoctorArgs::default(), &vars).unwrap();
        assert_eq!((j.nproc, j.nnodes, j.node_rank, j.world_size), (2, 2, 1, 4));
        assert_eq!(j.store, StoreRole::Connect, "rank 3 joins rank 0's store");
        assert_eq!(
            (j.threads_per_rank, j.threads_from),
            (8, ThreadsFrom::OnePerCore)
        );

        let rank0 = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        assert_eq!(
            job(&DoctorArgs::default(), &rank0).unwrap().store,
            StoreRole::Bind("127.0.0.1".into())
        );
        let mut agent = rank0.to_vec();
        agent.push(("BURN_DDP_USE_AGENT_STORE", "1"));
        assert_eq!(
            job(&DoctorArgs::default(), &agent).unwrap().store,
            StoreRole::Connect
        );
        // torchrun's agent holds MASTER_PORT: rank 0 connects, the port is not "in use".
        let mut torchrun = rank0.to_vec();
        torchrun.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        assert_eq!(
            job(&DoctorArgs::default(), &torchrun).unwrap().store,
            StoreRole::Connect
        );
    }

    #[test]
    fn bad_options_are_usage_errors() {
        let zero = DoctorArgs {
            nproc_per_node: Some(0),
            ..DoctorArgs::default()
        };
        assert!(job(&zero, &[]).unwrap_err().0.contains("--nproc-per-node"));
        let bad_port = job(&DoctorArgs::default(), &[("MASTER_PORT", "http")]).unwrap_err();
        assert!(
            bad_port.0.contains("MASTER_PORT=\"http\""),
            "{}",
            bad_port.0
        );
        let two_nodes = DoctorArgs {
            nnodes: Some(NodeRange::exactly(2)),
            ..DoctorArgs::default()
        };
        assert!(job(&two_nodes, &[])
            .unwrap_err()
            .0
            .contains("--master-addr"));
    }
}
