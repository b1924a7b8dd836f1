//! What the training loop asks of a way to step: data parallelism and pipeline stages. Plain
//! DDP, the gradient overlap and ZeRO stages 1 to 3 are one step kind, data parallelism (the
//! stages are burn-ddp's `Sharding` modes behind `DataParallel::micro_batch` and `step`).
//!
//! The loop owns the position, the plan, the schedule, the sampler, the clocks and the
//! decisions (when to log, check, save, validate; what a non-finite step means); a step kind
//! owns the model (or stage), the optimizer, the process groups, the app's metrics and how one
//! optimizer step, one checkpoint and one validation are done. Every method marked collective
//! is called by the loop at the same point on every rank of the job, so a step kind may run
//! collectives in it; each has the deadline of the groups it uses (`[distributed]
//! timeout_secs`), and a rank that misses one fails the job with the group's error.

use std::sync::Arc;

use burn::data::dataset::Dataset;
use burn_ddp::elastic::PlannedJoin;
use burn_ddp::sampler::Sample;
use burn_ddp::StepOutcome;

use super::events::HeldState;
use super::membership::{MembershipChange, Regrouped};
use super::summary::Validation;
use crate::engine::checkpoint::{Checkpoint, TrainPosition};
use crate::engine::loader::BatchStream;
use crate::engine::schedule::Schedule;
use crate::report::metrics::MetricValue;
use crate::report::timing::{PhaseClock, RankTimes, StepTime};

/// One optimizer step as the loop hands it to the step kind.
pub(crate) struct StepInput<'a> {
    /// The step's samples of this rank (or of this rank's replica).
    pub samples: &'a [Sample],
    /// The step's micro-batches in order, each with its weight (its share of the step's
    /// samples); the batch stream yields them in this order.
    pub micro_batches: Vec<(&'a [Sample], f32)>,
    /// The step's number, counted from 1 over the run (the position's step after it).
    pub number: usize,
    /// The seed of the step's randomness (dropout): the same in a resumed run.
    pub seed: u64,
    /// The learning rate of this step.
    pub lr: f64,
}

/// A way to step, for [`super::training_loop::fit`]. See the module docs for who owns what.
pub(crate) trait StepKind {
    /// One sample of the training set.
    type Item: Send + Sync + 'static;
    /// What this rank trains: the whole model, or its pipeline stage. Cloned (cheaply: Burn's
    /// tensors are shared) before a step when the survivors of a failure carry on, so that a
    /// dropped step leaves the weights it started from.
    type Module: Clone;

    /// This process's rank in the job.
    fn rank(&self) -> usize;
    /// Every process of the job.
    fn world_size(&self) -> usize;
    /// The ranks the sampler shards each epoch over (the job's world for data parallelism,
    /// the replicas of a pipeline); a step's global batch is its samples × this.
    fn data_parallel_size(&self) -> usize;
    /// The training set (this rank reads only its shard of it).
    fn train_set(&self) -> Arc<dyn Dataset<Self::Item>>;

    /// Loads the newest checkpoint every rank agrees on, if resuming, and makes the replicas
    /// equal. Collective.
    fn restore(
        &mut self,
        module: Self::Module,
    ) -> anyhow::Result<(Self::Module, Option<Checkpoint>)>;

    /// One optimizer step over `step`'s micro-batches, read from `batches`, its time added to
    /// `clock`'s phases; the outcome is the same on every rank. Collective.
    fn step(
        &mut self,
        module: Self::Module,
        batches: &mut BatchStream<Self::Item>,
        step: &StepInput<'_>,
        clock: &mut PhaseClock,
    ) -> anyhow::Result<(Self::Module, StepOutcome)>;

    /// The app's training metrics over the steps since the last call, over the job.
    /// Collective.
    fn train_metrics(
        &mut self,
        position: TrainPosition,
        lr: f64,
    ) -> anyhow::Result<Vec<MetricValue>>;

    /// Every rank's phase times, and their spread over the job. Collective.
    fn across_ranks(&mut self, ours: RankTimes) -> anyhow::Result<(StepTime, Vec<RankTimes>)>;

    /// Every rank's `ours`, in rank order. Collective.
    fn all_gather(&mut self, ours: &[f64]) -> anyhow::Result<Vec<f64>>;

    /// What this rank holds of the training state (optimizer state, gradients), counted.
    fn held_state(&mut self) -> anyhow::Result<HeldState>;

    /// Fails when the replicas no longer hold the same parameters. Collective.
    fn check_replicas(&mut self, module: &Self::Module, step: usize) -> anyhow::Result<()>;

    /// Writes a checkpoint of `position` (nothing without `checkpoint.dir`). Collective.
    fn save(
        &mut self,
        position: TrainPosition,
        module: &Self::Module,
        schedule: &Schedule,
    ) -> anyhow::Result<()>;

    /// Every validation sample once over the job; `None` without a validation set.
    /// Collective.
    fn validate(
        &mut self,
        module: &Self::Module,
        step: usize,
    ) -> anyhow::Result<Option<Validation>>;

    /// Re-forms the job's groups at a step boundary without the ranks that left or died
    /// (`change`); the rank and world size are then the new group's. Collective over the
    /// ranks that carry on. A way to step that cannot carry on refuses (the default).
    fn regroup(&mut self, change: MembershipChange<'_>) -> anyhow::Result<Regrouped> {
        let _ = change;
        anyhow::bail!("this way of stepping cannot re-form its group after a rank is lost")
    }

    /// At a step boundary after `step` optimizer steps, when ranks may join
    /// (`[fault_tolerance] on_rank_failure = "continue"`): the join due now, if any. Every
    /// rank calls it at every such boundary; not a collective. A way to step that cannot grow
    /// admits nobody (the default).
    fn joiners_due(&mut self, step: usize) -> anyhow::Result<Option<PlannedJoin>> {
        let _ = step;
        Ok(None)
    }

    /// Admits `plan`'s joiners into the job, then hands them rank 0's training state: the
    /// module (returned), the step kind's own (the optimizer's), and `loop_state` (the loop's,
    /// see [`LoopState`](super::membership::LoopState)), as the joiners'
    /// [`join`](Self::join) takes them. Collective over the grown job.
    fn admit(
        &mut self,
        module: Self::Module,
        plan: &PlannedJoin,
        loop_state: Vec<u8>,
    ) -> anyhow::Result<(Self::Module, Regrouped)> {
        let _ = (module, plan, loop_state);
        anyhow::bail!("this way of stepping cannot admit joining ranks")
    }

    /// After the survivors of a failure re-formed at different steps (`Regrouped::roll_forward`):
    /// every member takes rank 0's training state as [`join`](Self::join) does, the module
    /// (returned), the step kind's own and `loop_state`, which rank 0 sends and a member
    /// `receiving` (it was behind) gets back (the others get theirs). Collective.
    fn catch_up(
        &mut self,
        module: Self::Module,
        loop_state: Vec<u8>,
        receiving: bool,
    ) -> anyhow::Result<(Self::Module, Vec<u8>)> {
        let _ = (module, loop_state, receiving);
        anyhow::bail!("this way of stepping cannot hand its state to ranks behind it")
    }

    /// A rank that joined a training job (its group formed with the others'): takes rank 0's
    /// training state as [`admit`](Self::admit) hands it over; returns the module and the
    /// loop's state. Collective over the grown job.
    fn join(&mut self, module: Self::Module) -> anyhow::Result<(Self::Module, Vec<u8>)> {
        let _ = module;
        anyhow::bail!("this way of stepping cannot join a running job")
    }

    /// The end of the run, after the final checkpoint and validation.
    fn finish(&mut self, _position: TrainPosition) -> anyhow::Result<()> {
        Ok(())
    }
}
