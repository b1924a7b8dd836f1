//! The launcher: `--nproc-per-node N` starts N ranks of this same program on this machine and
//! supervises them, like `torchrun`.
//!
//! - On the first node (`--node-rank 0`) the launcher hosts the rendezvous store itself (so the
//!   port is bound before any rank starts: no race for a "free" port), on loopback when every
//!   rank is local and on all interfaces otherwise. Without `--master-port` on a single node the
//!   OS picks a free port, so two jobs on one machine never collide.
//! - Each child gets torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), the job token, and dies with the
//!   launcher (`PR_SET_PDEATHSIG`), so no orphan outlives it.
//! - The first rank to fail stops the others (SIGTERM, then SIGKILL after a grace period), and
//!   the launcher reports which rank failed and how, last, where the user looks.

use std::io::IsTerminal;
use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use burn_ddp::init::{AGENT_STORE_VAR, TOKEN_VAR};
use burn_ddp::store::TcpStoreServer;
use clap::Args;

use crate::cli::{UsageError, WORKER_VAR};
use crate::ranklog::RankLog;

/// torchrun-style launch options.
#[derive(Args, Debug, Clone, Default)]
pub struct LaunchArgs {
    /// Start this many ranks on this machine and supervise them.
    #[arg(long)]
    pub nproc_per_node: Option<usize>,
    /// Number of machines in the job.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This machine's index, 0..nnodes (node 0 hosts the rendezvous store).
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
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
    pub log_dir: Option<std::path::PathBuf>,
    /// After a rank fails, restart every local rank up to this many times; training resumes
    /// from the newest complete checkpoint. Bad input (exit code 2) is never retried.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: usize,
}

/// Set in every rank's environment: how many times the job was restarted (torchrun's
/// `TORCHELASTIC_RESTART_COUNT`).
pub const RESTART_COUNT_VAR: &str = "TRAINER_RESTART_COUNT";

/// How long ranks get to exit after SIGTERM before SIGKILL.
const GRACE: Duration = Duration::from_secs(10);

/// Starts the local ranks and waits for them. `config` is checked first, so a bad file fails
/// once, with exit code 2, before any rank starts.
pub fn launch(args: &LaunchArgs, config: Option<&Path>) -> anyhow::Result<ExitCode> {
    let nproc = args.nproc_per_node.unwrap_or(1);
    if nproc == 0 {
        return Err(UsageError("--nproc-per-node must be at least 1".into()).into());
    }
    if args.nnodes == 0 || args.node_rank >= args.nnodes {
        return Err(UsageError(format!(
            "--node-rank {} is not in 0..{} (--nnodes)",
            args.node_rank, args.nnodes
        ))
        .into());
    }
    if let Some(path) = config {
        crate::train::preflight(path)?;
    }
    let master_addr = match (&args.master_addr, args.nnodes) {
        (Some(a), _) => a.clone(),
        (None, 1) => "127.0.0.1".to_string(),
        (None, _) => {
            return Err(UsageError(
                "--master-addr (node 0's address) is required with --nnodes > 1".into(),
            )
            .into())
        }
    };
    let token = std::env::var(TOKEN_VAR).unwrap_or_else(|_| random_token());
    let world_size = nproc * args.nnodes;
    // Like torchrun's OMP_NUM_THREADS: N ranks on one machine share its cores instead of each
    // starting a thread per core (which oversubscribes the machine N times).
    let threads_per_rank = std::env::var("RAYON_NUM_THREADS").ok().unwrap_or_else(|| {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        (cores / nproc).max(1).to_string()
    });
    let exe = std::env::current_exe().context("cannot find this program's path to start ranks")?;
    let argv: Vec<String> = std::env::args().skip(1).collect();

    // Ctrl-C or SIGTERM: stop every rank, then exit (the flag is polled by `supervise`).
    let interrupted = Arc::new(AtomicUsize::new(0));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register_usize(sig, interrupted.clone(), sig as usize)
            .context("cannot install the signal handler")?;
    }

    let mut port = args
        .master_port
        .unwrap_or(if args.nnodes == 1 { 0 } else { 29500 });
    for attempt in 0..=args.max_restarts {
        // A fresh store per attempt: the ranks of a restarted job start from an empty store.
        let server = if args.node_rank == 0 {
            let local_only = args.nnodes == 1 && is_loopback_name(&master_addr);
            let host = if local_only { "127.0.0.1" } else { "0.0.0.0" };
            let server = TcpStoreServer::bind(&format!("{host}:{port}"), &token)
                .map_err(|e| UsageError(e.to_string()))?;
            port = server.local_addr().port();
            Some(server)
        } else {
            None
        };
        tracing::info!(
            "launching {nproc} rank(s) on node {} of {} (world size {world_size}), store at {master_addr}:{port}{}",
            args.node_rank,
            args.nnodes,
            if attempt > 0 { format!(", restart {attempt} of {}", args.max_restarts) } else { String::new() }
        );
        let mut children = Vec::with_capacity(nproc);
        for local_rank in 0..nproc {
            let rank = args.node_rank * nproc + local_rank;
            let mut cmd = Command::new(&exe);
            cmd.args(&argv)
                .env(WORKER_VAR, "1")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world_size.to_string())
                .env("LOCAL_RANK", local_rank.to_string())
                .env("LOCAL_WORLD_SIZE", nproc.to_string())
                .env("GROUP_RANK", args.node_rank.to_string())
                .env("MASTER_ADDR", &master_addr)
                .env("MASTER_PORT", port.to_string())
                .env(TOKEN_VAR, &token)
                .env("RAYON_NUM_THREADS", &threads_per_rank)
                .env(RESTART_COUNT_VAR, attempt.to_string())
                .env(AGENT_STORE_VAR, if server.is_some() { "1" } else { "0" });
            // Rank 0 keeps the terminal (its progress bar needs one); the others are tagged.
            let forward = rank != 0 || !std::io::stderr().is_terminal() || args.log_dir.is_some();
            if forward {
                cmd.stderr(Stdio::piped());
            }
            die_with_parent(&mut cmd);
            let started = args
                .log_dir
                .as_deref()
                .map(|dir| open_log(dir, rank))
                .transpose()
                .and_then(|file| {
                    let mut child = cmd
                        .spawn()
                        .with_context(|| format!("cannot start rank {rank} ({})", exe.display()))?;
                    let log = child.stderr.take().map(|e| RankLog::forward(rank, e, file));
                    Ok(Rank { rank, child, log })
                });
            match started {
                Ok(started) => children.push(started),
                Err(e) => {
                    stop_all(&mut children, &vec![None; nproc]);
                    return Err(e);
                }
            }
        }
        let outcome = supervise(children, &interrupted);
        drop(server);
        match outcome {
            Outcome::Success => return Ok(ExitCode::SUCCESS),
            Outcome::Interrupted(sig) => {
                eprintln!("trainer launcher: stopped every rank on signal {sig}");
                return Ok(ExitCode::from(128 + sig as u8));
            }
            // Bad input: retrying cannot help.
            Outcome::Failed { code: 2 } => return Ok(ExitCode::from(2)),
            Outcome::Failed { code } if attempt == args.max_restarts => return Ok(ExitCode::from(code)),
            Outcome::Failed { .. } => eprintln!(
                "trainer launcher: restarting every rank ({} of {} restarts); training resumes from the newest complete checkpoint",
                attempt + 1,
                args.max_restarts
            ),
        }
    }
    unreachable!("the last attempt always returns")
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

/// A started rank: its process and, when its stderr is piped, the forwarder of its lines.
struct Rank {
    rank: usize,
    child: Child,
    log: Option<RankLog>,
}

/// How a launched group ended.
enum Outcome {
    Success,
    /// A rank failed; the others were stopped. `code` is what the launcher exits with.
    Failed {
        code: u8,
    },
    /// The launcher got this signal; every rank was stopped.
    Interrupted(usize),
}

/// Waits for every rank; on the first failure stops the rest and reports it.
///
/// The likely cause is reported first: a rank killed by a signal (its peers then fail with
/// "connection lost"), else the lowest failed rank. After an error exit, other ranks get up to
/// [`SETTLE`] to show such a crash before they are stopped.
fn supervise(mut children: Vec<Rank>, interrupted: &AtomicUsize) -> Outcome {
    let mut done: Vec<Option<ExitStatus>> = vec![None; children.len()];
    loop {
        let sig = interrupted.load(Ordering::SeqCst);
        if sig != 0 {
            stop_all(&mut children, &done);
            flush_logs(children);
            return Outcome::Interrupted(sig);
        }
        let mut failed: Vec<(usize, ExitStatus)> = Vec::new();
        reap(&mut children, &mut done, &mut failed);
        // A rank that exits with an error may only be reacting to a peer that crashed: the
        // peer's socket or shared memory closed before we could reap it. Give such a crash a
        // moment to show up, so that it, not its messenger, is named as the cause.
        let settle = Instant::now() + SETTLE;
        while !failed.is_empty()
            && failed.iter().all(|(_, status)| status.signal().is_none())
            && done.iter().any(Option::is_none)
            && Instant::now() < settle
        {
            std::thread::sleep(Duration::from_millis(20));
            reap(&mut children, &mut done, &mut failed);
        }
        failed.sort_by_key(|(rank, status)| (status.signal().is_none(), *rank));
        if let Some(&(rank, status)) = failed.first() {
            stop_all(&mut children, &done);
            for &(other, other_status) in &failed[1..] {
                eprintln!(
                    "trainer launcher: rank {other} also failed: {}",
                    describe(other_status)
                );
            }
            // The failing rank's last words come last, where the user looks: every other
            // rank's output is forwarded in full before them.
            let failing = children.iter().position(|r| r.rank == rank);
            let tail = failing
                .and_then(|i| children.swap_remove(i).log)
                .map(RankLog::last_lines);
            flush_logs(children);
            eprintln!(
                "\ntrainer launcher: rank {rank} failed: {}; stopped the other ranks.",
                describe(status)
            );
            match tail {
                Some((_, lines)) if !lines.is_empty() => {
                    eprintln!("---- last lines of rank {rank} ----");
                    for line in lines {
                        eprintln!("{line}");
                    }
                }
                _ => eprintln!("Its messages are above."),
            }
            return Outcome::Failed {
                code: status.code().map(|c| c.clamp(1, 255) as u8).unwrap_or(1),
            };
        }
        if done.iter().all(Option::is_some) {
            flush_logs(children);
            return Outcome::Success;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until every rank's forwarded output has reached our stderr (their pipes close when
/// they exit), so that no line is lost when the launcher exits.
fn flush_logs(children: Vec<Rank>) {
    for log in children.into_iter().filter_map(|r| r.log) {
        let _ = log.last_lines();
    }
}

/// How long a rank's error exit waits for a crash of another rank to show (see `supervise`).
const SETTLE: Duration = Duration::from_secs(1);

/// Records the ranks that have exited since the last call; failures go to `failed`.
fn reap(
    children: &mut [Rank],
    done: &mut [Option<ExitStatus>],
    failed: &mut Vec<(usize, ExitStatus)>,
) {
    for (i, Rank { rank, child, .. }) in children.iter_mut().enumerate() {
        if done[i].is_none() {
            match child.try_wait() {
                Ok(Some(status)) => {
                    done[i] = Some(status);
                    if !status.success() {
                        failed.push((*rank, status));
                    }
                }
                Ok(None) => {}
                Err(e) => tracing::warn!("cannot query rank {rank}: {e}"),
            }
        }
    }
}

fn stop_all(children: &mut [Rank], done: &[Option<ExitStatus>]) {
    for (i, Rank { child, .. }) in children.iter_mut().enumerate() {
        if done[i].is_none() {
            // SAFETY: kill(2) on our own child's pid; the child has not been reaped (try_wait
            // returned None), so the pid still names it.
            unsafe {
                libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
            }
        }
    }
    let deadline = Instant::now() + GRACE;
    for (i, Rank { child, .. }) in children.iter_mut().enumerate() {
        if done[i].is_some() {
            continue;
        }
        loop {
            match child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// "exit code 3" or "killed by signal 9 (SIGKILL)".
pub fn describe(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exit code {code}");
    }
    match status.signal() {
        Some(sig) => {
            let name = match sig {
                libc::SIGKILL => " (SIGKILL: killed, e.g. by the OOM killer or kill -9)",
                libc::SIGSEGV => " (SIGSEGV: crashed)",
                libc::SIGABRT => " (SIGABRT: aborted)",
                libc::SIGTERM => " (SIGTERM)",
                libc::SIGINT => " (SIGINT)",
                _ => "",
            };
            format!("killed by signal {sig}{name}")
        }
        None => format!("{status}"),
    }
}

fn is_loopback_name(addr: &str) -> bool {
    addr == "localhost"
        || addr
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
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
