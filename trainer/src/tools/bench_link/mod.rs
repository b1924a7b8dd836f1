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
//! | `mod.rs` | the command: the rates and rounds, the tables |
//! | `runner.rs` | the node processes of each run, supervised, and what their outputs say |
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
mod runner;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use burn::module::Module;
use burn::tensor::Device;
use clap::Args;

use self::bounds::{LinkRate, StepModel};
use self::net::{Network, Shaping};
use self::pytorch::{TorchJob, TorchMeasured};
use self::runner::{Measured, Runner};
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
