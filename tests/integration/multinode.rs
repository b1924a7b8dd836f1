//! Two "machines" on one host: network namespaces joined by a veth pair, each with its own
//! address, running 2 nodes x 2 ranks. Needs root (CAP_NET_ADMIN) and `ip`; where namespaces
//! cannot be created the test records a skip ([`burn_ddp::testing::skip`], a failure where
//! `TESTS_MUST_RUN` names `netns`) and returns.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use burn_ddp::testing::Needs;

use crate::common::*;

/// Two namespaces, `<tag>a` (10.77.x.1) and `<tag>b` (10.77.x.2), removed on drop.
struct Hosts {
    a: String,
    b: String,
    addr_a: String,
    addr_b: String,
    veth: String,
}

impl Hosts {
    fn create(tag: &str, subnet: u8) -> Option<Hosts> {
        let pid = std::process::id() % 10000;
        let a = format!("ddp{tag}{pid}a");
        let b = format!("ddp{tag}{pid}b");
        let veth = format!("v{tag}{pid}");
        let hosts = Hosts {
            a: a.clone(),
            b: b.clone(),
            addr_a: format!("10.77.{subnet}.1"),
            addr_b: format!("10.77.{subnet}.2"),
            veth: veth.clone(),
        };
        let steps: Vec<Vec<String>> = vec![
            vec!["netns", "add", &a],
            vec!["netns", "add", &b],
            vec![
                "link",
                "add",
                &format!("{veth}a"),
                "type",
                "veth",
                "peer",
                "name",
                &format!("{veth}b"),
            ],
            vec!["link", "set", &format!("{veth}a"), "netns", &a],
            vec!["link", "set", &format!("{veth}b"), "netns", &b],
            vec![
                "-n",
                &a,
                "addr",
                "add",
                &format!("10.77.{subnet}.1/24"),
                "dev",
                &format!("{veth}a"),
            ],
            vec![
                "-n",
                &b,
                "addr",
                "add",
                &format!("10.77.{subnet}.2/24"),
                "dev",
                &format!("{veth}b"),
            ],
            vec!["-n", &a, "link", "set", &format!("{veth}a"), "up"],
            vec!["-n", &b, "link", "set", &format!("{veth}b"), "up"],
            vec!["-n", &a, "link", "set", "lo", "up"],
            vec!["-n", &b, "link", "set", "lo", "up"],
        ]
        .into_iter()
        .map(|v| v.into_iter().map(String::from).collect())
        .collect();
        for step in steps {
            let ok = Command::new("ip")
                .args(&step)
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false);
            if !ok {
                burn_ddp::testing::skip(
                    Needs::Netns,
                    &format!(
                        "cannot create network namespaces here (`ip {}` failed; needs root and iproute2)",
                        step.join(" ")
                    ),
                );
                return None;
            }
        }
        Some(hosts)
    }

    /// The trainer, run inside namespace `ns`, as node `node` of 2 with 2 ranks each.
    fn node(&self, ns: &str, node: usize, args: &[&str], port: u16) -> Command {
        let node = node.to_string();
        self.node_of(ns, &["--nnodes", "2", "--node-rank", &node], args, port)
    }

    /// The trainer with config `cfg`, run inside namespace `ns` with 2 ranks as a node of an
    /// elastic job of `range` nodes (the same command on every node), with a last call of 1 s;
    /// rank 0 20 ms slower per step, so that the run lasts long enough for a node to come.
    fn elastic_node(&self, ns: &str, range: &str, cfg: &str) -> Command {
        let elastic = ["--nnodes", range, "--rdzv-last-call-timeout", "1"];
        let mut cmd = self.node_of(ns, &elastic, &["--config", cfg], STORE_PORT);
        cmd.env("TRAINER_SLOW_STEP", "0:20");
        cmd
    }

    /// The trainer, run inside namespace `ns` with 2 ranks, as the `nodes` options say.
    fn node_of(&self, ns: &str, nodes: &[&str], args: &[&str], port: u16) -> Command {
        let cmd = trainer();
        let program = cmd.get_program().to_owned();
        let mut inner = Command::new("ip");
        inner.args(["netns", "exec", ns]).arg(program).args(args);
        inner.args(["--nproc-per-node", "2"]).args(nodes);
        inner.args([
            "--master-addr",
            &self.addr_a,
            "--master-port",
            &port.to_string(),
        ]);
        inner.env("BURN_DDP_TOKEN", "multinode-test-token");
        if let Some(dir) = cmd.get_current_dir() {
            inner.current_dir(dir);
        }
        inner
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &format!("{}a", self.veth)])
            .output();
    }
}

/// The store's port on node a: its namespace is new, with ports of its own, so no other
/// process can hold this one.
const STORE_PORT: u16 = 29500;

fn config(dir: &Path, name: &str) -> std::path::PathBuf {
    write_config(dir, name, &digits_config(SGD, 8, "max_steps = 12"))
}

/// Trains 2 nodes x 2 ranks between the namespaces `hosts` and 4 local ranks with `config`
/// (the same ring order) and requires the same final weights, bit for bit.
fn nodes_train_exactly_like_local_ranks(
    hosts: &Hosts,
    scratch_name: &str,
    config: impl Fn(&Path, &str) -> std::path::PathBuf,
) {
    let dir = scratch(scratch_name);
    let nodes = config(&dir, "nodes");
    let local = config(&dir, "local");
    let port = STORE_PORT;
    let cfg = nodes.display().to_string();
    let a = spawn(&mut hosts.node(&hosts.a, 0, &["--config", &cfg], port));
    let b = spawn(&mut hosts.node(&hosts.b, 1, &["--config", &cfg], port));
    let (a, b) = (finish(a), finish(b));
    assert_eq!(a.code, Some(0), "node 0:\n{}", a.all());
    assert_eq!(b.code, Some(0), "node 1:\n{}", b.all());
    let out = run(trainer()
        .arg("--config")
        .arg(&local)
        .args(["--nproc-per-node", "4"]));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_eq!(
        max_abs_diff(&final_weights(&dir, "nodes"), &final_weights(&dir, "local")),
        0.0,
        "same ring order, same reductions: bit-identical"
    );
}

#[test]
fn two_nodes_of_two_ranks_train_exactly_like_four_local_ranks() {
    let Some(hosts) = Hosts::create("t", 1) else {
        return;
    };
    nodes_train_exactly_like_local_ranks(&hosts, "multinode", config);
}

/// The staged ring with bf16 pieces (rounded, summed, widened piece by piece while others
/// cross the link between the namespaces) gives the bits of the same job on one host.
#[test]
fn bf16_gradients_between_nodes_train_exactly_like_four_local_ranks() {
    let Some(hosts) = Hosts::create("h", 3) else {
        return;
    };
    nodes_train_exactly_like_local_ranks(&hosts, "multinode-bf16", |dir, name| {
        let toml = digits_config(SGD, 8, "max_steps = 12")
            + "\n[distributed]\ngradient_compression = \"bf16\"\n";
        write_config(dir, name, &toml)
    });
}

#[test]
fn a_cut_link_stops_every_rank_with_a_clear_error() {
    let Some(hosts) = Hosts::create("c", 2) else {
        return;
    };
    let port = STORE_PORT;
    let args = [
        "collectives",
        "--op",
        "all_reduce",
        "--len",
        "65536",
        "--iters",
        "1000000",
        "--timeout-secs",
        "5",
    ];
    let mut a = spawn(&mut hosts.node(&hosts.a, 0, &args, port));
    let b = spawn(&mut hosts.node(&hosts.b, 1, &args, port));
    // Once rank 0 (on node a) has passed the set-up barrier, every link of the ring works and
    // every rank is past its set-up (its "ring connected" comes before the barrier, when a
    // rank across the link may still be connecting): pull the cable on node b's side.
    a.wait_for_line("process group ready");
    let cut = Command::new("ip")
        .args([
            "-n",
            &hosts.b,
            "link",
            "set",
            &format!("{}b", hosts.veth),
            "down",
        ])
        .status()
        .unwrap();
    assert!(cut.success());
    let cut_at = Instant::now();
    let (a, b) = (finish(a), finish(b));
    eprintln!("link cut: both nodes exited within {:?}", cut_at.elapsed());
    // Ranks 0 and 1 run on node a, 2 and 3 on node b. Each node must fail with the ring's own
    // error (a lost connection, or a collective's timeout saying whom it waited for) naming a
    // ring peer by rank and address; a store's timeout ("rendezvous store at ...: ... timed out
    // after") names none. The rank waiting on the cut link (0 for rank 3's data, 2 for rank
    // 1's) names the rank across it; its node neighbour, waiting on it in turn, may fail first
    // naming it (the launcher then stops the other), so the rank across the cut is required of
    // one node at least.
    let addr_of = |rank: usize| {
        if rank < 2 {
            &hosts.addr_a
        } else {
            &hosts.addr_b
        }
    };
    let ring_failure = |line: &str, peers: &[usize]| {
        (line.contains("connection with rank")
            || (line.contains("timed out after") && line.contains("waiting for")))
            && !line.contains("rendezvous store")
            && peers
                .iter()
                .any(|&p| line.contains(&format!("rank {p} ({}:", addr_of(p))))
    };
    let mut named_across = false;
    for (node, out, across) in [(0, &a, [2, 3]), (1, &b, [0, 1])] {
        assert_ne!(out.code, Some(0), "node {node} must fail:\n{}", out.all());
        assert!(
            out.stderr.lines().any(|l| ring_failure(l, &[0, 1, 2, 3])),
            "node {node} names the failed collective and a ring peer's rank and address:\n{}",
            out.all()
        );
        named_across |= out.stderr.lines().any(|l| ring_failure(l, &across));
        assert!(
            out.stderr.contains("trainer launcher: rank"),
            "node {node}'s launcher reports the rank:\n{}",
            out.all()
        );
    }
    assert!(
        named_across,
        "a rank names the rank and address across the cut link:\n{}\n{}",
        a.all(),
        b.all()
    );
}

/// How node 1 is lost.
#[derive(Clone, Copy, Debug)]
enum Loss {
    /// Its launcher killed with SIGKILL (its ranks die with it, by `PR_SET_PDEATHSIG`).
    LauncherKilled,
    /// Its link pulled: its ranks live on, cut off from node 0 and from the store, which node 0
    /// knows by their silent heartbeats (not by the collectives' deadline of 600 s). Then its
    /// launcher is killed and the link put back.
    LinkCut,
}

/// A node lost and back, with `--survivors-continue` on both nodes: node 1 is lost as `loss`
/// says once the job has trained 40 steps; node 0's ranks carry on alone; node 1's launcher
/// started again with the same command finds the job training and its ranks join it. Both
/// nodes end with exit code 0, the metrics record the lost ranks and the joined ones, and the
/// model reaches the accuracy of an uninterrupted run of the same config on 4 local ranks.
fn node_1_lost_and_back(tag: &str, subnet: u8, loss: Loss) {
    let Some(hosts) = Hosts::create(tag, subnet) else {
        return;
    };
    let dir = scratch(&format!("multinode-elastic-{tag}"));
    let body = long_continued_config();
    let nodes = write_config(&dir, "nodes", &body);
    let cfg = nodes.display().to_string();
    let args = ["--config", &cfg, "--survivors-continue"];
    // Rank 0 (node 0) 20 ms slower per step: the run lasts long enough for node 1 to come
    // back (about 300 × 20 ms).
    let node = |ns: &str, n: usize| {
        let mut cmd = hosts.node(ns, n, &args, STORE_PORT);
        cmd.env("TRAINER_SLOW_STEP", "0:20");
        cmd
    };
    let mut a = spawn(&mut node(&hosts.a, 0));
    let b = spawn(&mut node(&hosts.b, 1));
    a.wait_for_line("step-00000040");
    let link = |state: &str| {
        let veth = format!("{}b", hosts.veth);
        let set = Command::new("ip")
            .args(["-n", &hosts.b, "link", "set", &veth, state])
            .status();
        assert!(set.is_ok_and(|s| s.success()), "ip link set {veth} {state}");
    };
    if let Loss::LinkCut = loss {
        link("down");
        a.wait_for_line("training on with 2 ranks");
    }
    // The launcher alone (`ip netns exec` runs it in its own process).
    signal(b.id(), libc::SIGKILL);
    let b = finish(b);
    assert_eq!(b.signal, Some(9), "node 1's launcher:\n{}", b.all());
    if let Loss::LinkCut = loss {
        link("up");
    }
    let again = finish(spawn(&mut node(&hosts.b, 1)));
    assert_eq!(
        again.code,
        Some(0),
        "node 1 started again:\n{}",
        again.all()
    );
    assert_says(
        &again.stderr,
        &["is training already: the 2 rank(s) of node 1 join it"],
        &again,
    );
    let a = finish(a);
    assert_eq!(a.code, Some(0), "node 0:\n{}", a.all());
    // Node 1's 2 ranks join at one step boundary, or at two (each at the first boundary
    // after rank 0 saw its request).
    assert_says(&a.stdout, &["; ranks joined it "], &a);
    if let Loss::LinkCut = loss {
        assert_says(&a.stderr, &["silent for"], &a);
    }
    if a.stderr.contains("one behind the others") {
        // The cut fell between a survivor's end of a step and the other's.
        eprintln!("{loss:?}: a survivor one step behind went on from rank 0's state");
    }

    assert_eq!(
        membership_with_joins_together(&dir),
        vec![
            (2, serde_json::json!([2, 3]), serde_json::json!([])),
            (4, serde_json::json!([]), serde_json::json!([2, 3])),
        ],
        "{loss:?}: {}",
        a.all()
    );

    assert_as_accurate_as_local_ranks(&dir, &body, &a, 4, &format!("{loss:?}"));
}

/// 300 steps of the digits MLP in `"continue"` mode, a checkpoint every 20.
fn long_continued_config() -> String {
    digits_config(SGD, 8, "max_steps = 300")
        .replace("epochs = 3", "epochs = 10")
        .replace("every_epochs = 0", "every_epochs = 0\nevery_steps = 20")
        + "\n[distributed]\ntimeout_secs = 600\n[fault_tolerance]\non_rank_failure = \"continue\"\n"
}

/// The job's changes of membership in `dir`'s `nodes` run: (world size, lost, joined).
fn membership_changes(dir: &Path) -> Vec<(u64, serde_json::Value, serde_json::Value)> {
    let metrics = std::fs::read_to_string(dir.join("nodes-out/metrics.jsonl")).unwrap_or_default();
    metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|r| r["kind"] == "regroup")
        .map(|r| {
            (
                r["world_size"].as_u64().unwrap_or(0),
                r["lost"].clone(),
                r["joined"].clone(),
            )
        })
        .collect()
}

/// [`membership_changes`] with joins in a row taken as one (world size after the last): a
/// node's ranks ask to join at about the same time, and the job admits them at one step
/// boundary or at neighbouring ones.
fn membership_with_joins_together(dir: &Path) -> Vec<(u64, serde_json::Value, serde_json::Value)> {
    let is_join = |lost: &serde_json::Value, joined: &serde_json::Value| {
        lost.as_array().is_some_and(Vec::is_empty)
            && joined.as_array().is_some_and(|j| !j.is_empty())
    };
    let mut merged: Vec<(u64, serde_json::Value, serde_json::Value)> = Vec::new();
    for (world, lost, joined) in membership_changes(dir) {
        match merged.last_mut() {
            Some((last_world, last_lost, last_joined))
                if is_join(&lost, &joined) && is_join(last_lost, last_joined) =>
            {
                *last_world = world;
                if let (Some(all), Some(more)) = (last_joined.as_array_mut(), joined.as_array()) {
                    all.extend(more.iter().cloned());
                    all.sort_by_key(|rank| rank.as_u64());
                }
            }
            _ => merged.push((world, lost, joined)),
        }
    }
    merged
}

/// The run `elastic` reached the accuracy of an uninterrupted run of config `body` on `ranks`
/// local ranks (within 2 points).
fn assert_as_accurate_as_local_ranks(
    dir: &Path,
    body: &str,
    elastic: &Output,
    ranks: usize,
    what: &str,
) {
    let local = write_config(dir, "local", body);
    let out = run(trainer()
        .arg("--config")
        .arg(&local)
        .args(["--nproc-per-node", &ranks.to_string()]));
    assert_eq!(out.code, Some(0), "{}", out.all());
    let (elastic, uninterrupted) = (final_accuracy(elastic), final_accuracy(&out));
    eprintln!("{what}: final accuracy {elastic}%, {uninterrupted}% uninterrupted on {ranks} ranks");
    assert!(
        elastic >= uninterrupted - 2.0,
        "{what}: {elastic}% against {uninterrupted}% uninterrupted"
    );
}

#[test]
fn a_node_whose_launcher_dies_leaves_node_0_training_and_joins_again_when_started() {
    node_1_lost_and_back("e", 4, Loss::LauncherKilled);
}

#[test]
fn a_node_cut_off_leaves_node_0_training_and_joins_again_when_started() {
    node_1_lost_and_back("k", 5, Loss::LinkCut);
}

/// `--nnodes 1:2`, the same command on both machines (node 0 is the one that has
/// `--master-addr`): node 0 starts the job alone once the last call is over, node 1 started
/// later finds it training and its ranks join, and the run trains at least as well as node 0's
/// 2 ranks alone.
#[test]
fn a_job_of_1_to_2_nodes_starts_on_node_0_alone_and_grows_when_node_1_comes() {
    let Some(hosts) = Hosts::create("g", 6) else {
        return;
    };
    let dir = scratch("multinode-elastic-grow");
    let body = long_continued_config();
    let nodes = write_config(&dir, "nodes", &body);
    let cfg = nodes.display().to_string();
    let node = |ns: &str| hosts.elastic_node(ns, "1:2", &cfg);
    let mut a = spawn(&mut node(&hosts.a));
    a.wait_for_line("step-00000040");
    let b = finish(spawn(&mut node(&hosts.b)));
    assert_eq!(b.code, Some(0), "node 1:\n{}", b.all());
    for first in b
        .stderr
        .lines()
        .filter(|l| l.contains("trained its first step"))
    {
        eprintln!("node 1: {first}");
    }
    assert_says(
        &b.stderr,
        &["is training already: the 2 rank(s) of node 1 join it"],
        &b,
    );
    let a = finish(a);
    assert_eq!(a.code, Some(0), "node 0:\n{}", a.all());
    assert_says(
        &a.stderr,
        &["1 node(s) start the job (--nnodes 1:2; world size 2)"],
        &a,
    );
    assert_eq!(
        membership_with_joins_together(&dir),
        vec![(4, serde_json::json!([]), serde_json::json!([2, 3]))],
        "{}",
        a.all()
    );
    // Its first steps had half the global batch of a job of 2 nodes, so it is held to the job
    // that never grew, which a broken hand-over to the joiners (replicas apart) falls behind.
    // By the validation loss: on 359 samples the last accuracy moves by points between
    // neighbouring steps.
    let local = write_config(&dir, "local", &body);
    let never_grew = run(trainer()
        .arg("--config")
        .arg(&local)
        .args(["--nproc-per-node", "2"]));
    assert_eq!(never_grew.code, Some(0), "{}", never_grew.all());
    let (grown, alone) = (final_metric(&a, "Loss"), final_metric(&never_grew, "Loss"));
    eprintln!("1 node, then 2: final validation loss {grown}; {alone} on node 0's 2 ranks alone");
    assert!(
        grown <= alone * 1.05,
        "the grown job's loss {grown} against {alone} on 2 ranks alone"
    );
}

/// `--nnodes 2:3`, node 1 started before node 0 (it waits for node 0's store): the job starts
/// with the 2 nodes there after the last call; node 1's launcher killed, node 0's 2 ranks are
/// fewer than the 4 of 2 nodes, so they stop with exit code 2 and say so.
#[test]
fn a_job_of_2_to_3_nodes_stops_with_exit_code_2_when_fewer_than_2_are_left() {
    let Some(hosts) = Hosts::create("m", 7) else {
        return;
    };
    let dir = scratch("multinode-elastic-min");
    let nodes = write_config(&dir, "nodes", &long_continued_config());
    let cfg = nodes.display().to_string();
    // `on_rank_failure = "continue"` in the config is what lets the range through.
    let node = |ns: &str| hosts.elastic_node(ns, "2:3", &cfg);
    let b = spawn(&mut node(&hosts.b));
    let mut a = spawn(&mut node(&hosts.a));
    a.wait_for_line("step-00000020");
    signal(b.id(), libc::SIGKILL);
    let b = finish(b);
    assert_eq!(b.signal, Some(9), "node 1's launcher:\n{}", b.all());
    assert_says(
        &b.stderr,
        &["this machine is node 1 of the 2 that start the job"],
        &b,
    );
    let a = finish(a);
    assert_eq!(a.code, Some(2), "node 0:\n{}", a.all());
    assert_says(
        &a.stderr,
        &[
            "2 node(s) start the job (--nnodes 2:3; world size 4)",
            "only 2 of 4 ranks are left",
            "fewer than fault_tolerance.min_world_size = 4 (or the launcher's --nnodes MIN",
        ],
        &a,
    );
}
