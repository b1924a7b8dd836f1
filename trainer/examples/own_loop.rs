//! Tier 2, "your own loop": a plain Burn training loop made data-parallel with
//! `trainer::parallel::DataParallel` — the loop stays yours (Accelerate's tier).
//!
//! ```text
//! cargo build --release -p trainer --example own_loop
//! trainer launch --nproc-per-node 2 -- target/release/examples/own_loop --batch 8 --out runs/own-loop
//! ```
//! With per-rank batch `b` on `N` ranks it ends with the weights one process gets with batch
//! `N·b` (`tests/integration/tiers.rs` checks it). Rank 0 writes the checkpoint.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::prelude::*;
use models::{Classifier, InputShape, MlpOptions};
use trainer::checkpoint::TrainPosition;
use trainer::config::{DeviceKind, DistributedConfig};
use trainer::data::{synthetic, ClassificationBatcher};
use trainer::parallel::{CheckpointPolicy, DataParallel};

type B = Autodiff<Flex>;

/// `--batch B` (per rank), `--steps N`, `--out DIR`.
fn args() -> anyhow::Result<(usize, usize, PathBuf)> {
    let (mut batch, mut steps, mut out) = (8, 20, PathBuf::from("runs/own-loop"));
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--batch" => batch = value.parse()?,
            "--steps" => steps = value.parse()?,
            "--out" => out = value.into(),
            other => anyhow::bail!("unknown argument {other} (use --batch, --steps, --out)"),
        }
    }
    Ok((batch, steps, out))
}

fn train() -> anyhow::Result<()> {
    let (batch, steps, out) = args()?;
    // Join the job (launcher / torchrun / SLURM variables), or run alone.
    let mut ddp = DataParallel::from_env::<B>(&DistributedConfig::default(), DeviceKind::Cpu)?;
    let device = Default::default();
    let data = synthetic(1024, 20, 4, 3);
    B::seed(&device, 5);
    let model = MlpOptions::default().init::<B>(&InputShape::flat(20, 4), &device);
    // Every rank starts from rank 0's weights.
    let mut model = ddp.prepare(model)?;
    let mut optim = SgdConfig::new().init::<B, models::Mlp<B>>();
    let loss_fn = CrossEntropyLossConfig::new().init::<B>(&device);

    let (mut step, mut epoch) = (0, 0);
    let (mut loss_sum, mut seen) = (0.0, 0.0);
    while step < steps {
        // This rank's share of the epoch's global permutation.
        for chunk in ddp.shard(data.len(), 7, epoch).chunks(batch) {
            let items = chunk.iter().map(|&i| data[i].clone()).collect();
            let b: trainer::data::ClassificationBatch<B> =
                ClassificationBatcher.batch(items, &device);
            let loss = loss_fn.forward(model.forward(b.inputs), b.targets);
            loss_sum += loss.clone().into_scalar().elem::<f64>() * chunk.len() as f64;
            seen += chunk.len() as f64;
            let mut grads = GradientsParams::from_grads(loss.backward(), &model);
            // The mean gradient over every rank's batch, and which ranks (if any) had NaN or
            // Inf in theirs: all ranks get the same answer, so all stop together.
            let check = ddp.average_gradients(&model, &mut grads)?;
            if !check.all_finite() {
                anyhow::bail!(
                    "non-finite gradients at step {step} on rank(s) {:?}",
                    check.nonfinite_ranks
                );
            }
            model = optim.step(0.05, model, grads);
            step += 1;
            if step == steps {
                break;
            }
        }
        epoch += 1;
    }
    let [loss_sum, seen] = ddp.sum([loss_sum, seen])?;
    let policy = CheckpointPolicy {
        dir: out.join("checkpoints"),
        keep_last: 1,
        timeout: Duration::from_secs(60),
        model_name: "own-loop-mlp".into(),
        model_fingerprint: "mlp-20-128-4".into(),
        config_fingerprint: format!("batch {batch}"),
        seed: 5,
    };
    let position = TrainPosition {
        epoch,
        consumed: 0,
        step,
    };
    ddp.save_checkpoint::<B, _, _>(&policy, position, &model, &optim, &[])?;
    if ddp.rank() == 0 {
        println!(
            "own loop: {step} steps on {} rank(s), mean training loss {:.4}",
            ddp.world_size(),
            loss_sum / seen
        );
    }
    ddp.barrier()
}

fn main() -> ExitCode {
    trainer::run::report(train().map(|()| ExitCode::SUCCESS))
}
