//! Pipeline parallelism (issue #25): the plans, the links between stages, one pipeline step of
//! one stage and the handle a program holds.
//!
//! A model too big for one device is split into `P` consecutive **stages**; each rank holds
//! one stage of one pipeline, and `R` replicas of the pipeline train data-parallel, so
//! `world = P × R`. A global batch is cut into `m` **micro-batches**; activations flow forward
//! from stage `s` to `s + 1`, the gradients of those activations flow back, and the last
//! stage computes the loss. One pipeline step is one optimizer step over the global batch.
//!
//! | module | owns |
//! |---|---|
//! | [`layout`] | which rank runs which stage of which replica; a stage's neighbours and its replica group; which layers each stage holds; the rules that the stages divide the world and the model has a layer per stage (pure) |
//! | [`handle`] | [`PipelineParallel`], the handle a program holds: its stage and replica, the links, the DDP step over its stage's replicas |
//! | [`frame`] | the bytes of one activation or gradient between neighbouring stages (pure) |
//! | [`link`] | [`StageLinks`]: a stage's TCP connections to its neighbours — plan check at set-up, sends that never wait for the receiver, receives with a deadline that name a lost or silent neighbour |
//! | [`stage`] | [`PipelineStage`], the user's contract for a stage, and [`pipeline_step`]: one step of one stage through a schedule, activations and their gradients exchanged, parameter gradients accumulated over the micro-batches |
//! | [`schedule`] | the order of forward and backward passes on each stage, GPipe or 1F1B, and a simulation that proves a schedule runs to the end and measures its bubble (pure) |
//!
//! Pipeline × data parallel: each stage's replicas average their gradients with the DDP step
//! on a sub-group — `DataParallel::new(world.sub_group(&layout.replica_group(rank), ..)?, ..)`
//! (tested: 2 stages × 2 replicas equal one process with the whole model and batch).
//!
//! The engine's `[distributed] pipeline_stages` (trainer's `pipeline` module) runs an app's
//! stages with this handle, its checkpoints per stage. Not built yet: shared memory and NCCL
//! send/recv for the links (activations travel over TCP, as f32).

pub mod frame;
pub mod handle;
pub mod layout;
pub mod link;
pub mod schedule;
pub mod stage;

pub use handle::{PipelineConfig, PipelineError, PipelineParallel, StageStep};
pub use layout::{check_layers, stage_layers, LayoutError, PipelineLayout, StagePosition};
pub use link::{LinkError, StageLinks};
pub use schedule::{
    simulate, stage_actions, theoretical_bubble, Action, PipelineSchedule, Simulation,
};
pub use stage::{
    pipeline_forward, pipeline_step, pipeline_step_weighted, pipeline_step_with_outputs,
    PipelineStage, StageError, StepPlan, StepResult,
};
