//! Buffers kept equal across ranks: the float tensors of a model that the optimizer does not
//! train — BatchNorm's running mean and variance, any `RunningState`, frozen parameters.
//!
//! Each rank's forward passes update its own running statistics from its own shard of the
//! batch, so without a sync the replicas drift apart in exactly these tensors (and a checkpoint,
//! written by rank 0, holds rank 0's alone). Two rules, as [`BufferSync`] says:
//! - **broadcast** (PyTorch DDP's default, `broadcast_buffers=True`): rank 0's buffers to
//!   every rank;
//! - **average**: the mean over the ranks. For a running mean (an exponential moving average,
//!   linear in the batch means) the mean of the ranks' values is what one process with the
//!   global batch computes, when the ranks' batches are of equal size; for a running variance
//!   it is the mean of the per-rank batch variances, which leaves out the spread between the
//!   ranks' batch means.
//!
//! A buffer is recognised by what Burn tells apart: a float tensor of the (autodiff) model that
//! does not require a gradient.

use burn::module::Module;

use crate::ddp::module::{read_floats, write_floats, FloatSlot};
use crate::error::DdpError;
use crate::group::{ProcessGroup, ReduceOp};

/// How buffers are made equal across ranks (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferSync {
    /// Rank `root`'s values to every rank.
    Broadcast { root: usize },
    /// The element-wise mean over the ranks.
    Average,
}

/// Makes every buffer of `module` equal across ranks, as `rule` says. Collective (one
/// broadcast or all-reduce of all buffers together, none when the model has no buffers); the
/// model must have the same architecture on every rank. Parameters are left as they are.
pub fn sync_buffers<M, G>(module: M, group: &mut G, rule: BufferSync) -> Result<M, DdpError>
where
    M: Module,
    G: ProcessGroup,
{
    if group.world_size() == 1 {
        return Ok(module);
    }
    // A `RunningState` keeps its last update pending per thread and shows the committed value
    // to visitors; `valid()` commits it (and nothing else), so that what is read here is the
    // latest and what is written is not overwritten by a stale pending update afterwards.
    let _ = module.valid();
    let mut values = Vec::new();
    read_floats(&module, &mut values, buffers_in_order());
    if values.is_empty() {
        return Ok(module);
    }
    match rule {
        BufferSync::Broadcast { root } => group.broadcast(&mut values, root)?,
        BufferSync::Average => group.all_reduce(&mut values, ReduceOp::Avg)?,
    }
    Ok(write_floats(module, &values, buffers_in_order()))
}

/// How many buffer elements `module` has (0: nothing to sync). Local.
pub fn buffer_elements<M: Module>(module: &M) -> usize {
    let mut values = Vec::new();
    read_floats(module, &mut values, buffers_in_order());
    values.len()
}

/// Every buffer (a float tensor that requires no gradient) in visit order, one after the other.
fn buffers_in_order() -> impl FloatSlot {
    let mut next = 0;
    move |_, trained, n| {
        if trained {
            return None;
        }
        let range = next..next + n;
        next += n;
        Some(range)
    }
}

#[cfg(test)]
mod tests {
    //! Two ranks as threads over real loopback sockets, each running a BatchNorm network on
    //! its own input: the running statistics differ until synced, then follow the rule.
    use std::sync::Arc;

    use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
    use burn::prelude::*;
    use burn::tensor::TensorData;

    use super::*;
    use crate::ddp::{param_checksum, prepare_module};
    use crate::group::{TcpGroupOptions, TcpProcessGroup};
    use crate::store::{MemoryStore, Store};

    #[derive(Module, Debug)]
    struct Net {
        fc: Linear,
        norm: BatchNorm,
    }

    fn running_mean(net: &Net) -> Vec<f32> {
        net.norm
            .running_mean
            .value_sync()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
    }

    /// Each rank's (running mean before the sync, after it, weights checksum after it).
    fn run(rule: Option<BufferSync>) -> Vec<(Vec<f32>, Vec<f32>, u64, u64)> {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mut group =
                        TcpProcessGroup::new(store, rank, 2, TcpGroupOptions::default()).unwrap();
                    let device = Device::flex().autodiff();
                    let net = Net {
                        fc: LinearConfig::new(3, 4).init(&device),
                        norm: BatchNormConfig::new(4).init(&device),
                    };
                    let net = prepare_module(net, &mut group, 0).unwrap();
                    let weights = param_checksum(&net.fc);
                    let x: Vec<f32> = (0..12).map(|i| (i * (rank + 1)) as f32 * 0.3).collect();
                    let x = Tensor::<2>::from_data(TensorData::new(x, [4, 3]), &device);
                    let _ = net.norm.forward(net.fc.forward(x));
                    let before = running_mean(&net);
                    let net = match rule {
                        Some(rule) => sync_buffers(net, &mut group, rule).unwrap(),
                        None => net,
                    };
                    let after_weights = param_checksum(&net.fc);
                    assert_eq!(buffer_elements(&net), 8);
                    (before, running_mean(&net), weights, after_weights)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn broadcast_gives_rank_0s_and_average_the_mean() {
        let unsynced = run(None);
        assert_ne!(
            unsynced[0].1, unsynced[1].1,
            "the ranks' statistics must differ"
        );

        let broadcast = run(Some(BufferSync::Broadcast { root: 0 }));
        assert_eq!(broadcast[1].1, broadcast[0].0);
        assert_eq!(broadcast[0].1, broadcast[0].0);

        let average = run(Some(BufferSync::Average));
        let mean: Vec<f32> = average[0]
            .0
            .iter()
            .zip(&average[1].0)
            .map(|(a, b)| (a + b) / 2.0)
            .collect();
        for (r, (_, after, weights, after_weights)) in average.iter().enumerate() {
            for (x, m) in after.iter().zip(&mean) {
                assert!((x - m).abs() < 1e-6, "rank {r}: {after:?} vs {mean:?}");
            }
            assert_eq!(weights, after_weights, "parameters are not buffers");
        }
        assert_eq!(average[0].1, average[1].1);
    }
}
