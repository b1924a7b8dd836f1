//! `trainer doctor`: on a healthy machine every check is printed with its result and the exit
//! code is 0; a tiny `/dev/shm` (a 64 KiB tmpfs in a private mount namespace), an occupied
//! port, or launcher variables without `MASTER_ADDR` are each found, with advice, and exit 1.

use std::net::TcpListener;

use crate::common::*;

/// Every check the doctor runs in a CPU build, in the order it prints them.
const CHECKS: [&str; 12] = [
    "launcher",
    "cores",
    "memory",
    "/dev/shm",
    "open files",
    "processes",
    "loopback",
    "network",
    "port",
    "output",
    "build",
    "all-reduce",
];

/// A check's line of the report: its status word (`ok`, `warn`, `FAIL`, `skip`), the whole
/// line, and its advice (the `fix:` line below it), if any.
pub struct CheckLine {
    pub status: String,
    pub line: String,
    pub advice: Option<String>,
}

/// The line of check `name`; fails the test, showing the output, when there is none.
pub fn check_line(out: &Output, name: &str) -> CheckLine {
    let lines: Vec<&str> = out.stdout.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let Some((status, rest)) = line.split_once(' ') else {
            continue;
        };
        let rest = rest.trim_start();
        if ["ok", "warn", "FAIL", "skip"].contains(&status)
            && rest.starts_with(name)
            && rest[name.len()..].starts_with("  ")
        {
            let advice = lines
                .get(i + 1)
                .map(|l| l.trim_start())
                .and_then(|l| l.strip_prefix("fix: "))
                .map(String::from);
            return CheckLine {
                status: status.to_string(),
                line: line.to_string(),
                advice,
            };
        }
    }
    panic!("no line for the check {name:?}:\n{}", out.all())
}

/// The checks that failed.
fn failed(out: &Output) -> Vec<&'static str> {
    CHECKS
        .into_iter()
        .filter(|name| check_line(out, name).status == "FAIL")
        .collect()
}

#[test]
fn a_healthy_machine_passes_every_check() {
    let dir = scratch("doctor-healthy");
    let config = write_config(&dir, "job", &digits_config(SGD, 16, ""));
    let port = unused_port().to_string();
    let out = run(trainer()
        .args(["doctor", "--nproc-per-node", "2", "--master-port", &port])
        .arg("--config")
        .arg(&config));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(
        out.stdout
            .lines()
            .next()
            .is_some_and(|l| l.starts_with("trainer doctor: 2 local rank(s)")
                && l.contains(&format!("127.0.0.1:{port}"))),
        "the header says what is checked:\n{}",
        out.all()
    );
    for name in CHECKS {
        let check = check_line(&out, name);
        assert!(
            ["ok", "warn"].contains(&check.status.as_str()),
            "{name} on a healthy machine, with a config and 2 ranks:\n{}",
            out.all()
        );
        if check.status == "warn" {
            assert!(
                check.advice.is_some(),
                "a warning says what to do: {}",
                check.line
            );
        }
    }
    let port_line = check_line(&out, "port").line;
    assert!(
        port_line.contains(&format!("{port} is free")),
        "{port_line}"
    );
    let allreduce = check_line(&out, "all-reduce").line;
    for needle in ["2 local ranks", "results correct", "GB/s", "copy bandwidth"] {
        assert!(allreduce.contains(needle), "{needle:?}: {allreduce}");
    }
    assert!(check_line(&out, "memory").line.contains("parameters"));
    assert!(out.stdout.contains("all checks passed") || out.stdout.contains("no problems"));
}

#[test]
fn a_tiny_dev_shm_fails_with_its_size_and_advice() {
    let dir = scratch("doctor-shm");
    let Some(shm) = SmallDisk::mount(&dir.join("shm"), "64k") else {
        return;
    };
    let mut cmd = trainer();
    cmd.args(["doctor", "--nproc-per-node", "2", "--skip-allreduce"]);
    let out = run(&mut with_dev_shm(&cmd, &shm.0));
    assert_eq!(out.code, Some(1), "{}", out.all());
    let check = check_line(&out, "/dev/shm");
    assert_eq!(check.status, "FAIL", "{}", out.all());
    for needle in [
        "64 KiB free",
        // The job's group and the gradient overlap's (on by default), a ring file each: 4 MiB
        // and 1 MiB, and a page of counters each.
        "needs 10.0 MiB for 2 local ranks (5.0 MiB a rank: a ring for each of the job group and the gradient overlap's group)",
        "loopback TCP",
    ] {
        assert!(check.line.contains(needle), "{needle:?}: {}", check.line);
    }
    let advice = check.advice.unwrap_or_default();
    assert!(
        advice.contains("--shm-size") && advice.contains("BURN_DDP_SHM=0"),
        "{}",
        out.all()
    );
    assert_eq!(failed(&out), ["/dev/shm"], "{}", out.all());
}

#[test]
fn an_occupied_port_fails_naming_the_port() {
    let held = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = held.local_addr().expect("address").port().to_string();
    let out = run(trainer().args([
        "doctor",
        "--nproc-per-node",
        "2",
        "--master-port",
        &port,
        "--skip-allreduce",
    ]));
    assert_eq!(out.code, Some(1), "{}", out.all());
    let check = check_line(&out, "port");
    assert_eq!(check.status, "FAIL", "{}", out.all());
    assert!(
        check.line.contains(&format!("{port} is in use")),
        "{}",
        check.line
    );
    assert!(
        check.advice.unwrap_or_default().contains("--master-port"),
        "{}",
        out.all()
    );
    assert_eq!(failed(&out), ["port"], "{}", out.all());
    drop(held);
}

#[test]
fn launcher_variables_without_master_addr_fail_with_what_to_export() {
    let out = run(trainer()
        .args(["doctor", "--skip-allreduce"])
        .env("SLURM_JOB_ID", "42")
        .env("SLURM_PROCID", "0")
        .env("SLURM_NTASKS", "2")
        .env("SLURM_LOCALID", "0"));
    assert_eq!(out.code, Some(1), "{}", out.all());
    let check = check_line(&out, "launcher");
    assert_eq!(check.status, "FAIL", "{}", out.all());
    assert!(
        check.line.contains("SLURM (SLURM_JOB_ID SLURM_PROCID")
            && check.line.contains("MASTER_ADDR"),
        "{}",
        check.line
    );
    assert!(
        check
            .advice
            .unwrap_or_default()
            .contains("scontrol show hostnames"),
        "{}",
        out.all()
    );
}

#[test]
fn a_bad_config_is_a_usage_error() {
    let dir = scratch("doctor-config");
    let config = write_config(&dir, "bad", "[model]\nname = \"nope\"\n");
    let out = run(trainer().args(["doctor", "--config"]).arg(&config));
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert!(out.stderr.contains("model.name"), "{}", out.all());
}
