//! The launcher: spawns and supervises this machine's ranks (`--nproc-per-node`,
//! `trainer launch`), as torchrun does, and what ranks of any launcher share with it.
//!
//! | module | owns |
//! |---|---|
//! | `launch` | spawning local ranks and restarting every rank (`--max-restarts`) |
//! | `supervise` | waiting for the started ranks: the first failure stops the others (the failure report), or with `--survivors-continue` the others go on, a failed rank restarts to join, a fenced one is ended |
//! | `launch_plan` | the launcher's pure decisions: ranks, each rank's environment, threads, port |
//! | `nodes` | `--nnodes N` or `MIN:MAX`; an elastic rendezvous's decisions, pure |
//! | `fencing` | `--survivors-continue`: each process's identity, and the processes the job left out ended (SIGKILL), so a frozen rank never holds the job |
//! | `node_rendezvous` | how a launcher enters its job: the nodes' rendezvous in node 0's store, or joining a job that trains |
//! | `worker_env` | the launcher ↔ worker contract: every environment variable and rendezvous key |
//! | `limits` | this machine's limits (open files, threads, kernel tasks) against a job: the launcher refuses, the doctor shows |
//! | `ranklog` | each rank's stderr, tagged and kept for the failure report |
//! | `orphan` | a rank started by another launcher (torchrun, mpirun, srun) dies with it |
//! | `torchelastic` | torchrun's error file, written by a failing rank |

pub(crate) mod fencing;
pub(crate) mod launch;
pub(crate) mod launch_plan;
pub(crate) mod limits;
pub(crate) mod node_rendezvous;
pub(crate) mod nodes;
pub(crate) mod orphan;
pub(crate) mod ranklog;
pub(crate) mod supervise;
pub(crate) mod torchelastic;
pub(crate) mod worker_env;
