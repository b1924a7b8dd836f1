//! The collective layer across real processes: results, and failures that must be clear.

use std::process::Command;

use crate::common::*;

/// How ranks on one host move data: shared memory (the default) or TCP (`BURN_DDP_SHM=0`).
const TRANSPORTS: [&str; 2] = ["shm", "tcp"];

fn launch(nproc: usize, transport: &str, args: &[&str]) -> Output {
    let mut cmd = trainer();
    cmd.arg("collectives")
        .arg("--nproc-per-node")
        .arg(nproc.to_string())
        .args(args)
        .env("BURN_DDP_SHM", if transport == "tcp" { "0" } else { "1" });
    let out = run(&mut cmd);
    // Rank 0's set-up line says which links use shared memory.
    if out.code == Some(0) {
        assert_eq!(
            out.all().contains("(shared memory)"),
            transport == "shm",
            "{transport}: {}",
            out.all()
        );
    }
    out
}

#[test]
fn every_collective_is_exact_for_2_3_4_ranks_and_awkward_lengths() {
    for transport in TRANSPORTS {
        for nproc in [2, 3, 4] {
            for len in ["0", "1", "7", "1001"] {
                for dtype in ["i64", "f32"] {
                    let args = ["--len", len, "--dtype", dtype, "--root", "1"];
                    let out = launch(nproc, transport, &args);
                    assert_eq!(
                        out.code,
                        Some(0),
                        "{transport}, {nproc} ranks, len {len} {dtype}:\n{}",
                        out.all()
                    );
                    assert_eq!(
                        out.stdout.matches("all results correct").count(),
                        nproc,
                        "{}",
                        out.all()
                    );
                }
            }
        }
    }
}

#[test]
fn sixty_four_mib_buffers() {
    // 8 Mi i64 = 64 MiB per rank, exact integer results: 16 times the shared ring buffer.
    for transport in TRANSPORTS {
        for nproc in [2, 3] {
            let len = (8 << 20).to_string();
            let args = ["--len", &len, "--dtype", "i64", "--op", "all_reduce"];
            let out = launch(nproc, transport, &args);
            assert_eq!(out.code, Some(0), "{transport}: {}", out.all());
            let len = (16 << 20).to_string();
            let args = [
                "--len",
                &len,
                "--dtype",
                "f32",
                "--op",
                "broadcast",
                "--root",
                "1",
            ];
            let out = launch(nproc, transport, &args);
            assert_eq!(out.code, Some(0), "{transport}: {}", out.all());
        }
    }
}

/// Starts one rank by hand, as torchrun or SLURM would.
fn rank(rank: usize, world: &str, port: u16, extra: &[&str]) -> Command {
    let mut cmd = trainer();
    let timeout = if extra.contains(&"--timeout-secs") {
        &[][..]
    } else {
        &["--timeout-secs", "20"][..]
    };
    cmd.arg("collectives")
        .args(timeout)
        .args(extra)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world)
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string());
    cmd
}

#[test]
fn mismatched_lengths_fail_on_every_rank_naming_both_calls() {
    let out = launch(
        2,
        "shm",
        &[
            "--len",
            "7",
            "--len-for-rank",
            "1=8",
            "--op",
            "all_reduce",
            "--timeout-secs",
            "60",
        ],
    );
    assert_ne!(out.code, Some(0), "{}", out.all());
    assert!(out.stderr.contains("collective mismatch"), "{}", out.all());
    assert_says(&out.stderr, &["7 elements", "8 elements"], &out);
    assert!(
        out.stderr.contains("rank 1 failed") || out.stderr.contains("rank 0 failed"),
        "launcher names the rank:\n{}",
        out.all()
    );
}

#[test]
fn log_dir_keeps_each_ranks_own_log() {
    let dir = scratch("log-dir");
    let logs = dir.join("logs");
    let logs_arg = logs.display().to_string();
    let out = launch(
        2,
        "shm",
        &[
            "--len",
            "3",
            "--len-for-rank",
            "1=4",
            "--op",
            "all_reduce",
            "--log-dir",
            &logs_arg,
        ],
    );
    assert_ne!(out.code, Some(0), "{}", out.all());
    for rank in 0..2 {
        let log = std::fs::read_to_string(logs.join(format!("rank-{rank}.log"))).unwrap();
        assert!(
            log.contains(&format!("rank {rank}: collective mismatch")),
            "rank {rank}'s log:\n{log}"
        );
    }
}

#[test]
fn all_reduce_against_broadcast_is_a_mismatch_not_a_hang() {
    let out = launch(
        3,
        "shm",
        &[
            "--op",
            "all_reduce",
            "--op-for-rank",
            "2=broadcast",
            "--timeout-secs",
            "60",
        ],
    );
    assert_ne!(out.code, Some(0), "{}", out.all());
    assert_says(&out.stderr, &["all_reduce(Sum", "broadcast(root 0"], &out);
}

#[test]
fn different_world_sizes_are_refused_by_every_rank() {
    let (ranks, _port) =
        start_by_hand(|port| vec![rank(0, "2", port, &[]), rank(1, "3", port, &[])]);
    let mut outs = ranks.into_iter().map(finish);
    let (a, b) = (outs.next().unwrap(), outs.next().unwrap());
    for out in [&a, &b] {
        assert_ne!(out.code, Some(0), "{}", out.all());
        assert!(
            out.stderr.contains("WORLD_SIZE=3") && out.stderr.contains("WORLD_SIZE=2"),
            "{}",
            out.all()
        );
    }
}

#[test]
fn a_port_in_use_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let out = run(&mut rank(0, "2", port, &[]));
    assert_ne!(out.code, Some(0));
    assert!(
        out.stderr.contains(&format!("127.0.0.1:{port}")) && out.stderr.contains("MASTER_PORT"),
        "{}",
        out.all()
    );
    // The launcher says the same, with exit code 2 (a usage problem).
    let out = launch(2, "shm", &["--master-port", &port.to_string()]);
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert!(
        out.stderr.contains("already in use") || out.stderr.contains("Address in use"),
        "{}",
        out.all()
    );
}

#[test]
fn an_unreachable_master_times_out_naming_the_address() {
    let closed = ClosedPort::new();
    let port = closed.port;
    let out = run(&mut rank(1, "2", port, &["--timeout-secs", "2"]));
    assert_ne!(out.code, Some(0));
    assert!(
        out.stderr.contains(&format!("127.0.0.1:{port}")) && out.stderr.contains("could not reach"),
        "{}",
        out.all()
    );
}

#[test]
fn a_rank_that_never_arrives_is_named() {
    let (ranks, _port) = start_by_hand(|port| vec![rank(0, "3", port, &["--timeout-secs", "3"])]);
    let out = ranks.into_iter().next().map(finish).unwrap();
    assert_ne!(out.code, Some(0));
    assert_says(&out.stderr, &["rank(s) 1, 2 never joined"], &out);
}

#[test]
fn missing_environment_names_the_variable() {
    let out = run(trainer()
        .args(["collectives"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1"));
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert!(out.stderr.contains("MASTER_PORT"), "{}", out.all());
}

/// Two ranks exchanging 8 MiB each with shared memory asked for (`BURN_DDP_SHM=1`), in a
/// private mount namespace whose `/dev/shm` is the tmpfs `shm`; debug logs of the ring's set-up.
fn launch_with_dev_shm(shm: &SmallDisk) -> Output {
    let mut cmd = trainer();
    cmd.args(["collectives", "--nproc-per-node", "2"])
        .args(["--len", &(1 << 20).to_string(), "--dtype", "i64"])
        .args(["--op", "all_reduce", "--timeout-secs", "60"])
        .env("BURN_DDP_SHM", "1")
        .env("RUST_LOG", "info,burn_ddp::group::tcp::setup=debug");
    run(&mut with_dev_shm(&cmd, &shm.0))
}

/// The inode of this process's pid namespace, as burn-ddp names its `/dev/shm` entries
/// (`burn-ddp-<pid namespace>-<pid>-r<rank>-<n>`, see `burn_ddp::group::shm::ShmDir`).
fn pid_namespace() -> String {
    let link = std::fs::read_link("/proc/self/ns/pid").expect("/proc/self/ns/pid");
    let link = link.to_string_lossy();
    link.trim_start_matches("pid:[")
        .trim_end_matches(']')
        .to_string()
}

#[test]
fn a_full_dev_shm_falls_back_to_tcp() {
    // Each link's ring file is 4 MiB (reserved with posix_fallocate): 1 MiB cannot hold one.
    let dir = scratch("shm-full");
    let Some(shm) = SmallDisk::mount(&dir.join("shm"), "1m") else {
        return;
    };
    let out = launch_with_dev_shm(&shm);
    assert_eq!(
        out.code,
        Some(0),
        "a full /dev/shm must not fail the job:\n{}",
        out.all()
    );
    assert_eq!(
        out.stdout.matches("all results correct").count(),
        2,
        "{}",
        out.all()
    );
    assert!(
        !out.all().contains("(shared memory)"),
        "no link may use shared memory:\n{}",
        out.all()
    );
    for rank in 0..2 {
        assert!(
            out.stderr
                .lines()
                .any(|l| l.starts_with(&format!("[rank {rank}]"))
                    && l.contains("no shared memory (using TCP)")
                    && l.contains("No space left on device")),
            "rank {rank} says why it uses TCP:\n{}",
            out.all()
        );
    }
}

#[test]
fn dev_shm_is_left_clean_and_a_dead_jobs_leftovers_are_removed() {
    let dir = scratch("shm-clean");
    let Some(shm) = SmallDisk::mount(&dir.join("shm"), "64m") else {
        return;
    };
    let ns = pid_namespace();
    // Left by a process that cannot exist (pids stay below 2^22), and by one that is alive
    // (this test): only the dead one's may go.
    let dead = format!("burn-ddp-{ns}-{}-r0-0", u32::MAX);
    let live = format!("burn-ddp-{ns}-{}-r1-0", std::process::id());
    for name in [&dead, &live] {
        std::fs::create_dir(shm.0.join(name)).unwrap();
        std::fs::write(shm.0.join(name).join("ring"), b"leftover").unwrap();
    }
    let out = launch_with_dev_shm(&shm);
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_eq!(
        out.stdout.matches("all results correct").count(),
        2,
        "{}",
        out.all()
    );
    assert!(
        out.all().contains("(shared memory)"),
        "the ranks used this /dev/shm:\n{}",
        out.all()
    );
    let mut left: Vec<String> = std::fs::read_dir(&shm.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        vec![live.clone()],
        "only the live process's entry may remain (the dead one's and the run's own gone)"
    );
    assert_eq!(
        std::fs::read(shm.0.join(&live).join("ring")).unwrap(),
        b"leftover"
    );
}
