//! `[model] name = "regression"`: an MLP regressor (MSE, burn-train's `RegressionOutput`) on
//! lazily generated synthetic data, as a user's app would be written.

use std::sync::Arc;

use burn::backend::Flex;
use burn::tensor::backend::AutodiffBackend;
use burn::train::metric::LossMetric;
use models::{
    RegressionBatcher, RegressionConfig, RegressionItem, RegressionModel, SyntheticRegression,
};
use serde::{Deserialize, Serialize};

use super::{split_by_index, Named};
use crate::app::{App, AppError, Datasets, Learn, TrainSynced, ValidSynced};
use crate::metrics::Metrics;

/// The `[model] name` of this app.
pub const NAME: &str = "regression";

/// `[data]`: synthetic regression data, generated per index (nothing is held in memory).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RegressionData {
    /// Training samples.
    pub samples: usize,
    /// Validation samples (drawn from the same function, at other indices).
    pub validation_samples: usize,
    pub features: usize,
    pub targets: usize,
    pub seed: u64,
}

impl Default for RegressionData {
    fn default() -> Self {
        Self {
            samples: 2048,
            validation_samples: 512,
            features: 8,
            targets: 2,
            seed: 0,
        }
    }
}

/// The regression app.
#[derive(Debug, Clone, Copy, Default)]
pub struct RegressionApp;

impl App for RegressionApp {
    type ModelConfig = Named<RegressionConfig>;
    type DataConfig = RegressionData;
    type Item = RegressionItem;

    fn name(&self, model: &Self::ModelConfig) -> String {
        model.name.clone()
    }

    fn check(&self, model: &Self::ModelConfig, data: &RegressionData) -> Result<(), AppError> {
        if data.samples == 0 || data.features == 0 || data.targets == 0 {
            return Err(AppError::key(
                "data.samples/features/targets",
                "must each be at least 1",
            ));
        }
        model
            .config
            .check(data.features, data.targets)
            .map_err(|e| AppError(e.to_string()))
    }

    fn datasets(&self, d: &RegressionData) -> Result<Datasets<RegressionItem>, AppError> {
        let all = Arc::new(SyntheticRegression::new(
            d.samples + d.validation_samples,
            d.features,
            d.targets,
            d.seed,
        ));
        Ok(split_by_index(all, d.samples, d.validation_samples))
    }

    fn parameter_count(&self, model: &Self::ModelConfig, d: &RegressionData) -> Option<u64> {
        let lazy = model
            .config
            .init_lazy::<Flex>(d.features, d.targets, &Default::default());
        Some(models::lazy_param_count(&lazy))
    }
}

impl<B: AutodiffBackend> Learn<B> for RegressionApp {
    type Model = RegressionModel<B>;
    type ValidModel = RegressionModel<B::InnerBackend>;
    type TrainBatcher = RegressionBatcher;
    type ValidBatcher = RegressionBatcher;

    fn model(
        &self,
        model: &Self::ModelConfig,
        data: &RegressionData,
        device: &B::Device,
    ) -> Result<RegressionModel<B>, AppError> {
        Ok(model.config.init(data.features, data.targets, device))
    }

    fn batchers(
        &self,
        _model: &Self::ModelConfig,
        _data: &RegressionData,
    ) -> (RegressionBatcher, RegressionBatcher) {
        (RegressionBatcher, RegressionBatcher)
    }

    fn train_metrics(&self) -> Metrics<TrainSynced<Self, B>> {
        Metrics::new().with(LossMetric::<Flex>::new())
    }

    fn valid_metrics(&self) -> Metrics<ValidSynced<Self, B>> {
        Metrics::new().with(LossMetric::<Flex>::new())
    }
}
