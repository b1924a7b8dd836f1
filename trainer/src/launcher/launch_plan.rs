//! The launch plan: everything the launcher decides before it starts a process — validated
//! options, each local rank's global rank and environment, threads per rank, the store's port
//! and address, when to restart. Pure (the command line and a snapshot of the machine in, values
//! out), so it is unit-tested here; [`crate::launcher::launch`] only binds, spawns and waits.
//!
//! Ranks are numbered node by node, like torchrun's static rendezvous:
//!
//! ```text
//!   --nnodes 2 --nproc-per-node 3      node 0: RANK 0 1 2     node 1: RANK 3 4 5
//!                                      LOCAL_RANK  0 1 2      LOCAL_RANK  0 1 2
//! ```

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::error::UsageError;
use crate::launcher::nodes::NodeRange;
use crate::launcher::worker_env::{
    AGENT_STORE_VAR, GROUP_RANK_VAR, JOINING_VAR, LOCAL_RANK_VAR, LOCAL_WORLD_SIZE_VAR,
    MASTER_ADDR_VAR, MASTER_PORT_VAR, MAX_WORLD_SIZE_VAR, MIN_WORLD_SIZE_VAR, RANK_VAR,
    RESTART_COUNT_VAR, THREADS_VAR, TOKEN_VAR, WORKER_VAR, WORLD_SIZE_VAR,
};

/// torchrun-style launch options.
#[derive(Args, Debug, Clone, Default)]
pub struct LaunchArgs {
    /// Start this many ranks on this machine and supervise them.
    #[arg(long)]
    pub nproc_per_node: Option<usize>,
    /// Number of machines in the job: N, or MIN:MAX (torchrun's elastic range) — the job
    /// starts once MIN are there (waiting --rdzv-last-call-timeout for more, up to MAX), a
    /// node lost shrinks it down to MIN, and a node that comes, or comes back, grows it up to
    /// MAX. A range needs --survivors-continue (the trainer's `on_rank_failure = "continue"`).
    #[arg(long, default_value_t = NodeRange::default())]
    pub nnodes: NodeRange,
    /// This machine's index, 0..nnodes (default 0; node 0 hosts the rendezvous store). With
    /// --nnodes MIN:MAX the launchers number themselves as they come, node 0 first: leave it
    /// out (node 0 is the machine that has --master-addr), or give 0 to node 0 and any other
    /// number to the others (several nodes on one machine).
    #[arg(long)]
    pub node_rank: Option<usize>,
    /// Address of node 0, reachable from every node (default 127.0.0.1 on one node).
    #[arg(long)]
    pub master_addr: Option<String>,
    /// Port of the rendezvous store on node 0 (default: a free port on one node, 29500 on
    /// several).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Also write each local rank's output to DIR/rank-N.log (appended across restarts; all
    /// ranks' output is then piped, so rank 0 shows no progress bar).
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<PathBuf>,
    /// After a rank fails, restart every local rank up to this many times; training resumes
    /// from the newest complete checkpoint. With --survivors-continue, restart the failed rank
    /// alone, which joins the ranks that carried on (up to this many restarts in all). Bad
    /// input (exit code 2) is never retried.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: usize,
    /// A rank's failure does not stop the other ranks: they carry on without it, and the job
    /// succeeds if they do; with --max-restarts the failed rank is started again to join them
    /// (TRAINER_JOINING=1). The program must re-form its group itself: the trainer's
    /// `[fault_tolerance] on_rank_failure = "continue"` sets this on its own.
    #[arg(long)]
    pub survivors_continue: bool,
    /// --nnodes MIN:MAX: how long node 0 waits for MIN nodes, and another node for node 0's
    /// store and its place (torchrun's `join_timeout`).
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    pub rdzv_join_timeout: u64,
    /// --nnodes MIN:MAX: once MIN nodes are there, how long node 0 waits for more before the
    /// job starts with the nodes there (torchrun's `last_call_timeout`); a node that comes
    /// later joins the running job.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub rdzv_last_call_timeout: u64,
}

impl LaunchArgs {
    /// Whether the command line asks for the launcher: any of its options, not only
    /// `--nproc-per-node` (which defaults to 1, as torchrun's). A `--nnodes 2 --node-rank 1
    /// --master-addr …` or a `--max-restarts 3` without it starts one supervised rank, instead
    /// of being ignored by a run of one process.
    pub fn requested(&self) -> bool {
        self.nproc_per_node.is_some()
            || self.nnodes != NodeRange::default()
            || self.node_rank.is_some()
            || self.master_addr.is_some()
            || self.master_port.is_some()
            || self.log_dir.is_some()
            || self.max_restarts != 0
    }

    /// Ranks this machine starts (`--nproc-per-node`, default 1).
    pub fn ranks_here(&self) -> usize {
        self.nproc_per_node.unwrap_or(1)
    }
}

/// The store port on several machines when `--master-port` is not given (torchrun's). On one
/// machine the default is 0: the OS picks a free port, so two jobs never collide.
pub const DEFAULT_MULTI_NODE_PORT: u16 = 29500;

/// The exit code of bad input (command line, config, data): retrying cannot help.
pub const USAGE_EXIT_CODE: u8 = 2;

/// What the launcher reads from its machine and environment (see `launch::machine`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Cores available to the launcher (`std::thread::available_parallelism`).
    pub cores: usize,
    /// The launcher's own `RAYON_NUM_THREADS`: when set, every rank gets it unchanged.
    pub threads: Option<String>,
    /// The job token: the launcher's `BURN_DDP_TOKEN` when set (it must be the same on every
    /// node), else a fresh random one.
    pub token: String,
    /// Whether `--master-addr` is an address of this machine (with `--nnodes MIN:MAX` and no
    /// `--node-rank`: this launcher is node 0 and hosts the store).
    pub master_addr_is_here: bool,
}

/// The deadlines of an elastic job's node rendezvous (`--nnodes MIN:MAX`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RendezvousTimeouts {
    /// Node 0 waiting for `MIN` nodes; another node waiting for node 0's store, its place,
    /// and (coming late) for the job to train.
    pub join: Duration,
    /// Node 0 waiting for more than `MIN` nodes.
    pub last_call: Duration,
}

/// The validated launch: what every attempt starts, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchPlan {
    /// Ranks on this machine (`--nproc-per-node`, default 1): `LOCAL_WORLD_SIZE`.
    pub nproc: usize,
    /// `--nnodes`: the fewest and the most machines of the job.
    pub nodes: NodeRange,
    /// Machines in the job: `--nnodes N`, or with `MIN:MAX` `MAX` until the node rendezvous
    /// says how many start it ([`placed`](Self::placed)).
    pub nnodes: usize,
    /// This machine's index (`--node-rank`, or its place in an elastic job's rendezvous):
    /// `GROUP_RANK`.
    pub node_rank: usize,
    /// Ranks in the job, `nproc * nnodes`: `WORLD_SIZE`.
    pub world_size: usize,
    /// The node rendezvous's deadlines (`--nnodes MIN:MAX`).
    pub rendezvous: RendezvousTimeouts,
    /// Node 0's address, as the ranks reach it: `MASTER_ADDR`.
    pub master_addr: String,
    /// The store's port before the first bind; 0 lets the OS pick one (one machine only). The
    /// port actually bound is reused by every restart.
    pub port: u16,
    /// Where this launcher binds the store: `Some(host)` on node 0 — loopback when every rank
    /// is local (nothing outside can reach it), all interfaces otherwise — `None` elsewhere.
    pub store_host: Option<&'static str>,
    /// `RAYON_NUM_THREADS` of every rank.
    pub threads_per_rank: String,
    /// The job token given to every rank.
    pub token: String,
    /// Restarts of every local rank after a failure (`--max-restarts`).
    pub max_restarts: usize,
    /// Where each rank's own log goes (`--log-dir`).
    pub log_dir: Option<PathBuf>,
    /// A failed rank leaves the others running (`--survivors-continue`).
    pub survivors_continue: bool,
}

impl LaunchPlan {
    /// Validates `args` and computes the plan for this machine.
    ///
    /// Errors (as [`UsageError`], exit code 2) name the option: `--nproc-per-node 0`,
    /// `--nnodes 0`, a `--node-rank` outside `0..nnodes`, `--nnodes > 1` without
    /// `--master-addr`, and `--master-port 0` with several machines (the other nodes could not
    /// know the port the OS picks).
    pub fn new(args: &LaunchArgs, env: &LaunchEnv) -> Result<Self, UsageError> {
        let nproc = args.ranks_here();
        if nproc == 0 {
            return Err(UsageError("--nproc-per-node must be at least 1".into()));
        }
        let nodes = args.nnodes;
        if nodes.min == 0 {
            return Err(UsageError("--nnodes must be at least 1".into()));
        }
        if let Some(node_rank) = args.node_rank.filter(|&r| r >= nodes.max) {
            return Err(UsageError(format!(
                "--node-rank {node_rank} is not in 0..{} (--nnodes {nodes})",
                nodes.max
            )));
        }
        if nodes.is_elastic() && !args.survivors_continue {
            return Err(UsageError(format!(
                "--nnodes {nodes}: a job whose nodes come and go needs its ranks to train on when a node is lost: add --survivors-continue (the trainer sets it for `[fault_tolerance] on_rank_failure = \"continue\"`), or give a fixed --nnodes"
            )));
        }
        // With a range the launchers number themselves as they come: node 0 (the store's
        // host) is the one given 0, or, given none, the one that has --master-addr; any
        // other starts as "some node" and takes its number from node 0's rendezvous.
        let node_rank = match (nodes.is_elastic(), args.node_rank) {
            (false, rank) => rank.unwrap_or(0),
            (true, Some(0)) => 0,
            (true, Some(_)) => 1,
            (true, None) => usize::from(!env.master_addr_is_here),
        };
        let single_node = nodes.max == 1;
        let master_addr = match &args.master_addr {
            Some(addr) => addr.clone(),
            None if single_node => "127.0.0.1".to_string(),
            None => {
                return Err(UsageError(format!(
                    "--master-addr (node 0's address, reachable from every node) is required \
                     with --nnodes {nodes}"
                )))
            }
        };
        let port = match args.master_port {
            Some(0) if !single_node => {
                return Err(UsageError(format!(
                    "--master-port 0 (a port the OS picks) only works on one machine: with \
                     --nnodes {nodes} every node must be given node 0's port"
                )))
            }
            Some(port) => port,
            None if single_node => 0,
            None => DEFAULT_MULTI_NODE_PORT,
        };
        let store_host = (node_rank == 0).then(|| {
            if single_node && is_loopback_name(&master_addr) {
                "127.0.0.1"
            } else {
                "0.0.0.0"
            }
        });
        Ok(Self {
            nproc,
            nodes,
            nnodes: nodes.max,
            node_rank,
            world_size: nproc * nodes.max,
            rendezvous: RendezvousTimeouts {
                join: Duration::from_secs(args.rdzv_join_timeout),
                last_call: Duration::from_secs(args.rdzv_last_call_timeout),
            },
            master_addr,
            port,
            store_host,
            threads_per_rank: threads_per_rank(env, nproc),
            token: env.token.clone(),
            max_restarts: args.max_restarts,
            log_dir: args.log_dir.clone(),
            survivors_continue: args.survivors_continue,
        })
    }

    /// Refuses to start ranks from a process that is itself rank `outer_rank` of an
    /// `outer_world`-rank job of another launcher (torchrun, srun, mpirun): every one of its
    /// ranks would start a separate job, all writing the same output. Allowed where this
    /// launcher is the per-node agent of that job: one task per node, `--nnodes` equal to its
    /// world size (`srun --ntasks-per-node 1 trainer --nproc-per-node 8 --nnodes N ...`).
    pub fn check_outer_job(&self, outer_rank: usize, outer_world: usize) -> Result<(), UsageError> {
        if outer_world <= 1 || outer_world == self.nnodes {
            return Ok(());
        }
        Err(UsageError(format!(
            "this process is already rank {outer_rank} of {outer_world} of a job another launcher started (RANK, SLURM_PROCID or OMPI_COMM_WORLD_RANK is set: torchrun, srun, mpirun, or a stale export), and the launcher options (--nproc-per-node {}, --nnodes {}) ask it to start ranks of its own: each of the {outer_world} would start a separate job of {} ranks, all writing the same output. Under another launcher, drop the launcher options (it starts the ranks); to use this launcher as the per-node agent, start one task per node and give --nnodes the number of tasks",
            self.nproc, self.nnodes, self.world_size
        )))
    }

    /// This machine as node `node_rank` of the `nnodes` that start an elastic job (its node
    /// rendezvous's answer).
    pub fn placed(&self, node_rank: usize, nnodes: usize) -> Self {
        Self {
            node_rank,
            nnodes,
            world_size: self.nproc * nnodes,
            ..self.clone()
        }
    }

    /// This machine as node `node_rank`, come after an elastic job started: its ranks join
    /// it, and the job's admission gives each its rank and world size ([`JOINING_VAR`]); until
    /// then their `RANK` and `WORLD_SIZE` are as if the job had `node_rank + 1` nodes.
    pub fn late(&self, node_rank: usize) -> Self {
        self.placed(node_rank, node_rank + 1)
    }

    /// The global rank of local rank `local_rank` of this machine.
    pub fn rank(&self, local_rank: usize) -> usize {
        self.node_rank * self.nproc + local_rank
    }

    /// `host:port` to bind the store to, on node 0 only.
    pub fn store_bind_addr(&self, port: u16) -> Option<String> {
        self.store_host.map(|host| format!("{host}:{port}"))
    }

    /// The full environment the launcher adds for local rank `local_rank`, given the store's
    /// bound `port` and the restart `attempt` (0 first): one entry per
    /// [`crate::launcher::worker_env::LAUNCHER_VARS`], in that order.
    pub fn rank_env(
        &self,
        local_rank: usize,
        port: u16,
        attempt: usize,
    ) -> Vec<(&'static str, String)> {
        vec![
            (RANK_VAR, self.rank(local_rank).to_string()),
            (WORLD_SIZE_VAR, self.world_size.to_string()),
            (LOCAL_RANK_VAR, local_rank.to_string()),
            (LOCAL_WORLD_SIZE_VAR, self.nproc.to_string()),
            (GROUP_RANK_VAR, self.node_rank.to_string()),
            (MASTER_ADDR_VAR, self.master_addr.clone()),
            (MASTER_PORT_VAR, port.to_string()),
            (TOKEN_VAR, self.token.clone()),
            (
                AGENT_STORE_VAR,
                if self.store_host.is_some() { "1" } else { "0" }.to_string(),
            ),
            (THREADS_VAR, self.threads_per_rank.clone()),
            (WORKER_VAR, "1".to_string()),
            (RESTART_COUNT_VAR, attempt.to_string()),
        ]
        .into_iter()
        .chain(self.world_size_bounds())
        .collect()
    }

    /// With `--nnodes MIN:MAX`, the fewest and the most ranks of the job, for the ranks to
    /// stop below and to refuse joiners beyond ([`MIN_WORLD_SIZE_VAR`], [`MAX_WORLD_SIZE_VAR`]).
    fn world_size_bounds(&self) -> Vec<(&'static str, String)> {
        match self.nodes.is_elastic() {
            true => vec![
                (
                    MIN_WORLD_SIZE_VAR,
                    (self.nodes.min * self.nproc).to_string(),
                ),
                (
                    MAX_WORLD_SIZE_VAR,
                    (self.nodes.max * self.nproc).to_string(),
                ),
            ],
            false => Vec::new(),
        }
    }

    /// The environment of local rank `local_rank` started again after it failed, with
    /// `--survivors-continue`: the others train on, so it joins them ([`JOINING_VAR`]);
    /// `restarts` (from 1) is the job's restart count, so fault injection does not fire again.
    pub fn rejoin_env(
        &self,
        local_rank: usize,
        port: u16,
        restarts: usize,
    ) -> Vec<(&'static str, String)> {
        let mut env = self.rank_env(local_rank, port, restarts);
        env.push((JOINING_VAR, "1".to_string()));
        env
    }

    /// Whether rank `rank`'s stderr goes through the launcher (tagged `[rank N]`, kept for the
    /// failure report, copied to `--log-dir`) rather than straight to the terminal: rank 0
    /// keeps the terminal — its progress bar needs one — unless there is a log directory.
    pub fn pipes_stderr(&self, rank: usize, stderr_is_terminal: bool) -> bool {
        rank != 0 || !stderr_is_terminal || self.log_dir.is_some()
    }

    /// Whether a failure whose rank exited with `code` (`None`: killed by a signal), after
    /// `restarts` restarts, is followed by another: while restarts are left, except after bad
    /// input (exit code 2), which fails the same way every time. Without
    /// `--survivors-continue` every rank restarts; with it, the failed rank alone, which joins
    /// the ranks that carried on.
    pub fn restarts_after(&self, code: Option<u8>, restarts: usize) -> bool {
        code != Some(USAGE_EXIT_CODE) && restarts < self.max_restarts
    }
}

/// The launcher's `RAYON_NUM_THREADS` if it has one, else the cores shared among the local
/// ranks, at least 1 each: like torchrun's `OMP_NUM_THREADS`, N ranks on a machine share its
/// cores instead of each starting a thread per core (oversubscribing it N times).
fn threads_per_rank(env: &LaunchEnv, nproc: usize) -> String {
    match &env.threads {
        Some(threads) => threads.clone(),
        None => (env.cores / nproc).max(1).to_string(),
    }
}

fn is_loopback_name(addr: &str) -> bool {
    addr == "localhost"
        || addr
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests;
