//! [`GatherOutput`]: a step's output rows from every rank on rank 0, so that burn-train's
//! metrics see the global batch — counts and all, as one process with that batch sees it.
//!
//! A rank without a batch this iteration (its validation shard ran out first) takes part with
//! no rows. Implemented for burn-train's `ClassificationOutput` and `RegressionOutput`; a model
//! with its own output type implements it the same way (gather each tensor by rows, the loss as
//! a mean weighted by rows).

use burn::prelude::*;
use burn::tensor::TensorData;
use burn::train::{ClassificationOutput, RegressionOutput};

use crate::error::DdpError;
use crate::group::ProcessGroup;

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
pub fn gather_rows<B: Backend, G: ProcessGroup>(
    ours: Option<Tensor<B, 2>>,
    group: &mut G,
    root: usize,
) -> Result<Option<Tensor<B, 2>>, DdpError> {
    let world = group.world_size();
    let (rows, cols, values, device) = match ours {
        Some(t) => {
            let [rows, cols] = t.dims();
            let device = t.device();
            let values = t
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .unwrap_or_default();
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
    let device = device.unwrap_or_default();
    let tensor = Tensor::from_data(TensorData::new(joined, [total, cols]), &device);
    Ok(Some(tensor))
}

/// The loss as the mean over every rank's rows: each rank's (mean) loss weighted by its rows.
fn weighted_loss<B: Backend, G: ProcessGroup>(
    loss: Option<(Tensor<B, 1>, usize)>,
    group: &mut G,
    device: &B::Device,
) -> Result<Tensor<B, 1>, DdpError> {
    let world = group.world_size();
    let (value, rows) = match loss {
        Some((loss, rows)) => {
            let v = loss
                .into_data()
                .convert::<f64>()
                .to_vec::<f64>()
                .unwrap_or_default();
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
type Parts<B> = (Tensor<B, 1>, Tensor<B, 2>, Tensor<B, 2>);

/// Gathers one output given as its parts (`None`: this rank has no rows). Collective.
fn gather_parts<B: Backend, G: ProcessGroup>(
    ours: Option<(Tensor<B, 1>, Tensor<B, 2>, Tensor<B, 2>)>,
    group: &mut G,
    root: usize,
) -> Result<Option<Parts<B>>, DdpError> {
    let (loss, output, targets) = match ours {
        Some((loss, output, targets)) => {
            let rows = output.dims()[0];
            (Some((loss, rows)), Some(output), Some(targets))
        }
        None => (None, None, None),
    };
    let device = output.as_ref().map(|t| t.device()).unwrap_or_default();
    let loss = weighted_loss(loss, group, &device)?;
    let output = gather_rows(output, group, root)?;
    let targets = gather_rows(targets, group, root)?;
    Ok(match (output, targets) {
        (Some(output), Some(targets)) => Some((loss.to_device(&output.device()), output, targets)),
        _ => None,
    })
}

impl<B: Backend> GatherOutput for ClassificationOutput<B> {
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

impl<B: Backend> GatherOutput for RegressionOutput<B> {
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
