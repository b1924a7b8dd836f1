//! Who am I? Rank, world size and rendezvous address from the launcher's environment.
//!
//! Read in this order, first match wins per quantity:
//! 1. torchrun's variables: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//!    `MASTER_ADDR`, `MASTER_PORT` (the `trainer` launcher sets the same ones);
//! 2. SLURM's: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE`;
//! 3. Open MPI's: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`,
//!    `OMPI_COMM_WORLD_LOCAL_SIZE`.
//!
//! `MASTER_ADDR`/`MASTER_PORT` have no SLURM or MPI equivalent. When they are unset they are
//! derived where the launcher tells enough (as PyTorch Lightning does), and the derivation is
//! kept in [`DistEnv::derived`] for the log:
//! - under Slurm, rank 0's host is the first of `SLURM_STEP_NODELIST` (or
//!   `SLURM_JOB_NODELIST`; [`crate::hostlist`] expands the bracket syntax) and the port is
//!   `15000 + SLURM_JOB_ID % 10000` (Lightning's rule), the same on every rank of the job;
//! - under Open MPI with every rank on this machine, `127.0.0.1`, and a port from the job id
//!   (`OMPI_MCA_ess_base_jobid`, or `PMIX_NAMESPACE`);
//! - otherwise the error names the missing variable, as before.
//!
//! The launcher's identity of the job ([`DistEnv::launcher_job`]: Slurm's job and step id,
//! Open MPI's job id or PMIx namespace, torchrun's run id) becomes the job token when
//! `BURN_DDP_TOKEN` is unset, so two jobs on one port never join each other.
//!
//! The parsing is a pure function of a lookup so it is tested without touching the process
//! environment.
//!
//! The job's transport settings are read here too, once, where the job is formed
//! ([`crate::init::Distributed::init`]); the process groups themselves never read the
//! environment: `BURN_DDP_SHM=0` keeps same-host ring links on TCP ([`shared_memory_from`]).

use crate::error::InitError;

/// The variable in which a launcher that fences gives each process it starts an identity of
/// its own, unique over the job's life ([`crate::elastic::fencing`]).
pub const FENCE_ID_VAR: &str = "BURN_DDP_FENCE_ID";

/// The identity of this process in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank among the processes on this machine (selects the GPU).
    pub local_rank: usize,
    /// Number of processes on this machine.
    pub local_world_size: usize,
    /// Host of the rendezvous store (rank 0's machine).
    pub master_addr: String,
    /// Port of the rendezvous store.
    pub master_port: u16,
    /// What was derived rather than read, in words (e.g. `MASTER_ADDR=node01, the first host
    /// of SLURM_STEP_NODELIST=node[01-02]`); empty when everything was set.
    pub derived: Vec<String>,
    /// The launcher's identity of this job, e.g. `slurm-4242.0`; `None` when the launcher
    /// gives none (the trainer's own launcher sets `BURN_DDP_TOKEN` instead).
    pub launcher_job: Option<String>,
    /// This process's identity for fencing, from a launcher that ends the processes the job
    /// left out ([`FENCE_ID_VAR`]; see [`crate::elastic::fencing`]); `None` under other launchers.
    pub fence_id: Option<String>,
}

const RANK_VARS: [&str; 3] = ["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"];
const WORLD_VARS: [&str; 3] = ["WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"];
const LOCAL_RANK_VARS: [&str; 3] = ["LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"];
const LOCAL_WORLD_VARS: [&str; 3] = [
    "LOCAL_WORLD_SIZE",
    "SLURM_NTASKS_PER_NODE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
];

impl DistEnv {
    /// Reads the process environment. See the module docs for the variables.
    pub fn from_env() -> Result<Self, InitError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// True when some launcher variable for the rank is set (torchrun, SLURM or Open MPI).
    pub fn is_present() -> bool {
        RANK_VARS.iter().any(|v| std::env::var_os(v).is_some())
    }

    /// This process's rank as the launcher's variables say (the first of `RANK`,
    /// `SLURM_PROCID`, `OMPI_COMM_WORLD_RANK` that parses), for log levels and tags before
    /// (or without) a full [`DistEnv`].
    pub fn rank_from_env() -> Option<usize> {
        RANK_VARS
            .iter()
            .find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
    }

    /// Parses the variables returned by `lookup`; pure, for tests.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, InitError> {
        let ranks = Ranks::from_lookup(&lookup)?;
        let launcher = Launcher::of(ranks.rank_var);
        let mut derived = Vec::new();
        let master_addr = master_addr(&lookup, launcher, &ranks, &mut derived)?;
        let launcher_job = launcher_job(&lookup, launcher);
        let master_port = master_port(&lookup, launcher, &mut derived)?;
        Ok(Self {
            rank: ranks.rank,
            world_size: ranks.world_size,
            local_rank: ranks.local_rank,
            local_world_size: ranks.local_world_size,
            master_addr,
            master_port,
            derived,
            launcher_job,
            fence_id: lookup(FENCE_ID_VAR).filter(|id| !id.is_empty()),
        })
    }

    /// `MASTER_ADDR:MASTER_PORT`, ready for `ToSocketAddrs`.
    pub fn master_endpoint(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port) // IPv6 literal
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

/// This process's place in the job, and the variable its rank was read from (which names the
/// launcher).
struct Ranks {
    rank_var: &'static str,
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
}

impl Ranks {
    /// The global rank and world size (both required), then the local ones (a single machine
    /// when the launcher gives none), checked against each other.
    fn from_lookup(lookup: &impl Fn(&str) -> Option<String>) -> Result<Self, InitError> {
        let hint = "set by torchrun, `trainer --nproc-per-node`, SLURM (srun) or Open MPI (mpirun)";
        let (rank_var, rank) =
            first_usize(lookup, &RANK_VARS)?.ok_or(InitError::Missing { name: "RANK", hint })?;
        let (world_var, world_size) =
            first_usize(lookup, &WORLD_VARS)?.ok_or(InitError::Missing {
                name: "WORLD_SIZE",
                hint,
            })?;
        if world_size == 0 {
            return Err(InitError::Invalid {
                name: world_var,
                value: "0".into(),
                reason: "the world size must be at least 1".into(),
            });
        }
        if rank >= world_size {
            return Err(InitError::Inconsistent(format!(
                "{rank_var}={rank} but {world_var}={world_size}: ranks are 0..{world_size}"
            )));
        }
        let local_rank = first_usize(lookup, &LOCAL_RANK_VARS)?.map(|(_, v)| v);
        let local_world = first_usize(lookup, &LOCAL_WORLD_VARS)?;
        // Without local information assume a single machine, as torchrun does for one node.
        let local_rank = local_rank.unwrap_or(rank);
        let (local_world_var, local_world_size) =
            local_world.unwrap_or(("LOCAL_WORLD_SIZE", world_size));
        if local_rank >= local_world_size || local_world_size > world_size {
            return Err(InitError::Inconsistent(format!(
                "local rank {local_rank} with {local_world_var}={local_world_size} and world size {world_size}"
            )));
        }
        Ok(Self {
            rank_var,
            rank,
            world_size,
            local_rank,
            local_world_size,
        })
    }
}

/// `MASTER_ADDR`, else derived from the launcher's variables (the derivation noted in
/// `derived`); never empty.
fn master_addr(
    lookup: &impl Fn(&str) -> Option<String>,
    launcher: Launcher,
    ranks: &Ranks,
    derived: &mut Vec<String>,
) -> Result<String, InitError> {
    let master_addr = match lookup("MASTER_ADDR") {
        Some(addr) => addr,
        None => {
            let (addr, how) = derive_master_addr(lookup, launcher, ranks.local_world_size, ranks.world_size)?
                .ok_or(InitError::Missing {
                    name: "MASTER_ADDR",
                    hint: "the host of rank 0, e.g. 127.0.0.1 on one machine (derived only under srun, or mpirun on one machine)",
                })?;
            derived.push(format!("MASTER_ADDR={addr}, {how}"));
            addr
        }
    };
    if master_addr.trim().is_empty() {
        return Err(InitError::Invalid {
            name: "MASTER_ADDR",
            value: master_addr,
            reason: "empty host name".into(),
        });
    }
    Ok(master_addr)
}

/// `MASTER_PORT`, else derived from the launcher's job id (the derivation noted in
/// `derived`); in 1..=65535.
fn master_port(
    lookup: &impl Fn(&str) -> Option<String>,
    launcher: Launcher,
    derived: &mut Vec<String>,
) -> Result<u16, InitError> {
    let port = match lookup("MASTER_PORT") {
        Some(port) => port,
        None => {
            let (port, how) = derive_master_port(lookup, launcher).ok_or(InitError::Missing {
                name: "MASTER_PORT",
                hint: "a free TCP port on rank 0's host, the same on every rank, e.g. 29500 (derived only under srun or mpirun)",
            })?;
            derived.push(format!("MASTER_PORT={port}, {how}"));
            port.to_string()
        }
    };
    match port.trim().parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(InitError::Invalid {
            name: "MASTER_PORT",
            value: port,
            reason: "expected a TCP port number in 1..=65535".into(),
        }),
    }
}

/// The launcher whose rank variable was read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Launcher {
    /// `RANK`: torchrun, the trainer's launcher, or variables set by hand.
    Torchrun,
    Slurm,
    OpenMpi,
}

impl Launcher {
    fn of(rank_var: &str) -> Self {
        match rank_var {
            "SLURM_PROCID" => Self::Slurm,
            "OMPI_COMM_WORLD_RANK" => Self::OpenMpi,
            _ => Self::Torchrun,
        }
    }
}

/// Rank 0's host when the launcher tells it: `(host, how it was found)`, `None` when it does
/// not.
fn derive_master_addr(
    lookup: &impl Fn(&str) -> Option<String>,
    launcher: Launcher,
    local_world_size: usize,
    world_size: usize,
) -> Result<Option<(String, String)>, InitError> {
    match launcher {
        Launcher::Slurm => {
            for var in ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"] {
                if let Some(list) = lookup(var) {
                    let host =
                        crate::hostlist::first_host(&list).map_err(|e| InitError::Invalid {
                            name: var,
                            value: list.clone(),
                            reason: e.reason,
                        })?;
                    return Ok(Some((host, format!("the first host of {var}={list}"))));
                }
            }
            Ok(None)
        }
        Launcher::OpenMpi if local_world_size == world_size => Ok(Some((
            "127.0.0.1".into(),
            format!("every one of the {world_size} ranks is on this machine (OMPI_COMM_WORLD_LOCAL_SIZE)"),
        ))),
        _ => Ok(None),
    }
}

/// A port for the rendezvous store, the same on every rank of the job: `(port, how)`.
fn derive_master_port(
    lookup: &impl Fn(&str) -> Option<String>,
    launcher: Launcher,
) -> Option<(u16, String)> {
    let (var, id) = match launcher {
        Launcher::Slurm => ("SLURM_JOB_ID", lookup("SLURM_JOB_ID")?),
        Launcher::OpenMpi => ["OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"]
            .into_iter()
            .find_map(|v| Some((v, lookup(v)?)))?,
        Launcher::Torchrun => return None,
    };
    let id = id.trim();
    // Lightning's rule for numeric ids (the last four digits); a hash for other ids.
    let offset = match id.parse::<u64>() {
        Ok(n) => n % 10_000,
        Err(_) => crate::hash::fnv1a64(id.as_bytes()) % 10_000,
    };
    let port = 15_000 + offset as u16;
    Some((port, format!("15000 + {var}={id} mod 10000")))
}

/// The launcher's identity of the job, for the job token.
fn launcher_job(lookup: &impl Fn(&str) -> Option<String>, launcher: Launcher) -> Option<String> {
    let set = |v: &str| {
        lookup(v)
            .map(|x| x.trim().to_string())
            .filter(|x| !x.is_empty())
    };
    match launcher {
        Launcher::Slurm => {
            let job = set("SLURM_JOB_ID")?;
            let step = set("SLURM_STEP_ID").unwrap_or_else(|| "batch".into());
            Some(format!("slurm-{job}.{step}"))
        }
        Launcher::OpenMpi => set("OMPI_MCA_ess_base_jobid")
            .map(|j| format!("ompi-{j}"))
            .or_else(|| set("PMIX_NAMESPACE").map(|n| format!("pmix-{n}"))),
        // torchrun's run id is "none" unless --rdzv-id gives one.
        Launcher::Torchrun => set("TORCHELASTIC_RUN_ID")
            .filter(|id| id != "none")
            .map(|id| format!("torchrun-{id}")),
    }
}

/// Environment variable that turns shared memory between same-host ring neighbours off (`0`).
pub const SHM_VAR: &str = "BURN_DDP_SHM";

/// Whether a job formed from the environment moves same-host ring data through shared memory:
/// yes unless [`SHM_VAR`] is `0`. `lookup` reads a variable (pure, for tests).
pub fn shared_memory_from(lookup: impl Fn(&str) -> Option<String>) -> bool {
    lookup(SHM_VAR).is_none_or(|v| v.trim() != "0")
}

/// The first variable of `names` that is set, parsed as `usize`.
fn first_usize(
    lookup: &impl Fn(&str) -> Option<String>,
    names: &[&'static str],
) -> Result<Option<(&'static str, usize)>, InitError> {
    for &name in names {
        if let Some(value) = lookup(name) {
            // SLURM writes e.g. "2(x3)" for heterogeneous nodes; take the leading number.
            let digits: &str = value
                .trim()
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap_or("");
            return match digits.parse::<usize>() {
                Ok(v) => Ok(Some((name, v))),
                Err(_) => Err(InitError::Invalid {
                    name,
                    value,
                    reason: "expected a non-negative integer".into(),
                }),
            };
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<DistEnv, InitError> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        DistEnv::from_lookup(|k| map.get(k).cloned())
    }

    const MASTER: [(&str, &str); 2] = [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];

    #[test]
    fn torchrun_variables() {
        let mut v = vec![
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
        ];
        v.extend(MASTER);
        let env = parse(&v).unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (3, 8, 1, 2)
        );
        assert_eq!(env.master_endpoint(), "127.0.0.1:29500");
    }

    #[test]
    fn slurm_and_mpi_fallbacks() {
        let mut v = vec![
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "6"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NTASKS_PER_NODE", "3(x2)"),
        ];
        v.extend(MASTER);
        let env = parse(&v).unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (5, 6, 2, 3)
        );
        let mut v = vec![("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")];
        v.extend(MASTER);
        let env = parse(&v).unwrap();
        assert_eq!((env.rank, env.local_rank, env.local_world_size), (1, 1, 2));
    }

    #[test]
    fn srun_without_master_variables_derives_them_from_the_node_list_and_job_id() {
        let env = parse(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_ID", "123456"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_JOB_NODELIST", "gpu[1-9]"),
            ("SLURM_STEP_NODELIST", "node[07-08],big"),
        ])
        .unwrap();
        assert_eq!(env.master_endpoint(), "node07:18456");
        assert_eq!(env.launcher_job.as_deref(), Some("slurm-123456.0"));
        assert_eq!(env.derived.len(), 2, "{:?}", env.derived);
        assert!(env.derived[0].contains("SLURM_STEP_NODELIST=node[07-08],big"));
        // Set variables win, and nothing is said to be derived.
        let mut v = vec![
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_JOB_ID", "7"),
        ];
        v.extend(MASTER);
        let env = parse(&v).unwrap();
        assert_eq!(env.master_endpoint(), "127.0.0.1:29500");
        assert!(env.derived.is_empty());
        // A bad node list names the variable.
        let err = parse(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_JOB_NODELIST", "n[1-"),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("SLURM_JOB_NODELIST"), "{err}");
    }

    #[test]
    fn mpirun_on_one_machine_derives_loopback_and_a_port_from_the_job_id() {
        let one_machine = [
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("OMPI_MCA_ess_base_jobid", "2854748161"),
        ];
        let env = parse(&one_machine).unwrap();
        assert_eq!(env.master_endpoint(), "127.0.0.1:23161");
        assert_eq!(env.launcher_job.as_deref(), Some("ompi-2854748161"));
        // Two machines: rank 0's host is unknown, so the error of before.
        let err = parse(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("MASTER_ADDR"), "{err}");
    }

    #[test]
    fn torchrun_gives_a_job_identity_only_with_a_run_id() {
        let mut v = vec![
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("TORCHELASTIC_RUN_ID", "none"),
        ];
        v.extend(MASTER);
        assert_eq!(parse(&v).unwrap().launcher_job, None);
        v[2] = ("TORCHELASTIC_RUN_ID", "exp7");
        assert_eq!(
            parse(&v).unwrap().launcher_job.as_deref(),
            Some("torchrun-exp7")
        );
        // torchrun always sets the master variables: nothing to derive, no guess.
        let err = parse(&[("RANK", "0"), ("WORLD_SIZE", "1")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("MASTER_ADDR"), "{err}");
    }

    #[test]
    fn shared_memory_is_on_unless_turned_off() {
        assert!(shared_memory_from(|_| None));
        assert!(shared_memory_from(|_| Some("1".into())));
        assert!(!shared_memory_from(|k| (k == SHM_VAR).then(|| "0".into())));
    }

    #[test]
    fn errors_name_the_variable() {
        let err = parse(&MASTER).unwrap_err().to_string();
        assert!(err.contains("RANK"), "{err}");
        let mut v = vec![("RANK", "2"), ("WORLD_SIZE", "2")];
        v.extend(MASTER);
        let err = parse(&v).unwrap_err().to_string();
        assert!(
            err.contains("RANK=2") && err.contains("WORLD_SIZE=2"),
            "{err}"
        );
        let err = parse(&[("RANK", "0"), ("WORLD_SIZE", "x")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("WORLD_SIZE=\"x\""), "{err}");
        let err = parse(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "h")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("MASTER_PORT"), "{err}");
        let err = parse(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "70000"),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("MASTER_PORT=\"70000\""), "{err}");
    }
}
