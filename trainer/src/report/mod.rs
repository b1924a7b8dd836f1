//! What a run reports: the rank's reporter consumes the training loop's events
//! (`crate::engine::fit::events`) into rank 0's metrics file, TensorBoard files, progress bar
//! and charts. TensorBoard files and the drawing of charts are optional parts of a build,
//! in `crate::backend` (cargo features `tensorboard` and `plots`).
//!
//! | module | owns |
//! |---|---|
//! | `rank_reporter` | the consumer of the loop's events |
//! | [`metrics`] | burn-train metrics summed across ranks with counts; the progress bar and metrics file |
//! | `record` | the records of `metrics.jsonl` (the schema TensorBoard files and charts read back) |
//! | [`plot`] | PNG charts of a run from its metrics file |

pub mod metrics;
pub mod plot;
pub(crate) mod rank_reporter;
pub(crate) mod record;
