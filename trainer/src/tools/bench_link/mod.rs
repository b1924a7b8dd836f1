//! `trainer bench-link`: data-parallel training between "machines" joined by a real, slow
//! network, measured against what the link allows.
//!
//! For each link rate it builds the network of [`net`] (a namespace per node, veth links shaped
//! with `tc`), measures the link (`trainer bench-allreduce` across the nodes, at the size of
//! the model's gradients), then trains the workload once per gradient compression with one rank
//! per node (`--nnodes N --node-rank R`, one compute thread each) and prints, in one table:
//! samples/s; the step's local work and its communication time at the measured bandwidth; the
//! bytes each node put on its link per step (interface counters) next to the ring's payload;
//! and the two bounds of [`bounds`] (no overlap, full overlap) with the run's ratio to each.
//! With `--pytorch PYTHON` each round also trains the workload with PyTorch DDP (gloo) on the
//! same links ([`pytorch`]), and a second table sets the two side by side: samples/s and the
//! fraction of the communication each hid under its work.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | the command: runs, parsing their records, the table |
//! | [`bounds`] | the bounds and link-rate arithmetic (pure) |
//! | [`net`] | the namespaces, links and shaping, removed on drop |
//! | [`pytorch`] | the PyTorch DDP side of `--pytorch` (its program is embedded) |
//!
//! Needs root (it exits with code 2 otherwise). The namespaces are removed on every exit path:
//! errors and SIGINT / SIGTERM / SIGHUP (the node processes are stopped first) through the drop
//! of [`net::Network`], and SIGKILL by the next run ([`net::remove_stale`]).

pub mod bounds;
pub mod net;
pub mod pytorch;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use burn::module::Module;
use burn::tensor::Device;
use clap::Args;

use self::bounds::{LinkRate, StepModel};
use self::net::{Network, Shaping};
use self::pytorch::{TorchJob, TorchMeasured};
use crate::app::{App, AppConfig};
use crate::builtin::{self, WithApp};
use crate::engine::pipeline::StageSplit;
use crate::error::UsageError;

#[derive(Args, Debug, Clone)]
pub struct BenchLinkArgs {
    /// The workload: any built-in model's config.
    #[arg(long, default_value = "configs/bench-mlp.toml")]
    pub config: PathBuf,
    /// Link rates to measure, as `tc` writes them (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1gbit")]
    pub rate: Vec<String>,
    /// One-way delay between two nodes in milliseconds (`netem`; 0: none).
    #[arg(long, default_value_t = 0.0)]
    pub delay_ms: f64,
    /// Nodes (network namespaces), one rank each.
    #[arg(long, default_value_t = 2)]
    pub nodes: usize,
    /// Gradient compressions to train with: none, bf16, fp16 (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "none,bf16")]
    pub compression: Vec<String>,
    /// Runs of each configuration (alternating); the median samples/s is reported.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Training steps per run (default: the config's `training.max_steps`).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Deadline of each run (link measurement or training), in seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout_secs: u64,
    /// The trainer binary the nodes run (default: this one), to compare two builds on the
    /// same links.
    #[arg(long)]
    pub trainer: Option<PathBuf>,
    /// A Python with `torch`: each round also trains the workload (an MLP or the text
    /// transformer) with PyTorch DDP over gloo on the same links, right after the trainer,
    /// and the report sets the two side by side.
    #[arg(long, value_name = "PYTHON")]
    pub pytorch: Option<PathBuf>,
}

pub fn bench_link(args: &BenchLinkArgs) -> anyhow::Result<ExitCode> {
    net::check_privileges()?;
    if args.nodes < 2 || args.nodes > 200 {
        bail!(UsageError(format!(
            "--nodes {}: between 2 and 200",
            args.nodes
        )));
    }
    if !(args.delay_ms >= 0.0 && args.delay_ms.is_finite()) || args.rounds == 0 {
        bail!(UsageError(
            "--delay-ms must be 0 or more, --rounds at least 1".into()
        ));
    }
    struct Bench<'a>(&'a BenchLinkArgs);
    impl WithApp for Bench<'_> {
        type Output = anyhow::Result<ExitCode>;
        fn run<A: App + Clone>(self, app: A, _stages: Option<StageSplit<A>>) -> Self::Output {
            bench_app(app, self.0)
        }
    }
    builtin::with_app(&args.config, Bench(args))?
}

/// One line of the table.
struct Row {
    rate: LinkRate,
    compression: String,
    busbw: f64,
    samples_per_sec: f64,
    work_s: f64,
    sync_s: f64,
    payload_bytes: f64,
    wire_bytes_per_step: f64,
    /// PyTorch DDP on the same link and compression (`--pytorch`), median of its rounds.
    pytorch: Option<TorchMeasured>,
    /// The median run's bucket timeline (rank 0, last step), where its buckets overlapped.
    timeline: String,
}

/// The link rates asked for, after checking them and the compressions.
fn checked_rates(args: &BenchLinkArgs) -> anyhow::Result<Vec<LinkRate>> {
    for c in &args.compression {
        if !["none", "bf16", "fp16"].contains(&c.as_str()) {
            bail!(UsageError(format!(
                "--compression {c:?}: expected none, bf16 or fp16"
            )));
        }
    }
    Ok(args
        .rate
        .iter()
        .map(|r| LinkRate::parse(r).map_err(UsageError))
        .collect::<Result<Vec<_>, _>>()?)
}

fn bench_app<A: App>(app: A, args: &BenchLinkArgs) -> anyhow::Result<ExitCode> {
    let rates = checked_rates(args)?;
    let config = AppConfig::<A>::load(&args.config)?;
    let params = app
        .model(&config.model, &config.data, &Device::flex().autodiff())?
        .num_params();
    let batch = config.training.batch_size;
    let steps = args
        .steps
        .or(config.training.max_steps)
        .context("the config has no training.max_steps: pass --steps")?;

    let interrupted = Arc::new(AtomicUsize::new(0));
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        signal_hook::flag::register_usize(sig, interrupted.clone(), sig as usize)?;
    }
    net::remove_stale();
    let scratch = std::env::temp_dir().join(format!("trainer-bench-link-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let runner = Runner {
        exe: match &args.trainer {
            Some(path) => std::fs::canonicalize(path)
                .with_context(|| format!("--trainer {}", path.display()))?,
            None => std::env::current_exe()?,
        },
        scratch: scratch.clone(),
        timeout: Duration::from_secs(args.timeout_secs),
        interrupted,
    };
    // Absolute but not resolved: a virtual environment's `python` is a link, and Python finds
    // its environment from the path it was started by.
    let python = match &args.pytorch {
        Some(python) if python.is_file() => Some(std::path::absolute(python)?),
        Some(python) => bail!(UsageError(format!(
            "--pytorch {}: no such file (give a Python that can `import torch`)",
            python.display()
        ))),
        None => None,
    };
    let script = scratch.join("pytorch_ddp.py");
    std::fs::write(&script, pytorch::SCRIPT)?;
    let config_path = std::fs::canonicalize(&args.config)?;
    let torch = python.as_deref().map(|python| TorchJob {
        python,
        script: &script,
        config: &config_path,
        steps,
        timeout_secs: args.timeout_secs,
    });
    let result = measure_all(&runner, args, &rates, params, steps, torch.as_ref());
    let _ = std::fs::remove_dir_all(&scratch);
    let rows = result?;

    print_report(args, &rows, params, batch, steps);
    if rows.iter().any(|r| r.pytorch.is_some()) {
        print_side_by_side(args, &rows, batch);
    }
    for row in rows.iter().filter(|r| !r.timeline.is_empty()) {
        print!(
            "{}, {}, the median run's {}",
            row.rate, row.compression, row.timeline
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The trainer against PyTorch DDP, row by row: samples/s, their ratio, and the fraction of
/// the communication (at the link's measured bandwidth) each hid under its local work.
fn print_side_by_side(args: &BenchLinkArgs, rows: &[Row], batch: usize) {
    println!(
        "side by side with PyTorch DDP (gloo, the config's bucket cap, its bf16/fp16 compression hooks): \
         samples/s; work = the local work per step (PyTorch: its steps under no_sync(), on a \
         random batch reused); exposed = step - work, the communication the step waited for \
         (comm ms above: the wire's share); hidden = 1 - exposed / comm"
    );
    println!(
        "{:>10} {:>6} {:>9} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}",
        "link",
        "grads",
        "ours",
        "PyTorch",
        "ratio",
        "work ms",
        "PT work",
        "exposed",
        "PT exp.",
        "hidden",
        "PT hid."
    );
    let samples = (batch * args.nodes) as f64;
    for row in rows {
        let Some(torch) = row.pytorch else {
            continue;
        };
        let comm_s = StepModel {
            work_s: row.work_s,
            payload_bytes: row.payload_bytes,
            world: args.nodes,
            busbw: row.busbw,
            samples_per_step: samples,
        }
        .bounds()
        .comm_s;
        let ours_step = samples / row.samples_per_sec;
        println!(
            "{:>10} {:>6} {:>9.0} {:>9.0} {:>6.2}x {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>7.0}% {:>7.0}%",
            row.rate.to_string(),
            row.compression,
            row.samples_per_sec,
            torch.samples_per_sec,
            row.samples_per_sec / torch.samples_per_sec,
            row.work_s * 1e3,
            torch.work_s * 1e3,
            (ours_step - row.work_s) * 1e3,
            (torch.step_s - torch.work_s) * 1e3,
            100.0 * bounds::hidden_fraction(ours_step, row.work_s, comm_s),
            100.0 * bounds::hidden_fraction(torch.step_s, torch.work_s, comm_s),
        );
    }
}

/// The table of measured rows against their bounds.
fn print_report(args: &BenchLinkArgs, rows: &[Row], params: usize, batch: usize, steps: usize) {
    println!(
        "workload: {} ({params} parameters), per-rank batch {batch}, {} nodes x 1 rank (one \
         compute thread each), {steps} steps per run, median of {} run(s)",
        args.config.display(),
        args.nodes,
        args.rounds
    );
    println!(
        "bounds: work = data + compute + optimizer per step (medians over ranks, this run); sync \
         = the gradient sync's measured time; comm = payload x 2(n-1)/n / busbw; no overlap = samples / (work + comm); full \
         overlap = samples / max(work, comm)"
    );
    println!(
        "{:>10} {:>6} {:>10} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>10} {:>6} {:>10} {:>6}",
        "link",
        "grads",
        "samples/s",
        "work ms",
        "sync ms",
        "comm ms",
        "wire MB",
        "ring MB",
        "busbw GB/s",
        "no-overlap",
        "%",
        "full-ovl",
        "%"
    );
    for row in rows {
        let model = StepModel {
            work_s: row.work_s,
            payload_bytes: row.payload_bytes,
            world: args.nodes,
            busbw: row.busbw,
            samples_per_step: (batch * args.nodes) as f64,
        };
        let b = model.bounds();
        println!(
            "{:>10} {:>6} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>9.2} {:>9.2} {:>10.4} {:>10.0} {:>5.1}% {:>10.0} {:>5.1}%",
            row.rate.to_string(),
            row.compression,
            row.samples_per_sec,
            row.work_s * 1e3,
            row.sync_s * 1e3,
            b.comm_s * 1e3,
            row.wire_bytes_per_step / 1e6,
            bounds::ring_bytes_per_rank(row.payload_bytes, args.nodes) / 1e6,
            row.busbw / 1e9,
            b.no_overlap,
            100.0 * row.samples_per_sec / b.no_overlap,
            b.full_overlap,
            100.0 * row.samples_per_sec / b.full_overlap,
        );
    }
    println!(
        "wire MB: bytes each node sent on its link per step (interface counters: payload, \
         headers, set-up and the initial broadcast spread over the steps); ring MB: the \
         all-reduce payload each rank sends per step"
    );
}

/// Every rate: its network, its link measurement, then the rounds of every compression.
fn measure_all(
    runner: &Runner,
    args: &BenchLinkArgs,
    rates: &[LinkRate],
    params: usize,
    steps: usize,
    torch: Option<&TorchJob<'_>>,
) -> anyhow::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for &rate in rates {
        let shaping = Shaping {
            rate,
            delay_ms: args.delay_ms,
        };
        let network = Network::create(args.nodes, shaping)
            .with_context(|| format!("cannot build the {rate} network"))?;
        let f32_bytes = params * 4;
        let busbw = runner.measure_busbw(&network, f32_bytes)?;
        eprintln!(
            "bench-link: {rate} link: all-reduce of {:.2} MB at {:.4} GB/s busbw ({:.0}% of the \
             line rate)",
            f32_bytes as f64 / 1e6,
            busbw / 1e9,
            100.0 * busbw / rate.bytes_per_sec()
        );
        let mut runs: Vec<Vec<Measured>> = vec![Vec::new(); args.compression.len()];
        let mut torch_runs: Vec<Vec<TorchMeasured>> = vec![Vec::new(); args.compression.len()];
        for round in 0..args.rounds {
            for (c, compression) in args.compression.iter().enumerate() {
                let m = runner.train(&network, &args.config, compression, steps, round)?;
                eprintln!(
                    "bench-link: {rate}, {compression}, round {round}: {:.0} samples/s, work \
                     {:.2} ms, {:.2} MB sent per step",
                    m.samples_per_sec,
                    m.work_s * 1e3,
                    m.wire_bytes_per_step / 1e6
                );
                runs[c].push(m);
                if let Some(torch) = torch {
                    let t = runner.train_pytorch(&network, torch, compression)?;
                    eprintln!(
                        "bench-link: {rate}, {compression}, round {round}: PyTorch DDP {:.0} \
                         samples/s, work {:.2} ms",
                        t.samples_per_sec,
                        t.work_s * 1e3
                    );
                    torch_runs[c].push(t);
                }
            }
        }
        for ((compression, mut measured), mut torch) in
            args.compression.iter().zip(runs).zip(torch_runs)
        {
            measured.sort_by(|a, b| a.samples_per_sec.total_cmp(&b.samples_per_sec));
            torch.sort_by(|a, b| a.samples_per_sec.total_cmp(&b.samples_per_sec));
            let m = &measured[measured.len() / 2];
            let element = if compression == "none" { 4 } else { 2 };
            rows.push(Row {
                rate,
                compression: compression.clone(),
                busbw,
                samples_per_sec: m.samples_per_sec,
                work_s: m.work_s,
                sync_s: m.sync_s,
                payload_bytes: (params * element) as f64,
                wire_bytes_per_step: m.wire_bytes_per_step,
                pytorch: torch.get(torch.len() / 2).copied(),
                timeline: m.timeline.clone(),
            });
        }
        drop(network);
    }
    Ok(rows)
}

/// What one training run measured.
#[derive(Debug, Clone)]
struct Measured {
    samples_per_sec: f64,
    work_s: f64,
    sync_s: f64,
    wire_bytes_per_step: f64,
    /// Rank 0's bucket timeline of its last step, as its summary printed it (empty without).
    timeline: String,
}

/// Starts node processes in the namespaces and supervises them.
struct Runner {
    exe: PathBuf,
    scratch: PathBuf,
    timeout: Duration,
    /// The signal number once SIGINT / SIGTERM / SIGHUP arrived.
    interrupted: Arc<AtomicUsize>,
}

/// The store's port on node 0: its namespace is new, so the port is free.
const STORE_PORT: u16 = 29500;

impl Runner {
    /// `trainer bench-allreduce` across the nodes at `bytes`: the link's all-reduce bus
    /// bandwidth, bytes/s.
    fn measure_busbw(&self, network: &Network, bytes: usize) -> anyhow::Result<f64> {
        let bytes = bytes.to_string();
        let outputs = self.run_nodes(network, "bench-allreduce", |r| {
            let mut cmd = self.trainer_node(network, r);
            cmd.args([
                "bench-allreduce",
                "--min-bytes",
                &bytes,
                "--max-bytes",
                &bytes,
            ]);
            self.as_node(cmd, network, r)
        })?;
        // Rank 0's table: size, count, time (us), algbw, busbw, ...
        let table = std::fs::read_to_string(&outputs[0].stdout)?;
        let row = table
            .lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let cols: Vec<f64> = l
                    .split_whitespace()
                    .filter_map(|c| c.parse().ok())
                    .collect();
                (cols.len() >= 3).then(|| (cols[0], cols[2]))
            })
            .with_context(|| format!("bench-allreduce printed no result:\n{table}"))?;
        let (size, micros) = row;
        Ok(bounds::busbw(size, micros * 1e-6, network.nodes().len()))
    }

    /// One training run of `config` with `compression`, one rank per node.
    fn train(
        &self,
        network: &Network,
        config: &Path,
        compression: &str,
        steps: usize,
        round: usize,
    ) -> anyhow::Result<Measured> {
        let out_dir = self.scratch.join(format!("{compression}-{round}"));
        let _ = std::fs::remove_dir_all(&out_dir);
        std::fs::create_dir_all(&out_dir)?;
        let patched = patch_config(config, &out_dir, compression, steps)?;
        let nodes = network.nodes().len();
        let before = (0..nodes)
            .map(|n| network.tx_bytes(n))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let patched = patched.display().to_string();
        let outputs = self.run_nodes(network, "train", |r| {
            let mut cmd = self.trainer_node(network, r);
            cmd.args(["--config", &patched]);
            self.as_node(cmd, network, r)
        })?;
        let mut sent = 0u64;
        for (n, b) in before.iter().enumerate() {
            sent += network.tx_bytes(n)?.saturating_sub(*b);
        }
        let metrics = std::fs::read_to_string(out_dir.join("metrics.jsonl"))
            .context("the run wrote no metrics.jsonl")?;
        let (samples_per_sec, work_s, sync_s) = parse_metrics(&metrics)?;
        let summary = std::fs::read_to_string(&outputs[0].stdout).unwrap_or_default();
        Ok(Measured {
            samples_per_sec,
            work_s,
            sync_s,
            wire_bytes_per_step: sent as f64 / nodes as f64 / steps as f64,
            timeline: timeline_of(&summary),
        })
    }

    /// One PyTorch DDP run of `torch`'s workload with `compression`, one process per node.
    fn train_pytorch(
        &self,
        network: &Network,
        torch: &TorchJob<'_>,
        compression: &str,
    ) -> anyhow::Result<TorchMeasured> {
        let outputs = self.run_nodes(network, "pytorch", |r| {
            torch.node_command(network, r, compression)
        })?;
        pytorch::parse_result(&std::fs::read_to_string(&outputs[0].stdout)?)
    }

    /// The trainer in node `r`'s namespace: the caller adds its command and arguments, then
    /// [`as_node`](Self::as_node) the job's.
    fn trainer_node(&self, network: &Network, r: usize) -> Command {
        network.command(r, &self.exe)
    }

    /// `cmd` (the trainer, in node `r`'s namespace) as rank `r` of the job of one rank per
    /// node: `--nproc-per-node 1 --nnodes N --node-rank R --master-addr ...`, one compute
    /// thread.
    fn as_node(&self, mut cmd: Command, network: &Network, r: usize) -> Command {
        let nodes = network.nodes();
        cmd.args([
            "--nproc-per-node",
            "1",
            "--nnodes",
            &nodes.len().to_string(),
        ])
        .args([
            "--node-rank",
            &r.to_string(),
            "--master-addr",
            &nodes[0].addr,
        ])
        .args(["--master-port", &STORE_PORT.to_string()])
        .env("BURN_DDP_TOKEN", "bench-link")
        .env("RAYON_NUM_THREADS", "1");
        cmd
    }

    /// Runs `node(r)` (a command in node `r`'s namespace) for every node and waits for all of
    /// them, within the deadline. The first failure, the deadline or a signal stops every
    /// node. Returns each node's output files.
    fn run_nodes(
        &self,
        network: &Network,
        what: &str,
        node: impl Fn(usize) -> Command,
    ) -> anyhow::Result<Vec<NodeOutput>> {
        let mut children: Vec<(Child, NodeOutput)> = Vec::new();
        let mut guard = Stopper(Vec::new());
        for r in 0..network.nodes().len() {
            let out = NodeOutput {
                stdout: self.scratch.join(format!("{what}-node{r}.out")),
                stderr: self.scratch.join(format!("{what}-node{r}.err")),
            };
            let mut cmd = node(r);
            cmd.stdin(Stdio::null())
                .stdout(File::create(&out.stdout)?)
                .stderr(File::create(&out.stderr)?);
            // A process group of its own: a stop reaches the node's ranks too.
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
            let child = cmd
                .spawn()
                .with_context(|| format!("cannot start node {r}"))?;
            guard.0.push(child.id());
            children.push((child, out));
        }
        let deadline = Instant::now() + self.timeout;
        let mut done = vec![false; children.len()];
        while done.iter().any(|d| !d) {
            let sig = self.interrupted.load(Ordering::Relaxed);
            if sig != 0 {
                bail!("interrupted by signal {sig}: stopped the nodes, removing the namespaces");
            }
            if Instant::now() > deadline {
                bail!(
                    "{what} did not finish within {:?} (--timeout-secs)",
                    self.timeout
                );
            }
            for (r, (child, out)) in children.iter_mut().enumerate() {
                if done[r] {
                    continue;
                }
                if let Some(status) = child.try_wait()? {
                    done[r] = true;
                    if !status.success() {
                        let err = std::fs::read_to_string(&out.stderr).unwrap_or_default();
                        let tail: Vec<&str> = err.lines().rev().take(15).collect();
                        let tail: Vec<&str> = tail.into_iter().rev().collect();
                        bail!("{what} on node {r} failed ({status}):\n{}", tail.join("\n"));
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        guard.0.clear();
        Ok(children.into_iter().map(|(_, out)| out).collect())
    }
}

/// Where a node's output went.
struct NodeOutput {
    stdout: PathBuf,
    stderr: PathBuf,
}

/// Stops the process groups of nodes still running when dropped (an error or a signal left
/// them): SIGTERM, then SIGKILL after 5 s.
struct Stopper(Vec<u32>);

impl Drop for Stopper {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        // SAFETY: kill(2) with signal 0 only asks whether the process group exists; it touches
        // no memory.
        let alive = |pid: u32| unsafe { libc::kill(-(pid as i32), 0) == 0 };
        for &pid in &self.0 {
            // SAFETY: kill(2) on process groups this process created.
            unsafe { libc::kill(-(pid as i32), libc::SIGTERM) };
        }
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until && self.0.iter().any(|&p| alive(p)) {
            reap(&self.0);
            std::thread::sleep(Duration::from_millis(50));
        }
        for &pid in &self.0 {
            // SAFETY: as above.
            unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
        }
        reap(&self.0);
    }
}

/// Collects the exit status of the given children without blocking.
fn reap(pids: &[u32]) {
    for &pid in pids {
        // SAFETY: waitpid on this process's own children, non-blocking.
        unsafe { libc::waitpid(pid as i32, std::ptr::null_mut(), libc::WNOHANG) };
    }
}

/// The workload's config with its own output directory, no checkpoints, no charts, the
/// given gradient compression and number of steps; written next to the outputs.
fn patch_config(
    config: &Path,
    out_dir: &Path,
    compression: &str,
    steps: usize,
) -> anyhow::Result<PathBuf> {
    let text = std::fs::read_to_string(config)?;
    let mut table: toml::Table = toml::from_str(&text)?;
    table.remove("checkpoint");
    let mut output = toml::Table::new();
    output.insert("dir".into(), out_dir.display().to_string().into());
    output.insert("plots".into(), false.into());
    table.insert("output".into(), output.into());
    let distributed = table
        .entry("distributed")
        .or_insert_with(|| toml::Table::new().into());
    if let Some(d) = distributed.as_table_mut() {
        d.insert("gradient_compression".into(), compression.into());
    }
    if let Some(training) = table.get_mut("training").and_then(|t| t.as_table_mut()) {
        training.insert("max_steps".into(), (steps as i64).into());
    }
    let patched = out_dir.join("bench-link.toml");
    std::fs::write(&patched, toml::to_string(&table)?)?;
    Ok(patched)
}

/// Samples/s, seconds of local work per step (data + compute + optimizer medians over ranks)
/// and of gradient sync, each the mean over the train records after the first (warm-up).
/// The bucket timeline of a run's summary (rank 0's standard output): its heading and the
/// indented lines under it; empty without one.
fn timeline_of(summary: &str) -> String {
    let mut lines = summary
        .lines()
        .skip_while(|l| !l.starts_with(crate::engine::fit::TIMELINE_HEADING));
    let Some(heading) = lines.next() else {
        return String::new();
    };
    let mut out = format!("{heading}\n");
    for line in lines.take_while(|l| l.starts_with("  ")) {
        out.push_str(line);
        out.push('\n');
    }
    out
}

fn parse_metrics(metrics: &str) -> anyhow::Result<(f64, f64, f64)> {
    let records: Vec<serde_json::Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "train")
        .skip(1)
        .collect();
    let mut rates = Vec::new();
    let mut work = Vec::new();
    let mut sync = Vec::new();
    for r in &records {
        rates.extend(r["samples_per_sec"].as_f64());
        let t = &r["time"];
        let phases = ["data", "compute", "optimizer"].map(|p| t[p]["median"].as_f64());
        if let [Some(d), Some(c), Some(o)] = phases {
            work.push(d + c + o);
        }
        sync.extend(t["sync"]["median"].as_f64());
    }
    if rates.is_empty() || work.is_empty() {
        bail!(
            "no throughput or step-time records after the warm-up window: raise the steps \
             above 2 x training.log_every"
        );
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let sync = if sync.is_empty() {
        f64::NAN
    } else {
        mean(&sync)
    };
    Ok((mean(&rates), mean(&work), sync))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_timeline_is_found_in_a_runs_summary() {
        let summary = "finished: 30 optimizer steps\n\
                       bucket timeline of the last step on rank 0 (ms): backward done at 9.0\n\
                       \x20 bucket 0: 0.04 MB, queued at 8.1, summed 8.1-8.3\n\
                       \x20 bucket 1: 2.10 MB, queued at 8.9, summed 8.9-25.0\n\
                       done\n";
        let timeline = timeline_of(summary);
        assert!(
            timeline.starts_with("bucket timeline of the last step"),
            "{timeline}"
        );
        assert_eq!(timeline.lines().count(), 3, "{timeline}");
        assert!(timeline.ends_with("8.9-25.0\n"), "{timeline}");
        assert_eq!(timeline_of("finished: 30 optimizer steps\n"), "");
    }

    #[test]
    fn metrics_skip_the_warm_up_and_sum_the_local_phases() {
        let rec = |rate: f64, compute: f64| {
            format!(
                r#"{{"kind":"train","samples_per_sec":{rate},"time":{{"data":{{"median":0.001}},"compute":{{"median":{compute}}},"sync":{{"median":0.05}},"optimizer":{{"median":0.002}}}}}}"#
            )
        };
        let text = [
            rec(10.0, 0.5),
            rec(100.0, 0.010),
            r#"{"kind":"valid","samples_per_sec":5}"#.to_string(),
            rec(200.0, 0.020),
        ]
        .join("\n");
        let (rate, work, sync) = parse_metrics(&text).unwrap();
        assert_eq!(rate, 150.0);
        assert!((work - 0.018).abs() < 1e-12, "{work}");
        assert_eq!(sync, 0.05);
        assert!(parse_metrics(&rec(1.0, 1.0)).is_err());
    }
}
