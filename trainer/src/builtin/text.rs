//! `[model] name = "text_transformer"`: a small transformer text classifier (integer token ids,
//! a boolean padding mask, variable-length sequences padded per batch) on lazily generated
//! synthetic sequences, as a user's app would be written.

use std::sync::Arc;

use burn::tensor::Device;
use burn_ddp::pipeline::check_layers;
use models::{
    SyntheticText, TextBatcher, TextClassifier, TextClassifierConfig, TextClassifierStage, TextItem,
};
use serde::{Deserialize, Serialize};

use super::parts::{loss_and_accuracy, split_by_index, Named};
use crate::app::{App, AppError, Datasets, TrainItem, ValidItem};
use crate::engine::pipeline::{StageOf, StageSplit};
use crate::report::metrics::Metrics;

/// The `[model] name` of this app.
pub const NAME: &str = "text_transformer";

/// `[data]`: synthetic token sequences, generated per index.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TextData {
    /// Token ids are below this (0 is padding); at most the model's `vocab_size`.
    pub vocab_size: usize,
    pub samples: usize,
    pub validation_samples: usize,
    pub min_len: usize,
    pub max_len: usize,
    pub seed: u64,
}

impl Default for TextData {
    fn default() -> Self {
        Self {
            vocab_size: 32,
            samples: 2048,
            validation_samples: 512,
            min_len: 4,
            max_len: 24,
            seed: 0,
        }
    }
}

/// The text classification app.
#[derive(Debug, Clone, Copy, Default)]
pub struct TextApp;

impl App for TextApp {
    type ModelConfig = Named<TextClassifierConfig>;
    type DataConfig = TextData;
    type Item = TextItem;
    type Model = TextClassifier;
    type Batcher = TextBatcher;

    fn name(&self, model: &Self::ModelConfig) -> String {
        model.name.clone()
    }

    fn check(&self, model: &Self::ModelConfig, data: &TextData) -> Result<(), AppError> {
        if data.samples == 0 || data.min_len == 0 || data.min_len > data.max_len {
            return Err(AppError::key(
                "data.samples/min_len/max_len",
                "need samples >= 1 and 1 <= min_len <= max_len",
            ));
        }
        if data.vocab_size < 4 || data.vocab_size > model.config.vocab_size {
            return Err(AppError::key(
                "data.vocab_size",
                format!(
                    "must be in 4..={} (the model's vocab_size), got {}",
                    model.config.vocab_size, data.vocab_size
                ),
            ));
        }
        if data.max_len > model.config.max_len {
            return Err(AppError::key(
                "data.max_len",
                format!(
                    "{} is longer than the model's max_len {} (raise model.max_len)",
                    data.max_len, model.config.max_len
                ),
            ));
        }
        model.config.check().map_err(|e| AppError(e.to_string()))
    }

    fn datasets(&self, d: &TextData) -> Result<Datasets<TextItem>, AppError> {
        // One generator for both sets (the same task), split by index.
        let total = d.samples + d.validation_samples;
        let all = SyntheticText::new(total, d.vocab_size, d.min_len, d.max_len, d.seed)
            .map(Arc::new)
            .map_err(|e| AppError(format!("[data] {e}")))?;
        Ok(split_by_index(all, d.samples, d.validation_samples))
    }

    fn parameter_count(&self, model: &Self::ModelConfig, _data: &TextData) -> Option<u64> {
        let lazy = model.config.init_lazy(&Device::flex());
        Some(burn_ddp::parameter_count(&lazy))
    }

    fn model(
        &self,
        model: &Self::ModelConfig,
        _data: &TextData,
        device: &Device,
    ) -> Result<TextClassifier, AppError> {
        Ok(model.config.init(device))
    }

    fn batcher(
        &self,
        _model: &Self::ModelConfig,
        _data: &TextData,
        _device: &Device,
    ) -> TextBatcher {
        TextBatcher { pad_token: 0 }
    }

    fn train_metrics(&self) -> Metrics<TrainItem<Self>> {
        loss_and_accuracy()
    }

    fn valid_metrics(&self) -> Metrics<ValidItem<Self>> {
        loss_and_accuracy()
    }
}

/// How the text classifier is cut into pipeline stages: the embeddings on the first stage, the
/// encoder layers spread in order, the head on the last.
pub fn stages() -> StageSplit<TextApp> {
    StageSplit::new(
        |model: &Named<TextClassifierConfig>, _data: &TextData, which: StageOf, device: &Device| {
            let layers = model.config.layers;
            if check_layers(layers, which.stages).is_err() {
                return Err(AppError::key(
                    "model.layers",
                    format!(
                        "{layers} encoder layers cannot be cut into distributed.pipeline_stages = {} stages (each needs at least one layer): raise model.layers or lower pipeline_stages",
                        which.stages
                    ),
                ));
            }
            Ok(model.config.init_stage(which.stage, which.stages, device))
        },
        TextClassifierStage::classification,
    )
}
