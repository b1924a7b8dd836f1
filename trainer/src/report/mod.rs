//! What a run reports: the rank's reporter consumes the training loop's events
//! (`crate::engine::fit::events`) into rank 0's metrics file, TensorBoard files, progress bar
//! and charts. TensorBoard files and the drawing of charts are optional parts of a build
//! (cargo features `tensorboard` and `plots`, `crate::features`): `tensorboard.rs` and
//! `plot/draw.rs`, each with its stand-in.
//!
//! | module | owns |
//! |---|---|
//! | `rank_reporter` | the consumer of the loop's events |
//! | [`metrics`] | burn-train metrics summed across ranks with counts; the progress bar and metrics file |
//! | `record` | the records of `metrics.jsonl` (the schema TensorBoard files and charts read back) |
//! | `tensorboard` | TensorBoard event files (cargo feature `tensorboard`; `tensorboard_stand_in.rs` without it) |
//! | [`plot`] | PNG charts of a run from its metrics file |

pub mod metrics;
pub mod plot;
pub(crate) mod rank_reporter;
pub(crate) mod record;

// An optional part (`crate::features`): the real module with its cargo feature, the stand-in
// with the same names without it.
#[cfg(feature = "tensorboard")]
pub(crate) mod tensorboard;
#[cfg(not(feature = "tensorboard"))]
#[path = "tensorboard_stand_in.rs"]
pub(crate) mod tensorboard;
