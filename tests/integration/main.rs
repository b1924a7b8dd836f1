//! End-to-end tests: real `trainer` processes, real sockets on loopback, real files.
//!
//! One test binary (each links all of Burn). Every child process runs under a watchdog, so a
//! hang fails the test with the child's output instead of blocking CI.

mod common;

mod buffers;
mod burn_train;
mod collectives;
#[cfg(feature = "cuda")]
mod cuda;
mod data_sources;
mod doctor;
mod faults;
mod launch;
mod launchers;
mod multinode;
mod overlap;
mod pipeline;
mod plots;
mod reference_models;
mod resume;
mod slurm;
mod survivors;
mod tensorboard;
mod tiers;
mod torchrun;
mod training;
mod user_crate;
#[cfg(feature = "wgpu")]
mod wgpu;
mod zero;
