//! Helpers: run the trainer with a watchdog, scratch directories, configs, checkpoints.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Generous: these tests run on a loaded 2-core machine.
pub const WATCHDOG: Duration = Duration::from_secs(300);

/// A launcher's identity, which a command of the tests never inherits from the environment
/// running them (every launcher under test sets its own).
pub const LAUNCHER_IDENTITY: [&str; 14] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TRAINER_WORKER",
    "TRAINER_RESTART_COUNT",
    "BURN_DDP_TOKEN",
    "BURN_DDP_USE_AGENT_STORE",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
];

/// `cmd` without any of [`LAUNCHER_IDENTITY`].
pub fn without_launcher_identity(cmd: &mut Command) -> &mut Command {
    for var in LAUNCHER_IDENTITY {
        cmd.env_remove(var);
    }
    cmd
}

pub fn trainer() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_trainer"));
    cmd.current_dir(env!("CARGO_MANIFEST_DIR").to_string() + "/..");
    without_launcher_identity(&mut cmd);
    cmd
}

/// A finished process: exit code (None when killed by a signal), the signal, and its output.
#[derive(Debug)]
pub struct Output {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn all(&self) -> String {
        format!("--- stdout\n{}\n--- stderr\n{}", self.stdout, self.stderr)
    }
}

/// Starts `cmd` with piped output, under the [`WATCHDOG`] (see [`Proc`]).
pub fn spawn(cmd: &mut Command) -> Proc {
    Proc::start(cmd)
}

/// Waits for `proc` under its deadline; a process still running then is killed with every
/// process it started, and the test fails, showing what it printed.
pub fn finish(proc: Proc) -> Output {
    proc.finish()
}

/// One line of a process's output.
enum Line {
    Out(String),
    Err(String),
}

/// A running process under a deadline: its stdout and stderr lines are streamed (and kept);
/// any wait that passes the deadline kills it and every process it started (a launcher's
/// ranks) and fails the test with its output; a wait for a line it never prints fails as soon
/// as its output ends, not at the deadline. Dropped while running (a failed assertion), it is
/// killed the same way, so a failing test leaves no process behind.
pub struct Proc {
    child: Child,
    lines: mpsc::Receiver<Line>,
    pub stdout: Vec<String>,
    pub stderr: Vec<String>,
    status: Option<ExitStatus>,
    deadline: Instant,
}

impl Proc {
    pub fn start(cmd: &mut Command) -> Proc {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", cmd.get_program()));
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        let tx_err = tx.clone();
        std::thread::spawn(move || stream(out, &tx, Line::Out));
        std::thread::spawn(move || stream(err, &tx_err, Line::Err));
        Proc {
            child,
            lines,
            stdout: Vec::new(),
            stderr: Vec::new(),
            status: None,
            deadline: Instant::now() + WATCHDOG,
        }
    }

    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Every line seen so far, stdout and stderr (in the order they arrived).
    pub fn log(&self) -> String {
        format!(
            "--- stdout\n{}\n--- stderr\n{}",
            self.stdout.join("\n"),
            self.stderr.join("\n")
        )
    }

    fn keep(&mut self, line: Line) -> String {
        let (text, into) = match line {
            Line::Out(l) => (l, &mut self.stdout),
            Line::Err(l) => (l, &mut self.stderr),
        };
        into.push(text.clone());
        text
    }

    /// Kills the process and its descendants, then fails the test with `why` and the output.
    pub fn fail(&mut self, why: &str) -> ! {
        self.kill();
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
            self.keep(line);
        }
        panic!("{why}\n{}", self.log());
    }

    /// Waits for a line (stdout or stderr) containing `needle` and returns it. Fails at the
    /// deadline, or at once when the process's output ends (it exited) without one.
    pub fn wait_for_line(&mut self, needle: &str) -> String {
        match self.wait_for_line_or_end(needle) {
            Some(line) => line,
            None => {
                let status = self.try_wait();
                panic!(
                    "the process ended ({status:?}) without a line with {needle:?}:\n{}",
                    self.log()
                )
            }
        }
    }

    /// Waits for a line containing `needle`; `None` when the output ends (the process exited)
    /// without one. Fails at the deadline.
    pub fn wait_for_line_or_end(&mut self, needle: &str) -> Option<String> {
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let line = self.keep(line);
                    if line.contains(needle) {
                        return Some(line);
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => self.fail(&format!(
                    "no line with {needle:?} within the {WATCHDOG:?} watchdog"
                )),
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// Waits for `count` lines containing `needle` in all (counting those already seen).
    pub fn wait_for_lines(&mut self, needle: &str, count: usize) {
        let seen = |p: &Proc| {
            p.stdout
                .iter()
                .chain(&p.stderr)
                .filter(|l| l.contains(needle))
                .count()
        };
        while seen(self) < count {
            self.wait_for_line(needle);
        }
    }

    /// Takes the lines printed so far without waiting.
    pub fn poll_lines(&mut self) {
        while let Ok(line) = self.lines.try_recv() {
            self.keep(line);
        }
    }

    /// The exit status if the process has exited (reaps it), else `None`.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().expect("wait");
        }
        self.status
    }

    /// Waits for the process to exit and its output to end, for at most `bound` (and never
    /// past the deadline); past it, fails like [`Proc::fail`]. Returns the time it took.
    pub fn wait_within(&mut self, bound: Duration) -> Duration {
        let start = Instant::now();
        let deadline = self.deadline.min(start + bound);
        loop {
            self.poll_lines();
            if self.try_wait().is_some() {
                break;
            }
            if Instant::now() > deadline {
                self.fail(&format!("still running {bound:?} later (a hang)"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let took = start.elapsed();
        // Its output ends when every process holding its pipes has gone (its ranks too).
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.keep(line);
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return took,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    self.fail("exited, but processes it started still hold its output")
                }
            }
        }
    }

    /// Waits (under the deadline) and returns the output.
    pub fn finish(mut self) -> Output {
        self.wait_within(WATCHDOG);
        let status = self.status.expect("exited");
        Output {
            code: status.code(),
            signal: status.signal(),
            stdout: lines_text(&std::mem::take(&mut self.stdout)),
            stderr: lines_text(&std::mem::take(&mut self.stderr)),
        }
    }

    /// SIGKILLs the process and every descendant, and reaps it.
    pub fn kill(&mut self) {
        if self.try_wait().is_none() {
            kill_tree(self.child.id());
            self.status = self.child.wait().ok();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn lines_text(lines: &[String]) -> String {
    lines.iter().map(|l| format!("{l}\n")).collect()
}

fn stream(pipe: impl Read, tx: &mpsc::Sender<Line>, wrap: fn(String) -> Line) {
    let mut reader = BufReader::new(pipe);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let text = String::from_utf8_lossy(&buf);
                let line = text.trim_end_matches(['\n', '\r']).to_string();
                if tx.send(wrap(line)).is_err() {
                    return;
                }
            }
        }
    }
}

/// Pids whose parent is `parent` (from /proc).
pub fn children_of(parent: u32) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().filter_map(Result::ok) {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the command name, which is in parentheses and may contain spaces.
        let after = &stat[stat.rfind(')').map_or(0, |i| i + 2)..];
        let ppid = after.split(' ').nth(1).and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(parent) {
            pids.push(pid);
        }
    }
    pids
}

/// `root` and every process below it.
pub fn tree_of(root: u32) -> Vec<u32> {
    let mut all = vec![root];
    let mut i = 0;
    while i < all.len() {
        let kids = children_of(all[i]);
        all.extend(kids);
        i += 1;
    }
    all
}

/// SIGKILLs `root` (stopped first, so it starts nothing more) and every process below it.
pub fn kill_tree(root: u32) {
    signal(root, libc::SIGSTOP);
    for pid in tree_of(root) {
        signal(pid, libc::SIGKILL);
    }
}

pub fn alive(pid: u32) -> bool {
    // A zombie still has /proc/<pid>; it is not running anything, so count it as gone.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

pub fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) with a pid and a signal number.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// The `RANK` a process was started with (from /proc/PID/environ).
pub fn rank_of(pid: u32) -> Option<usize> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    environ
        .split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(b"RANK="))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
}

/// Waits until every pid in `pids` has gone, for at most `bound`; returns those left.
pub fn wait_gone(pids: &[u32], bound: Duration) -> Vec<u32> {
    let deadline = Instant::now() + bound;
    loop {
        let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGKILLs `launcher` (a supervising process that started 2 ranks as its children) and
/// fails unless its ranks are gone within 60 s; returns the launcher's log.
pub fn kill_launcher_and_expect_its_ranks_gone(launcher: &mut Proc) -> String {
    let ranks = children_of(launcher.id());
    kill_launcher_and_expect_gone(launcher, &ranks)
}

/// SIGKILLs `launcher` and fails unless the 2 processes `ranks` are gone within 60 s; returns
/// the launcher's log.
pub fn kill_launcher_and_expect_gone(launcher: &mut Proc, ranks: &[u32]) -> String {
    assert_eq!(ranks.len(), 2, "{}", launcher.log());
    signal(launcher.id(), libc::SIGKILL);
    let left = wait_gone(ranks, Duration::from_secs(60));
    for &pid in &left {
        signal(pid, libc::SIGKILL);
    }
    assert!(
        left.is_empty(),
        "ranks {left:?} outlived their killed launcher by 60 s:\n{}",
        launcher.log()
    );
    launcher.log()
}

/// Fails if a line of `out` tagged as rank 1's (it starts with `rank1_tag`, the launcher's
/// tag) logs at INFO: by default only rank 0 does.
pub fn assert_rank1_logs_no_info(out: &Output, rank1_tag: &str) {
    assert!(
        !out.all()
            .lines()
            .any(|l| l.starts_with(rank1_tag) && l.contains("INFO")),
        "rank 1 must log warnings only by default:\n{}",
        out.all()
    );
}

pub fn run(cmd: &mut Command) -> Output {
    finish(spawn(cmd))
}

/// Trains with `config` on `nproc` local ranks and expects success.
pub fn train(config: &Path, nproc: usize) -> Output {
    let out = run(trainer()
        .arg("--config")
        .arg(config)
        .arg("--nproc-per-node")
        .arg(nproc.to_string()));
    assert_eq!(
        out.code,
        Some(0),
        "training with {nproc} rank(s) failed:\n{}",
        out.all()
    );
    out
}

/// `"bytes_reduced"` of the reducer statistics (rank 0) of the run written by
/// `write_config(dir, name, …)` (needs `output.log_samples`).
pub fn bytes_reduced(dir: &Path, name: &str) -> u64 {
    let stats = std::fs::read_to_string(dir.join(format!("{name}-out/reducer-stats.json")))
        .expect("reducer-stats.json");
    let value = stats
        .split("\"bytes_reduced\":")
        .nth(1)
        .and_then(|rest| rest.split([',', '}']).next())
        .and_then(|v| v.parse().ok());
    value.unwrap_or_else(|| panic!("no bytes_reduced in {stats}"))
}

/// The count of optimizer steps skipped for non-finite gradients in rank 0's closing line
/// ("…; skipped N optimizer steps with non-finite gradients").
pub fn skipped_steps(out: &Output) -> usize {
    out.stdout
        .split("skipped ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of skipped steps:\n{}", out.all()))
}

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir()
        .join("burn-ddp-tests")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A port nobody listened on a moment ago (bound, then released): another process may take it
/// before it is used. Prefer the launcher's own port (it binds port 0 and says "store at"),
/// [`start_by_hand`] (which retries when the port was taken) or [`ClosedPort`].
pub fn unused_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Ranks started by hand, as torchrun's workers or SLURM's and Open MPI's tasks are:
/// `commands(port)` gives each rank's command, rank 0 (which hosts the store on
/// `MASTER_PORT`) first. The port is one the OS has just handed out and released; when rank 0
/// finds it taken in between, every rank is stopped and the whole start is retried on another
/// one. Each start gets its own job token (unless the commands set `BURN_DDP_TOKEN`), so a
/// rank that reached someone else's store is refused instead of joining it. Returns the running ranks, rank 0 first, once rank 0 hosts
/// the store (or has ended for another reason), and the port.
pub fn start_by_hand(commands: impl Fn(u16) -> Vec<Command>) -> (Vec<Proc>, u16) {
    for attempt in 0..20 {
        let port = unused_port();
        let token = format!("by-hand-{}-{port}-{attempt}", std::process::id());
        let mut cmds = commands(port);
        for cmd in &mut cmds {
            // A command that sets its own token (even an empty one) keeps it.
            if !cmd.get_envs().any(|(k, _)| k == "BURN_DDP_TOKEN") {
                cmd.env("BURN_DDP_TOKEN", &token);
            }
        }
        // So that rank 0 says when it has bound the port (its default level is info).
        let level = cmds[0]
            .get_envs()
            .find(|(k, _)| *k == "RUST_LOG")
            .and_then(|(_, v)| Some(v?.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "info".into());
        cmds[0].env("RUST_LOG", format!("{level},burn_ddp::store::server=debug"));
        let mut procs: Vec<Proc> = cmds.iter_mut().map(spawn).collect();
        if procs[0]
            .wait_for_line_or_end("rendezvous store listening")
            .is_none()
        {
            let err = procs[0].stderr.join("\n");
            if err.contains("cannot host the rendezvous store") && err.contains("in use") {
                eprintln!("port {port} was taken before rank 0 bound it: starting again");
                continue;
            }
        }
        return (procs, port);
    }
    panic!("20 ports in a row were taken before rank 0 could bind them");
}

pub use burn_ddp::testing::ClosedPort;

/// A tiny tmpfs, unmounted on drop. Where it cannot be mounted (no root), [`SmallDisk::mount`]
/// records a skip ([`burn_ddp::testing::skip`]: a failure where `TESTS_MUST_RUN` names `tmpfs`)
/// and returns `None`; the test then returns.
pub struct SmallDisk(pub PathBuf);

impl SmallDisk {
    pub fn mount(path: &Path, size: &str) -> Option<SmallDisk> {
        std::fs::create_dir_all(path).ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(path)
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !ok {
            burn_ddp::testing::skip(
                burn_ddp::testing::Needs::Tmpfs,
                &format!(
                    "cannot mount a {size} tmpfs on {} (needs root)",
                    path.display()
                ),
            );
            return None;
        }
        Some(SmallDisk(path.to_path_buf()))
    }
}

/// `cmd` (a [`trainer`] command: its program, arguments, directory and environment) run in a
/// private mount namespace (`unshare -m`) where `shm` (a [`SmallDisk`]) is mounted over
/// `/dev/shm`: the job sees only that tmpfs, and the test can read it before and after.
pub fn with_dev_shm(cmd: &Command, shm: &Path) -> Command {
    let mut wrapped = Command::new("unshare");
    wrapped
        .args([
            "-m",
            "sh",
            "-c",
            r#"mount --bind "$0" /dev/shm && exec "$@""#,
        ])
        .arg(shm)
        .arg(cmd.get_program())
        .args(cmd.get_args());
    if let Some(dir) = cmd.get_current_dir() {
        wrapped.current_dir(dir);
    }
    for (key, value) in cmd.get_envs() {
        match value {
            Some(value) => wrapped.env(key, value),
            None => wrapped.env_remove(key),
        };
    }
    wrapped
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).output();
    }
}

/// Writes a config into `dir/name.toml` and returns its path. `body` holds every section; the
/// checkpoint and output directories are placed under `dir`.
pub fn write_config(dir: &Path, name: &str, body: &str) -> PathBuf {
    let text = body
        .replace(
            "{ckpt}",
            &dir.join(format!("{name}-ckpt")).display().to_string(),
        )
        .replace(
            "{out}",
            &dir.join(format!("{name}-out")).display().to_string(),
        )
        .replace(
            "{data}",
            &(env!("CARGO_MANIFEST_DIR").to_string() + "/../data/digits.csv.gz"),
        );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// (index → times seen) over the non-padding samples of epoch 0 in `samples-rank*.txt`.
pub fn visits(out_dir: &Path, into: &mut BTreeMap<usize, usize>) {
    for entry in std::fs::read_dir(out_dir).unwrap().filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().to_string();
        if !name.starts_with("samples-rank") {
            continue;
        }
        for line in std::fs::read_to_string(entry.path()).unwrap().lines() {
            let f: Vec<usize> = line.split(' ').map(|x| x.parse().unwrap()).collect();
            if f[0] == 0 && f[2] == 0 {
                *into.entry(f[1]).or_default() += 1;
            }
        }
    }
}

/// Copies the newest checkpoint under `from` into the checkpoint root `to` (a run configured
/// with `to` then resumes from it).
pub fn copy_newest_checkpoint(from: &Path, to: &Path) {
    let src = newest_checkpoint(from);
    let dst = to.join(src.file_name().unwrap());
    std::fs::create_dir_all(&dst).unwrap();
    for f in std::fs::read_dir(&src).unwrap().filter_map(Result::ok) {
        std::fs::copy(f.path(), dst.join(f.file_name())).unwrap();
    }
}

/// Resumes the 2-rank run `dir/first-*` as run `resume<nproc>` with `nproc` ranks and `body`,
/// and checks that epoch 0, counted from `before` (the first run's visits), saw each of its
/// `len` samples exactly once. Returns the resumed run's output.
pub fn resume_visits_every_sample_once(
    dir: &Path,
    nproc: usize,
    body: &str,
    before: &BTreeMap<usize, usize>,
    len: usize,
) -> Output {
    let name = format!("resume{nproc}");
    copy_newest_checkpoint(&dir.join("first-ckpt"), &dir.join(format!("{name}-ckpt")));
    let config = write_config(dir, &name, body);
    let out = train(&config, nproc);
    assert_says(&out.stderr, &["saved with world size 2"], &out);
    let mut seen = before.clone();
    visits(&dir.join(format!("{name}-out")), &mut seen);
    assert_eq!(
        seen.len(),
        len,
        "every sample of the epoch, with {nproc} rank(s) after resume"
    );
    let repeated: Vec<_> = seen.iter().filter(|(_, &c)| c != 1).collect();
    assert!(
        repeated.is_empty(),
        "samples seen more than once with {nproc} rank(s): {repeated:?}"
    );
    out
}

/// The newest checkpoint directory under `root`.
pub fn newest_checkpoint(root: &Path) -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .unwrap_or_else(|e| panic!("no checkpoints in {}: {e}", root.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
        })
        .collect();
    dirs.sort();
    dirs.pop()
        .unwrap_or_else(|| panic!("no checkpoints in {}", root.display()))
}

/// Every tensor of a safetensors file, as f32.
pub fn read_weights(path: &Path) -> BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, values)
        })
        .collect()
}

/// Largest absolute difference between two sets of weights with the same names and shapes.
pub fn max_abs_diff(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f32 {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "different tensors"
    );
    let mut worst = 0f32;
    for (name, x) in a {
        let y = &b[name];
        assert_eq!(x.len(), y.len(), "{name}");
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs());
        }
    }
    worst
}

/// The value of metric `name` on the engine's `final validation: Loss 0.07, Accuracy 97.77% (...)`
/// line.
pub fn final_metric(out: &Output, name: &str) -> f64 {
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("final validation:"))
        .unwrap_or_else(|| panic!("no final validation line:\n{}", out.all()));
    metric_on(line, name).unwrap_or_else(|| panic!("no {name} on: {line}"))
}

/// The number after `name ` on a line of `name value[unit]` pairs.
pub fn metric_on(line: &str, name: &str) -> Option<f64> {
    let rest = &line[line.find(&format!("{name} "))? + name.len() + 1..];
    let number: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || matches!(c, '.' | '-' | 'e' | 'N' | 'a'))
        .collect();
    number.parse().ok()
}

/// The validation accuracy (%) on the engine's final line.
pub fn final_accuracy(out: &Output) -> f64 {
    final_metric(out, "Accuracy")
}

/// A small, fast MLP run on the digits data; `{ckpt}`/`{out}` land in the test's scratch dir.
pub fn digits_config(optimizer: &str, batch: usize, extra_training: &str) -> String {
    format!(
        r#"
[model]
name = "mlp"
hidden = [32]

[data]
source = "digits"
path = "{{data}}"

[optimizer]
{optimizer}

[training]
epochs = 3
batch_size = {batch}
seed = 7
log_every = 5
{extra_training}

[checkpoint]
dir = "{{ckpt}}"
every_epochs = 0

[output]
dir = "{{out}}"
log_samples = true
"#
    )
}

pub const SGD: &str = "name = \"sgd\"\nlearning_rate = 0.05";
pub const ADAM: &str = "name = \"adam\"\nlearning_rate = 0.003";

/// The weights of the newest checkpoint of the run written by `write_config(dir, name, …)`.
pub fn final_weights(dir: &Path, name: &str) -> BTreeMap<String, Vec<f32>> {
    read_weights(&newest_checkpoint(&dir.join(format!("{name}-ckpt"))).join("model.safetensors"))
}

/// Fails unless the newest checkpoints of the runs `a` and `b` (configs written by
/// `write_config(dir, …)`) hold the same weights within `tolerance`.
pub fn assert_same_weights(dir: &Path, a: &str, b: &str, tolerance: f32) {
    let diff = max_abs_diff(&final_weights(dir, a), &final_weights(dir, b));
    assert!(diff <= tolerance, "{a} vs {b}: max |dw| = {diff:e}");
}

/// Fails unless the run's log says it resumed from the checkpoint of optimizer step `step`.
pub fn assert_resumed_at(out: &Output, step: usize) {
    assert!(
        out.stderr.contains("resumed from") && out.stderr.contains(&format!("step {step}")),
        "{}",
        out.all()
    );
}

/// Fails, showing the whole output, unless `stream` (`out.stdout` or `out.stderr`) contains
/// every one of `needles`.
pub fn assert_says(stream: &str, needles: &[&str], out: &Output) {
    for needle in needles {
        assert!(
            stream.contains(needle),
            "missing {needle:?}:\n{}",
            out.all()
        );
    }
}

/// Fails unless the launcher refused before starting any rank (no `[rank N]` line).
pub fn assert_no_rank_started(out: &Output) {
    assert!(
        !out.all().contains("[rank "),
        "no rank started:\n{}",
        out.all()
    );
}
