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
mod tests {
    use super::*;
    use crate::launcher::worker_env::LAUNCHER_VARS;

    fn env(cores: usize) -> LaunchEnv {
        LaunchEnv {
            cores,
            threads: None,
            token: "secret".into(),
            master_addr_is_here: false,
        }
    }

    fn args(nproc: usize) -> LaunchArgs {
        LaunchArgs {
            nproc_per_node: Some(nproc),
            nnodes: NodeRange::exactly(1),
            ..LaunchArgs::default()
        }
    }

    fn error(args: &LaunchArgs) -> String {
        LaunchPlan::new(args, &env(8)).unwrap_err().0
    }

    #[test]
    fn any_launcher_option_asks_for_the_launcher_with_one_rank_by_default() {
        let none = LaunchArgs {
            nnodes: NodeRange::exactly(1),
            ..LaunchArgs::default()
        };
        assert!(!none.requested());
        let asking = [
            args(2),
            LaunchArgs {
                nnodes: NodeRange::exactly(2),
                ..none.clone()
            },
            LaunchArgs {
                node_rank: Some(1),
                ..none.clone()
            },
            LaunchArgs {
                master_addr: Some("10.0.0.1".into()),
                ..none.clone()
            },
            LaunchArgs {
                master_port: Some(29500),
                ..none.clone()
            },
            LaunchArgs {
                log_dir: Some("logs".into()),
                ..none.clone()
            },
            LaunchArgs {
                max_restarts: 3,
                ..none.clone()
            },
        ];
        for asks in &asking {
            assert!(asks.requested(), "{asks:?}");
        }
        assert_eq!(asking[6].ranks_here(), 1);
        let plan = LaunchPlan::new(&asking[6], &env(8)).unwrap();
        assert_eq!((plan.nproc, plan.world_size, plan.max_restarts), (1, 1, 3));
    }

    #[test]
    fn a_launch_inside_a_rank_of_another_launcher_is_refused_unless_it_is_the_node_agent() {
        let plan = LaunchPlan::new(&args(2), &env(8)).unwrap();
        // Not under another launcher, or in a job of one process: nothing to refuse.
        assert!(plan.check_outer_job(0, 1).is_ok());
        // torchrun --nproc-per-node 2 ... trainer --nproc-per-node 2: two separate jobs.
        let nested = plan.check_outer_job(1, 2).unwrap_err().0;
        assert!(nested.contains("already rank 1 of 2"), "{nested}");
        assert!(nested.contains("drop the launcher options"), "{nested}");
        // srun --ntasks-per-node 1 -N 2 trainer --nproc-per-node 2 --nnodes 2 --node-rank R.
        let agent = LaunchArgs {
            nnodes: NodeRange::exactly(2),
            node_rank: Some(1),
            master_addr: Some("node01".into()),
            ..args(2)
        };
        let plan = LaunchPlan::new(&agent, &env(8)).unwrap();
        assert!(plan.check_outer_job(1, 2).is_ok());
        assert!(plan.check_outer_job(1, 4).is_err());
    }

    #[test]
    fn node_1_of_2_with_3_procs_gets_ranks_3_to_5_and_their_environment() {
        let args = LaunchArgs {
            nproc_per_node: Some(3),
            nnodes: NodeRange::exactly(2),
            node_rank: Some(1),
            master_addr: Some("10.0.0.1".into()),
            ..LaunchArgs::default()
        };
        let plan = LaunchPlan::new(&args, &env(12)).unwrap();
        assert_eq!(plan.world_size, 6);
        assert_eq!((0..3).map(|l| plan.rank(l)).collect::<Vec<_>>(), [3, 4, 5]);
        // Node 1 joins node 0's store on torchrun's default port; it hosts none.
        assert_eq!(plan.port, DEFAULT_MULTI_NODE_PORT);
        assert_eq!(plan.store_bind_addr(plan.port), None);

        let env = plan.rank_env(2, 29500, 1);
        let names: Vec<&str> = env.iter().map(|(name, _)| *name).collect();
        assert_eq!(names, LAUNCHER_VARS);
        let value = |name: &str| env.iter().find(|(n, _)| *n == name).unwrap().1.as_str();
        assert_eq!(value("RANK"), "5");
        assert_eq!(value("WORLD_SIZE"), "6");
        assert_eq!(value("LOCAL_RANK"), "2");
        assert_eq!(value("LOCAL_WORLD_SIZE"), "3");
        assert_eq!(value("GROUP_RANK"), "1");
        assert_eq!(value("MASTER_ADDR"), "10.0.0.1");
        assert_eq!(value("MASTER_PORT"), "29500");
        assert_eq!(value("BURN_DDP_TOKEN"), "secret");
        assert_eq!(value("BURN_DDP_USE_AGENT_STORE"), "0");
        assert_eq!(value("RAYON_NUM_THREADS"), "4");
        assert_eq!(value("TRAINER_WORKER"), "1");
        assert_eq!(value("TRAINER_RESTART_COUNT"), "1");
    }

    #[test]
    fn node_0_hosts_the_store_on_loopback_alone_and_on_every_interface_with_others() {
        let alone = LaunchPlan::new(&args(2), &env(8)).unwrap();
        assert_eq!(alone.master_addr, "127.0.0.1");
        assert_eq!(alone.port, 0, "one machine: the OS picks a free port");
        assert_eq!(
            alone.store_bind_addr(41234).as_deref(),
            Some("127.0.0.1:41234")
        );
        assert_eq!(
            alone.rank_env(0, 41234, 0)[8],
            (AGENT_STORE_VAR, "1".into())
        );

        let first_of_two = LaunchArgs {
            nnodes: NodeRange::exactly(2),
            master_addr: Some("10.0.0.1".into()),
            master_port: Some(29400),
            ..args(2)
        };
        let plan = LaunchPlan::new(&first_of_two, &env(8)).unwrap();
        assert_eq!(
            plan.store_bind_addr(plan.port).as_deref(),
            Some("0.0.0.0:29400")
        );
        assert_eq!(plan.rank(1), 1);

        // One machine, but a non-loopback address: other hosts may be meant to reach it.
        let public = LaunchArgs {
            master_addr: Some("192.168.1.5".into()),
            ..args(2)
        };
        let plan = LaunchPlan::new(&public, &env(8)).unwrap();
        assert_eq!(plan.store_host, Some("0.0.0.0"));
    }

    #[test]
    fn ranks_share_the_cores_unless_rayon_num_threads_is_set() {
        let threads = |nproc, cores| {
            LaunchPlan::new(&args(nproc), &env(cores))
                .unwrap()
                .threads_per_rank
        };
        assert_eq!(threads(1, 16), "16");
        assert_eq!(threads(3, 16), "5");
        assert_eq!(threads(4, 2), "1", "at least one thread per rank");
        let given = LaunchEnv {
            threads: Some("7".into()),
            ..env(16)
        };
        let plan = LaunchPlan::new(&args(4), &given).unwrap();
        assert_eq!(plan.threads_per_rank, "7");
    }

    #[test]
    fn bad_options_are_usage_errors_naming_the_option() {
        assert_eq!(error(&args(0)), "--nproc-per-node must be at least 1");
        assert_eq!(
            error(&LaunchArgs {
                nnodes: NodeRange::exactly(0),
                ..args(1)
            }),
            "--nnodes must be at least 1"
        );
        let out_of_range = error(&LaunchArgs {
            nnodes: NodeRange::exactly(2),
            node_rank: Some(2),
            master_addr: Some("10.0.0.1".into()),
            ..args(1)
        });
        assert!(
            out_of_range.contains("--node-rank 2 is not in 0..2"),
            "{out_of_range}"
        );
        let no_addr = error(&LaunchArgs {
            nnodes: NodeRange::exactly(2),
            node_rank: Some(1),
            ..args(1)
        });
        assert!(no_addr.contains("--master-addr"), "{no_addr}");
        assert!(no_addr.contains("--nnodes 2"), "{no_addr}");
        let port_0 = error(&LaunchArgs {
            nnodes: NodeRange::exactly(2),
            master_addr: Some("10.0.0.1".into()),
            master_port: Some(0),
            ..args(1)
        });
        assert!(port_0.contains("--master-port 0"), "{port_0}");
    }

    #[test]
    fn nproc_defaults_to_one() {
        let args = LaunchArgs {
            nproc_per_node: None,
            ..args(1)
        };
        let plan = LaunchPlan::new(&args, &env(8)).unwrap();
        assert_eq!((plan.nproc, plan.world_size, plan.rank(0)), (1, 1, 0));
    }

    #[test]
    fn rank_0_keeps_the_terminal_unless_logs_are_kept() {
        let plan = LaunchPlan::new(&args(2), &env(8)).unwrap();
        assert!(!plan.pipes_stderr(0, true));
        assert!(plan.pipes_stderr(0, false));
        assert!(plan.pipes_stderr(1, true));
        let logged = LaunchArgs {
            log_dir: Some("logs".into()),
            ..args(2)
        };
        let plan = LaunchPlan::new(&logged, &env(8)).unwrap();
        assert!(plan.pipes_stderr(0, true));
    }

    #[test]
    fn restarts_while_left_but_never_after_bad_input() {
        let plan = LaunchPlan::new(
            &LaunchArgs {
                max_restarts: 2,
                ..args(2)
            },
            &env(8),
        )
        .unwrap();
        assert!(plan.restarts_after(Some(1), 0));
        assert!(plan.restarts_after(None, 1), "killed by a signal");
        assert!(!plan.restarts_after(Some(1), 2), "no restarts left");
        assert!(!plan.restarts_after(Some(USAGE_EXIT_CODE), 0));
    }

    #[test]
    fn a_rank_started_again_to_join_is_told_so_and_past_its_faults() {
        let plan = LaunchPlan::new(
            &LaunchArgs {
                max_restarts: 1,
                survivors_continue: true,
                ..args(3)
            },
            &env(8),
        )
        .unwrap();
        let env = plan.rejoin_env(1, 4242, 1);
        let get = |name: &str| env.iter().find(|(k, _)| *k == name).map(|(_, v)| v.clone());
        assert_eq!(get(JOINING_VAR).as_deref(), Some("1"));
        assert_eq!(get(RESTART_COUNT_VAR).as_deref(), Some("1"));
        assert_eq!(get(RANK_VAR).as_deref(), Some("1"));
        assert!(plan
            .rank_env(1, 4242, 0)
            .iter()
            .all(|(k, _)| *k != JOINING_VAR));
    }

    #[test]
    fn an_elastic_job_needs_its_survivors_and_numbers_its_nodes_as_they_come() {
        let elastic = LaunchArgs {
            nnodes: NodeRange { min: 1, max: 3 },
            master_addr: Some("10.0.0.1".into()),
            survivors_continue: true,
            ..args(2)
        };
        let refused = error(&LaunchArgs {
            survivors_continue: false,
            ..elastic.clone()
        });
        assert!(refused.contains("--nnodes 1:3"), "{refused}");
        assert!(refused.contains("--survivors-continue"), "{refused}");

        // Without --node-rank, node 0 is the machine that has --master-addr.
        let here = LaunchEnv {
            master_addr_is_here: true,
            ..env(8)
        };
        let host = LaunchPlan::new(&elastic, &here).unwrap();
        assert_eq!((host.node_rank, host.nnodes, host.world_size), (0, 3, 6));
        assert!(host.store_bind_addr(29500).is_some());
        let other = LaunchPlan::new(&elastic, &env(8)).unwrap();
        assert!(other.store_bind_addr(29500).is_none());
        // Given, 0 hosts and any other number does not (several nodes on one machine).
        let numbered = |node_rank, env: &LaunchEnv| {
            LaunchPlan::new(
                &LaunchArgs {
                    node_rank: Some(node_rank),
                    ..elastic.clone()
                },
                env,
            )
            .unwrap()
            .store_bind_addr(29500)
            .is_some()
        };
        assert!(numbered(0, &env(8)));
        assert!(!numbered(2, &here));

        // The rendezvous places it second of 2 nodes: ranks 2 and 3 of 4, told the bounds.
        let placed = other.placed(1, 2);
        assert_eq!((placed.world_size, placed.rank(1)), (4, 3));
        let vars = placed.rank_env(1, 29500, 0);
        let get = |name: &str| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(get(RANK_VAR).as_deref(), Some("3"));
        assert_eq!(get(WORLD_SIZE_VAR).as_deref(), Some("4"));
        assert_eq!(get(MIN_WORLD_SIZE_VAR).as_deref(), Some("2"));
        assert_eq!(get(MAX_WORLD_SIZE_VAR).as_deref(), Some("6"));
        // Come late, as fourth: its ranks' provisional numbers lie within their world.
        let late = other.late(3);
        assert_eq!((late.rank(1), late.world_size), (7, 8));
        // A fixed --nnodes tells no bounds.
        let fixed = LaunchPlan::new(&args(2), &env(8))
            .unwrap()
            .rank_env(0, 1, 0);
        assert!(fixed.iter().all(|(k, _)| *k != MIN_WORLD_SIZE_VAR));
    }
}
