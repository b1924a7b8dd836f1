//! [`GatherOutput`]: a step's output rows from every rank on rank 0, so that burn-train's
//! metrics see the global batch — counts and all, as one process with that batch sees it.
//!
//! A rank without a batch this iteration (its validation shard ran out first) takes part with
//! no rows. Implemented for burn-train's `ClassificationOutput`,
//! `MultiLabelClassificationOutput` and `RegressionOutput`; a model with its own output type
//! implements it the same way (gather each tensor by rows, the loss as a mean weighted by
//! rows). burn-train's `SequenceOutput` is not: batches on different ranks may have different
//! sequence lengths, and padding them would change what its metrics count.

use burn::prelude::*;
use burn::tensor::TensorData;
use burn::train::{ClassificationOutput, MultiLabelClassificationOutput, RegressionOutput};

use crate::error::DdpError;
use crate::group::ProcessGroup;
use crate::host_values::host_values;

/// A step output that can be gathered on rank 0. Collective.
pub trait GatherOutput: Sized {
    /// Every rank's rows (this rank's `ours`, or none), concatenated in rank order on `root`
    /// (`Some` there when any rank had rows, `None` elsewhere).
    fn gather<G: ProcessGroup>(
        ours: Option<Self>,
        group: &mut G,
        root: usize,
    ) -> Result<Option<Self>, DdpError>;
}

/// Rows of a 2-D float tensor from every rank (a rank without rows passes `None`); on `root`,
/// the concatenation in rank order.
///
/// The rows come back on the device of `root`'s own rows (without autodiff), or on Burn's CPU
/// device (`Device::flex()`) when `root` had none.
pub fn gather_rows<G: ProcessGroup>(
    ours: Option<Tensor<2>>,
    group: &mut G,
    root: usize,
) -> Result<Option<Tensor<2>>, DdpError> {
    let world = group.world_size();
    let (rows, cols, values, device) = match ours {
        Some(t) => {
            let [rows, cols] = t.dims();
            let device = t.device().without_autodiff();
            let data = t
                .try_into_data()
                .map_err(|e| DdpError::Device(format!("reading a model output failed: {e:?}")))?;
            let values = host_values::<f32>(data).map_err(|e| {
                DdpError::Mismatch(format!("model outputs must be float tensors: {e:?}"))
            })?;
            (rows, cols, values, Some(device))
        }
        None => (0, 0, Vec::new(), None),
    };
    let mut shapes = vec![0i64; 2 * world];
    group.all_gather(&[rows as i64, cols as i64], &mut shapes)?;
    let counts: Vec<usize> = shapes.iter().step_by(2).map(|&n| n as usize).collect();
    let cols = shapes.iter().skip(1).step_by(2).copied().max().unwrap_or(0) as usize;
    let max_rows = counts.iter().copied().max().unwrap_or(0);
    if max_rows == 0 {
        return Ok(None);
    }
    let mut padded = values;
    padded.resize(max_rows * cols, 0.0);
    let mut all = vec![0.0f32; world * max_rows * cols];
    group.all_gather(&padded, &mut all)?;
    if group.rank() != root {
        return Ok(None);
    }
    let total: usize = counts.iter().sum();
    let mut joined = Vec::with_capacity(total * cols);
    for (r, &n) in counts.iter().enumerate() {
        let start = r * max_rows * cols;
        joined.extend_from_slice(&all[start..start + n * cols]);
    }
    let device = device.unwrap_or_else(Device::flex);
    let tensor = Tensor::from_data(TensorData::new(joined, [total, cols]), &device);
    Ok(Some(tensor))
}

/// The loss as the mean over every rank's rows: each rank's (mean) loss weighted by its rows.
fn weighted_loss<G: ProcessGroup>(
    loss: Option<(Tensor<1>, usize)>,
    group: &mut G,
    device: &Device,
) -> Result<Tensor<1>, DdpError> {
    let world = group.world_size();
    let (value, rows) = match loss {
        Some((loss, rows)) => {
            let data = loss
                .try_into_data()
                .map_err(|e| DdpError::Device(format!("reading the loss failed: {e:?}")))?;
            let v = host_values::<f64>(data).map_err(|e| {
                DdpError::Mismatch(format!("the loss must be a float tensor: {e:?}"))
            })?;
            (v.first().copied().unwrap_or(0.0), rows)
        }
        None => (0.0, 0),
    };
    let mut all = vec![0.0f64; 2 * world];
    group.all_gather(&[value * rows as f64, rows as f64], &mut all)?;
    let sum: f64 = all.iter().step_by(2).sum();
    let rows: f64 = all.iter().skip(1).step_by(2).sum();
    let mean = if rows > 0.0 { sum / rows } else { 0.0 };
    Ok(Tensor::from_data(
        TensorData::new(vec![mean as f32], [1]),
        device,
    ))
}

/// A gathered output's parts: the loss over every rank's rows, and the outputs and targets
/// (as 2-D float rows) concatenated, on `root` when any rank had rows.
type Parts = (Tensor<1>, Tensor<2>, Tensor<2>);

/// Gathers one output given as its parts (`None`: this rank has no rows). Collective.
fn gather_parts<G: ProcessGroup>(
    ours: Option<Parts>,
    group: &mut G,
    root: usize,
) -> Result<Option<Parts>, DdpError> {
    let (loss, output, targets) = match ours {
        Some((loss, output, targets)) => {
            let rows = output.dims()[0];
            (Some((loss, rows)), Some(output), Some(targets))
        }
        None => (None, None, None),
    };
    let device = output
        .as_ref()
        .map(|t| t.device().without_autodiff())
        .unwrap_or_else(Device::flex);
    let loss = weighted_loss(loss, group, &device)?;
    let output = gather_rows(output, group, root)?;
    let targets = gather_rows(targets, group, root)?;
    Ok(match (output, targets) {
        (Some(output), Some(targets)) => Some((loss.to_device(&output.device()), output, targets)),
        _ => None,
    })
}

impl GatherOutput for ClassificationOutput {
    fn gather<G: ProcessGroup>(
        ours: Option<Self>,
        group: &mut G,
        root: usize,
    ) -> Result<Option<Self>, DdpError> {
        let parts = ours.map(|o| {
            let rows = o.output.dims()[0];
            // Class indices travel as f32: exact below 2^24 classes.
            (o.loss, o.output, o.targets.float().reshape([rows, 1]))
        });
        Ok(
            gather_parts(parts, group, root)?.map(|(loss, output, targets)| {
                let rows = targets.dims()[0];
                ClassificationOutput {
                    loss,
                    output,
                    targets: targets.reshape([rows]).round().int(),
                }
            }),
        )
    }
}

impl GatherOutput for MultiLabelClassificationOutput {
    fn gather<G: ProcessGroup>(
        ours: Option<Self>,
        group: &mut G,
        root: usize,
    ) -> Result<Option<Self>, DdpError> {
        // The 0/1 labels travel as f32 rows, exactly.
        let parts = ours.map(|o| (o.loss, o.output, o.targets.float()));
        Ok(
            gather_parts(parts, group, root)?.map(|(loss, output, targets)| {
                MultiLabelClassificationOutput {
                    loss,
                    output,
                    targets: targets.round().int(),
                }
            }),
        )
    }
}

impl GatherOutput for RegressionOutput {
    fn gather<G: ProcessGroup>(
        ours: Option<Self>,
        group: &mut G,
        root: usize,
    ) -> Result<Option<Self>, DdpError> {
        let parts = ours.map(|o| (o.loss, o.output, o.targets));
        Ok(
            gather_parts(parts, group, root)?.map(|(loss, output, targets)| RegressionOutput {
                loss,
                output,
                targets,
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    //! Three ranks as threads over real loopback sockets, with 2, 0 and 3 rows.
    use std::sync::Arc;

    use super::*;
    use crate::group::{TcpGroupOptions, TcpProcessGroup};
    use crate::store::{MemoryStore, Store};

    const ROWS: [usize; 3] = [2, 0, 3];

    fn on_three_ranks<R: Send + 'static>(
        body: impl Fn(usize, &mut TcpProcessGroup) -> R + Send + Sync + 'static,
    ) -> Vec<R> {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let body = Arc::new(body);
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let (store, body) = (store.clone(), body.clone());
                std::thread::spawn(move || {
                    let mut group =
                        TcpProcessGroup::new(store, rank, 3, TcpGroupOptions::default()).unwrap();
                    body(rank, &mut group)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// Rank `rank`'s rows: output `[rank, row]`, labels `row % 2`, `(row + rank) % 2`; loss
    /// `rank + 1`.
    fn multi_label(rank: usize) -> Option<MultiLabelClassificationOutput> {
        let rows = ROWS[rank];
        if rows == 0 {
            return None;
        }
        let device = Device::flex();
        let output: Vec<f32> = (0..rows).flat_map(|r| [rank as f32, r as f32]).collect();
        let targets: Vec<i64> = (0..rows)
            .flat_map(|r| [(r % 2) as i64, ((r + rank) % 2) as i64])
            .collect();
        Some(MultiLabelClassificationOutput {
            loss: Tensor::from_data(TensorData::new(vec![rank as f32 + 1.0], [1]), &device),
            output: Tensor::from_data(TensorData::new(output, [rows, 2]), &device),
            targets: Tensor::from_data(TensorData::new(targets, [rows, 2]), &device),
        })
    }

    #[test]
    fn multi_label_outputs_arrive_on_rank_0_in_rank_order_with_the_row_weighted_loss() {
        let results = on_three_ranks(|rank, group| {
            MultiLabelClassificationOutput::gather(multi_label(rank), group, 0)
                .unwrap()
                .map(|o| {
                    (
                        o.loss.into_data().try_to_vec::<f32>().unwrap(),
                        o.output.dims(),
                        o.output.into_data().try_to_vec::<f32>().unwrap(),
                        o.targets
                            .into_data()
                            .convert::<i64>()
                            .try_to_vec::<i64>()
                            .unwrap(),
                    )
                })
        });
        assert!(
            results[1].is_none() && results[2].is_none(),
            "only the root"
        );
        let (loss, dims, output, targets) = results[0].clone().expect("rank 0 gets every row");
        // (2 rows x loss 1 + 3 rows x loss 3) / 5 rows.
        assert!((loss[0] - 11.0 / 5.0).abs() < 1e-6, "{loss:?}");
        assert_eq!(dims, [5, 2]);
        assert_eq!(output, vec![0., 0., 0., 1., 2., 0., 2., 1., 2., 2.]);
        assert_eq!(targets, vec![0, 0, 1, 1, 0, 0, 1, 1, 0, 0]);
    }

    #[test]
    fn classification_outputs_keep_their_class_indices() {
        let results = on_three_ranks(|rank, group| {
            let rows = ROWS[rank];
            let device = Device::flex();
            let ours = (rows > 0).then(|| ClassificationOutput {
                loss: Tensor::from_data(TensorData::new(vec![1.0f32], [1]), &device),
                output: Tensor::zeros([rows, 4], &device),
                targets: Tensor::from_data(
                    TensorData::new(
                        (0..rows as i64).map(|r| r + 10 * rank as i64).collect(),
                        [rows],
                    ),
                    &device,
                ),
            });
            ClassificationOutput::gather(ours, group, 0)
                .unwrap()
                .map(|o| {
                    o.targets
                        .into_data()
                        .convert::<i64>()
                        .try_to_vec::<i64>()
                        .unwrap()
                })
        });
        assert_eq!(results[0], Some(vec![0, 1, 20, 21, 22]));
    }
}
