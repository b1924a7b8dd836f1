//! What a run reports: the rank's reporter consumes the training loop's events
//! (`crate::engine::fit::events`) into rank 0's metrics file, TensorBoard files, progress bar
//! and charts.
//!
//! | module | owns |
//! |---|---|
//! | `rank_reporter` | the consumer of the loop's events |
//! | [`metrics`] | burn-train metrics summed across ranks with counts; the progress bar and metrics file |
//! | `record` | the records of `metrics.jsonl` (the schema TensorBoard files and charts read back) |
//! | `tensorboard` | the metrics records as TensorBoard event files (`output.tensorboard`) |
//! | [`plot`] | PNG charts of a run from its metrics file |

pub mod metrics;
pub mod plot;
pub(crate) mod rank_reporter;
pub(crate) mod record;
pub(crate) mod tensorboard;
