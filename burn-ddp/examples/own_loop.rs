//! "Your own loop": a plain Burn training loop made data-parallel with
//! [`burn_ddp::DataParallel`] — the loop, the model, the data and the loss stay yours; the
//! program needs `burn` and `burn-ddp` only (burn-store writes the final weights).
//!
//! ```text
//! cargo build --release -p burn-ddp --example own_loop
//! trainer launch --nproc-per-node 2 -- target/release/examples/own_loop --batch 8 --out runs/own-loop
//! torchrun --nproc-per-node 2 target/release/examples/own_loop --batch 8 --out runs/own-loop
//! ```
//! With per-rank batch `b` on `N` ranks it ends with the weights one process gets with batch
//! `N·b` (`tests/integration/tiers.rs` checks it, with plain DDP and with ZeRO stages 1 to 3
//! and Adam). Rank 0 writes `model.safetensors`. It trains on Burn's CPU device
//! (`Device::flex().autodiff()`); the device is a value, so another one is a one-line change.
//! At ZeRO stage 3 (`--zero-stage 3`) each rank keeps a shard of the marked layers: three
//! more lines (`fully_shard`, `gathered`, and `DataParallel::training_device`, which turns
//! on Burn's gradient checkpointing where stage 3 needs it).
//!
//! With `--survivors` (under `trainer launch --survivors-continue`) a rank that dies does not
//! end the job: the step in flight is dropped, the others agree on who carries on
//! (`DataParallel::regroup_after_failure`), take the rest of the epoch over themselves and
//! train on ([`carry_on`]; `docs/fault-tolerance.md` has the recipe, `tests/integration/tiers.rs`
//! kills a rank). A death in the last step, or after the loop (the loss's sum, the final
//! save), still ends the run: those collectives are outside the recipe.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::prelude::*;
use burn_ddp::elastic::{failed_peers, AgreementOptions};
use burn_ddp::rng::SplitMix64;
use burn_ddp::sampler::DistributedSampler;
use burn_ddp::{
    mark_block, DataParallel, DdpError, DdpOptions, MicroBatch, StepOutcome, ZeroStage,
};
use burn_store::{ModuleSnapshot, SafetensorsStore};

/// Where this program trains: Burn's CPU backend, with autodiff, at every ZeRO stage, through
/// burn-ddp's rule for stage 3 (a GPU device gets Burn's gradient checkpointing there; on the
/// CPU each gathered layer's memory is given back after its forward and gathered again for its
/// backward by burn-ddp, so the device is returned as it is).
fn train_device(options: &DdpOptions) -> Device {
    DataParallel::training_device(options, Device::flex().autodiff())
}

const FEATURES: usize = 20;
const CLASSES: usize = 4;

/// The user's model.
#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    out: Linear,
    act: Relu,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Self {
            hidden: LinearConfig::new(FEATURES, 64).init(device),
            out: LinearConfig::new(64, CLASSES).init(device),
            act: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        // Each layer is a block for gradient overlap: its gradients go on the wire as soon as
        // backward has passed it (an identity when the backward is not armed).
        let x = self.act.forward(mark_block(&x, &self.hidden).forward(x));
        mark_block(&x, &self.out).forward(x)
    }
}

/// The user's data: `(features, label)` pairs, the label the argmax of a fixed projection.
fn data(samples: usize, seed: u64) -> Vec<(Vec<f32>, i64)> {
    let mut rng = SplitMix64::new(seed);
    let projection: Vec<f32> = (0..FEATURES * CLASSES)
        .map(|_| rng.symmetric_f32())
        .collect();
    (0..samples)
        .map(|_| {
            let x: Vec<f32> = (0..FEATURES).map(|_| rng.next_f32()).collect();
            let label = (0..CLASSES)
                .map(|c| {
                    let score: f32 = (0..FEATURES)
                        .map(|f| (x[f] - 0.5) * projection[f * CLASSES + c])
                        .sum();
                    (c, score)
                })
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (c, s)| if s > b.1 { (c, s) } else { b },
                )
                .0;
            (x, label as i64)
        })
        .collect()
}

struct Args {
    batch: usize,
    steps: usize,
    out: PathBuf,
    zero_stage: ZeroStage,
    adam: bool,
    /// The survivors of a rank's death carry on.
    survivors: bool,
}

/// `--batch B` (per rank), `--steps N`, `--out DIR`, `--zero-stage 0|1|2|3`, `--adam`,
/// `--survivors`.
fn args() -> Result<Args, String> {
    let mut a = Args {
        batch: 8,
        steps: 20,
        out: PathBuf::from("runs/own-loop"),
        zero_stage: ZeroStage::Off,
        adam: false,
        survivors: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--adam" => a.adam = true,
            "--survivors" => a.survivors = true,
            _ => {}
        }
        if flag == "--adam" || flag == "--survivors" {
            continue;
        }
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<usize>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        match flag.as_str() {
            "--batch" => a.batch = number()?,
            "--steps" => a.steps = number()?,
            "--zero-stage" => {
                a.zero_stage = value.parse().map_err(|e| format!("{flag} {value}: {e}"))?
            }
            "--out" => a.out = value.into(),
            other => {
                return Err(format!(
                    "unknown argument {other} (use --batch, --steps, --out, --zero-stage, --adam, --survivors)"
                ))
            }
        }
    }
    if a.survivors && (a.adam || a.zero_stage != ZeroStage::Off) {
        // SGD holds no state, so the survivors need hand nothing over but the weights.
        return Err(
            "--survivors trains with plain SGD at ZeRO stage 0: leave out --adam and --zero-stage"
                .into(),
        );
    }
    Ok(a)
}

/// Where the loop stands in the run: what the survivors of a failure go on from.
#[derive(Debug, Clone, Copy, Default)]
struct Position {
    /// Optimizer steps applied.
    step: usize,
    epoch: usize,
    /// Samples of the epoch's global order consumed (by every rank together).
    consumed: usize,
}

/// The training loop, for any optimizer.
fn train(
    ddp: &mut DataParallel,
    a: &Args,
    device: &Device,
    mut optim: ModuleOptimizer,
    lr: f64,
) -> Result<(Mlp, f64, usize), DdpError> {
    let data = data(1024, 3);
    device.seed(5);
    // Every rank starts from rank 0's weights.
    let model = ddp.prepare(Mlp::new(device))?;
    // ZeRO stage 3: one forward finds the marked layers, whose parameters are then cut into
    // shards (at other stages the model is returned as it is).
    let sample = Tensor::<1>::from_floats(data[0].0.as_slice(), device).reshape([1, FEATURES]);
    let mut model = ddp.fully_shard(model, |m| {
        let _ = m.forward(sample);
    })?;
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let mut at = Position::default();
    let (mut loss_sum, mut seen) = (0.0, 0.0);
    if ddp.rank() == 0 {
        println!("own loop: training on {} rank(s)", ddp.world_size());
    }
    while at.step < a.steps {
        // This rank's share of the rest of the epoch's global permutation (all of it, unless
        // the job re-formed in the middle of it).
        let sampler =
            DistributedSampler::new(data.len(), ddp.world_size(), ddp.rank()).with_seed(7);
        let world = ddp.world_size();
        let mut regrouped = false;
        for chunk in sampler
            .indices(at.epoch as u64, at.consumed)
            .chunks(a.batch)
        {
            // With --survivors: the weights this step starts from, to go on from if a rank
            // dies during it (cheap: Burn's tensors are shared, the update makes new ones).
            let before = a.survivors.then(|| model.clone());
            let (x, y) = batch(&data, chunk, device);
            // Before the forward: this backward may sum the marked layers' gradients while it
            // runs (the step's only micro-batch), and at stage 3 the marked layers are gathered
            // whole for this forward and its backward.
            let scope = ddp.micro_batch(&model, MicroBatch::ONLY);
            let loss = loss_fn.forward(model.forward(x), y);
            let value = loss
                .clone()
                .try_into_scalar::<f64>()
                .map_err(|e| DdpError::Device(format!("reading the loss: {e:?}")))?;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            drop(scope);
            // The DDP step: the mean gradient over every rank's batch, your optimizer (under
            // ZeRO stage 1 each rank steps its own parameters and sends them), the buffers.
            // Every rank gets the same outcome, so all stop together on NaN or Inf.
            let mut updated = false;
            let stepped = ddp.step(model, grads, |m, g| {
                updated = true;
                optim.step(lr, m, g)
            });
            let (next, outcome) = match stepped {
                Ok(stepped) => stepped,
                // Once this rank's optimizer applied the step it cannot be dropped.
                Err(e) => {
                    let before = before.filter(|_| !updated);
                    (model, at) = carry_on(ddp, before, e, at)?;
                    regrouped = true;
                    break;
                }
            };
            model = next;
            if let StepOutcome::Skipped { ranks } = outcome {
                return Err(DdpError::Unsupported(format!(
                    "non-finite gradients at step {} on rank(s) {ranks:?}",
                    at.step
                )));
            }
            loss_sum += value * chunk.len() as f64;
            seen += chunk.len() as f64;
            at.step += 1;
            at.consumed += chunk.len() * world;
            if ddp.rank() == 0 && at.step % 500 == 0 {
                println!("own loop: step {} of {}", at.step, a.steps);
            }
            if at.step == a.steps {
                break;
            }
        }
        if !regrouped && at.step < a.steps {
            (at.epoch, at.consumed) = (at.epoch + 1, 0);
        }
    }
    let [loss_sum, seen] = ddp.sum([loss_sum, seen])?;
    // Stage 3: the whole model, gathered on every rank, for rank 0 to write.
    let model = ddp.gathered(&model)?;
    Ok((model, loss_sum / seen, at.step))
}

/// The samples `chunk` of `data` as a batch on `device`: features and labels.
fn batch(
    data: &[(Vec<f32>, i64)],
    chunk: &[usize],
    device: &Device,
) -> (Tensor<2>, Tensor<1, Int>) {
    let x: Vec<f32> = chunk.iter().flat_map(|&i| data[i].0.clone()).collect();
    let y: Vec<i64> = chunk.iter().map(|&i| data[i].1).collect();
    let x = Tensor::<1>::from_floats(x.as_slice(), device).reshape([chunk.len(), FEATURES]);
    (x, Tensor::<1, Int>::from_ints(y.as_slice(), device))
}

/// After a failed step: when it was the loss of peers (`failed_peers`) and the step can be
/// dropped (`before`, the weights it started from), the survivors agree on who carries on
/// and re-form their groups, and every member goes on from the weights and the position of
/// the new rank 0 (the members that finished one more step than others, if any, lead; SGD
/// holds no other state). Any other error ends the run. Collective over the survivors.
fn carry_on(
    ddp: &mut DataParallel,
    before: Option<Mlp>,
    error: DdpError,
    at: Position,
) -> Result<(Mlp, Position), DdpError> {
    let (Some(model), Some(known_gone)) = (before, failed_peers(&error)) else {
        return Err(error);
    };
    eprintln!(
        "rank {}: {error}; the survivors re-form the job",
        ddp.rank()
    );
    let survivors =
        ddp.regroup_after_failure(&known_gone, at.step as u64, &AgreementOptions::default())?;
    // Rank 0's weights and position (it stood at the furthest step) on every member.
    let model = ddp.prepare(model)?;
    let ours = [at.step, at.epoch, at.consumed]
        .map(|n| n.to_le_bytes())
        .concat();
    let theirs = ddp.broadcast_bytes(ours)?;
    let number = |i: usize| {
        let bytes = theirs.get(i * 8..i * 8 + 8).and_then(|b| b.try_into().ok());
        bytes.map(usize::from_le_bytes).ok_or_else(|| {
            DdpError::Membership(format!("rank 0's position reads {} bytes", theirs.len()))
        })
    };
    let at = Position {
        step: number(0)?,
        epoch: number(1)?,
        consumed: number(2)?,
    };
    if ddp.rank() == 0 {
        println!(
            "own loop: lost rank(s) {:?} after step {}; {} rank(s) train on",
            survivors.lost,
            at.step,
            ddp.world_size()
        );
    }
    Ok((model, at))
}

/// Rank 0 writes the weights; the others wait for it (and fail if it failed).
fn save<M: ModuleSnapshot>(
    ddp: &mut DataParallel,
    model: &M,
    out: &std::path::Path,
) -> Result<(), String> {
    let path = out.join("model.safetensors");
    let written = ddp
        .run_on_rank_zero(
            "to write the weights",
            "own-loop/final",
            Duration::from_secs(60),
            || {
                std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
                // A second run into the same directory replaces the weights, as it did
                // before burn-store refused to overwrite by default.
                let mut store = SafetensorsStore::from_file(&path).overwrite(true);
                model
                    .save_into(&mut store)
                    .map_err(|e| format!("{}: {e}", path.display()))
            },
        )
        .map_err(|e| e.to_string())?;
    written
}

fn run() -> Result<(), Failure> {
    let a = args().map_err(|e| Failure(e, 2))?;
    // Join the job (launcher / torchrun / Slurm / Open MPI variables), or run alone.
    // --survivors: every rank beats a heartbeat, so a frozen or cut-off peer is named within
    // the failure detection time, not at the collective's deadline.
    let options = DdpOptions::default()
        .with_zero_stage(a.zero_stage)
        .with_peer_heartbeats(a.survivors);
    let device = train_device(&options);
    let mut ddp = DataParallel::from_env(options, &device)?;
    let trained = if a.adam {
        train(&mut ddp, &a, &device, AdamConfig::new().init(), 1e-3)
    } else {
        train(&mut ddp, &a, &device, SgdConfig::new().init(), 0.05)
    };
    let (model, mean_loss, steps) = trained?;
    if a.survivors {
        // Every replica the same after the failure (one collective checksum).
        ddp.check_replicas(&model, steps)?;
    }
    save(&mut ddp, &model, &a.out).map_err(|e| Failure(e, 1))?;
    if ddp.rank() == 0 {
        println!(
            "own loop: {steps} steps on {} rank(s), ZeRO stage {}, mean training loss {mean_loss:.4}",
            ddp.world_size(),
            ddp.zero_stage()
        );
    }
    Ok(ddp.barrier()?)
}

/// What went wrong, and the exit code: 2 for an input to fix, 1 otherwise.
struct Failure(String, u8);

impl From<DdpError> for Failure {
    fn from(e: DdpError) -> Self {
        let code = if e.is_usage() { 2 } else { 1 };
        Self(e.to_string(), code)
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure(message, code)) => {
            eprintln!("own_loop: {message}");
            ExitCode::from(code)
        }
    }
}
