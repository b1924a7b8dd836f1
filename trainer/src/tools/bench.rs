//! `trainer bench-train`: what the DDP layer costs and what data parallelism gains, measured in
//! one run on this machine.
//!
//! It runs, alternating so that machine noise hits all of them alike:
//! - **plain**: a hand-written Burn training loop over the same app (its data set, batcher,
//!   `TrainStep::step`, the optimizer; no sampler, no reducer, no metrics, no prefetching) — the
//!   baseline a Burn user would write;
//! - **engine, world 1**: `trainer --config` on the same model and data;
//! - **engine, world 2**: `trainer --config --nproc-per-node 2`, with ZeRO stage 0 (plain DDP),
//!   stage 1 (sharded optimizer state), stage 2 (sharded gradients too) and stage 3 (sharded
//!   weights of the marked blocks too).
//!
//! With `--device cuda` (or `wgpu`) every run trains on that device instead, world 1 only (one
//! GPU per process), and the plain loop also runs waiting for the device after each step, which
//! shows how much of the engine's overhead its once-a-step wait explains.
//!
//! Every process computes on one thread (`RAYON_NUM_THREADS=1`). It prints the overhead of the
//! trainer at world 1 over the plain loop, the throughput and scaling efficiency at world 2
//! (throughput at 2 / twice the throughput at 1), stages 1 to 3's throughput against stage
//! 0's, each run's peak resident memory, counted parameter + gradient + optimizer-state bytes
//! per rank and bytes of its collectives' buffers per step (rank 0), the parameter count and
//! the bytes each rank sends per optimizer step.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{bail, Context};
use burn::data::dataloader::batcher::Batcher;
use burn::module::Module;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer, SgdConfig};
use burn::tensor::Device;
use burn::train::TrainStep;
use clap::Args;

use crate::app::{App, AppConfig};
use crate::builtin::{self, WithApp};
use crate::config::{DeviceKind, OptimizerName};
use crate::engine::device::{device_name, train_device};
use crate::engine::pipeline::StageSplit;
use burn_ddp::ddp::zero::sharded_sync;

#[derive(Args, Debug, Clone)]
pub struct BenchTrainArgs {
    /// The workload: any built-in model's config (`configs/bench-mlp.toml`,
    /// `configs/bench-text.toml`).
    #[arg(long, default_value = "configs/bench-mlp.toml")]
    pub config: PathBuf,
    /// Rounds of (plain, world 1, world 2); the median of each is reported.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// The device of every run (the config's `output.device` is replaced): `cpu`, or `cuda` /
    /// `wgpu` in builds with that feature. On a GPU only world 1 runs (one GPU per process):
    /// the figure is the DDP layer's overhead against the plain loop on the same GPU.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceKind,
    /// Internal: run only the plain loop and print its samples/s.
    #[arg(long, hide = true)]
    pub plain_only: bool,
    /// Internal, with `--plain-only`: wait for the device after every step.
    #[arg(long, hide = true)]
    pub plain_waits: bool,
}

pub fn bench_train(args: &BenchTrainArgs) -> anyhow::Result<ExitCode> {
    struct Bench<'a>(&'a BenchTrainArgs);
    impl WithApp for Bench<'_> {
        type Output = anyhow::Result<ExitCode>;
        fn run<A: App + Clone>(self, app: A, _stages: Option<StageSplit<A>>) -> Self::Output {
            bench_app(app, self.0)
        }
    }
    builtin::with_app(&args.config, Bench(args))?
}

/// (label, world size, ZeRO stage) of the engine's runs; the plain loop runs first in every
/// round.
const ENGINE_RUNS: [(&str, usize, u8); 5] = [
    ("engine, world 1", 1, 0),
    ("engine, world 2, ZeRO 0", 2, 0),
    ("engine, world 2, ZeRO 1", 2, 1),
    ("engine, world 2, ZeRO 2", 2, 2),
    ("engine, world 2, ZeRO 3", 2, 3),
];

/// The engine's runs on `device`: all of [`ENGINE_RUNS`] on the CPU, world 1 alone on a GPU
/// (two ranks cannot share one GPU under NCCL, and a machine may have just one).
fn engine_runs(device: DeviceKind) -> &'static [(&'static str, usize, u8)] {
    match device {
        DeviceKind::Cpu => &ENGINE_RUNS,
        DeviceKind::Cuda | DeviceKind::Wgpu => &ENGINE_RUNS[..1],
    }
}

fn bench_app<A: App>(app: A, args: &BenchTrainArgs) -> anyhow::Result<ExitCode> {
    let config = AppConfig::<A>::load(&args.config)?;
    crate::engine::device::device_available(args.device, 0)?;
    if args.plain_only {
        println!(
            "plain samples/s: {:.1}",
            plain_loop(&app, &config, args.device, args.plain_waits)?
        );
        if let Some(peak) = crate::engine::memory::peak_resident_bytes() {
            println!("plain peak RSS bytes: {peak}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let (plain, waiting, runs) = measure(args)?;
    println!(
        "workload: {} {}, {:?}, per-rank batch {} (one compute thread per process)",
        app.name(&config.model),
        serde_json::to_string(&config.model).unwrap_or_default(),
        config.optimizer.name,
        config.training.batch_size
    );
    print_runs(
        config.training.batch_size as f64,
        &plain,
        &runs,
        args.device,
    );
    if let Some(waiting) = waiting {
        println!(
            "plain Burn loop waiting for the device after each step: {:.0} samples/s, {:+.1}% step time vs plain (how much of the engine's overhead one wait per step explains)",
            waiting.rate,
            100.0 * (plain.rate / waiting.rate - 1.0)
        );
    }
    let device = Device::flex().autodiff();
    let model = app.model(&config.model, &config.data, &device)?;
    print_state_and_bytes(&model, config.optimizer.name, config.optimizer.momentum);
    Ok(ExitCode::SUCCESS)
}

/// The median over `args.rounds` rounds of the plain loop, of the plain loop waiting for the
/// device after each step (on a GPU), and of each of [`ENGINE_RUNS`], interleaved so that a
/// machine's drift affects them alike.
fn measure(args: &BenchTrainArgs) -> anyhow::Result<(Measured, Option<Measured>, Vec<Measured>)> {
    let exe = std::env::current_exe()?;
    let scratch = std::env::temp_dir().join(format!("trainer-bench-{}", std::process::id()));
    let mut plain = Vec::new();
    let mut waiting = Vec::new();
    let engine = engine_runs(args.device);
    let mut runs: Vec<Vec<Measured>> = vec![Vec::new(); engine.len()];
    for round in 0..args.rounds {
        plain.push(run_plain(&exe, &args.config, args.device, false)?);
        let mut line = format!("round {round}: plain {:.0}", plain[round].rate);
        if args.device != DeviceKind::Cpu {
            let m = run_plain(&exe, &args.config, args.device, true)?;
            line += &format!(", plain waiting each step {:.0}", m.rate);
            waiting.push(m);
        }
        for (k, &(label, nproc, stage)) in engine.iter().enumerate() {
            let dir = scratch.join(format!("w{nproc}-z{stage}-{round}"));
            let m = run_trainer(&exe, &args.config, &dir, (nproc, stage), args.device)?;
            line += &format!(", {label} {:.0}", m.rate);
            runs[k].push(m);
        }
        eprintln!("{line} samples/s");
    }
    let _ = std::fs::remove_dir_all(&scratch);
    Ok((
        Measured::median(plain),
        (!waiting.is_empty()).then(|| Measured::median(waiting)),
        runs.into_iter().map(Measured::median).collect(),
    ))
}

/// The table of runs and the ratios of the same run: DDP overhead, scaling, ZeRO's cost.
fn print_runs(per_step: f64, plain: &Measured, runs: &[Measured], device: DeviceKind) {
    println!(
        "{:<28} {:>12} {:>14} {:>26} {:>46} {:>24}",
        "",
        "samples/s",
        "step time (ms)",
        "peak RSS per rank (MiB)",
        "params + grads + optim. state + gathered (MiB)",
        "collectives / step (MiB)"
    );
    let mut rows = vec![("plain Burn loop", 1, plain)];
    rows.extend(
        engine_runs(device)
            .iter()
            .zip(runs)
            .map(|(&(l, n, _), m)| (l, n, m)),
    );
    for (name, nproc, m) in rows {
        let per_rank = |bytes: &[u64], digits: usize| -> String {
            let v: Vec<String> = bytes
                .iter()
                .map(|&b| format!("{:.digits$}", mib(b)))
                .collect();
            v.join(" / ")
        };
        println!(
            "{name:<28} {:>12.0} {:>14.2} {:>26} {:>46} {:>24}",
            m.rate,
            1e3 * per_step * nproc as f64 / m.rate,
            per_rank(&m.peak_rss, 0),
            per_rank(&m.model_state, 1),
            m.collective_bytes
                .map_or_else(|| "-".to_string(), |b| format!("{:.1}", mib(b))),
        );
    }
    println!(
        "DDP layer overhead at world 1 (step time vs plain loop): {:+.1}%",
        100.0 * (plain.rate / runs[0].rate - 1.0)
    );
    let [one, two, sharded @ ..] = runs else {
        return;
    };
    println!(
        "scaling efficiency at world 2 (throughput / 2 x world 1): {:.1}%",
        100.0 * two.rate / (2.0 * one.rate)
    );
    let rss = |m: &Measured, rank: usize| mib(m.peak_rss.get(rank).copied().unwrap_or(0));
    for (stage, m) in (1..).zip(sharded) {
        println!(
            "ZeRO stage {stage} at world 2: {:.1}% of stage 0's throughput; peak RSS per rank {:+.0} MiB (rank 0), {:+.0} MiB (rank 1)",
            100.0 * m.rate / two.rate,
            rss(m, 0) - rss(two, 0),
            rss(m, 1) - rss(two, 1),
        );
    }
}

/// Optimizer state per rank and bytes on the wire per step at world 2, stages 0, 1 and 2.
fn print_state_and_bytes<M: Module>(model: &M, optimizer: OptimizerName, momentum: f64) {
    let params = model.num_params();
    let stage1_own = sharded_sync::plan_for(model, 2).counts().to_vec();
    let state_copies = match optimizer {
        OptimizerName::Sgd if momentum > 0.0 => 1,
        OptimizerName::Sgd => 0,
        OptimizerName::Adam | OptimizerName::AdamW => 2,
    };
    println!(
        "parameters: {params}; optimizer state per rank: stage 0 {:.1} MiB, stages 1 and 2 {} MiB",
        mib(params as u64 * 4 * state_copies),
        stage1_own
            .iter()
            .map(|&n| format!("{:.1}", mib(n as u64 * 4 * state_copies)))
            .collect::<Vec<_>>()
            .join(" / ")
    );
    // What each rank puts on the wire per optimizer step at world 2 (f32): the ring all-reduce
    // sends 2 (N-1)/N of the gradients; stage 1's reduce-scatter sends every block but the
    // rank's own, its all-gather every block but its successor's. Stage 2 sends the same
    // blocks bucket by bucket (the same total at world 2).
    let all_reduce = 2 * params.div_ceil(2) * 4;
    let sharded: Vec<String> = (0..2)
        .map(|r| {
            let sent = (params - stage1_own[r]) + (params - stage1_own[(r + 1) % 2]);
            format!("{:.1}", mib((sent * 4) as u64))
        })
        .collect();
    println!(
        "bytes sent per rank per step at world 2: stage 0 {:.1} MiB (all-reduce), stages 1 and 2 {} MiB (reduce-scatter + all-gather)",
        mib(all_reduce as u64),
        sharded.join(" / ")
    );
}

/// One run's throughput, each rank's peak resident memory and counted parameter + gradient +
/// optimizer-state bytes, with stage 3's peak of gathered whole parameters (the finish
/// record's; none for the plain loop).
#[derive(Debug, Clone)]
struct Measured {
    rate: f64,
    peak_rss: Vec<u64>,
    model_state: Vec<u64>,
    /// Bytes of rank 0's collectives' buffers per optimizer step (its `reducer-stats.json`).
    collective_bytes: Option<u64>,
}

impl Measured {
    /// The run of median throughput.
    fn median(mut v: Vec<Measured>) -> Measured {
        v.sort_by(|a, b| a.rate.total_cmp(&b.rate));
        v.swap_remove(v.len() / 2)
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn run_plain(
    exe: &Path,
    config: &Path,
    device: DeviceKind,
    waits: bool,
) -> anyhow::Result<Measured> {
    let out = Command::new(exe)
        .args([
            "bench-train",
            "--plain-only",
            "--device",
            &device_name(device),
        ])
        .args(waits.then_some("--plain-waits"))
        .arg("--config")
        .arg(config)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .context("cannot run the plain loop")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let value = |prefix: &str| -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.trim().parse().ok())
    };
    let rate = value("plain samples/s: ").with_context(|| {
        format!(
            "plain loop failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    let peak = value("plain peak RSS bytes: ").unwrap_or(0.0) as u64;
    Ok(Measured {
        rate,
        peak_rss: vec![peak],
        model_state: Vec::new(),
        collective_bytes: None,
    })
}

/// Runs the trainer and returns the mean samples/s of its metrics after the first window, and
/// each rank's peak resident memory.
fn run_trainer(
    exe: &Path,
    config: &Path,
    out_dir: &Path,
    (nproc, zero_stage): (usize, u8),
    device: DeviceKind,
) -> anyhow::Result<Measured> {
    let text = std::fs::read_to_string(config)?;
    std::fs::create_dir_all(out_dir)?;
    // The same config with its own output directory and no checkpoints.
    let mut table: toml::Table = toml::from_str(&text)?;
    table.remove("checkpoint");
    let mut output = toml::Table::new();
    output.insert(
        "dir".into(),
        toml::Value::String(out_dir.display().to_string()),
    );
    output.insert("device".into(), toml::Value::String(device_name(device)));
    // For rank 0's `reducer-stats.json`.
    output.insert("log_samples".into(), toml::Value::Boolean(true));
    table.insert("output".into(), toml::Value::Table(output));
    let distributed = table
        .entry("distributed")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    if let toml::Value::Table(d) = distributed {
        d.insert("zero_stage".into(), toml::Value::Integer(zero_stage.into()));
    }
    let patched = out_dir.join("bench.toml");
    std::fs::write(&patched, toml::to_string(&table)?)?;
    let status = Command::new(exe)
        .arg("--config")
        .arg(&patched)
        .args(["--nproc-per-node", &nproc.to_string()])
        .env("RAYON_NUM_THREADS", "1")
        .stdout(std::process::Stdio::null())
        .status()?;
    if !status.success() {
        bail!("trainer with {nproc} rank(s) failed ({status})");
    }
    let metrics = std::fs::read_to_string(out_dir.join("metrics.jsonl"))?;
    let records: Vec<serde_json::Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .collect();
    let finish = records.iter().rfind(|v| v["kind"] == "finish");
    let per_rank = |field: &str| -> Vec<u64> {
        finish
            .and_then(|v| v[field].as_array())
            .map(|a| a.iter().filter_map(|b| b.as_u64()).collect())
            .unwrap_or_default()
    };
    let peak_rss = per_rank("peak_rss_bytes");
    // At ZeRO stage 3 the whole parameters held at once (their peak) count too.
    let gathered = per_rank("gathered_peak_bytes");
    let model_state = per_rank("gradient_bytes")
        .iter()
        .zip(per_rank("optimizer_state_bytes"))
        .zip(per_rank("parameter_bytes"))
        .enumerate()
        .map(|(r, ((g, s), p))| g + s + p + gathered.get(r).copied().unwrap_or(0))
        .collect();
    let collective_bytes = std::fs::read_to_string(out_dir.join("reducer-stats.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| Some(v["bytes_reduced"].as_u64()? / v["steps"].as_u64()?.max(1)));
    let rates: Vec<f64> = records
        .iter()
        .filter(|v| v["kind"] == "train")
        .filter_map(|v| v["samples_per_sec"].as_f64())
        .skip(1) // warm-up window
        .collect();
    if rates.is_empty() {
        bail!("no throughput records: raise training.max_steps above 2 x training.log_every");
    }
    Ok(Measured {
        rate: rates.iter().sum::<f64>() / rates.len() as f64,
        peak_rss,
        model_state,
        collective_bytes,
    })
}

/// The baseline: a straightforward Burn loop over the same app's data, batcher and model
/// (`TrainStep::step`, then the optimizer), with the configured optimizer at a constant rate:
/// no sampler, no reducer, no metrics, no prefetching. With `waits`, it also waits for the
/// device after every step, as the engine's step does (on a GPU, the queue then runs empty).
fn plain_loop<A: App>(
    app: &A,
    config: &AppConfig<A>,
    device: DeviceKind,
    waits: bool,
) -> anyhow::Result<f64> {
    let device = train_device(device, 0)?;
    let optim = match config.optimizer.name {
        OptimizerName::Sgd => SgdConfig::new().init(),
        OptimizerName::Adam => AdamConfig::new().init(),
        OptimizerName::AdamW => AdamWConfig::new().init(),
    };
    plain_with(app, config, optim, device, waits)
}

fn plain_with<A: App>(
    app: &A,
    config: &AppConfig<A>,
    mut optim: ModuleOptimizer,
    device: Device,
    waits: bool,
) -> anyhow::Result<f64> {
    device.seed(config.training.seed);
    let data = app.datasets(&config.data)?;
    let mut model = app.model(&config.model, &config.data, &device)?;
    let batcher = app.batcher(&config.model, &config.data, &device);
    let batch = config.training.batch_size;
    let steps = config.training.max_steps.unwrap_or(100);
    let warmup = config.training.log_every;
    let len = data.train.len();
    let mut start = Instant::now();
    for step in 0..steps + warmup {
        if step == warmup {
            start = Instant::now();
        }
        let items = (0..batch)
            .filter_map(|i| data.train.get((step * batch + i) % len).ok())
            .collect();
        let output = TrainStep::step(&model, batcher.batch(items, &device));
        model = model.optimize(
            &mut optim,
            config.optimizer.learning_rate.into(),
            output.grads,
        );
        if waits {
            device
                .sync()
                .map_err(|e| anyhow::anyhow!("the device failed: {e:?}"))?;
        }
    }
    let _ = model.valid();
    // Queued device work belongs to the timed steps.
    device
        .sync()
        .map_err(|e| anyhow::anyhow!("the device failed: {e:?}"))?;
    Ok((steps * batch) as f64 / start.elapsed().as_secs_f64())
}
