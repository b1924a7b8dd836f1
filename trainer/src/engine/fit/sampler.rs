//! The training sampler of an epoch: one global order per epoch, sharded over the ranks.

use burn::data::dataset::Dataset;
use burn_ddp::sampler::{DistributedSampler, Sample, WeightedDistributedSampler};

use crate::app::App;
use crate::config::TrainingConfig;
use crate::error::UsageError;

/// The training sampler: uniform (PyTorch's `DistributedSampler`) or weighted
/// (`WeightedDistributedSampler`, with the app's per-sample weights, as many draws per epoch as
/// the data set has samples). Both shard one global order per epoch.
pub(crate) enum EpochSampler {
    Uniform(DistributedSampler),
    Weighted(WeightedDistributedSampler),
}

impl EpochSampler {
    /// Rank `rank` of `world`'s sampler over `train` for app `app` (a pipeline's replicas are
    /// its ranks: every stage of one replica gets the same samples).
    pub(crate) fn for_app<A: App>(
        app: &A,
        t: &TrainingConfig,
        train: &dyn Dataset<A::Item>,
        world: usize,
        rank: usize,
    ) -> anyhow::Result<Self> {
        let weights = if t.balance_classes {
            let w = app.sample_weights(train).ok_or_else(|| {
                UsageError(
                    "training.balance_classes = true, but this app gives no per-sample weights (App::sample_weights)".into(),
                )
            })?;
            Some(w)
        } else {
            None
        };
        Self::new(train.len(), t, world, rank, weights)
    }

    /// Rank `rank` of `world`'s sampler over `len` samples, weighted by `weights` if given.
    pub(crate) fn new(
        len: usize,
        t: &TrainingConfig,
        world: usize,
        rank: usize,
        weights: Option<Vec<f64>>,
    ) -> anyhow::Result<Self> {
        match weights {
            None => Ok(Self::Uniform(
                DistributedSampler::new(len, world, rank)
                    .with_seed(t.seed)
                    .with_shuffle(t.shuffle)
                    .with_drop_last(t.drop_last),
            )),
            Some(weights) => WeightedDistributedSampler::new(&weights, len, world, rank, t.seed)
                .map(Self::Weighted)
                .ok_or_else(|| {
                    anyhow::anyhow!(UsageError(
                        "training.balance_classes: no usable sample weights".into()
                    ))
                }),
        }
    }

    /// The same sampler as rank `rank` of `world`: after the job re-formed, the rest of an
    /// epoch re-sharded over the ranks left (the global order is the same at every world size).
    pub(crate) fn resharded(&self, world: usize, rank: usize) -> Self {
        match self {
            Self::Uniform(s) => Self::Uniform(DistributedSampler {
                world_size: world,
                rank,
                ..s.clone()
            }),
            Self::Weighted(s) => {
                let mut s = s.clone();
                s.world_size = world;
                s.rank = rank;
                Self::Weighted(s)
            }
        }
    }

    pub(crate) fn samples(&self, epoch: u64, consumed: usize) -> Vec<Sample> {
        match self {
            Self::Uniform(s) => s.samples(epoch, consumed),
            Self::Weighted(s) => s.samples(epoch, consumed),
        }
    }
}
