//! The launcher: `--nproc-per-node N` starts N ranks of this same program on this machine and
//! supervises them, like `torchrun`; `trainer launch [OPTIONS] -- PROGRAM [ARGS...]` does the
//! same for any other program (torchrun's `--no-python`).
//!
//! - What to start, where, with which environment, is decided first by the pure
//!   [`LaunchPlan`](crate::launcher::launch_plan::LaunchPlan); this file only binds, spawns and waits. The
//!   variables each rank gets are listed in [`crate::launcher::worker_env`].
//! - On the first node (`--node-rank 0`) the launcher hosts the rendezvous store itself (so the
//!   port is bound before any rank starts: no race for a "free" port), on loopback when every
//!   rank is local and on all interfaces otherwise. Without `--master-port` on a single node the
//!   OS picks a free port, so two jobs on one machine never collide.
//! - Where this node's ranks enter the job — start it, join it while it trains (a node that
//!   comes back, or comes after an elastic `--nnodes MIN:MAX` job started), or find it over —
//!   is [`node_rendezvous`]'s decision, made once the store is up.
//! - Each child gets torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), the job token, and dies with the
//!   launcher (`PR_SET_PDEATHSIG`), so no orphan outlives it.
//! - The first rank to fail stops the others (SIGTERM, then SIGKILL after a grace period), and
//!   the launcher reports which rank failed and how, last, where the user looks; with
//!   `--max-restarts K` every rank is then started again, up to K times. With
//!   `--survivors-continue` (the trainer's `[fault_tolerance] on_rank_failure = "continue"`)
//!   a failed rank is reported and the others go on without it; with `--max-restarts K` too,
//!   the failed rank alone is started again (up to K restarts in all) and joins them.

use std::ffi::{OsStr, OsString};
use std::io::IsTerminal;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use anyhow::Context;
use burn_ddp::store::TcpStoreServer;
use clap::Args;

use crate::error::UsageError;
use crate::finding::Status;
use crate::launcher::fencing::Fencing;
pub use crate::launcher::launch_plan::LaunchArgs;
use crate::launcher::launch_plan::{LaunchEnv, LaunchPlan};
use crate::launcher::limits::{limit_checks, JobShape};
use crate::launcher::node_rendezvous::{self, Entry};
use crate::launcher::ranklog::RankLog;
use crate::launcher::supervise::{
    stop_all, supervise, supervise_survivors, Outcome, Rank, SurvivorSupervision,
};
use crate::launcher::worker_env::{FENCE_ID_VAR, THREADS_VAR, TOKEN_VAR};

/// Kept here too for the callers that still name it `launch::RESTART_COUNT_VAR`.
pub use crate::launcher::worker_env::RESTART_COUNT_VAR;

/// `trainer launch [OPTIONS] -- PROGRAM [ARGS...]`: any program as N supervised ranks.
#[derive(Args, Debug, Clone)]
pub struct LaunchCommand {
    #[command(flatten)]
    pub launch: LaunchArgs,
    /// The program every rank runs (looked up in PATH unless it contains a `/`), and its
    /// arguments, after `--`.
    #[arg(last = true, required = true, value_name = "PROGRAM")]
    pub program: Vec<OsString>,
}

/// The program every rank runs, and its arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    pub exe: PathBuf,
    pub args: Vec<OsString>,
}

impl Program {
    /// This same program with this process's arguments: `trainer ... --nproc-per-node N`
    /// starts N copies of itself, which see the launcher's variables and train.
    pub fn this_process() -> anyhow::Result<Self> {
        let exe =
            std::env::current_exe().context("cannot find this program's path to start ranks")?;
        Ok(Self {
            exe,
            args: std::env::args_os().skip(1).collect(),
        })
    }

    /// `command[0]` found the way `execvp` finds it — in `PATH` (`/bin:/usr/bin` when unset)
    /// unless it contains a `/` — with the rest of `command` as its arguments. A program that
    /// is not there, or not executable, is a [`UsageError`] naming it, before any rank starts.
    pub fn resolve(command: &[OsString]) -> Result<Self, UsageError> {
        let (name, args) = command
            .split_first()
            .ok_or_else(|| UsageError("no program to launch (give it after `--`)".into()))?;
        let path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
        let exe = find_program(name, &path)?;
        Ok(Self {
            exe,
            args: args.to_vec(),
        })
    }
}

/// Looks `name` up like `execvp`: a name with a `/` is taken as a path, anything else is
/// searched in the directories of `search_path` (an empty entry is the current directory).
fn find_program(name: &OsStr, search_path: &OsStr) -> Result<PathBuf, UsageError> {
    let shown = Path::new(name).display();
    if name.is_empty() {
        return Err(UsageError(
            "the program to launch is an empty string".into(),
        ));
    }
    if name.as_encoded_bytes().contains(&b'/') {
        let path = PathBuf::from(name);
        return match std::fs::metadata(&path) {
            Ok(meta) if is_executable(&meta) => Ok(path),
            Ok(_) => Err(UsageError(format!(
                "cannot launch `{shown}`: not an executable file"
            ))),
            Err(e) => Err(UsageError(format!("cannot launch `{shown}`: {e}"))),
        };
    }
    std::env::split_paths(search_path)
        .map(|dir| {
            if dir.as_os_str().is_empty() {
                PathBuf::from(".").join(name)
            } else {
                dir.join(name)
            }
        })
        .find(|candidate| std::fs::metadata(candidate).is_ok_and(|m| is_executable(&m)))
        .ok_or_else(|| {
            UsageError(format!(
                "cannot launch `{shown}`: no such program in PATH ({})",
                Path::new(search_path).display()
            ))
        })
}

fn is_executable(meta: &std::fs::Metadata) -> bool {
    meta.is_file() && meta.permissions().mode() & 0o111 != 0
}

/// Starts the local ranks of `program` and waits for them (and restarts them, if asked).
///
/// Returns the job's exit code: 0 when every rank succeeded, the failing rank's code (1 when
/// killed by a signal), or 128 + N when the launcher got signal N. Invalid options are a
/// [`UsageError`]. Checks of the program's input (a config file, for example) are the caller's,
/// before this call, so that bad input fails once instead of once per rank.
pub fn launch(args: &LaunchArgs, program: &Program) -> anyhow::Result<ExitCode> {
    let mut plan = LaunchPlan::new(args, &machine(args))?;
    if let Ok(outer) = burn_ddp::DistEnv::from_env() {
        plan.check_outer_job(outer.rank, outer.world_size)?;
    }
    refuse_beyond_limits(&plan)?;

    // Ctrl-C or SIGTERM: stop every rank, then exit (the flag is polled by `supervise`).
    let interrupted = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_usize(sig, interrupted.clone(), sig as usize)
            .context("cannot install the signal handler")?;
    }

    let mut port = plan.port;
    // Restarts so far: of every rank (an attempt), or with --survivors-continue of one rank.
    let mut restarts = 0;
    loop {
        let attempt = restarts;
        // A fresh store per attempt: the ranks of a restarted job start from an empty store.
        let server = match plan.store_bind_addr(port) {
            Some(addr) => {
                let server = TcpStoreServer::bind(&addr, &plan.token)
                    .map_err(|e| UsageError(e.to_string()))?;
                port = server.local_addr().port();
                Some(server)
            }
            None => None,
        };
        // Where this node enters is decided once: a restart starts the same nodes again.
        let mut joining = false;
        if attempt == 0 {
            match node_rendezvous::enter(&plan, port)? {
                Entry::Start(placed) => plan = placed,
                Entry::Join(placed) => {
                    plan = placed;
                    joining = true;
                    eprintln!(
                        "trainer launcher: the job at {}:{port} is training already: the {} rank(s) of node {} join it",
                        plan.master_addr, plan.nproc, plan.node_rank
                    );
                }
                Entry::Ended => {
                    eprintln!(
                        "trainer launcher: the job at {}:{port} has ended: nothing left to train",
                        plan.master_addr
                    );
                    return Ok(ExitCode::SUCCESS);
                }
            }
        }
        tracing::info!(
            "launching {} rank(s) on node {} of {} (world size {}), store at {}:{port}{}",
            plan.nproc,
            plan.node_rank,
            plan.nnodes,
            plan.world_size,
            plan.master_addr,
            if attempt > 0 {
                format!(", restart {attempt} of {}", plan.max_restarts)
            } else {
                String::new()
            }
        );
        // With --survivors-continue the job may leave a rank out: this launcher ends it.
        let mut fencing = plan
            .survivors_continue
            .then(|| Fencing::new(&plan, port, random_token()));
        let children = start_ranks(&plan, program, port, attempt, joining, &mut fencing)?;
        let outcome = match fencing {
            Some(mut fencing) => {
                let mut rejoin = |local_rank: usize, restarts: usize, fencing: &mut Fencing| {
                    let mut env = plan.rejoin_env(local_rank, port, restarts);
                    let identity = fencing.next_identity();
                    env.push((FENCE_ID_VAR, identity.clone()));
                    start_rank(&plan, program, local_rank, env, Some(identity))
                };
                let survivors = SurvivorSupervision {
                    plan: &plan,
                    fencing: &mut fencing,
                    restarts: &mut restarts,
                    rejoin: &mut rejoin,
                };
                supervise_survivors(children, &interrupted, survivors)
            }
            None => supervise(children, &interrupted),
        };
        drop(server);
        match outcome {
            Outcome::Success => return Ok(ExitCode::SUCCESS),
            Outcome::Interrupted(sig) => {
                eprintln!("trainer launcher: stopped every rank on signal {sig}");
                return Ok(ExitCode::from(128 + sig as u8));
            }
            Outcome::Failed { code } if plan.restarts_after(Some(code), restarts) => {
                restarts += 1;
                eprintln!(
                    "trainer launcher: restarting every rank ({restarts} of {} restarts, {RESTART_COUNT_VAR}={restarts}); \
                     a trainer resumes from its newest complete checkpoint",
                    plan.max_restarts,
                );
            }
            Outcome::Failed { code } => return Ok(ExitCode::from(code)),
        }
    }
}

/// Refuses, before any process starts, a job this machine's limits cannot hold
/// ([`limit_checks`], which the doctor shows too), naming each limit, the numbers and the fix:
/// starting it would end in a failed `fork` or `accept` part-way, after a machine-wide flood of
/// processes.
fn refuse_beyond_limits(plan: &LaunchPlan) -> Result<(), UsageError> {
    let shape = JobShape {
        local_ranks: plan.nproc,
        world_size: plan.world_size,
        threads_per_rank: plan.threads_per_rank.parse().unwrap_or(1),
        // The program's own loader threads are not known here: the need stays a lower bound.
        loader_threads: 0,
        hosts_store: plan.store_host.is_some(),
    };
    let failed: Vec<String> = limit_checks(&shape)
        .into_iter()
        .filter(|f| f.status == Status::Fail)
        .map(|f| {
            let advice = f.advice.map(|a| format!(": {a}")).unwrap_or_default();
            format!("{}: {}{advice}", f.check, f.detail)
        })
        .collect();
    if failed.is_empty() {
        return Ok(());
    }
    Err(UsageError(format!(
        "this machine cannot start {} local ranks (world size {}); no rank was started:\n  {}\n(`trainer doctor` with the same options shows every check)",
        plan.nproc,
        plan.world_size,
        failed.join("\n  ")
    )))
}

/// What the plan needs from this machine: its cores, the launcher's `RAYON_NUM_THREADS`, the
/// job token (the launcher's `BURN_DDP_TOKEN`, else 128 fresh random bits), and, for an
/// elastic job without `--node-rank`, whether `--master-addr` is this machine's.
fn machine(args: &LaunchArgs) -> LaunchEnv {
    let decides_host = args.nnodes.is_elastic() && args.node_rank.is_none();
    LaunchEnv {
        master_addr_is_here: decides_host
            && args.master_addr.as_deref().is_some_and(is_this_machine),
        cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        threads: std::env::var(THREADS_VAR).ok(),
        token: std::env::var(TOKEN_VAR).unwrap_or_else(|_| random_token()),
    }
}

/// Whether `addr` names this machine: a socket can be bound to it (binding to another
/// machine's address fails with `EADDRNOTAVAIL`), as torchrun tells its store's host.
fn is_this_machine(addr: &str) -> bool {
    std::net::TcpListener::bind((addr, 0)).is_ok()
}

/// Starts the local ranks, as ranks that start the job or (`joining`) that join it; with
/// `fencing`, each with an identity of its own.
fn start_ranks(
    plan: &LaunchPlan,
    program: &Program,
    port: u16,
    attempt: usize,
    joining: bool,
    fencing: &mut Option<Fencing>,
) -> anyhow::Result<Vec<Rank>> {
    let mut children = Vec::with_capacity(plan.nproc);
    for local_rank in 0..plan.nproc {
        let mut env = match joining {
            true => plan.rejoin_env(local_rank, port, attempt),
            false => plan.rank_env(local_rank, port, attempt),
        };
        let identity = fencing.as_mut().map(Fencing::next_identity);
        if let Some(identity) = &identity {
            env.push((FENCE_ID_VAR, identity.clone()));
        }
        let started = start_rank(plan, program, local_rank, env, identity);
        match started {
            Ok(started) => children.push(started),
            Err(e) => {
                let done = vec![None; children.len()];
                stop_all(&mut children, &done);
                return Err(e);
            }
        }
    }
    Ok(children)
}

/// Starts local rank `local_rank` with the launcher's variables `env` (which hold
/// `fence_id`, its identity for fencing, when it has one).
fn start_rank(
    plan: &LaunchPlan,
    program: &Program,
    local_rank: usize,
    env: Vec<(&'static str, String)>,
    fence_id: Option<String>,
) -> anyhow::Result<Rank> {
    let rank = plan.rank(local_rank);
    let mut cmd = Command::new(&program.exe);
    cmd.args(&program.args).envs(env);
    if plan.pipes_stderr(rank, std::io::stderr().is_terminal()) {
        cmd.stderr(Stdio::piped());
    }
    die_with_parent(&mut cmd);
    let file = plan
        .log_dir
        .as_deref()
        .map(|dir| open_log(dir, rank))
        .transpose()?;
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start rank {rank} ({})", program.exe.display()))?;
    let log = child.stderr.take().map(|e| RankLog::forward(rank, e, file));
    Ok(Rank {
        local_rank,
        rank,
        child,
        log,
        fence_id,
        fenced: false,
    })
}

/// Opens (appending) DIR/rank-N.log.
fn open_log(dir: &Path, rank: usize) -> anyhow::Result<std::fs::File> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create --log-dir {}", dir.display()))?;
    let path = dir.join(format!("rank-{rank}.log"));
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))
}

/// Asks the kernel to SIGKILL the child when the launcher dies, however it dies.
fn die_with_parent(cmd: &mut Command) {
    // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches no memory of the parent;
    // it is the only call made between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// 128 random bits as hex, from the OS.
fn random_token() -> String {
    let mut bytes = [0u8; 16];
    let filled = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if filled.is_err() {
        // No /dev/urandom: the pid and the clock still separate concurrent jobs.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        bytes.copy_from_slice(&(nanos ^ ((std::process::id() as u128) << 64)).to_le_bytes());
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    #[test]
    fn a_program_is_found_in_path_like_execvp_finds_it() {
        let dir = std::env::temp_dir().join(format!("launch-find-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("hello-rank");
        std::fs::write(&script, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let plain = dir.join("not-executable");
        std::fs::write(&plain, "").unwrap();
        let search = std::env::join_paths(["/nonexistent-dir", dir.to_str().unwrap()]).unwrap();

        assert_eq!(
            find_program("hello-rank".as_ref(), &search).unwrap(),
            script
        );
        let missing = find_program("no-such-program-xyz".as_ref(), &search).unwrap_err();
        assert!(missing.0.contains("`no-such-program-xyz`"), "{}", missing.0);
        assert!(missing.0.contains("PATH"), "{}", missing.0);
        // A file without execute permission is skipped, as execvp skips it.
        assert!(find_program("not-executable".as_ref(), &search).is_err());
        // With a `/`, PATH is not searched.
        assert_eq!(
            find_program(script.as_os_str(), "".as_ref()).unwrap(),
            script
        );
        let gone = find_program("./no-such-file".as_ref(), &search).unwrap_err();
        assert!(gone.0.contains("`./no-such-file`"), "{}", gone.0);
        let plain = find_program(plain.as_os_str(), &search).unwrap_err();
        assert!(plain.0.contains("not an executable file"), "{}", plain.0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_resolved_program_keeps_its_arguments() {
        let program = Program::resolve(&os(&["sh", "-c", "echo $RANK"])).unwrap();
        assert!(program.exe.ends_with("sh"), "{}", program.exe.display());
        assert_eq!(program.args, os(&["-c", "echo $RANK"]));
        assert!(Program::resolve(&[]).is_err());
    }
}
