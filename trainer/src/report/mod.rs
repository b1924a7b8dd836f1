//! What a run reports, below the engine that reports it: the metrics summed across ranks, the
//! step times, the records of the metrics file, TensorBoard files and charts. The engine's
//! rank reporter (`crate::engine::fit::rank_reporter`) consumes the training loop's events
//! into them; nothing here imports the engine. TensorBoard files and the drawing of charts are optional parts of a build
//! (cargo features `tensorboard` and `plots`, `crate::features`): `tensorboard.rs` and
//! `plot/draw.rs`, each with its stand-in.
//!
//! | module | owns |
//! |---|---|
//! | [`metrics`] | burn-train metrics summed across ranks with counts; the progress bar and metrics file |
//! | `record` | the records of `metrics.jsonl` (the schema TensorBoard files and charts read back) |
//! | `timing` | where each step's time goes, per rank and across ranks (pure; the loop's clock) |
//! | `tensorboard` | TensorBoard event files (cargo feature `tensorboard`; `tensorboard_stand_in.rs` without it) |
//! | [`plot`] | PNG charts of a run from its metrics file |

pub mod metrics;
pub mod plot;
pub(crate) mod record;
pub(crate) mod timing;

// An optional part (`crate::features`): the real module with its cargo feature, the stand-in
// with the same names without it.
#[cfg(feature = "tensorboard")]
pub(crate) mod tensorboard;
#[cfg(not(feature = "tensorboard"))]
#[path = "tensorboard_stand_in.rs"]
pub(crate) mod tensorboard;
