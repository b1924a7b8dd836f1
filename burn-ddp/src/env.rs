//! Who am I? Rank, world size and rendezvous address from the launcher's environment.
//!
//! Read in this order, first match wins per quantity:
//! 1. torchrun's variables: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//!    `MASTER_ADDR`, `MASTER_PORT` (the `trainer` launcher sets the same ones);
//! 2. SLURM's: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NTASKS_PER_NODE`;
//! 3. Open MPI's: `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`,
//!    `OMPI_COMM_WORLD_LOCAL_SIZE`.
//!
//! `MASTER_ADDR`/`MASTER_PORT` have no SLURM or MPI equivalent and must be set (as with
//! PyTorch). The parsing is a pure function of a lookup so it is tested without touching the
//! process environment.
//!
//! The job's transport settings are read here too, once, where the job is formed
//! ([`crate::init::Distributed::init`]); the process groups themselves never read the
//! environment: `BURN_DDP_SHM=0` keeps same-host ring links on TCP ([`shared_memory_from`]).

use crate::error::InitError;

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

    /// Parses the variables returned by `lookup`; pure, for tests.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, InitError> {
        let hint = "set by torchrun, `trainer --nproc-per-node`, SLURM (srun) or Open MPI (mpirun)";
        let (rank_var, rank) =
            first_usize(&lookup, &RANK_VARS)?.ok_or(InitError::Missing { name: "RANK", hint })?;
        let (world_var, world_size) =
            first_usize(&lookup, &WORLD_VARS)?.ok_or(InitError::Missing {
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
        let local_rank = first_usize(&lookup, &LOCAL_RANK_VARS)?.map(|(_, v)| v);
        let local_world = first_usize(&lookup, &LOCAL_WORLD_VARS)?;
        // Without local information assume a single machine, as torchrun does for one node.
        let local_rank = local_rank.unwrap_or(rank);
        let (local_world_var, local_world_size) =
            local_world.unwrap_or(("LOCAL_WORLD_SIZE", world_size));
        if local_rank >= local_world_size || local_world_size > world_size {
            return Err(InitError::Inconsistent(format!(
                "local rank {local_rank} with {local_world_var}={local_world_size} and world size {world_size}"
            )));
        }
        let master_addr = lookup("MASTER_ADDR").ok_or(InitError::Missing {
            name: "MASTER_ADDR",
            hint: "the host of rank 0, e.g. 127.0.0.1 on one machine",
        })?;
        if master_addr.trim().is_empty() {
            return Err(InitError::Invalid {
                name: "MASTER_ADDR",
                value: master_addr,
                reason: "empty host name".into(),
            });
        }
        let port = lookup("MASTER_PORT").ok_or(InitError::Missing {
            name: "MASTER_PORT",
            hint: "a free TCP port on rank 0's host, the same on every rank, e.g. 29500",
        })?;
        let master_port = match port.trim().parse::<u16>() {
            Ok(p) if p != 0 => p,
            _ => {
                return Err(InitError::Invalid {
                    name: "MASTER_PORT",
                    value: port,
                    reason: "expected a TCP port number in 1..=65535".into(),
                })
            }
        };
        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
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
