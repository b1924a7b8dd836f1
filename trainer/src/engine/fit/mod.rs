//! The engine's training loop, written once, over step kinds.
//!
//! | file | what |
//! |---|---|
//! | [`training_loop`] | the loop, for any [`StepKind`](step_kind::StepKind): restore, set-up, each epoch's optimizer steps, after-step (log, replica check, checkpoint), validation, finish |
//! | [`step_kind`] | the contract of a way to step: what the loop asks of data parallelism (one step kind for plain DDP, the overlap and ZeRO stages 1 to 3, burn-ddp's `Sharding` modes) and of pipeline stages |
//! | [`data_parallel`] | the entry that trains an [`App`](crate::app::App) data-parallel: join the job, run the loop, rank 0's closing lines |
//! | [`data_parallel_steps`] | the data-parallel step kind (burn-ddp's `DataParallel::step`, its checkpoints, validation, and the membership changes) |
//! | [`membership_round`] | the loop's one membership entry point, at every step boundary and after a failed step: a scripted leave, the survivors of a failure, joiners; the change applied to the loop in one place |
//! | [`membership`] | what the loop needs when the job's membership changes at a step boundary (`[fault_tolerance] on_rank_failure = "continue"`): why, what the step kind reports, which errors are the loss of peers |
//! | [`run_end`] | the end of the run: step times over the ranks, the final checkpoint and validation, the `Finished` event, the summary |
//! | [`events`] | what the loop reports, as events; the loop knows no file and no progress bar ([`rank_reporter`] consumes them) |
//! | [`rank_reporter`] | the rank's consumer of the events: rank 0's metrics file and TensorBoard files, the progress bar, the sample log, the charts at the end (what it writes is `crate::report`'s) |
//! | [`sampler`] | the epoch's sampler: uniform (`DistributedSampler`) or weighted |
//! | [`summary`] | what a finished run reports, and the non-finite verdict's error |
//! | [`optimizer`] | the optimizer `[optimizer]` names |
//! | [`across_ranks`] | the job-wide sums the loop's reports need (training metrics, step times) |
//!
//! A run, read top to bottom:
//!
//! 1. **join the job** — one process or one rank of many (launcher, torchrun, SLURM); ranks
//!    check that they run the same config ([`data_parallel::start`]);
//! 2. **open the data** — the app's data sets, once per rank; only this rank's shard is read;
//! 3. **build the model** (or this rank's pipeline stage), **restore** the newest checkpoint if
//!    there is one, and make replicas equal (the step kind's `restore`);
//! 4. **for each epoch** ([`training_loop`]): the sampler gives this rank its shard of the
//!    epoch's global order (skipping what a restored checkpoint already consumed); each
//!    optimizer step is the step kind's `step` over `accumulation_steps` micro-batches; then
//!    what the [`StepPlan`](crate::engine::plan::StepPlan) asks for: a `train` line, a replica check, a
//!    checkpoint, validation on every validation sample exactly once.
//!
//! No `cfg(feature)` here: devices live in [`crate::engine::device`], the gradient path in
//! `burn_ddp::DataParallel`, which chooses host staging or NCCL from the device.

pub(crate) mod across_ranks;
pub(crate) mod data_parallel;
pub(crate) mod data_parallel_steps;
pub(crate) mod events;
pub(crate) mod membership;
pub(crate) mod membership_round;
pub(crate) mod optimizer;
pub(crate) mod rank_reporter;
pub(crate) mod run_end;
pub(crate) mod sampler;
pub(crate) mod step_kind;
pub(crate) mod summary;
pub(crate) mod training_loop;

pub use data_parallel::{
    ended_before_joining, job_ended, start, train, RankStart, TIMELINE_HEADING,
};
pub use summary::{Summary, Validation};
