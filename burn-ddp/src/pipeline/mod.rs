//! Pipeline parallelism (issue #25), first step: the pure plans every later part follows.
//!
//! A model too big for one device is split into `P` consecutive **stages**; each rank holds
//! one stage of one pipeline, and `R` replicas of the pipeline train data-parallel, so
//! `world = P × R`. A global batch is cut into `m` **micro-batches**; activations flow forward
//! from stage `s` to `s + 1`, the gradients of those activations flow back, and the last
//! stage computes the loss. One pipeline step is one optimizer step over the global batch.
//!
//! | module | owns |
//! |---|---|
//! | [`layout`] | which rank runs which stage of which replica; a stage's neighbours and its replica group (pure) |
//! | [`frame`] | the bytes of one activation or gradient between neighbouring stages (pure) |
//! | [`link`] | [`StageLinks`]: a stage's TCP connections to its neighbours — plan check at set-up, sends that never wait for the receiver, receives with a deadline that name a lost or silent neighbour |
//! | [`schedule`] | the order of forward and backward passes on each stage, GPipe or 1F1B, and a simulation that proves a schedule runs to the end and measures its bubble (pure) |
//!
//! Not built yet: shared memory and NCCL send/recv for the links, the stage runner (a model
//! split into stages, trained with a schedule), the engine's `[distributed] pipeline_stages`,
//! stage checkpoints.

pub mod frame;
pub mod layout;
pub mod link;
pub mod schedule;

pub use layout::{LayoutError, PipelineLayout, StagePosition};
pub use link::{LinkError, StageLinks};
pub use schedule::{
    simulate, stage_actions, theoretical_bubble, Action, PipelineSchedule, Simulation,
};
