//! The training loop, read top to bottom:
//!
//! 1. **join the job** — one process (`trainer --config`) or one rank of many (launcher,
//!    torchrun, SLURM); ranks check that they run the same config;
//! 2. **load the data** — the same seeded train/validation split on every rank;
//! 3. **build the model** from the registry, **restore** the newest checkpoint if there is one,
//!    and make replicas equal (deterministic parameter ids, broadcast from rank 0);
//! 4. **for each epoch**: the sampler gives this rank its shard of the epoch's global order
//!    (skipping what a restored checkpoint already consumed); each optimizer step runs
//!    `accumulation_steps` micro-batches forward and backward, averages the gradients across
//!    ranks once, and steps the optimizer; then validation on every validation sample exactly
//!    once, and a checkpoint.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use burn::backend::{Autodiff, Flex};
use burn::data::dataloader::batcher::Batcher;
use burn::module::AutodiffModule;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    AdamConfig, AdamWConfig, GradientsAccumulator, GradientsParams, Optimizer, SgdConfig,
};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
#[cfg(feature = "cuda")]
use burn_ddp::ddp::NcclBuckets;
use burn_ddp::ddp::{param_checksum, prepare_module, HostStaging, Reducer, ReducerStats};
#[cfg(feature = "cuda")]
use burn_ddp::group::nccl::{NcclGroupOptions, NcclProcessGroup};
use burn_ddp::kernels::BucketOps;
use burn_ddp::sampler::{DistributedSampler, Sample, WeightedDistributedSampler};
use burn_ddp::{DdpError, Distributed, ProcessGroup, TcpGroupOptions, TcpProcessGroup};
use models::{Classifier, InputShape, ModelTask};

use crate::checkpoint::{self, Checkpoint, Manifest, TrainPosition, FORMAT_VERSION};
use crate::cli::UsageError;
use crate::config::{
    Config, DataSource, DeviceKind, GradientSyncMode, OptimizerName, TrainingConfig,
};
use crate::data::{self, ClassificationBatch, ClassificationBatcher, ClassificationDataset};
use crate::metrics::{global_sum, Record, Reporter};
use burn::data::dataset::Dataset;

/// The CPU backend: Burn's pure-Rust `Flex` under autodiff.
pub type CpuBackend = Autodiff<Flex>;

/// What the training loop needs of a backend beyond autodiff: the bucket kernels (or their
/// fallback) on its inner backend, and whether its gradients can be summed by NCCL. Every
/// backend can average through the host; only CUDA overrides `sync_with_nccl` (feature `cuda`).
pub trait TrainBackend: AutodiffBackend<InnerBackend: BucketOps> {
    /// Averages `grads` over `group` without leaving the GPU ([`NcclBuckets`]).
    /// `GradientSync::new` picks NCCL only for `output.device = "cuda"`, which runs the CUDA
    /// backend, so this default is never reached; if it were, it fails instead of guessing.
    #[cfg(feature = "cuda")]
    fn sync_with_nccl<M: AutodiffModule<Self>>(
        reducer: &mut Reducer,
        group: &mut NcclProcessGroup,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<(), DdpError> {
        let _ = (reducer, group, model, grads);
        Err(DdpError::Unsupported(
            "distributed.gradient_sync = \"nccl\" needs the CUDA backend".into(),
        ))
    }
}

impl TrainBackend for CpuBackend {}

#[cfg(feature = "wgpu")]
impl TrainBackend for Autodiff<burn::backend::Wgpu> {}

#[cfg(feature = "cuda")]
impl TrainBackend for Autodiff<burn::backend::Cuda> {
    fn sync_with_nccl<M: AutodiffModule<Self>>(
        reducer: &mut Reducer,
        group: &mut NcclProcessGroup,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<(), DdpError> {
        reducer.sync::<Self, M, _>(&mut NcclBuckets(group), model, grads)
    }
}

/// How this rank averages gradients once per optimizer step (`distributed.gradient_sync`),
/// with one [`Reducer`] either way (`distributed.gradient_compression` applies to both).
struct GradientSync {
    reducer: Reducer,
    /// `None`: through the host, over the job's TCP group. `Some`: on the GPU, over an NCCL
    /// group formed beside the TCP one (as PyTorch keeps a gloo group beside its NCCL group),
    /// dropped at the end of `fit`, before the final TCP barrier.
    #[cfg(feature = "cuda")]
    nccl: Option<Box<NcclProcessGroup>>,
}

impl GradientSync {
    /// The configured kind. For NCCL this forms the group through the job's store: collective,
    /// every rank calls it at the same point (after the config check, so ranks agree on the
    /// kind), bounded by `distributed.timeout_secs`.
    fn new(config: &Config, dist: &Distributed) -> anyhow::Result<Self> {
        let d = &config.distributed;
        let reducer = Reducer::new(d.bucket_cap_mb, d.gradient_compression.format());
        let use_nccl = d
            .gradient_sync
            .resolve(config.output.device, dist.env.world_size)
            == GradientSyncMode::Nccl;
        // Unreachable in practice: `preflight` refuses `output.device = "cuda"` in such a build,
        // and validation refuses "nccl" on other devices.
        #[cfg(not(feature = "cuda"))]
        if use_nccl {
            bail!(UsageError(
                "distributed.gradient_sync = \"nccl\" needs a build with `--features cuda`".into()
            ));
        }
        Ok(Self {
            reducer,
            #[cfg(feature = "cuda")]
            nccl: if use_nccl {
                Some(nccl_group(config, dist)?)
            } else {
                None
            },
        })
    }

    /// Replaces every gradient with its mean over the ranks. Collective, once per optimizer step
    /// ([`Reducer::sync`]).
    fn sync<B: TrainBackend, M: AutodiffModule<B>>(
        &mut self,
        tcp: &mut TcpProcessGroup,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<(), DdpError> {
        #[cfg(feature = "cuda")]
        if let Some(group) = &mut self.nccl {
            return B::sync_with_nccl(&mut self.reducer, group, model, grads);
        }
        self.reducer
            .sync::<B, M, _>(&mut HostStaging(tcp), model, grads)
    }

    fn stats(&self) -> ReducerStats {
        self.reducer.stats()
    }
}

/// Forms the NCCL group for gradients (`distributed.gradient_sync` resolved to `"nccl"`).
#[cfg(feature = "cuda")]
fn nccl_group(config: &Config, dist: &Distributed) -> anyhow::Result<Box<NcclProcessGroup>> {
    let d = &config.distributed;
    let (rank, world) = (dist.env.rank, dist.env.world_size);
    let options = NcclGroupOptions {
        timeout: Duration::from_secs(d.timeout_secs),
        stall_warning: Duration::from_secs(d.stall_warning_secs),
        ..Default::default()
    };
    // The same ordinal as the CudaDevice of `run`, so NCCL and Burn share one GPU.
    let device = burn_ddp::cuda::local_device(dist.env.local_rank);
    let group = NcclProcessGroup::with_options(dist.store.clone(), rank, world, device, options)
        .context(
            "forming the NCCL group for distributed.gradient_sync \
             (set it to \"host\" to average gradients through the host instead)",
        )?;
    tracing::info!(rank, world, device, "gradients are averaged with NCCL");
    Ok(Box::new(group))
}

/// The data of a run: the same on every rank.
pub struct Data {
    pub train: ClassificationDataset,
    pub valid: ClassificationDataset,
    pub input: InputShape,
}

/// Loads the configured data set and splits it.
pub fn load_data(config: &Config) -> anyhow::Result<Data> {
    let d = &config.data;
    let (items, input) = match d.source {
        DataSource::Digits => {
            let (h, w) = data::DIGITS_IMAGE;
            (
                data::load_digits(&d.path)?,
                InputShape::image(h, w, data::DIGITS_CLASSES),
            )
        }
        DataSource::Synthetic => (
            data::synthetic(d.samples, d.features, d.classes, d.split_seed),
            InputShape::flat(d.features, d.classes),
        ),
    };
    let (train, valid) = data::split_train_validation(items, d.validation_fraction, d.split_seed);
    if train.is_empty() {
        bail!(UsageError(format!(
            "data: no training samples left after holding out {} for validation",
            d.validation_fraction
        )));
    }
    Ok(Data {
        train: ClassificationDataset::new(train),
        valid: ClassificationDataset::new(valid),
        input,
    })
}

/// Checks what can be checked before any rank starts: config, data and model options.
pub fn preflight(config_path: &Path) -> anyhow::Result<Config> {
    let config = Config::load(config_path)?;
    let data = load_data(&config)?;
    models::validate(&config.model.name, &config.model.options, &data.input)?;
    device_available(config.output.device)?;
    Ok(config)
}

/// Whether this build can train on `device`, and (for CUDA) whether this machine can: a missing
/// driver or GPU is a clear usage error before any rank starts, never a panic inside CUDA.
fn device_available(device: DeviceKind) -> anyhow::Result<()> {
    let built_in = match device {
        DeviceKind::Cpu => true,
        DeviceKind::Wgpu => cfg!(feature = "wgpu"),
        DeviceKind::Cuda => cfg!(feature = "cuda"),
    };
    let name = format!("{device:?}").to_lowercase();
    if !built_in {
        return Err(UsageError(format!(
            "output.device = \"{name}\" is not available in this build of trainer. Rebuild with `cargo build --release -p trainer --features {name}`, or set output.device = \"cpu\""
        ))
        .into());
    }
    #[cfg(feature = "cuda")]
    if device == DeviceKind::Cuda {
        let local_rank = std::env::var("LOCAL_RANK")
            .ok()
            .and_then(|r| r.parse().ok())
            .unwrap_or(0);
        burn_ddp::cuda::check_cuda_available(burn_ddp::cuda::local_device(local_rank))
            .map_err(|e| UsageError(format!("output.device = \"cuda\": {e}")))?;
    }
    Ok(())
}

/// `trainer --config FILE` as one rank (or the only process).
pub fn run(config_path: &Path, no_resume: bool) -> anyhow::Result<ExitCode> {
    let config = preflight(config_path)?;
    let data = load_data(&config)?;
    let options = TcpGroupOptions {
        timeout: Duration::from_secs(config.distributed.timeout_secs),
        stall_warning: Duration::from_secs(config.distributed.stall_warning_secs),
        ..Default::default()
    };
    let dist = Distributed::from_env_or_standalone(options)?;
    let local_rank = dist.env.local_rank;
    match config.output.device {
        DeviceKind::Cpu => {
            train_on::<CpuBackend>(config, dist, data, no_resume, Default::default())
        }
        #[cfg(feature = "wgpu")]
        DeviceKind::Wgpu => {
            // One adapter per rank when the machine has several; else everyone shares the default.
            let device = burn::backend::wgpu::WgpuDevice::DefaultDevice;
            let _ = local_rank;
            train_on::<Autodiff<burn::backend::Wgpu>>(config, dist, data, no_resume, device)
        }
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => {
            // The local rank is the device ordinal (as with torchrun), unless the launcher gave
            // each process one GPU through CUDA_VISIBLE_DEVICES (then it is 0): see
            // `burn_ddp::cuda::local_device`. The NCCL group uses the same ordinal.
            let device =
                burn::backend::cuda::CudaDevice::new(burn_ddp::cuda::local_device(local_rank));
            train_on::<Autodiff<burn::backend::Cuda>>(config, dist, data, no_resume, device)
        }
        #[allow(unreachable_patterns)]
        other => {
            let _ = local_rank;
            Err(device_available(other)
                .err()
                .unwrap_or_else(|| anyhow::anyhow!("device {other:?} is not available")))
        }
    }
}

/// Trains on backend `B` and prints the result on rank 0.
fn train_on<B: TrainBackend>(
    config: Config,
    dist: Distributed,
    data: Data,
    no_resume: bool,
    device: B::Device,
) -> anyhow::Result<ExitCode> {
    let mut job = Job::<B> {
        config,
        dist,
        data,
        device,
        no_resume,
    };
    job.check_same_config()?;
    B::seed(&job.device, job.config.training.seed);
    let (name, options, input, device) = (
        job.config.model.name.clone(),
        job.config.model.options.clone(),
        job.data.input.clone(),
        job.device.clone(),
    );
    let summary = models::with_model::<B, _>(
        &name,
        &options,
        &input,
        &device,
        TrainTask { job: &mut job },
    )??;
    if job.dist.env.rank == 0 {
        println!(
            "final validation accuracy: {:.2}% (loss {:.4}, {} samples, {} optimizer steps, world size {})",
            summary.accuracy * 100.0,
            summary.loss,
            summary.samples,
            summary.steps,
            job.dist.env.world_size
        );
    }
    // Rank 0 may host the store: leave together.
    job.dist.group.barrier()?;
    Ok(ExitCode::SUCCESS)
}

/// What a finished run reports.
#[derive(Debug, Clone, Copy)]
pub struct Summary {
    pub loss: f64,
    pub accuracy: f64,
    pub samples: usize,
    pub steps: usize,
}

/// Everything one rank's training needs.
struct Job<B: AutodiffBackend> {
    config: Config,
    dist: Distributed,
    data: Data,
    device: B::Device,
    no_resume: bool,
}

impl<B: AutodiffBackend> Job<B> {
    fn rank(&self) -> usize {
        self.dist.env.rank
    }

    fn world_size(&self) -> usize {
        self.dist.env.world_size
    }

    /// Ranks refuse to start with different configs, naming the rank that differs.
    fn check_same_config(&mut self) -> anyhow::Result<()> {
        if self.world_size() == 1 {
            return Ok(());
        }
        let ours = self.config.fingerprint();
        let rank = self.rank();
        let store = &self.dist.store;
        store.set(&format!("trainer/config/{rank}"), ours.as_bytes())?;
        let theirs = store.get(
            "trainer/config/0",
            Duration::from_secs(self.config.distributed.timeout_secs),
        )?;
        if theirs != ours.as_bytes() {
            bail!(UsageError(format!(
                "rank {rank}'s config differs from rank 0's (fingerprint {ours} vs {}): every rank must train with the same settings",
                String::from_utf8_lossy(&theirs)
            )));
        }
        Ok(())
    }

    /// The newest usable checkpoint, if resuming; every rank must see the same one.
    fn find_checkpoint(&mut self) -> anyhow::Result<Option<Checkpoint>> {
        let c = &self.config.checkpoint;
        let found = match (&c.dir, c.resume && !self.no_resume) {
            (Some(dir), true) => checkpoint::latest(dir),
            _ => None,
        };
        if let Some(ckpt) = &found {
            checkpoint::check_compatible(
                ckpt,
                &self.config.model.name,
                &self.config.model_fingerprint(),
            )?;
        }
        let step = found
            .as_ref()
            .map_or(-1, |c| c.manifest.position.step as i64);
        let mut agreed = [step];
        self.dist.group.broadcast(&mut agreed, 0)?;
        if agreed[0] != step {
            bail!(
                "rank {} found the checkpoint of step {step} but rank 0 found step {} (-1: none): checkpoint.dir must be the same directory, shared by every rank",
                self.rank(),
                agreed[0]
            );
        }
        Ok(found)
    }

    /// Rank 0 writes; the others wait for it with the checkpoint timeout, so a slow disk never
    /// trips the collectives' deadline.
    fn save_checkpoint<M, O>(
        &mut self,
        position: TrainPosition,
        model: &M,
        optim: &O,
    ) -> anyhow::Result<()>
    where
        M: AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        let Some(root) = self.config.checkpoint.dir.clone() else {
            return Ok(());
        };
        let key = format!("trainer/checkpoint/{}", position.step);
        if self.rank() == 0 {
            let manifest = Manifest {
                format_version: FORMAT_VERSION,
                model: self.config.model.name.clone(),
                model_fingerprint: self.config.model_fingerprint(),
                config_fingerprint: self.config.fingerprint(),
                seed: self.config.training.seed,
                world_size: self.world_size(),
                position,
                checksums: Default::default(),
            };
            let result = checkpoint::save::<B, M, O>(
                &root,
                self.config.checkpoint.keep_last,
                manifest,
                model,
                optim,
            );
            let status = match &result {
                Ok(dir) => {
                    tracing::info!("checkpoint written: {}", dir.display());
                    "ok".to_string()
                }
                Err(e) => format!("{e:#}"),
            };
            if self.world_size() > 1 {
                self.dist.store.set(&key, status.as_bytes())?;
            }
            result.map(|_| ())
        } else {
            let timeout = Duration::from_secs(self.config.checkpoint.timeout_secs);
            let status = self
                .dist
                .store
                .get(&key, timeout)
                .context("waiting for rank 0 to write a checkpoint")?;
            if status != b"ok" {
                bail!(
                    "rank 0 failed to write the checkpoint: {}",
                    String::from_utf8_lossy(&status)
                );
            }
            Ok(())
        }
    }
}

/// Picks the optimizer, then runs [`fit`] with the concrete model and optimizer types.
struct TrainTask<'a, B: AutodiffBackend> {
    job: &'a mut Job<B>,
}

impl<B: TrainBackend> ModelTask<B> for TrainTask<'_, B> {
    type Output = anyhow::Result<Summary>;

    fn run<M>(self, model: M) -> Self::Output
    where
        M: Classifier<B> + AutodiffModule<B> + 'static,
        M::InnerModule: Classifier<B::InnerBackend>,
    {
        let o = self.job.config.optimizer.clone();
        let decay = (o.weight_decay > 0.0).then(|| WeightDecayConfig::new(o.weight_decay as f32));
        match o.name {
            OptimizerName::Sgd => {
                let momentum = (o.momentum > 0.0).then(|| {
                    MomentumConfig::new()
                        .with_momentum(o.momentum)
                        .with_dampening(0.0)
                });
                let optim = SgdConfig::new()
                    .with_momentum(momentum)
                    .with_weight_decay(decay)
                    .init();
                fit(self.job, model, optim)
            }
            OptimizerName::Adam => fit(
                self.job,
                model,
                AdamConfig::new().with_weight_decay(decay).init(),
            ),
            OptimizerName::AdamW => {
                let optim = AdamWConfig::new()
                    .with_weight_decay(o.weight_decay as f32)
                    .init();
                fit(self.job, model, optim)
            }
        }
    }
}

/// The loop itself (module docs, step 3 and 4).
fn fit<B, M, O>(job: &mut Job<B>, model: M, optim: O) -> anyhow::Result<Summary>
where
    B: TrainBackend,
    M: Classifier<B> + AutodiffModule<B> + 'static,
    M::InnerModule: Classifier<B::InnerBackend>,
    O: Optimizer<M, B>,
{
    let t = job.config.training.clone();
    let (rank, world) = (job.rank(), job.world_size());

    // Restore, then make the replicas equal.
    let restored = job.find_checkpoint()?;
    let mut model = model;
    let mut optim = optim;
    let mut position = TrainPosition::default();
    if let Some(ckpt) = &restored {
        model = checkpoint::load_model::<B, M>(ckpt, model)?;
        position = ckpt.manifest.position;
    }
    let mut model = prepare_module(model, &mut job.dist.group, 0)?;
    if let Some(ckpt) = &restored {
        optim = checkpoint::load_optimizer::<B, M, O>(ckpt, optim, &job.device)?;
        tracing::info!(
            "resumed from {} (epoch {}, {} samples into it, step {}; saved with world size {}, now {world})",
            ckpt.dir.display(),
            position.epoch,
            position.consumed,
            position.step,
            ckpt.manifest.world_size
        );
    }

    let train_len = job.data.train.len();
    let sampler = EpochSampler::new(&job.data.train, &t, world, rank)?;
    // Samples per rank per optimizer step.
    let per_step = t.batch_size * t.accumulation_steps;
    // Steps are counted from the start of the run; after a resume with another world size the
    // rest of the current epoch takes a different number of steps than it would have.
    let steps_per_epoch = sampler.samples(0, 0).len().div_ceil(per_step);
    let rest_of_epoch = sampler
        .samples(position.epoch as u64, position.consumed)
        .len()
        .div_ceil(per_step);
    let planned = if position.epoch < t.epochs {
        position.step + rest_of_epoch + (t.epochs - position.epoch - 1) * steps_per_epoch
    } else {
        position.step
    };
    let total_steps = t.max_steps.unwrap_or(usize::MAX).min(planned);
    let mut reducer = GradientSync::new(&job.config, &job.dist)?;
    let loss_fn = CrossEntropyLossConfig::new().init::<B>(&job.device);
    let mut reporter = Reporter::new(
        rank,
        &job.config.output.dir,
        total_steps as u64,
        position.step as u64,
    )?;
    let mut window = Window::new();
    let mut last_saved = restored.as_ref().map(|c| c.manifest.position.step);
    let mut last_valid = None;

    'epochs: while position.epoch < t.epochs && position.step < total_steps {
        let samples = sampler.samples(position.epoch as u64, position.consumed);
        let epoch_start = position.consumed;
        for (k, chunk) in samples.chunks(per_step).enumerate() {
            // Seeded per step, so dropout masks are the same in a resumed run.
            B::seed(&job.device, t.seed.wrapping_add(position.step as u64 + 1));
            let mut accumulator = GradientsAccumulator::<M>::new();
            let mut chunk_loss = 0.0;
            for micro in chunk.chunks(t.batch_size) {
                let items = micro
                    .iter()
                    .filter_map(|s| job.data.train.get(s.index))
                    .collect();
                let batch: ClassificationBatch<B> = ClassificationBatcher.batch(items, &job.device);
                let loss = loss_fn.forward(model.forward(batch.inputs), batch.targets);
                // Each micro-batch's mean weighted by its share: the sum is the step's mean.
                let loss = loss.mul_scalar(micro.len() as f64 / chunk.len() as f64);
                chunk_loss += loss.clone().into_scalar().elem::<f64>();
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                accumulator.accumulate(&model, grads);
            }
            let mut grads = accumulator.grads();
            reducer.sync::<B, M>(&mut job.dist.group, &model, &mut grads)?;
            let lr = job
                .config
                .optimizer
                .learning_rate(world, position.step, total_steps);
            model = optim.step(lr, model, grads);

            position.step += 1;
            position.consumed = (epoch_start + (k + 1) * per_step * world).min(train_len);
            window.add(chunk_loss, chunk.len() * world);
            if job.config.output.log_samples {
                log_samples(&job.config.output.dir, rank, position.epoch, chunk)?;
            }
            if position.step % t.log_every == 0 || position.step == total_steps {
                let [loss_sum, steps] =
                    global_sum(&mut job.dist.group, [window.loss, window.steps as f64])?;
                let rate = window.rate();
                reporter.record(&Record::Train {
                    epoch: position.epoch,
                    step: position.step,
                    loss: loss_sum / steps.max(1.0),
                    lr,
                    samples_per_sec: rate,
                    world_size: world,
                });
                reporter.progress(
                    position.step as u64,
                    format!(
                        "epoch {} loss {:.4} {:.0} samples/s",
                        position.epoch + 1,
                        loss_sum / steps.max(1.0),
                        rate
                    ),
                );
                window = Window::new();
            }
            if t.check_replicas_every > 0 && position.step % t.check_replicas_every == 0 {
                check_replicas(&mut job.dist.group, &model, position.step)?;
            }
            let every = job.config.checkpoint.every_steps;
            if every > 0 && position.step % every == 0 {
                job.save_checkpoint(position, &model, &optim)?;
                last_saved = Some(position.step);
            }
            crash_if_asked(rank, position.step);
            if position.step >= total_steps {
                break;
            }
        }
        if position.consumed >= train_len || samples.is_empty() {
            // The epoch is complete: validate, and checkpoint at the start of the next one.
            position.epoch += 1;
            position.consumed = 0;
            let v = validate(
                &model,
                &job.data.valid,
                &mut job.dist.group,
                &job.device,
                t.batch_size,
            )?;
            reporter.record(&Record::Valid {
                epoch: position.epoch - 1,
                step: position.step,
                loss: v.loss,
                accuracy: v.accuracy,
                samples: v.samples,
            });
            reporter.say(&format!(
                "epoch {}/{}: validation loss {:.4}, accuracy {:.2}% ({} samples)",
                position.epoch,
                t.epochs,
                v.loss,
                v.accuracy * 100.0,
                v.samples
            ));
            last_valid = Some(v);
            let every = job.config.checkpoint.every_epochs;
            if every > 0 && position.epoch % every == 0 && last_saved != Some(position.step) {
                job.save_checkpoint(position, &model, &optim)?;
                last_saved = Some(position.step);
            }
        }
        if position.step >= total_steps {
            break 'epochs;
        }
    }
    reporter.finish();
    if last_saved != Some(position.step) {
        job.save_checkpoint(position, &model, &optim)?;
    }
    let v = match last_valid {
        Some(v) if v.steps == position.step => v,
        _ => validate(
            &model,
            &job.data.valid,
            &mut job.dist.group,
            &job.device,
            t.batch_size,
        )?,
    };
    tracing::debug!(
        rank,
        syncs = reducer.stats().syncs,
        buckets = reducer.stats().bucket_all_reduces,
        "gradient synchronisation"
    );
    if rank == 0 && job.config.output.log_samples {
        // Tests read the gradient synchronisations and bytes per optimizer step from here.
        let stats = reducer.stats();
        fs::write(
            job.config.output.dir.join("reducer-stats.json"),
            format!(
                "{{\"syncs\":{},\"bucket_all_reduces\":{},\"bytes_reduced\":{},\"steps\":{}}}",
                stats.syncs, stats.bucket_all_reduces, stats.bytes_reduced, position.step
            ),
        )?;
    }
    Ok(Summary {
        loss: v.loss,
        accuracy: v.accuracy,
        samples: v.samples,
        steps: position.step,
    })
}

/// Fault injection for tests: `TRAINER_CRASH_AFTER_STEP=N` (optionally with
/// `TRAINER_CRASH_RANK=R`, default every rank) kills this process with SIGKILL right after
/// optimizer step `N` and its checkpoint — exactly what `kill -9` at that point does.
fn crash_if_asked(rank: usize, step: usize) {
    let at = std::env::var("TRAINER_CRASH_AFTER_STEP")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    let who = std::env::var("TRAINER_CRASH_RANK")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    // Only in the first attempt: a restarted job must be able to get past the same step.
    let restarted = std::env::var(crate::launch::RESTART_COUNT_VAR).is_ok_and(|c| c != "0");
    if at == Some(step) && who.is_none_or(|r| r == rank) && !restarted {
        eprintln!(
            "[rank {rank}] TRAINER_CRASH_AFTER_STEP={step}: killing this process (fault injection)"
        );
        // SAFETY: kill(2) on our own pid with a signal number; no memory is involved.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// The training sampler: uniform (PyTorch's `DistributedSampler`) or class-balanced
/// (`WeightedDistributedSampler` with weights inversely proportional to class frequency, as many
/// draws per epoch as the data set has samples). Both shard one global order per epoch.
enum EpochSampler {
    Uniform(DistributedSampler),
    Weighted(WeightedDistributedSampler),
}

impl EpochSampler {
    fn new(
        train: &ClassificationDataset,
        t: &TrainingConfig,
        world: usize,
        rank: usize,
    ) -> anyhow::Result<Self> {
        if !t.balance_classes {
            return Ok(Self::Uniform(
                DistributedSampler::new(train.len(), world, rank)
                    .with_seed(t.seed)
                    .with_shuffle(t.shuffle)
                    .with_drop_last(t.drop_last),
            ));
        }
        let labels: Vec<usize> = train.iter().map(|i| i.label).collect();
        let mut counts = vec![0usize; labels.iter().map(|l| l + 1).max().unwrap_or(0)];
        for &label in &labels {
            counts[label] += 1;
        }
        let weights: Vec<f64> = labels.iter().map(|&l| 1.0 / counts[l] as f64).collect();
        WeightedDistributedSampler::new(&weights, train.len(), world, rank, t.seed)
            .map(Self::Weighted)
            .ok_or_else(|| anyhow::anyhow!("training.balance_classes: no usable class weights"))
    }

    fn samples(&self, epoch: u64, consumed: usize) -> Vec<Sample> {
        match self {
            Self::Uniform(s) => s.samples(epoch, consumed),
            Self::Weighted(s) => s.samples(epoch, consumed),
        }
    }
}

/// Loss and throughput since the last log line.
struct Window {
    loss: f64,
    steps: usize,
    samples: usize,
    start: Instant,
}

impl Window {
    fn new() -> Self {
        Self {
            loss: 0.0,
            steps: 0,
            samples: 0,
            start: Instant::now(),
        }
    }
    fn add(&mut self, loss: f64, global_samples: usize) {
        self.loss += loss;
        self.steps += 1;
        self.samples += global_samples;
    }
    fn rate(&self) -> f64 {
        self.samples as f64 / self.start.elapsed().as_secs_f64().max(1e-9)
    }
}

/// Validation results over all ranks.
#[derive(Debug, Clone, Copy)]
struct Validation {
    loss: f64,
    accuracy: f64,
    samples: usize,
    steps: usize,
}

/// Evaluates every validation sample exactly once across the ranks (no padding) and sums the
/// per-sample loss and hits with their real counts. Collective.
fn validate<B, M>(
    model: &M,
    valid: &ClassificationDataset,
    group: &mut impl ProcessGroup,
    device: &B::Device,
    batch_size: usize,
) -> anyhow::Result<Validation>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    M::InnerModule: Classifier<B::InnerBackend>,
{
    let inner = model.valid();
    let (loss_sum, hits, n) = evaluate_shard::<B::InnerBackend, _>(
        &inner,
        valid,
        group.rank(),
        group.world_size(),
        device,
        batch_size,
    );
    let [loss_sum, hits, n] = global_sum(group, [loss_sum, hits, n])?;
    Ok(Validation {
        loss: loss_sum / n.max(1.0),
        accuracy: hits / n.max(1.0),
        samples: n as usize,
        steps: 0,
    })
}

/// (summed loss, correct predictions, samples) of this rank's evaluation shard.
fn evaluate_shard<B: Backend, M: Classifier<B>>(
    model: &M,
    items: &ClassificationDataset,
    rank: usize,
    world: usize,
    device: &B::Device,
    batch_size: usize,
) -> (f64, f64, f64) {
    let indices = DistributedSampler::new(items.len(), world, rank).eval_indices();
    let loss_fn = CrossEntropyLossConfig::new().init::<B>(device);
    let (mut loss_sum, mut hits) = (0.0, 0.0);
    for chunk in indices.chunks(batch_size.max(1)) {
        let batch: ClassificationBatch<B> = ClassificationBatcher
            .batch(chunk.iter().filter_map(|&i| items.get(i)).collect(), device);
        let logits = model.forward(batch.inputs);
        let predicted = logits.clone().argmax(1).flatten::<1>(0, 1);
        hits += predicted
            .equal(batch.targets.clone())
            .int()
            .sum()
            .into_scalar()
            .elem::<f64>();
        loss_sum += loss_fn
            .forward(logits, batch.targets)
            .into_scalar()
            .elem::<f64>()
            * chunk.len() as f64;
    }
    (loss_sum, hits, indices.len() as f64)
}

/// Compares a checksum of the parameters across ranks; replicas must be bit-identical.
fn check_replicas<B: AutodiffBackend, M: AutodiffModule<B>>(
    group: &mut impl ProcessGroup,
    model: &M,
    step: usize,
) -> anyhow::Result<()> {
    let ours = param_checksum::<B, M>(model) as i64;
    let mut all = vec![0i64; group.world_size()];
    group.all_gather(&[ours], &mut all)?;
    if let Some(r) = all.iter().position(|&c| c != all[0]) {
        bail!(
            "replica drift at step {step}: rank {r}'s parameters (checksum {:016x}) differ from rank 0's ({:016x})",
            all[r] as u64,
            all[0] as u64
        );
    }
    Ok(())
}

/// Appends `epoch index is_padding` lines for the samples of one step (for tests).
fn log_samples(dir: &Path, rank: usize, epoch: usize, chunk: &[Sample]) -> anyhow::Result<()> {
    fs::create_dir_all(dir)?;
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("samples-rank{rank}.txt")))?;
    for s in chunk {
        writeln!(f, "{epoch} {} {}", s.index, u8::from(s.is_padding))?;
    }
    Ok(())
}

/// `trainer eval`: loads a checkpoint into the configured model and validates it (one process).
pub fn evaluate(config_path: &Path, checkpoint_path: &Path) -> anyhow::Result<ExitCode> {
    let config = preflight(config_path)?;
    let data = load_data(&config)?;
    let ckpt = if checkpoint_path.join("manifest.json").exists() {
        checkpoint::open(checkpoint_path)?
    } else {
        checkpoint::latest(checkpoint_path).ok_or_else(|| {
            UsageError(format!(
                "no usable checkpoint in {}",
                checkpoint_path.display()
            ))
        })?
    };
    checkpoint::check_compatible(&ckpt, &config.model.name, &config.model_fingerprint())?;
    struct Eval<'a> {
        ckpt: &'a Checkpoint,
        valid: &'a ClassificationDataset,
        batch_size: usize,
    }
    impl ModelTask<CpuBackend> for Eval<'_> {
        type Output = anyhow::Result<(f64, f64, f64)>;
        fn run<M>(self, model: M) -> Self::Output
        where
            M: Classifier<CpuBackend> + AutodiffModule<CpuBackend> + 'static,
            M::InnerModule: Classifier<Flex>,
        {
            let model = checkpoint::load_model::<CpuBackend, M>(self.ckpt, model)?.valid();
            Ok(evaluate_shard::<Flex, _>(
                &model,
                self.valid,
                0,
                1,
                &Default::default(),
                self.batch_size,
            ))
        }
    }
    let task = Eval {
        ckpt: &ckpt,
        valid: &data.valid,
        batch_size: config.training.batch_size,
    };
    let (loss, hits, n) = models::with_model::<CpuBackend, _>(
        &config.model.name,
        &config.model.options,
        &data.input,
        &Default::default(),
        task,
    )??;
    println!(
        "checkpoint {} (step {}): validation accuracy {:.2}%, loss {:.4}, {} samples",
        ckpt.dir.display(),
        ckpt.manifest.position.step,
        100.0 * hits / n.max(1.0),
        loss / n.max(1.0),
        n
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::{Module, Param};
    use burn_ddp::store::{MemoryStore, Store};
    use std::sync::Arc;

    #[derive(Module, Debug)]
    struct Tiny<B: Backend> {
        weight: Param<Tensor<B, 1>>,
    }

    /// Two ranks (threads, real sockets) compare their parameters; `values[r]` is rank r's.
    fn compare(values: [f32; 2]) -> Vec<anyhow::Result<()>> {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mut group =
                        TcpProcessGroup::new(store, rank, 2, TcpGroupOptions::default())?;
                    let device = Default::default();
                    let tensor = Tensor::<CpuBackend, 1>::from_floats([values[rank], 1.0], &device);
                    let model = Tiny {
                        weight: Param::from_tensor(tensor),
                    };
                    check_replicas::<CpuBackend, _>(&mut group, &model, 7)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("thread"))
            .collect()
    }

    #[test]
    fn replica_drift_is_detected_and_names_the_rank() {
        for result in compare([0.5, 0.5]) {
            assert!(result.is_ok(), "{result:?}");
        }
        for result in compare([0.5, 0.5000001]) {
            let err = result.expect_err("drift must be reported").to_string();
            assert!(
                err.contains("replica drift at step 7") && err.contains("rank 1"),
                "{err}"
            );
        }
    }
}
