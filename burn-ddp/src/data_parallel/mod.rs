//! [`DataParallel`]: the one home of the DDP step — the handle a rank holds to train with
//! the others (what Accelerate's `Accelerator` or a DDP-wrapped module is to PyTorch). The
//! `trainer` engine's loop, the burn-train strategy ([`crate::learner::DdpStrategy`]) and
//! own-loop programs all train through it.
//!
//! ```text
//! let mut ddp = DataParallel::from_env(DdpOptions::default(), &device)?;
//! let mut model = ddp.prepare(model)?;                  // replicas equal (rank 0's weights)
//! for epoch in 0..epochs {
//!     for batch in ddp.shard(train.len(), seed, epoch).chunks(b) {   // this rank's samples
//!         let scope = ddp.micro_batch(&model, MicroBatch::ONLY); // overlap armed; stage 3 gathers
//!         let loss = /* your forward and loss */;
//!         let grads = GradientsParams::from_grads(loss.backward(), &model);
//!         drop(scope);
//!         // The whole DDP step: mean gradients over all ranks, the verdict on NaN/Inf (the
//!         // same on every rank), your optimizer, ZeRO 1/2's gather, the buffers.
//!         let (next, outcome) = ddp.step(model, grads, |m, g| optim.step(lr, m, g))?;
//!         model = next;
//!         if let StepOutcome::Skipped { ranks } = outcome { /* stop, or go on: all ranks alike */ }
//!     }
//!     let [loss_sum, n] = ddp.sum([loss_sum, n])?;      // exact global metrics
//! }
//! ddp.barrier()?;
//! ```
//! A compiled, runnable version: `burn-ddp/examples/own_loop.rs` (a program that uses
//! `burn` and `burn-ddp` only, and burn-store to write its weights).
//!
//! Every method marked *collective* must be called by every rank, in the same order, with
//! arguments that agree where it says so; each has a deadline ([`DdpOptions::timeout`], or the
//! one it is given) after which it fails naming the ranks that did not arrive.
//!
//! | file | owns |
//! |---|---|
//! | `handle` | [`DataParallel`]: joining, preparing the model, sharding it (stage 3), what runs before a micro-batch's backward ([`DataParallel::micro_batch`]) and the step after it |
//! | `collectives` | the rest a rank does with the others: its samples, exact sums, the replica check, rank 0's actions, the barrier |
//! | `outcome` | [`StepOutcome`] |
//! | `rank_zero` | rank 0's actions the others wait for through the store, with a heartbeat that tells a slow disk from a dead rank 0 |
//! | `regroup` | the groups formed again among the ranks that carry on ([`DataParallel::regroup`], [`DataParallel::regroup_after_failure`]; [`crate::elastic`]) |
//! | `admission` | processes joining a job that trains: the members admit them at a step boundary and form the grown group ([`DataParallel::joiners_due`], [`DataParallel::admit_joiners`]; the joiner's side is [`Distributed::join`](crate::Distributed::join) in `joining.rs`), and hand them the state as bytes |

mod admission;
mod collectives;
mod handle;
mod outcome;
mod rank_zero;
mod regroup;

pub use handle::DataParallel;
pub use outcome::StepOutcome;
