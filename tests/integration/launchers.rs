//! Ranks started by other launchers, as those launchers start them: every rank a process with
//! the launcher's variables (Slurm's, Open MPI's, torchrun's), and the launcher a parent
//! process that may die.

use std::process::Command;

use crate::common::*;

/// A port in 15000..25000 that was free a moment ago, and a Slurm job id whose derived port
/// (`15000 + id mod 10000`) it is.
fn slurm_job_for_free_port() -> (u16, u64) {
    let start = std::process::id() as u16 % 10_000;
    for k in 0..10_000u16 {
        let port = 15_000 + (start + k) % 10_000;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return (port, 4_200_000 + u64::from(port - 15_000));
        }
    }
    panic!("no free port in 15000..25000");
}

fn srun_task(config: &std::path::Path, rank: usize, job: u64) -> Command {
    let mut cmd = trainer();
    cmd.arg("--config").arg(config);
    for (k, v) in [
        ("SLURM_PROCID", rank.to_string()),
        ("SLURM_LOCALID", rank.to_string()),
        ("SLURM_NTASKS", "2".into()),
        ("SLURM_JOB_ID", job.to_string()),
        ("SLURM_STEP_ID", "0".into()),
        ("SLURM_JOB_NODELIST", "localhost".into()),
        ("SLURM_STEP_NODELIST", "localhost".into()),
    ] {
        cmd.env(k, v);
    }
    cmd
}

/// srun sets no MASTER_ADDR / MASTER_PORT: rank 0's host comes from the node list and the
/// port from the job id, both logged; only rank 0 logs at INFO (the rank is SLURM_PROCID);
/// and the two ranks train together to the end.
#[test]
fn srun_tasks_without_master_variables_derive_them_and_train() {
    let dir = scratch("srun-derived");
    let config = write_config(&dir, "run", &digits_config(SGD, 8, "max_steps = 10"));
    for attempt in 0..5 {
        let (port, job) = slurm_job_for_free_port();
        let mut ranks: Vec<Proc> = (0..2)
            .map(|r| spawn(&mut srun_task(&config, r, job)))
            .collect();
        let rank1 = ranks.pop().map(Proc::finish).expect("rank 1");
        let rank0 = ranks.pop().map(Proc::finish).expect("rank 0");
        if rank0.stderr.contains("in use") && attempt < 4 {
            continue; // the port was taken between the check and rank 0's bind
        }
        assert_eq!(rank0.code, Some(0), "rank 0:\n{}", rank0.all());
        assert_eq!(rank1.code, Some(0), "rank 1:\n{}", rank1.all());
        assert_says(
            &rank0.stderr,
            &[
                "derived MASTER_ADDR=localhost, the first host of SLURM_STEP_NODELIST=localhost",
                &format!("derived MASTER_PORT={port}, 15000 + SLURM_JOB_ID={job} mod 10000"),
            ],
            &rank0,
        );
        assert!(
            !rank1.stderr.contains("INFO"),
            "rank 1 (SLURM_PROCID=1) must log warnings only by default:\n{}",
            rank1.all()
        );
        return;
    }
}

fn mpirun_rank(config: &std::path::Path, rank: usize, job: &str, port: u16) -> Command {
    let mut cmd = trainer();
    cmd.arg("--config").arg(config);
    for (k, v) in [
        ("OMPI_COMM_WORLD_RANK", rank.to_string()),
        ("OMPI_COMM_WORLD_LOCAL_RANK", rank.to_string()),
        ("OMPI_COMM_WORLD_SIZE", "2".into()),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2".into()),
        ("OMPI_MCA_ess_base_jobid", job.into()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
    ] {
        cmd.env(k, v);
    }
    cmd
}

/// Two Open MPI jobs given the same MASTER_PORT, without BURN_DDP_TOKEN: each job's token is
/// its launcher's job id, so the second job's rank is refused at the first job's store and
/// the first job finishes untouched.
#[test]
fn a_second_job_on_the_same_port_is_refused_by_its_launcher_identity() {
    let dir = scratch("two-jobs");
    let config = write_config(&dir, "first", &digits_config(SGD, 8, "max_steps = 6"));
    let (mut first, port) = start_by_hand(|port| {
        (0..2)
            .map(|r| {
                let mut cmd = mpirun_rank(&config, r, "1111", port);
                // No token of their own: the launcher's job id is theirs.
                cmd.env("BURN_DDP_TOKEN", "");
                // Both ranks pause after step 2, long enough for the stranger to knock.
                cmd.env("TRAINER_STALL_AFTER_STEP", "2:10");
                cmd
            })
            .collect()
    });
    first[1].wait_for_line("sleeping (fault injection)");
    let stranger = run(mpirun_rank(&config, 1, "2222", port).env("BURN_DDP_TOKEN", ""));
    assert_ne!(stranger.code, Some(0), "{}", stranger.all());
    assert_says(&stranger.stderr, &["token"], &stranger);
    let rank1 = first.pop().map(Proc::finish).expect("rank 1");
    let rank0 = first.pop().map(Proc::finish).expect("rank 0");
    assert_eq!(rank0.code, Some(0), "first job, rank 0:\n{}", rank0.all());
    assert_eq!(rank1.code, Some(0), "first job, rank 1:\n{}", rank1.all());
    assert_says(&rank0.stdout, &["final validation"], &rank0);
}

/// A rank started by a launcher other than the trainer's has no `PR_SET_PDEATHSIG` from it;
/// it watches its parent instead. The "launcher" here is a shell that starts two ranks with
/// torchrun's variables and waits; SIGKILL of the shell must take the ranks down (they would
/// otherwise sleep for 10 minutes after their first step).
#[test]
fn ranks_started_by_another_launcher_die_with_it() {
    let dir = scratch("foreign-launcher");
    let config = write_config(&dir, "run", &digits_config(SGD, 8, "max_steps = 100"));
    let port = unused_port();
    let mut launcher = spawn(
        Command::new("sh")
            .arg("-c")
            .arg(r#"RANK=0 "$TRAINER" --config "$CONFIG" & RANK=1 "$TRAINER" --config "$CONFIG" & wait"#)
            .env("TRAINER", env!("CARGO_BIN_EXE_trainer"))
            .env("CONFIG", &config)
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("BURN_DDP_TOKEN", format!("foreign-{port}"))
            .env("TRAINER_STALL_AFTER_STEP", "1:600")
            .env_remove("TRAINER_WORKER"),
    );
    launcher.wait_for_lines("sleeping (fault injection)", 2);
    kill_launcher_and_expect_its_ranks_gone(&mut launcher);
}

/// `mpirun` (Open MPI) when it is installed; otherwise a recorded skip.
pub(crate) fn mpirun() -> Option<Command> {
    let found = Command::new("mpirun")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        burn_ddp::testing::skip(
            burn_ddp::testing::Needs::Mpi,
            "mpirun not found (apt-get install openmpi-bin)",
        );
        return None;
    }
    let mut cmd = Command::new("mpirun");
    // --tag-output: each line says which rank printed it, `[1,R]<stderr>:`.
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--tag-output",
        "-np",
        "2",
    ]);
    without_launcher_identity(&mut cmd);
    Some(cmd)
}

/// The real `mpirun` with no MASTER_* variables: rank 0's address and the port are derived
/// (every rank is on this machine), the ranks train, and only rank 0 logs at INFO.
#[test]
fn mpirun_trains_without_master_variables() {
    let Some(mut mpirun) = mpirun() else { return };
    let dir = scratch("mpirun");
    let config = write_config(&dir, "run", &digits_config(SGD, 8, "max_steps = 10"));
    let out = run(mpirun
        .arg(env!("CARGO_BIN_EXE_trainer"))
        .arg("--config")
        .arg(&config));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_says(
        &out.all(),
        &[
            "derived MASTER_ADDR=127.0.0.1, every one of the 2 ranks is on this machine",
            "final validation",
        ],
        &out,
    );
    assert_rank1_logs_no_info(&out, "[1,1]");
}

/// Two real `mpirun` jobs given the same MASTER_PORT: the second cannot join the first (its
/// ranks carry another job token, from Open MPI's job id), and the first finishes untouched.
/// Then SIGKILL of a third `mpirun` takes its ranks down (they watch their parent).
#[test]
fn a_second_mpirun_job_on_the_same_port_leaves_the_first_untouched() {
    let Some(mut first) = mpirun() else { return };
    let dir = scratch("mpirun-two-jobs");
    let config = write_config(&dir, "first", &digits_config(SGD, 8, "max_steps = 6"));
    let port = unused_port().to_string();
    let third_config = write_config(&dir, "third", &digits_config(SGD, 8, "max_steps = 100"));
    let job = |cmd: &mut Command, config: &std::path::Path, stall: &str| {
        cmd.args([
            "-x",
            "MASTER_ADDR",
            "-x",
            "MASTER_PORT",
            "-x",
            "TRAINER_STALL_AFTER_STEP",
        ])
        .arg(env!("CARGO_BIN_EXE_trainer"))
        .arg("--config")
        .arg(config)
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", &port)
        .env("TRAINER_STALL_AFTER_STEP", stall);
    };
    job(&mut first, &config, "2:10");
    let mut first = spawn(&mut first);
    first.wait_for_lines("sleeping (fault injection)", 2);
    let Some(mut second) = mpirun() else { return };
    job(&mut second, &config, "2:10");
    let second = run(&mut second);
    assert_ne!(
        second.code,
        Some(0),
        "the second job joined the first:\n{}",
        second.all()
    );
    let first = first.finish();
    assert_eq!(
        first.code,
        Some(0),
        "the first job was disturbed:\n{}",
        first.all()
    );
    assert_says(&first.stdout, &["final validation"], &first);
    assert!(!first.all().contains("joined twice"), "{}", first.all());

    let Some(mut third) = mpirun() else { return };
    job(&mut third, &third_config, "1:600");
    let mut third = spawn(&mut third);
    third.wait_for_lines("sleeping (fault injection)", 2);
    kill_launcher_and_expect_its_ranks_gone(&mut third);
}
