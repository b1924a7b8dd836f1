//! [`DdpStrategy`]: burn-train's `SupervisedTraining` as one rank of a multi-process job.
//!
//! ```text
//!  SupervisedTraining::new(dir, train_loader, valid_loader)          (unchanged)
//!      .with_training_strategy(TrainingStrategy::Custom(Arc::new(DdpStrategy::from_env()?)))
//!      .launch(learner)                                              on every rank
//!
//!  per optimizer step:  forward/backward on this rank's batch (accumulated as configured)
//!                       gradients averaged over the ranks (the TCP ring)  ─▶ optimizer step
//!                       buffers (BatchNorm statistics) broadcast from rank 0
//!  per iteration:       the step's outputs gathered on rank 0 ─▶ burn-train's event processor
//!                       (metrics of the global batch, renderer, metric logs: rank 0 only)
//!  per epoch:           validation of every rank's shard, gathered likewise; rank 0 writes
//!                       burn-train's checkpoint, the others wait for it (barrier, with the
//!                       group's deadline); early stopping as rank 0 decides
//! ```
//!
//! **Data.** With [`super::DistributedDataLoaderBuilder`] each rank reads its shard of one
//! global permutation per epoch (PyTorch's `DistributedSampler`). With a plain
//! `DataLoaderBuilder` loader the strategy falls back to contiguous equal slices (burn-train's
//! own multi-device split), the tail that does not divide by the world size dropped so every
//! rank runs as many iterations; shuffling then happens within each rank's slice only.
//!
//! **Resume** is burn-train's: `.checkpoint(epoch)` on the builder makes every rank load rank
//! 0's checkpoint of that epoch (a directory all ranks can read) and continue with the next
//! epoch. Unlike the `trainer` engine it is per epoch, not per step, and does not re-shard a
//! partly consumed epoch; the world size may change between runs (the state is the same on
//! every rank). A distributed loader resumed after epoch `e` iterates epoch `e + 1`'s order, so
//! a run resumed at the same world size trains as the uninterrupted one did.
//!
//! **Failure.** The strategy trait cannot return errors: a collective that fails or times out
//! (a rank died, a rank's loader ran out early) ends this process with exit code 1 after
//! printing the error, as an exception would end a PyTorch DDP rank; the launcher reports it
//! and stops the others.

use std::sync::Mutex;

use burn::data::dataloader::Progress;
use burn::module::{AutodiffModule, Module};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::AutodiffBackend;
use burn::train::{
    EventProcessorTraining, InferenceStep, Learner, LearnerEvent, LearningComponentsTypes,
    LearningResult, SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader,
    TrainStep, TrainingComponents, TrainingItem, TrainingModel, ValidLoader,
};

use super::gather::GatherOutput;
use super::loader;
use crate::ddp::buffers::{self, BufferSync};
use crate::ddp::{prepare_module, HostStaging, Reducer};
use crate::error::DdpError;
use crate::group::ProcessGroup;
use crate::init::Distributed;
use crate::kernels::BucketOps;
use crate::TcpGroupOptions;

/// One rank of a data-parallel `SupervisedTraining` (module docs).
pub struct DdpStrategy {
    state: Mutex<State>,
    rank: usize,
    world_size: usize,
}

struct State {
    dist: Distributed,
    reducer: Reducer,
    buffers: Option<BufferSync>,
}

impl DdpStrategy {
    /// Joins the job the environment describes (this project's launcher, torchrun, Slurm,
    /// Open MPI variables), or forms a job of one without them. Collective: every rank calls it
    /// (deadline: `options.timeout`). On ranks other than 0 it installs a quiet global logger
    /// (warnings and errors, tagged with the rank), so that burn-train's experiment logger,
    /// installed by `launch`, stays rank 0's.
    pub fn from_env() -> Result<Self, DdpError> {
        Self::from_env_with(TcpGroupOptions::default())
    }

    /// [`from_env`](Self::from_env) with the process group's options (deadlines, shared
    /// memory).
    pub fn from_env_with(options: TcpGroupOptions) -> Result<Self, DdpError> {
        let dist = Distributed::from_env_or_standalone(options)?;
        Ok(Self::new(dist))
    }

    /// The strategy over an already formed job.
    pub fn new(dist: Distributed) -> Self {
        let (rank, world_size) = (dist.env.rank, dist.env.world_size);
        if rank != 0 {
            quiet_logger();
        }
        Self {
            state: Mutex::new(State {
                dist,
                reducer: Reducer::new(25.0, None),
                buffers: Some(BufferSync::Broadcast { root: 0 }),
            }),
            rank,
            world_size,
        }
    }

    /// How buffers (BatchNorm running statistics) are kept equal after every optimizer step:
    /// rank 0's (the default, PyTorch's `broadcast_buffers=True`), the mean, or not at all.
    pub fn with_buffer_sync(self, rule: Option<BufferSync>) -> Self {
        if let Ok(mut state) = self.state.lock() {
            state.buffers = rule;
        }
        self
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }
}

/// Warnings and errors to stderr as the global subscriber of a rank that is not rank 0 (a
/// subscriber the program installed earlier is kept; the launcher tags each line with the
/// rank).
fn quiet_logger() {
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Ends this rank after a failed collective (module docs: the trait has no error path).
fn fail(rank: usize, what: &str, error: impl std::fmt::Display) -> ! {
    let _ = std::io::Write::write_fmt(
        &mut std::io::stderr(),
        format_args!("[rank {rank}] burn-ddp: {what}: {error}\n"),
    );
    std::process::exit(1)
}

/// Whether each rank has another batch; `Ok(true)` when all do, `Ok(false)` when none does.
fn all_have<G: ProcessGroup>(group: &mut G, ours: bool, what: &str) -> Result<bool, DdpError> {
    let mut all = vec![0u8; group.world_size()];
    group.all_gather(&[u8::from(ours)], &mut all)?;
    if all.iter().all(|&h| h == 1) {
        return Ok(true);
    }
    if all.iter().all(|&h| h == 0) {
        return Ok(false);
    }
    let short: Vec<usize> = (0..all.len()).filter(|&r| all[r] == 0).collect();
    Err(DdpError::Unsupported(format!(
        "{what}: rank(s) {short:?} ran out of batches before the others; every rank must run as many iterations (build the loader with burn_ddp::learner::DistributedDataLoaderBuilder)"
    )))
}

/// Whether any rank has another batch.
fn any_has<G: ProcessGroup>(group: &mut G, ours: bool) -> Result<bool, DdpError> {
    let mut all = vec![0u8; group.world_size()];
    group.all_gather(&[u8::from(ours)], &mut all)?;
    Ok(all.contains(&1))
}

type TrainOut<LC> = <<LC as LearningComponentsTypes>::TrainingModel as TrainStep>::Output;
type ValidOut<LC> = <<LC as LearningComponentsTypes>::InferenceModel as InferenceStep>::Output;

impl<LC> SupervisedLearningStrategy<LC> for DdpStrategy
where
    LC: LearningComponentsTypes,
    <LC::Backend as AutodiffBackend>::InnerBackend: BucketOps,
    TrainOut<LC>: GatherOutput,
    ValidOut<LC>: GatherOutput,
{
    fn train(
        &self,
        mut learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        mut components: TrainingComponents<LC>,
    ) -> LearningResult<LC::InferenceModel> {
        // burn-train's resume, on every rank: rank 0's files (module docs).
        let starting_epoch = match components.checkpoint {
            Some(epoch) => {
                if let Some(checkpointer) = &mut components.checkpointer {
                    learner = checkpointer.load_checkpoint(learner, &Default::default(), epoch);
                }
                epoch + 1
            }
            None => 1,
        };
        // burn-train's epochs count from 1; a distributed loader's from 0. Its order in a
        // resumed epoch is then the uninterrupted run's (other loaders keep their own state).
        let loader_epoch = starting_epoch as u64 - 1;
        loader::start_at_epoch(&dataloader_train, loader_epoch);
        loader::start_at_epoch(&dataloader_valid, loader_epoch);
        let summary = components.summary.take();
        if self.rank == 0 {
            components
                .event_processor
                .process_train(LearnerEvent::Start);
        }
        let (model, mut processor) = self.fit(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
        );
        if self.rank == 0 {
            let summary = summary.and_then(|s| s.init().ok());
            processor.process_train(LearnerEvent::End(summary));
        }
        LearningResult {
            model: model.valid(),
            renderer: processor.renderer(),
        }
    }

    fn fit(
        &self,
        components: TrainingComponents<LC>,
        mut learner: Learner<LC>,
        dataloader_train: TrainLoader<LC>,
        dataloader_valid: ValidLoader<LC>,
        starting_epoch: usize,
    ) -> (TrainingModel<LC>, SupervisedTrainingEventProcessor<LC>) {
        let rank = self.rank;
        let mut state = match self.state.lock() {
            Ok(state) => state,
            Err(poisoned) => poisoned.into_inner(),
        };
        let state = &mut *state;
        let train = shard(dataloader_train, rank, self.world_size);
        let valid = shard(dataloader_valid, rank, self.world_size);

        // Replicas equal: rank 0's weights and deterministic parameter ids everywhere.
        let prepared = prepare_module(learner.model(), &mut state.dist.group, 0)
            .unwrap_or_else(|e| fail(rank, "making the replicas equal", e));
        learner.load_model(prepared.into_record());

        let mut processor = components.event_processor;
        let mut checkpointer = components.checkpointer;
        let mut early_stopping = components.early_stopping;
        let accumulation = components.grad_accumulation.unwrap_or(1).max(1);
        let has_buffers = buffers::buffer_elements(&learner.model()) > 0;

        for epoch in starting_epoch..=components.num_epochs {
            let global = Progress::new(epoch, components.num_epochs);
            if rank == 0 {
                tracing::info!(
                    "epoch {epoch}/{}: training on {} rank(s)",
                    components.num_epochs,
                    self.world_size
                );
            }
            let mut iter = train.iter();
            let mut iteration = 0;
            let mut accumulator = GradientsAccumulator::new();
            let mut accumulated = 0;
            loop {
                let batch = iter.next();
                match all_have(&mut state.dist.group, batch.is_some(), "training") {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => fail(rank, "training", e),
                }
                let Some(batch) = batch else { break };
                iteration += 1;
                learner.lr_step();
                let progress = iter.progress();
                let output = learner.train_step(batch);
                accumulator.accumulate(&learner.model(), output.grads);
                accumulated += 1;
                if accumulated == accumulation {
                    let model = learner.model();
                    let mut grads: GradientsParams = accumulator.grads();
                    let check = state
                        .reducer
                        .sync::<LC::Backend, _, _>(
                            &mut HostStaging(&mut state.dist.group),
                            &model,
                            &mut grads,
                        )
                        .unwrap_or_else(|e| fail(rank, "averaging gradients", e));
                    if !check.all_finite() {
                        fail(
                            rank,
                            "training",
                            format!(
                                "non-finite gradients (NaN or Inf) at epoch {epoch}, iteration {iteration}, first on rank(s) {:?}",
                                check.nonfinite_ranks
                            ),
                        );
                    }
                    learner.optimizer_step(grads);
                    accumulated = 0;
                    if has_buffers {
                        if let Some(rule) = state.buffers {
                            let synced =
                                buffers::sync_buffers(learner.model(), &mut state.dist.group, rule)
                                    .unwrap_or_else(|e| fail(rank, "syncing buffers", e));
                            learner.load_model(synced.into_record());
                        }
                    }
                }
                let gathered = GatherOutput::gather(Some(output.item), &mut state.dist.group, 0)
                    .unwrap_or_else(|e| fail(rank, "gathering training outputs", e));
                if let Some(item) = gathered {
                    let progress = scaled(&progress, self.world_size);
                    let item = TrainingItem::new(
                        item,
                        progress,
                        global.clone(),
                        Some(iteration),
                        Some(learner.lr_current()),
                    );
                    processor.process_train(LearnerEvent::ProcessedItem(item));
                }
            }
            if rank == 0 {
                processor.process_train(LearnerEvent::EndEpoch(epoch));
            }

            // Validation: every rank its shard, gathered on rank 0.
            let model = learner.model().valid();
            let mut iter = valid.iter();
            let mut iteration = 0;
            loop {
                let batch = iter.next();
                match any_has(&mut state.dist.group, batch.is_some()) {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => fail(rank, "validation", e),
                }
                iteration += 1;
                let progress = scaled(&iter.progress(), self.world_size);
                let output = batch.map(|b| model.step(b));
                let gathered = GatherOutput::gather(output, &mut state.dist.group, 0)
                    .unwrap_or_else(|e| fail(rank, "gathering validation outputs", e));
                if let Some(item) = gathered {
                    let item =
                        TrainingItem::new(item, progress, global.clone(), Some(iteration), None);
                    processor.process_valid(LearnerEvent::ProcessedItem(item));
                }
            }
            if rank == 0 {
                processor.process_valid(LearnerEvent::EndEpoch(epoch));
                if let Some(checkpointer) = &mut checkpointer {
                    checkpointer.checkpoint(&learner, epoch, &components.event_store);
                }
            }
            // Rank 0's verdict on stopping (early stopping reads its event store; an
            // interrupt on rank 0 stops every rank), and the others wait for its checkpoint.
            let stop = rank == 0
                && (components.interrupter.should_stop()
                    || early_stopping
                        .as_mut()
                        .is_some_and(|s| s.should_stop(epoch, &components.event_store)));
            let mut verdict = [i64::from(stop)];
            state
                .dist
                .group
                .broadcast(&mut verdict, 0)
                .unwrap_or_else(|e| fail(rank, "waiting for rank 0 at the end of the epoch", e));
            if verdict[0] == 1 {
                break;
            }
        }
        state
            .dist
            .group
            .barrier()
            .unwrap_or_else(|e| fail(rank, "the final barrier", e));
        (learner.model(), processor)
    }
}

/// A rank's progress as the job's: positions times the world size.
fn scaled(progress: &Progress, world: usize) -> Progress {
    Progress::new(
        progress.items_processed * world,
        progress.items_total * world,
    )
}

/// This rank's part of `loader`: a loader from [`super::DistributedDataLoaderBuilder`] as it
/// is; any other as an equal contiguous slice (module docs).
fn shard<B, O>(
    loader: std::sync::Arc<dyn burn::data::dataloader::DataLoader<B, O>>,
    rank: usize,
    world: usize,
) -> std::sync::Arc<dyn burn::data::dataloader::DataLoader<B, O>>
where
    B: burn::tensor::backend::Backend,
{
    if world == 1 || loader::is_distributed(&loader) {
        return loader;
    }
    let each = loader.num_items() / world;
    loader.slice(rank * each, (rank + 1) * each)
}
