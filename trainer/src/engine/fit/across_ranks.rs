//! The job-wide sums the loop's reports need: the training metrics of a window and the step
//! times of every rank. Collective: every rank of the group calls them at the same point.

use burn::data::dataloader::Progress;
use burn::train::ItemLazy;
use burn_ddp::{ProcessGroup, TcpProcessGroup};

use crate::engine::checkpoint::TrainPosition;
use crate::report::metrics::{MetricValue, Metrics};
use crate::report::timing::{RankTimes, StepTime};

/// The training metrics of a `train` record: the micro-batches' `outputs` since the last one
/// (each with its samples), synced and fed to `metrics` here, then summed over every rank of
/// `group`. Collective.
pub(crate) fn train_metrics_window<I: ItemLazy>(
    metrics: &mut Metrics<I>,
    outputs: Vec<(I, usize)>,
    position: TrainPosition,
    train_len: usize,
    lr: f64,
    group: &mut impl ProcessGroup,
) -> anyhow::Result<Vec<MetricValue>> {
    let progress = Progress {
        items_processed: position.consumed,
        items_total: train_len,
        unit: None,
    };
    for (output, samples) in outputs {
        metrics.update_lazy(
            output,
            samples,
            progress.clone(),
            position.step,
            Some(lr),
            "training",
        )?;
    }
    Ok(metrics.global(group)?)
}

/// Every rank's step times, combined over the ranks (collective: one small all-gather).
/// Every rank's phase times of `group` (the job), and their spread. Collective.
pub(crate) fn across_ranks(
    group: &mut TcpProcessGroup,
    ours: RankTimes,
) -> anyhow::Result<(StepTime, Vec<RankTimes>)> {
    let row = ours.to_row();
    let mut all = vec![0.0; row.len() * group.world_size()];
    group.all_gather(&row, &mut all)?;
    let ranks: Vec<RankTimes> = all
        .chunks_exact(RankTimes::ROW)
        .map(RankTimes::from_row)
        .collect();
    Ok((StepTime::across_ranks(&ranks), ranks))
}
