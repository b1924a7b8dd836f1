//! The optimizer `[optimizer]` names.

use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer, SgdConfig};

use crate::config::{OptimizerConfig, OptimizerName};

/// The optimizer `[optimizer]` names, for any module (the whole model, or a pipeline stage).
pub(crate) fn optimizer(o: &OptimizerConfig) -> ModuleOptimizer {
    let decay = (o.weight_decay > 0.0).then(|| WeightDecayConfig::new(o.weight_decay as f32));
    match o.name {
        OptimizerName::Sgd => {
            let momentum = (o.momentum > 0.0).then(|| {
                MomentumConfig::new()
                    .with_momentum(o.momentum)
                    .with_dampening(0.0)
            });
            SgdConfig::new()
                .with_momentum(momentum)
                .with_weight_decay(decay)
                .init()
        }
        OptimizerName::Adam => AdamConfig::new().with_weight_decay(decay).init(),
        OptimizerName::AdamW => AdamWConfig::new()
            .with_weight_decay(o.weight_decay as f32)
            .init(),
    }
}
