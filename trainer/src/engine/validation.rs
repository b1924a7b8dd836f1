//! Validation: every validation sample exactly once across the ranks, through the model
//! without autodiff. The training loop validates with it, and so does the `eval` command.

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::Progress;
use burn::data::dataset::Dataset;
use burn::tensor::Device;
use burn::train::InferenceStep;
use burn_ddp::sampler::DistributedSampler;

use crate::app::AppError;
use crate::report::metrics::Metrics;

/// Feeds this rank's evaluation shard of `items` through `model` to `metrics` (local); returns
/// the shard's size. `model` is the `valid()` copy and `device` the device without autodiff
/// the batches are made on.
#[allow(clippy::too_many_arguments)]
pub(crate) fn evaluate_shard<I, VM, Bt>(
    model: &VM,
    items: &dyn Dataset<I>,
    batcher: &Bt,
    metrics: &mut Metrics<VM::Output>,
    rank: usize,
    world: usize,
    device: &Device,
    batch_size: usize,
) -> anyhow::Result<usize>
where
    VM: InferenceStep,
    Bt: Batcher<I, VM::Input>,
{
    let indices = DistributedSampler::new(items.len(), world, rank).eval_indices();
    for (k, chunk) in indices.chunks(batch_size.max(1)).enumerate() {
        let batch_items = chunk
            .iter()
            .map(|&i| crate::app::read_item(items, i, "validation set").map_err(AppError))
            .collect::<Result<Vec<_>, _>>()?;
        let batch = batcher.batch(batch_items, device);
        let progress = Progress {
            items_processed: ((k + 1) * batch_size).min(indices.len()),
            items_total: indices.len(),
            unit: None,
        };
        metrics.update_lazy(
            model.step(batch),
            chunk.len(),
            progress,
            k,
            None,
            "validation",
        )?;
    }
    Ok(indices.len())
}
