//! The launch plan's decisions, each against the environment a rank gets.

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
