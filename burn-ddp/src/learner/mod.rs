//! burn-train integration (feature `burn-train`): a Burn user's `SupervisedTraining` program
//! goes data-parallel across processes by changing its strategy and loader-builder lines.
//!
//! ```text
//!  - let loader = DataLoaderBuilder::new(batcher).batch_size(64).shuffle(42).build(train);
//!  + let loader = DistributedDataLoaderBuilder::new(batcher).batch_size(64).shuffle(42).build(train);
//!    SupervisedTraining::new(dir, loader, valid_loader)
//!  +     .with_training_strategy(TrainingStrategy::Custom(Arc::new(DdpStrategy::from_env()?)))
//!        .metrics((AccuracyMetric::new(), LossMetric::new()))
//!        .with_default_checkpointers()
//!        .num_epochs(10)
//!        .launch(learner);
//! ```
//! then `trainer launch --nproc-per-node 2 -- ./my-training` (or torchrun, srun, mpirun).
//!
//! - [`loader`]: [`DistributedDataLoaderBuilder`], each rank's shard of one global order per
//!   epoch.
//! - [`gather`]: [`GatherOutput`], step outputs gathered on rank 0 for burn-train's metrics.
//! - [`strategy`]: [`DdpStrategy`], the `SupervisedLearningStrategy`.

pub mod gather;
pub mod loader;
pub mod strategy;

pub use gather::GatherOutput;
pub use loader::DistributedDataLoaderBuilder;
pub use strategy::DdpStrategy;
