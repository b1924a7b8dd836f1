//! The doctor's judgements: measured facts in, a [`Finding`] with advice out. Pure, so every
//! threshold is unit-tested beside it; [`super::probe`] and [`super::allreduce`] gather the
//! facts. Each file states the assumptions behind its thresholds (and the findings state them
//! too); the open-file, process and kernel-task limits are judged in `crate::launcher::limits`, which the
//! launcher checks too.
//!
//! | file | checks |
//! |---|---|
//! | [`resources`] | cores against ranks x threads; memory against the pre-flight's estimate |
//! | [`shm`] | `/dev/shm` against one ring file per local rank |
//! | [`connectivity`] | loopback, the route to `MASTER_ADDR`, the store's port |
//! | [`launchers`] | the launcher variables seen, and what a rank derives from them |
//! | [`output`] | the directories the job writes to |
//! | [`allreduce_run`] | the all-reduce's ranks, results and bandwidth |
//! | [`backends`] | this build's devices; the CUDA driver, GPUs and NCCL; the wgpu adapter |
//! | [`units`] | sizes and counts as the findings write them |
//!
//! [`Finding`]: crate::finding::Finding

mod allreduce_run;
mod backends;
mod connectivity;
mod launchers;
mod output;
mod resources;
mod shm;
mod units;

pub use allreduce_run::{allreduce, AllReduceRun, RankReport};
pub use backends::devices;
pub use connectivity::{loopback, network, port, PortProbe, RouteFacts};
pub use launchers::launcher;
pub use output::{output_dirs, DirState};
pub use resources::{cores, memory, CoreFacts, ThreadsFrom};
pub use shm::{dev_shm, FsSpace, RingGroups, ShmFacts};
