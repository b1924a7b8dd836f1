//! The `trainer` binary's modules.
//!
//! | module | owns |
//! |---|---|
//! | [`cli`] | the command line; decides launcher / worker / tool; exit codes |
//! | [`config`] | the TOML schema, defaults and validation |
//! | [`launch`] | spawning and supervising local ranks (`--nproc-per-node`), like torchrun |
//! | [`ranklog`] | each rank's stderr, tagged and kept for the failure report |
//! | [`train`] | the training loop, top to bottom |
//! | [`checkpoint`] | rank-0 checkpoints: atomic save, manifest, resume |
//! | [`metrics`] | cross-rank averages, progress bar, metrics file |
//! | [`data`] | the digits and synthetic data sets, batching |
//! | [`tools`] | collective self-test and all-reduce benchmark |
//! | [`bench`] | the trainer's overhead and scaling benchmark |

pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod data;
pub mod launch;
pub mod metrics;
pub mod ranklog;
pub mod tools;
pub mod train;
