//! `trainer bench-train`: what the DDP layer costs and what data parallelism gains, measured in
//! one run on this machine.
//!
//! It runs, alternating so that machine noise hits all of them alike:
//! - **plain**: a hand-written Burn training loop over the same app (its data set, batcher,
//!   `TrainStep::step`, the optimizer; no sampler, no reducer, no metrics, no prefetching) — the
//!   baseline a Burn user would write;
//! - **engine, world 1**: `trainer --config` on the same model and data;
//! - **engine, world 2**: `trainer --config --nproc-per-node 2`.
//!
//! Every process computes on one thread (`RAYON_NUM_THREADS=1`). It prints the overhead of the
//! trainer at world 1 over the plain loop, and the throughput and scaling efficiency at world 2
//! (throughput at 2 / twice the throughput at 1).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{bail, Context};
use burn::data::dataloader::batcher::Batcher;
use burn::module::AutodiffModule;
use burn::optim::{AdamConfig, AdamWConfig, Optimizer, SgdConfig};
use burn::prelude::*;
use burn::train::TrainStep;
use clap::Args;

use crate::app::Learn;
use crate::backend::{CpuBackend, LearnAnywhere};
use crate::builtin::{self, WithApp};
use crate::config::AppConfig;
use crate::config::OptimizerName;

#[derive(Args, Debug, Clone)]
pub struct BenchTrainArgs {
    /// The workload: any built-in model's config (`configs/bench-mlp.toml`,
    /// `configs/bench-text.toml`).
    #[arg(long, default_value = "configs/bench-mlp.toml")]
    pub config: PathBuf,
    /// Rounds of (plain, world 1, world 2); the median of each is reported.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Internal: run only the plain loop and print its samples/s.
    #[arg(long, hide = true)]
    pub plain_only: bool,
}

pub fn bench_train(args: &BenchTrainArgs) -> anyhow::Result<ExitCode> {
    struct Bench<'a>(&'a BenchTrainArgs);
    impl WithApp for Bench<'_> {
        type Output = anyhow::Result<ExitCode>;
        fn run<A: LearnAnywhere + Clone>(self, app: A) -> Self::Output {
            bench_app(app, self.0)
        }
    }
    builtin::with_app(&args.config, Bench(args))?
}

fn bench_app<A: LearnAnywhere>(app: A, args: &BenchTrainArgs) -> anyhow::Result<ExitCode> {
    let config = AppConfig::<A>::load(&args.config)?;
    if args.plain_only {
        println!("plain samples/s: {:.1}", plain_loop(&app, &config)?);
        return Ok(ExitCode::SUCCESS);
    }
    let exe = std::env::current_exe()?;
    let scratch = std::env::temp_dir().join(format!("trainer-bench-{}", std::process::id()));
    let (mut plain, mut one, mut two) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..args.rounds {
        plain.push(run_plain(&exe, &args.config)?);
        one.push(run_trainer(
            &exe,
            &args.config,
            &scratch.join(format!("w1-{round}")),
            1,
        )?);
        two.push(run_trainer(
            &exe,
            &args.config,
            &scratch.join(format!("w2-{round}")),
            2,
        )?);
        eprintln!(
            "round {round}: plain {:.0}, world 1 {:.0}, world 2 {:.0} samples/s",
            plain[round], one[round], two[round]
        );
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let (plain, one, two) = (median(plain), median(one), median(two));
    println!(
        "workload: {} {}, {:?}, per-rank batch {} (one compute thread per process)",
        app.name(&config.model),
        serde_json::to_string(&config.model).unwrap_or_default(),
        config.optimizer.name,
        config.training.batch_size
    );
    println!("{:<28} {:>12} {:>14}", "", "samples/s", "step time (ms)");
    let per_step = config.training.batch_size as f64;
    for (name, rate, batch) in [
        ("plain Burn loop", plain, per_step),
        ("engine, world 1", one, per_step),
        ("engine, world 2", two, 2.0 * per_step),
    ] {
        println!("{name:<28} {rate:>12.0} {:>14.2}", 1e3 * batch / rate);
    }
    println!(
        "DDP layer overhead at world 1 (step time vs plain loop): {:+.1}%",
        100.0 * (plain / one - 1.0)
    );
    println!(
        "scaling efficiency at world 2 (throughput / 2 x world 1): {:.1}%",
        100.0 * two / (2.0 * one)
    );
    Ok(ExitCode::SUCCESS)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn run_plain(exe: &Path, config: &Path) -> anyhow::Result<f64> {
    let out = Command::new(exe)
        .args(["bench-train", "--plain-only", "--config"])
        .arg(config)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .context("cannot run the plain loop")?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| l.strip_prefix("plain samples/s: "))
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| {
            format!(
                "plain loop failed: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
}

/// Runs the trainer and returns the mean samples/s of its metrics after the first window.
fn run_trainer(exe: &Path, config: &Path, out_dir: &Path, nproc: usize) -> anyhow::Result<f64> {
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
    table.insert("output".into(), toml::Value::Table(output));
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
    let rates: Vec<f64> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "train")
        .filter_map(|v| v["samples_per_sec"].as_f64())
        .skip(1) // warm-up window
        .collect();
    if rates.is_empty() {
        bail!("no throughput records: raise training.max_steps above 2 x training.log_every");
    }
    Ok(rates.iter().sum::<f64>() / rates.len() as f64)
}

/// The baseline: a straightforward Burn loop over the same app's data, batcher and model
/// (`TrainStep::step`, then the optimizer), with the configured optimizer at a constant rate:
/// no sampler, no reducer, no metrics, no prefetching.
fn plain_loop<A: LearnAnywhere>(app: &A, config: &AppConfig<A>) -> anyhow::Result<f64> {
    let o = &config.optimizer;
    match o.name {
        OptimizerName::Sgd => plain_with(app, config, SgdConfig::new().init()),
        OptimizerName::Adam => plain_with(app, config, AdamConfig::new().init()),
        OptimizerName::AdamW => plain_with(app, config, AdamWConfig::new().init()),
    }
}

fn plain_with<A, O>(app: &A, config: &AppConfig<A>, mut optim: O) -> anyhow::Result<f64>
where
    A: Learn<CpuBackend>,
    O: Optimizer<A::Model, CpuBackend>,
{
    let device = Default::default();
    CpuBackend::seed(&device, config.training.seed);
    let data = app.datasets(&config.data)?;
    let mut model = app.model(&config.model, &config.data, &device)?;
    let (batcher, _) = app.batchers(&config.model, &config.data);
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
            .filter_map(|i| data.train.get((step * batch + i) % len))
            .collect();
        let output = model.step(batcher.batch(items, &device));
        model = model.optimize(&mut optim, config.optimizer.learning_rate, output.grads);
    }
    let _ = model.valid();
    Ok((steps * batch) as f64 / start.elapsed().as_secs_f64())
}
