//! [`DdpStrategy`]: burn-train's `SupervisedTraining` as one rank of a multi-process job.
//!
//! ```text
//!  SupervisedTraining::new(dir, train_loader, valid_loader)          (unchanged)
//!      .with_training_strategy(TrainingStrategy::Custom(Arc::new(DdpStrategy::from_env()?)))
//!      .launch(learner)                                              on every rank
//!
//!  per optimizer step:  forward/backward on this rank's batch (accumulated as configured)
//!                       the DDP step of `DataParallel`: gradients averaged over the ranks
//!                       (host ring or NCCL; ZeRO stages 1 and 2: reduced to each
//!                       parameter's owner) ─▶ optimizer step ─▶ (stages 1 and 2) owners
//!                       send the new values
//!                       ─▶ buffers (BatchNorm statistics) broadcast from rank 0
//!  per iteration:       the step's outputs gathered on rank 0 ─▶ burn-train's event processor
//!                       (metrics of the global batch, renderer, metric logs: rank 0 only)
//!  per epoch:           validation of every rank's shard, gathered likewise (burn-train's
//!                       split and epoch events on rank 0); rank 0 writes
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
//! **Resume** is burn-train's: `.checkpoint(epoch)` on the builder makes `launch` load rank
//! 0's checkpoint of that epoch on every rank (a directory all ranks can read) before the
//! strategy runs, and the strategy continues with the next epoch. Unlike the `trainer` engine it is per epoch, not per step, and does not re-shard a
//! partly consumed epoch; the world size may change between runs (the state is the same on
//! every rank). A distributed loader resumed after epoch `e` iterates epoch `e + 1`'s order, so
//! a run resumed at the same world size trains as the uninterrupted one did.
//!
//! **Device.** The strategy puts the model and the loaders on this rank's training device
//! ([`DdpStrategy::with_device`]; by default the model's own device, or for a model on a CUDA
//! device the GPU of this rank's local rank), autodiff for training and plain for validation,
//! as burn-train's single-device strategy does.
//!
//! **Options** ([`DdpOptions`], [`DdpStrategy::with_options`]): the engine's — gradient
//! transport (NCCL on Burn's CUDA backend), ZeRO stages 1 and 2, bf16/fp16 compression,
//! bucket size, buffer rule, deadlines. Under ZeRO stages 1 and 2 each rank keeps the optimizer
//! state of the parameters it owns; burn-train's `Learner` does not let a strategy read that
//! state, so rank 0 could not write it whole: stage 1 or 2 with a checkpointer is refused at the
//! start (exit code 2) instead of writing checkpoints that would resume with other ranks' state
//! lost. ZeRO stage 3 is refused where the options are given ([`DdpStrategy::from_env_with`],
//! [`DdpStrategy::with_options`]: [`DdpError::Options`]): the `Learner` cannot hold a sharded
//! model.
//!
//! **Failure.** The strategy trait cannot return errors: a collective that fails or times out
//! (a rank died, a rank's loader ran out early) ends this process with exit code 1 after
//! printing the error, as an exception would end a PyTorch DDP rank; a data-set item that
//! cannot be read is bad input: exit code 2. The launcher reports either and stops the others.

use std::sync::Mutex;

use burn::data::dataloader::{DataLoader, Progress};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::Device;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent, LearnerModel,
    LearningResult, SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader,
    TrainStep, TrainingComponents, TrainingItem, ValidLoader,
};

use super::gather::GatherOutput;
use super::loader;
use crate::data_parallel::{DataParallel, StepOutcome};
use crate::ddp::buffers::{self, BufferSync};
use crate::ddp::micro_batch::MicroBatch;
use crate::ddp::DdpOptions;
use crate::error::DdpError;
use crate::group::ProcessGroup;
use crate::init::Distributed;

/// One rank of a data-parallel `SupervisedTraining` (module docs).
pub struct DdpStrategy {
    member: Mutex<Member>,
    options: DdpOptions,
    /// The training device, when chosen ([`DdpStrategy::with_device`]).
    device: Option<Device>,
    rank: usize,
    local_rank: usize,
    world_size: usize,
}

/// This rank's membership: joined, then (once the device is known, in `fit`) the DDP handle.
enum Member {
    Joined(Box<Distributed>),
    Training(Box<DataParallel>),
    /// Only after a failed set-up, which ends the process.
    Gone,
}

impl DdpStrategy {
    /// Joins the job the environment describes (this project's launcher, torchrun, Slurm,
    /// Open MPI variables), or forms a job of one without them, with the default
    /// [`DdpOptions`] (PyTorch DDP's). Collective: every rank calls it (deadline: the
    /// options' timeout). On ranks other than 0 it installs a quiet global logger (warnings
    /// and errors, tagged with the rank), so that burn-train's experiment logger, installed by
    /// `launch`, stays rank 0's.
    pub fn from_env() -> Result<Self, DdpError> {
        Self::from_env_with(DdpOptions::default())
    }

    /// [`from_env`](Self::from_env) with these options (the same on every rank). Options the
    /// strategy cannot train with (ZeRO stage 3) are refused before joining, with
    /// [`DdpError::Options`] (a usage error, [`DdpError::is_usage`]).
    pub fn from_env_with(options: DdpOptions) -> Result<Self, DdpError> {
        check_options(&options)?;
        let dist = Distributed::from_env_or_standalone(options.tcp_options())?;
        Self::new(dist).with_options(options)
    }

    /// The strategy over an already formed job, with the default options.
    pub fn new(dist: Distributed) -> Self {
        let (rank, local_rank, world_size) =
            (dist.env.rank, dist.env.local_rank, dist.env.world_size);
        if rank != 0 {
            quiet_logger();
        }
        Self {
            member: Mutex::new(Member::Joined(Box::new(dist))),
            options: DdpOptions::default(),
            device: None,
            rank,
            local_rank,
            world_size,
        }
    }

    /// How gradients are synchronised (transport, ZeRO stage, compression, buckets, buffers).
    /// The same on every rank. The deadlines of an already formed job stay those it was
    /// formed with. [`DdpError::Options`] for options the strategy cannot train with (ZeRO
    /// stage 3).
    pub fn with_options(mut self, options: DdpOptions) -> Result<Self, DdpError> {
        check_options(&options)?;
        self.options = options;
        Ok(self)
    }

    /// The device this rank trains on (made autodiff when it is not; validation runs on its
    /// plain form). Without it: the device of the learner's model, except that a model on a
    /// CUDA device trains on the GPU of this rank's local rank
    /// ([`crate::cuda::local_device`], feature `cuda`).
    pub fn with_device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// How buffers (BatchNorm running statistics) are kept equal after every optimizer step:
    /// rank 0's (the default, PyTorch's `broadcast_buffers=True`), the mean, or not at all.
    pub fn with_buffer_sync(mut self, rule: Option<BufferSync>) -> Self {
        self.options.buffers = rule;
        self
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The autodiff device this rank trains on (see [`with_device`](Self::with_device)).
    fn training_device(&self, model_device: Option<Device>) -> Device {
        let device = match (&self.device, model_device) {
            (Some(device), _) => device.clone(),
            (None, Some(device)) => self.rank_device(device),
            // A model without parameters: nothing decides; the CPU.
            (None, None) => Device::flex(),
        };
        if device.is_autodiff() {
            device
        } else {
            device.autodiff()
        }
    }

    /// The model's device, or this rank's GPU for a model on a CUDA device.
    fn rank_device(&self, model_device: Device) -> Device {
        #[cfg(feature = "cuda")]
        if crate::ddp::cuda_ordinal(&model_device).is_some() {
            return Device::cuda(crate::cuda::local_device(self.local_rank)).autodiff();
        }
        let _ = self.local_rank;
        model_device
    }

    /// The DDP handle for the training `device`, made on first use (collective when it forms
    /// an NCCL group: every rank reaches `fit` together).
    fn data_parallel<'a>(
        &self,
        member: &'a mut Member,
        device: &Device,
    ) -> Result<&'a mut DataParallel, DdpError> {
        if let Member::Joined(_) = member {
            let Member::Joined(dist) = std::mem::replace(member, Member::Gone) else {
                unreachable!("matched above")
            };
            *member = Member::Training(Box::new(DataParallel::new(*dist, self.options, device)?));
        }
        match member {
            Member::Training(ddp) => Ok(&mut **ddp),
            _ => Err(DdpError::Unsupported(
                "the strategy's earlier set-up failed".into(),
            )),
        }
    }
}

/// Warnings and errors to stderr as the global subscriber of a rank that is not rank 0 (a
/// subscriber the program installed earlier is kept; the launcher tags each line with the
/// rank).
fn quiet_logger() {
    use std::io::IsTerminal;
    // burn-train's `launch` then fails to install its experiment logger here and warns that
    // it did: expected on these ranks, so that one warning is not shown.
    let filter =
        tracing_subscriber::EnvFilter::new("warn,burn_train::learner::supervised::paradigm=error");
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Refuses the options the strategy cannot train with, before any rank joins or trains: ZeRO
/// stage 3, whose sharded model burn-train's `Learner` cannot hold. Local (the options are the
/// same on every rank, so every rank refuses).
fn check_options(options: &DdpOptions) -> Result<(), DdpError> {
    if options.zero_stage.shards_parameters() {
        return Err(DdpError::Options(
            "ZeRO stage 3 is not available under the burn-train strategy: burn-train 0.22's Learner cannot hold a sharded model (Learner::load_model keeps every parameter's shape, dropping a record of another shape, and its optimizer is private, so a strategy cannot put the shards in its place). Train through the trainer engine or your own loop (DataParallel::fully_shard and micro_batch), or use ZeRO stage 2".into(),
        ));
    }
    Ok(())
}

/// Ends this rank after a failed collective (module docs: the trait has no error path).
fn fail(rank: usize, what: &str, error: impl std::fmt::Display) -> ! {
    let _ = std::io::Write::write_fmt(
        &mut std::io::stderr(),
        format_args!("[rank {rank}] burn-ddp: {what}: {error}\n"),
    );
    std::process::exit(1)
}

/// Ends this rank for an input to fix (exit code 2, as the trainer's usage errors).
fn refuse(rank: usize, error: impl std::fmt::Display) -> ! {
    let _ = std::io::Write::write_fmt(
        &mut std::io::stderr(),
        format_args!("[rank {rank}] burn-ddp: {error}\n"),
    );
    std::process::exit(2)
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

type TrainOut<M> = <M as TrainStep>::Output;
type ValidOut<M> = <M as InferenceStep>::Output;

impl<M> SupervisedLearningStrategy<M> for DdpStrategy
where
    M: LearnerModel,
    TrainOut<M>: GatherOutput,
    ValidOut<M>: GatherOutput,
{
    fn train(
        &self,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        components: TrainingComponents<M>,
    ) -> LearningResult<M> {
        let sharded = self.options.zero_stage.shards_optimizer_state();
        if sharded && components.checkpointer.is_some() {
            refuse(
                self.rank,
                "ZeRO stages 1 and 2 under the burn-train strategy cannot write burn-train's checkpoints: its Learner does not let a strategy read the optimizer state each rank holds, so rank 0's files would resume with the other ranks' state lost. Remove the checkpointer, use ZeRO stage 0, or train through the trainer engine (its checkpoints merge the shards)",
            );
        }
        // burn-train's epochs count from 1; a distributed loader's from 0. Its order in a
        // resumed epoch is then the uninterrupted run's (other loaders keep their own state).
        // `launch` has loaded the checkpoint on every rank already.
        let starting_epoch = components.checkpoint.map_or(1, |epoch| epoch + 1);
        let loader_epoch = starting_epoch as u64 - 1;
        loader::start_at_epoch(&dataloader_train, loader_epoch);
        loader::start_at_epoch(&dataloader_valid, loader_epoch);
        if self.rank == 0 {
            // burn-train's own `train` around this strategy's `fit`: its start and end events
            // and the summary with its model block, as a one-process run has them.
            return WithBurnTrainEvents(self).train(
                learner,
                dataloader_train,
                dataloader_valid,
                components,
            );
        }
        // Other ranks: no events.
        let interrupter = components.interrupter.clone();
        let (model, processor) = self.fit(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
        );
        LearningResult {
            model: model.valid(),
            renderer: processor.renderer(),
            interrupted: interrupter.interruption(),
            error: interrupter.error(),
        }
    }

    fn fit(
        &self,
        mut components: TrainingComponents<M>,
        mut learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let rank = self.rank;
        let device = self.training_device(learner.model().devices().into_iter().next());
        let mut member = match self.member.lock() {
            Ok(member) => member,
            Err(poisoned) => poisoned.into_inner(),
        };
        let ddp = match self.data_parallel(&mut member, &device) {
            Ok(ddp) => ddp,
            Err(e) if e.is_usage() => refuse(rank, e),
            Err(e) => fail(rank, "setting up the DDP step", e),
        };
        // This rank's shard (decided on the loaders as built), on this rank's device.
        let train = shard(dataloader_train, rank, self.world_size).to_device(&device);
        let valid =
            shard(dataloader_valid, rank, self.world_size).to_device(&device.clone().inner());
        self.make_replica(ddp, &mut learner, &device);

        let interrupter = components.interrupter.clone();
        let steps = StepRule {
            accumulation: components.grad_accumulation.unwrap_or(1).max(1),
            reload: ddp.zero_stage().shards_optimizer_state()
                || (self.options.buffers.is_some()
                    && buffers::buffer_elements(&learner.model()) > 0),
        };
        for epoch in starting_epoch..=components.num_epochs {
            if rank == 0 {
                tracing::info!(
                    "epoch {epoch}/{}: training on {} rank(s)",
                    components.num_epochs,
                    self.world_size
                );
            }
            let events = Events {
                rank,
                epoch,
                interrupter: &interrupter,
            };
            let processor = &mut components.event_processor;
            self.train_epoch(ddp, &mut learner, &train, processor, steps, &events);
            self.validate_epoch(ddp, &learner, &valid, processor, &events);
            events.train::<M>(processor, LearnerEvent::EndEpoch(epoch));
            if self.end_epoch(ddp, &learner, &mut components, &interrupter, epoch) {
                break;
            }
        }
        ddp.barrier()
            .unwrap_or_else(|e| fail(rank, "the final barrier", e));
        (learner.model(), components.event_processor)
    }
}

/// Rank 0's view of the strategy: burn-train's default `train` (`Start`, `fit`, `End` with the
/// summary and its model block — the block a strategy cannot fill itself) around
/// [`DdpStrategy`]'s `fit`.
struct WithBurnTrainEvents<'a>(&'a DdpStrategy);

impl<M> SupervisedLearningStrategy<M> for WithBurnTrainEvents<'_>
where
    M: LearnerModel,
    TrainOut<M>: GatherOutput,
    ValidOut<M>: GatherOutput,
{
    fn fit(
        &self,
        components: TrainingComponents<M>,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        self.0.fit(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
        )
    }
}

/// burn-train's events, sent on rank 0 only; an error of the event processor is recorded in
/// the interrupter (which stops every rank at the end of the epoch), as burn-train does.
struct Events<'a> {
    rank: usize,
    /// The epoch the events are of.
    epoch: usize,
    interrupter: &'a Interrupter,
}

impl Events<'_> {
    fn train<M: LearnerModel>(
        &self,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        event: LearnerEvent<TrainOut<M>>,
    ) {
        if self.rank == 0 {
            self.interrupter
                .fail_on_error(processor.process_train(event));
        }
    }

    fn valid<M: LearnerModel>(
        &self,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        event: LearnerEvent<ValidOut<M>>,
    ) {
        if self.rank == 0 {
            self.interrupter
                .fail_on_error(processor.process_valid(event));
        }
    }
}

/// How optimizer steps are taken in an epoch.
#[derive(Clone, Copy)]
struct StepRule {
    /// Micro-batches per optimizer step (burn-train's gradient accumulation).
    accumulation: usize,
    /// Whether the DDP step changes the model after the optimizer step (ZeRO stage 1's
    /// gathered parameters, synchronised buffers), so the learner must load it back.
    reload: bool,
}

impl DdpStrategy {
    /// Moves the learner to this rank's training `device` and gives it rank 0's weights and
    /// deterministic parameter ids, so the replicas start equal. Collective.
    fn make_replica<M: LearnerModel>(
        &self,
        ddp: &mut DataParallel,
        learner: &mut Learner<M>,
        device: &Device,
    ) {
        learner.fork(device);
        let prepared = ddp
            .prepare(learner.model())
            .unwrap_or_else(|e| fail(self.rank, "making the replicas equal", e));
        learner.load_model(prepared.into_record());
    }

    /// The end of `epoch`: rank 0 flushes its events and writes its checkpoint; then every
    /// rank learns rank 0's verdict on stopping (early stopping reads its event store; an
    /// interrupt or an error of its event processor stops every rank), which also makes the
    /// others wait for its checkpoint. Collective; true when training stops.
    fn end_epoch<M: LearnerModel>(
        &self,
        ddp: &mut DataParallel,
        learner: &Learner<M>,
        components: &mut TrainingComponents<M>,
        interrupter: &Interrupter,
        epoch: usize,
    ) -> bool {
        let rank = self.rank;
        if rank == 0 {
            if components.checkpointer.is_some() || components.early_stopping.is_some() {
                interrupter.fail_on_error(components.event_processor.flush());
            }
            if let Some(checkpointer) = &mut components.checkpointer {
                checkpointer.checkpoint(learner, epoch, &components.event_store);
            }
        }
        let stop = rank == 0
            && (interrupter.should_stop()
                || components
                    .early_stopping
                    .as_mut()
                    .is_some_and(|s| s.should_stop(epoch, &components.event_store)));
        let verdict = ddp
            .broadcast_from_rank_zero(i64::from(stop))
            .unwrap_or_else(|e| fail(rank, "waiting for rank 0 at the end of the epoch", e));
        verdict == 1
    }

    /// One epoch of training on this rank's shard: micro-batches accumulated, the learning
    /// rate scheduler and the DDP step once per optimizer step (an epoch's last, partial
    /// accumulation steps too, as burn-train's single-device epoch does), the outputs
    /// gathered on rank 0 for burn-train's metrics.
    fn train_epoch<M>(
        &self,
        ddp: &mut DataParallel,
        learner: &mut Learner<M>,
        train: &TrainLoader<M>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        steps: StepRule,
        events: &Events<'_>,
    ) where
        M: LearnerModel,
        TrainOut<M>: GatherOutput,
    {
        let rank = self.rank;
        events.train::<M>(
            processor,
            LearnerEvent::StartSplit {
                epoch_number: events.epoch,
                total_items: train.num_items() * self.world_size,
            },
        );
        let mut iter = train.iter();
        let mut iteration = 0;
        let mut accumulator = GradientsAccumulator::new();
        let mut accumulated = 0;
        loop {
            let batch = iter.next();
            match all_have(ddp.group(), batch.is_some(), "training") {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => fail(rank, "training", e),
            }
            let batch = match batch {
                Some(Ok(batch)) => batch,
                Some(Err(e)) => refuse(rank, format!("reading the training data: {e}")),
                None => break,
            };
            iteration += 1;
            let progress = iter.progress();
            let last = accumulated + 1 == steps.accumulation || progress.is_completed();
            let scope = {
                // The model's handles only for this call: a clone held over the step would
                // keep Burn from updating the parameters in place.
                let model = learner.model();
                if last {
                    // This backward may put the model's marked blocks on the wire as it goes,
                    // added to the earlier micro-batches' gradients as the accumulator adds
                    // them.
                    let earlier = (accumulated > 0).then(|| accumulator.grads());
                    let position = MicroBatch::Last {
                        earlier: earlier.as_ref(),
                        weight: 1.0,
                    };
                    let scope = ddp.micro_batch(&model, position);
                    if let Some(earlier) = earlier {
                        accumulator.accumulate(&model, earlier);
                    }
                    scope
                } else {
                    ddp.micro_batch(&model, MicroBatch::Accumulating)
                }
            };
            let output = learner.train_step(batch);
            drop(scope);
            accumulator.accumulate(&learner.model(), output.grads);
            accumulated += 1;
            if last {
                let grads: GradientsParams = accumulator.grads();
                learner.lr_step();
                optimizer_step(ddp, learner, grads, steps.reload, iteration)
                    .unwrap_or_else(|e| fail(rank, "the DDP step", e));
                accumulated = 0;
            }
            let gathered = GatherOutput::gather(Some(output.item), ddp.group(), 0)
                .unwrap_or_else(|e| fail(rank, "gathering training outputs", e));
            if let Some(item) = gathered {
                let progress = scaled(&progress, self.world_size);
                let item =
                    TrainingItem::new(item, progress, Some(iteration), Some(learner.lr_current()));
                events.train::<M>(processor, LearnerEvent::ProcessedItem(item));
            }
        }
        events.train::<M>(processor, LearnerEvent::EndSplit(events.epoch));
    }

    /// Validation of every rank's shard, the outputs gathered on rank 0.
    fn validate_epoch<M>(
        &self,
        ddp: &mut DataParallel,
        learner: &Learner<M>,
        valid: &ValidLoader<M>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        events: &Events<'_>,
    ) where
        M: LearnerModel,
        ValidOut<M>: GatherOutput,
    {
        let rank = self.rank;
        events.valid::<M>(
            processor,
            LearnerEvent::StartSplit {
                epoch_number: events.epoch,
                total_items: valid.num_items() * self.world_size,
            },
        );
        let model = learner.model().valid();
        let mut iter = valid.iter();
        let mut iteration = 0;
        loop {
            let batch = match iter.next() {
                Some(Ok(batch)) => Some(batch),
                Some(Err(e)) => refuse(rank, format!("reading the validation data: {e}")),
                None => None,
            };
            match any_has(ddp.group(), batch.is_some()) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => fail(rank, "validation", e),
            }
            iteration += 1;
            let progress = scaled(&iter.progress(), self.world_size);
            let output = batch.map(|b| InferenceStep::step(&model, b));
            let gathered = GatherOutput::gather(output, ddp.group(), 0)
                .unwrap_or_else(|e| fail(rank, "gathering validation outputs", e));
            if let Some(item) = gathered {
                let item = TrainingItem::new(item, progress, Some(iteration), None);
                events.valid::<M>(processor, LearnerEvent::ProcessedItem(item));
            }
        }
        events.valid::<M>(processor, LearnerEvent::EndSplit(events.epoch));
    }
}

/// burn-train's optimizer step inside burn-ddp's DDP step ([`DataParallel::step`]); a step
/// skipped for non-finite gradients (on every rank alike) is an error here. The learner takes
/// the model back only where the step changed it after the optimizer (`reload`: ZeRO stage
/// 1's gather, the buffer sync). Collective.
fn optimizer_step<M: LearnerModel>(
    ddp: &mut DataParallel,
    learner: &mut Learner<M>,
    grads: GradientsParams,
    reload: bool,
    iteration: usize,
) -> Result<(), DdpError> {
    let (model, outcome) = ddp.step(learner.model(), grads, |_, grads| {
        learner.optimizer_step(grads);
        learner.model()
    })?;
    if let StepOutcome::Skipped { ranks } = outcome {
        return Err(DdpError::Unsupported(format!(
            "non-finite gradients (NaN or Inf) at iteration {iteration}, first on rank(s) {ranks:?}"
        )));
    }
    if reload {
        learner.load_model(model.into_record());
    }
    Ok(())
}

/// A rank's progress as the job's: positions times the world size.
fn scaled(progress: &Progress, world: usize) -> Progress {
    Progress::new(
        progress.items_processed * world,
        progress.items_total * world,
        progress.unit.clone(),
    )
}

/// This rank's part of `loader`: a loader from [`super::DistributedDataLoaderBuilder`] as it
/// is; any other as an equal contiguous slice (module docs).
fn shard<O>(
    loader: std::sync::Arc<dyn DataLoader<O>>,
    rank: usize,
    world: usize,
) -> std::sync::Arc<dyn DataLoader<O>> {
    if world == 1 || loader::is_distributed(&loader) {
        return loader;
    }
    let each = loader.num_items() / world;
    loader.slice(rank * each, (rank + 1) * each)
}

#[cfg(test)]
mod tests;
