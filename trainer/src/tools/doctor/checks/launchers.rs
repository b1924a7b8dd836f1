//! The launcher variables this process sees, and what a rank derives from them.

use burn_ddp::{DistEnv, InitError};

use crate::finding::Finding;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::finding::Status;
    use std::collections::HashMap;

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
}
