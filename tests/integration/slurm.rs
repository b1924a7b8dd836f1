//! The real Slurm on one node: the test writes a `slurm.conf` of its own, starts `munged`
//! (when it is not running), `slurmctld` and `slurmd` as root, runs `srun`, and stops the
//! daemons it started. Where that cannot be done (no root, Slurm not installed) it records a
//! skip ([`burn_ddp::testing::skip`]: a failure where `TESTS_MUST_RUN` names `slurm`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use burn_ddp::testing::{skip, Needs};

use crate::common::*;

/// A one-node Slurm cluster for the duration of a test.
struct Slurm {
    conf: PathBuf,
    daemons: Vec<Child>,
    /// `munged`'s pid when this test started it.
    munged: Option<u32>,
}

impl Slurm {
    fn start(dir: &Path) -> Option<Slurm> {
        // SAFETY: geteuid(2) cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        let installed = ["slurmctld", "slurmd", "srun", "munged"]
            .iter()
            .all(|b| which(b).is_some());
        if !root || !installed {
            skip(
                Needs::Slurm,
                "needs root and Debian's slurm-wlm and munge (bash .ci/run installs them)",
            );
            return None;
        }
        let munged = start_munged();
        let node = String::from_utf8(
            Command::new("slurmd")
                .arg("-C")
                .output()
                .expect("slurmd -C")
                .stdout,
        )
        .expect("utf-8");
        let node = node.lines().next().expect("slurmd -C prints the node line");
        let host = node
            .strip_prefix("NodeName=")
            .and_then(|rest| rest.split_whitespace().next())
            .expect("NodeName=");
        // Other job ids every run, so the port derived from them changes too.
        let first_job = 100_000 + std::process::id() % 10_000;
        let state = dir.join("state");
        let spool = dir.join("spool");
        std::fs::create_dir_all(&state).unwrap();
        std::fs::create_dir_all(&spool).unwrap();
        let conf = dir.join("slurm.conf");
        std::fs::write(
            &conf,
            format!(
                "ClusterName=burnddp\nSlurmctldHost={host}\nSlurmctldPort={ctld}\nSlurmdPort={d}\n\
                 AuthType=auth/munge\nCredType=cred/munge\nSlurmUser=root\nSlurmdUser=root\n\
                 StateSaveLocation={state}\nSlurmdSpoolDir={spool}\n\
                 SlurmctldPidFile={dir}/slurmctld.pid\nSlurmdPidFile={dir}/slurmd.pid\n\
                 ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n\
                 SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n\
                 AccountingStorageType=accounting_storage/none\nJobAcctGatherType=jobacct_gather/none\n\
                 MpiDefault=none\nReturnToService=2\nKillWait=5\nFirstJobId={first_job}\n\
                 {node} State=UNKNOWN\nPartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP\n",
                ctld = unused_port(),
                d = unused_port(),
                state = state.display(),
                spool = spool.display(),
                dir = dir.display(),
            ),
        )
        .unwrap();
        let daemon = |name: &str| {
            Command::new(name)
                .args(["-D", "-f"])
                .arg(&conf)
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start {name}: {e}"))
        };
        let slurm = Slurm {
            daemons: vec![daemon("slurmctld"), daemon("slurmd")],
            conf,
            munged,
        };
        slurm.wait_idle(dir);
        Some(slurm)
    }

    /// A Slurm command (`srun`, `sinfo`) of this cluster.
    fn command(&self, name: &str) -> Command {
        let mut cmd = Command::new(name);
        cmd.env("SLURM_CONF", &self.conf);
        cmd
    }

    fn wait_idle(&self, dir: &Path) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let state = self.command("sinfo").args(["-h", "-o", "%T"]).output();
            if state.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "idle") {
                return;
            }
            if Instant::now() > deadline {
                let log = |n: &str| std::fs::read_to_string(dir.join(n)).unwrap_or_default();
                panic!(
                    "the Slurm node is not idle after 120 s:\n--- slurmctld\n{}\n--- slurmd\n{}",
                    log("slurmctld.log"),
                    log("slurmd.log")
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for daemon in &mut self.daemons {
            signal(daemon.id(), libc::SIGTERM);
            let _ = daemon.wait();
        }
        if let Some(pid) = self.munged {
            signal(pid, libc::SIGTERM);
        }
    }
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
            .map(|p| p.join(name))
            .find(|p| p.is_file())
    })
}

/// Starts `munged` as its user unless one answers already; returns the pid it started.
fn start_munged() -> Option<u32> {
    let socket = Path::new("/run/munge/munge.socket.2");
    if socket.exists()
        && Command::new("munge")
            .arg("-n")
            .output()
            .is_ok_and(|o| o.status.success())
    {
        return None;
    }
    std::fs::create_dir_all("/run/munge").expect("/run/munge");
    let chown = Command::new("chown")
        .args(["munge:munge", "/run/munge"])
        .status()
        .expect("chown");
    assert!(chown.success());
    let started = Command::new("runuser")
        .args(["-u", "munge", "--", "/usr/sbin/munged", "--force"])
        .status()
        .expect("runuser munged");
    assert!(started.success(), "munged did not start");
    std::fs::read_to_string("/run/munge/munged.pid")
        .ok()
        .and_then(|p| p.trim().parse().ok())
}

/// `srun -n 2` with no MASTER_* variables: the ranks find rank 0's host in the node list and
/// the port from the job id, train together, and only rank 0 logs at INFO.
#[test]
fn srun_trains_without_master_variables() {
    let dir = scratch("slurm");
    let Some(slurm) = Slurm::start(&dir) else {
        return;
    };
    let config = write_config(&dir, "run", &digits_config(SGD, 8, "max_steps = 10"));
    let mut srun = slurm.command("srun");
    srun.args(["-n", "2", "--label", "--kill-on-bad-exit=1"])
        .arg(env!("CARGO_BIN_EXE_trainer"))
        .arg("--config")
        .arg(&config);
    without_launcher_identity(&mut srun);
    let out = run(&mut srun);
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_says(
        &out.all(),
        &[
            "derived MASTER_ADDR=",
            "the first host of SLURM_STEP_NODELIST=",
            "derived MASTER_PORT=",
            "final validation",
        ],
        &out,
    );
    assert_rank1_logs_no_info(&out, "1:");
    drop(slurm);
}
