//! How a launcher enters its job, once node 0's store is up (node 0 hosts it): start it, join
//! it while it trains, or find it over.
//!
//! - `--nnodes N` (static, torchrun's static rendezvous): every node starts the job, except that
//!   with `--survivors-continue` a node other than 0 first asks node 0's store whether the job
//!   trains already (a node that comes back after its launcher or machine died), and then
//!   joins it.
//! - `--nnodes MIN:MAX` (elastic, torchrun's dynamic rendezvous): every launcher but node 0's
//!   takes a place in node 0's store (1, 2, … as they come); node 0 waits until `MIN` nodes
//!   are there (at most the join timeout), then up to the last-call timeout for more, and
//!   closes the rendezvous at the nodes there, at most `MAX`
//!   ([`NodeRange::starting_nodes`](crate::launcher::nodes::NodeRange::starting_nodes)). Those
//!   start the job, numbered by place; a launcher that comes later
//!   ([`NodePlace::Late`]) waits for the job to train and joins it.

use std::time::{Duration, Instant};

use burn_ddp::elastic::join::{job_state, JobState};
use burn_ddp::store::{Store, TcpStore};
use burn_ddp::DdpError;

use crate::error::UsageError;
use crate::launcher::launch_plan::LaunchPlan;
use crate::launcher::nodes::NodePlace;

/// How this launcher's ranks take part in the job.
#[derive(Debug)]
pub enum Entry {
    /// They start it, as the plan's node (placed by an elastic rendezvous).
    Start(LaunchPlan),
    /// It trains already: they join it.
    Join(LaunchPlan),
    /// It is over: nothing to do.
    Ended,
}

/// Store keys of the nodes' rendezvous (beside the ranks' own, which start with other words).
const PLACES: &str = "launcher/nodes/places";
const STARTING: &str = "launcher/nodes/starting";

/// How often node 0 looks at the places taken, and a late node at the job's state.
const POLL: Duration = Duration::from_millis(100);

/// How long a node other than node 0 waits, in a static job, for node 0's store to tell
/// whether the job trains already; a store not up by then is a job not started (its ranks
/// wait for it themselves).
const JOB_STATE_WAIT: Duration = Duration::from_secs(10);

/// Where this launcher's ranks enter the job whose store is at the plan's address and `port`
/// (bound already when this launcher hosts it). Prints what an elastic rendezvous decided.
///
/// # Errors
/// [`UsageError`] (exit code 2) when fewer than `MIN` nodes come within the join timeout;
/// an error naming the store when it cannot be reached or fails within the deadlines.
pub fn enter(plan: &LaunchPlan, port: u16) -> anyhow::Result<Entry> {
    if !plan.nodes.is_elastic() {
        return Ok(match static_job_state(plan, port) {
            JobState::NotStarted => Entry::Start(plan.clone()),
            JobState::Training => Entry::Join(plan.clone()),
            JobState::Ended => Entry::Ended,
        });
    }
    let hosting = plan.store_host.is_some();
    // Node 0 reaches its own store over loopback (it listens on every interface).
    let endpoint = match hosting {
        true => format!("127.0.0.1:{port}"),
        false => format!("{}:{port}", plan.master_addr),
    };
    let store = TcpStore::connect(&endpoint, &plan.token, plan.rendezvous.join)
        .map_err(|e| anyhow::anyhow!("the nodes' rendezvous at {endpoint}: {e}"))?;
    if hosting {
        let nodes = close_rendezvous(&store, plan)?;
        eprintln!(
            "trainer launcher: {nodes} node(s) start the job (--nnodes {}; world size {}); a node that comes later joins it",
            plan.nodes,
            nodes * plan.nproc
        );
        return Ok(Entry::Start(plan.placed(0, nodes)));
    }
    let place = usize::try_from(store.add(PLACES, 1)?).unwrap_or(0);
    let starting = store
        .get(STARTING, plan.rendezvous.join)
        .map_err(|e| anyhow::anyhow!("waiting for node 0 at {endpoint} to start the job: {e}"))?;
    let nodes = String::from_utf8_lossy(&starting)
        .parse::<usize>()
        .map_err(|_| anyhow::anyhow!("node 0's store holds no node count under {STARTING}"))?;
    match NodePlace::of(place, nodes) {
        NodePlace::Member { node_rank, nodes } => {
            eprintln!(
                "trainer launcher: this machine is node {node_rank} of the {nodes} that start the job"
            );
            Ok(Entry::Start(plan.placed(node_rank, nodes)))
        }
        NodePlace::Late { node_rank } => match wait_until_trained(&store, plan, &endpoint)? {
            JobState::Ended => Ok(Entry::Ended),
            _ => Ok(Entry::Join(plan.late(node_rank))),
        },
    }
}

/// Node 0: waits for `MIN` nodes (join timeout), then for more up to `MAX` (last call), and
/// writes how many start the job.
fn close_rendezvous(store: &TcpStore, plan: &LaunchPlan) -> anyhow::Result<usize> {
    let range = plan.nodes;
    let arrived =
        || -> anyhow::Result<usize> { Ok(usize::try_from(store.add(PLACES, 0)?).unwrap_or(0)) };
    let join_deadline = Instant::now() + plan.rendezvous.join;
    let mut seen = arrived()?;
    while range.starting_nodes(seen).is_none() {
        if Instant::now() >= join_deadline {
            return Err(UsageError(format!(
                "only {} of the at least {} nodes of --nnodes {range} came within --rdzv-join-timeout {} s: no rank was started; start the others with the same --master-addr and --master-port, or lower MIN",
                1 + seen,
                range.min,
                plan.rendezvous.join.as_secs()
            ))
            .into());
        }
        std::thread::sleep(POLL);
        seen = arrived()?;
    }
    let last_call = Instant::now() + plan.rendezvous.last_call;
    while 1 + seen < range.max && Instant::now() < last_call {
        std::thread::sleep(POLL);
        seen = arrived()?;
    }
    let nodes = range.starting_nodes(seen).unwrap_or(range.min);
    store.set(STARTING, nodes.to_string().as_bytes())?;
    Ok(nodes)
}

/// A node that came after the rendezvous closed: waits until the job trains (its ranks can
/// join only then) or is over, at most the join timeout.
fn wait_until_trained(
    store: &TcpStore,
    plan: &LaunchPlan,
    endpoint: &str,
) -> anyhow::Result<JobState> {
    let deadline = Instant::now() + plan.rendezvous.join;
    loop {
        match job_state(store)? {
            JobState::NotStarted if Instant::now() < deadline => std::thread::sleep(POLL),
            JobState::NotStarted => anyhow::bail!(
                "the job at {endpoint} did not start training within --rdzv-join-timeout {} s, so this node cannot join it",
                plan.rendezvous.join.as_secs()
            ),
            state => return Ok(state),
        }
    }
}

/// A static job with `--survivors-continue`: a node other than node 0 (which hosts the store:
/// when it starts, nothing trains) asks node 0's store, so that a node that comes back (its
/// launcher killed, its machine restarted) joins the job its ranks left instead of starting
/// another. Anything else, or a store that does not answer within [`JOB_STATE_WAIT`], is a
/// job not started.
fn static_job_state(plan: &LaunchPlan, port: u16) -> JobState {
    if !plan.survivors_continue || plan.node_rank == 0 {
        return JobState::NotStarted;
    }
    let endpoint = format!("{}:{port}", plan.master_addr);
    let state = TcpStore::connect(&endpoint, &plan.token, JOB_STATE_WAIT)
        .map_err(DdpError::from)
        .and_then(|store| job_state(&store));
    state.unwrap_or_else(|e| {
        tracing::debug!("no job state from the store at {endpoint} ({e}): starting the job");
        JobState::NotStarted
    })
}

#[cfg(test)]
mod tests {
    use burn_ddp::store::TcpStoreServer;

    use super::{enter, Entry};
    use crate::launcher::launch_plan::{LaunchArgs, LaunchEnv, LaunchPlan};
    use crate::launcher::nodes::NodeRange;

    /// Node `node_rank` (0 hosts, any other does not) of a `2:3` job whose store is at `port`,
    /// with no last call and a join timeout of `join` seconds.
    fn plan(node_rank: usize, port: u16, join: u64) -> LaunchPlan {
        let args = LaunchArgs {
            nproc_per_node: Some(2),
            nnodes: NodeRange { min: 2, max: 3 },
            node_rank: Some(node_rank),
            master_addr: Some("127.0.0.1".into()),
            master_port: Some(port),
            survivors_continue: true,
            rdzv_join_timeout: join,
            rdzv_last_call_timeout: 0,
            ..LaunchArgs::default()
        };
        let env = LaunchEnv {
            cores: 2,
            threads: None,
            token: "rendezvous-test".into(),
            master_addr_is_here: false,
        };
        LaunchPlan::new(&args, &env).expect("a valid plan")
    }

    fn placed(entry: anyhow::Result<Entry>) -> (&'static str, usize, usize) {
        match entry {
            Ok(Entry::Start(plan)) => ("start", plan.node_rank, plan.world_size),
            Ok(Entry::Join(plan)) => ("join", plan.node_rank, plan.world_size),
            Ok(Entry::Ended) => ("ended", 0, 0),
            Err(e) => panic!("{e:#}"),
        }
    }

    /// Over a real store on loopback: node 0 waits for a second node (MIN 2), both start the
    /// job as nodes 0 and 1 of 2; a third launcher, come after the rendezvous closed, waits
    /// for the job to train and joins it as node 2.
    #[test]
    fn two_nodes_start_the_job_and_a_third_that_comes_later_joins_it() {
        let server = TcpStoreServer::bind("127.0.0.1:0", "rendezvous-test").expect("a store");
        let port = server.local_addr().port();
        let host = std::thread::spawn(move || placed(enter(&plan(0, port, 60), port)));
        let other = std::thread::spawn(move || placed(enter(&plan(1, port, 60), port)));
        let (host, other) = (host.join(), other.join());
        assert_eq!(host.ok(), Some(("start", 0, 4)));
        assert_eq!(other.ok(), Some(("start", 1, 4)));

        let late = std::thread::spawn(move || placed(enter(&plan(1, port, 60), port)));
        let store = burn_ddp::store::TcpStore::connect(
            &format!("127.0.0.1:{port}"),
            "rendezvous-test",
            std::time::Duration::from_secs(30),
        )
        .expect("the store");
        assert!(burn_ddp::elastic::join::open(&store).is_ok());
        assert_eq!(late.join().ok(), Some(("join", 2, 6)));
    }

    /// Node 0 alone, MIN 2: at the join timeout it stops, naming how many came (exit code 2).
    #[test]
    fn fewer_nodes_than_min_by_the_join_timeout_is_an_error_with_the_numbers() {
        let server = TcpStoreServer::bind("127.0.0.1:0", "rendezvous-test").expect("a store");
        let port = server.local_addr().port();
        let error = match enter(&plan(0, port, 0), port) {
            Err(e) => e,
            Ok(entry) => panic!("started: {entry:?}"),
        };
        assert!(
            error.downcast_ref::<crate::error::UsageError>().is_some(),
            "{error:#}"
        );
        let text = error.to_string();
        assert!(
            text.contains("only 1 of the at least 2 nodes of --nnodes 2:3"),
            "{text}"
        );
    }
}
