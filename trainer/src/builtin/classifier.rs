//! The digits classifiers (`[model] name = "mlp" | "cnn"`) as an app of the engine: the
//! vendored UCI digits or synthetic data, cross-entropy, loss and accuracy metrics.

use std::path::PathBuf;
use std::sync::Arc;

use burn::backend::Flex;
use burn::data::dataset::{Dataset, InMemDataset};
use burn::tensor::backend::AutodiffBackend;
use models::{DigitsModel, InputShape};
use serde::{Deserialize, Serialize};

use crate::app::{App, AppError, Datasets, Learn, TrainSynced, ValidSynced};
use crate::data::{self, ClassificationBatcher, ClassificationItem};
use crate::metrics::Metrics;

/// `[model]`: `name` picks the model from the registry; the other keys are its options
/// (checked by the model, naming any unknown key).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ModelSection {
    pub name: String,
    #[serde(flatten)]
    pub options: toml::Table,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum DataSource {
    /// The vendored UCI digits (8x8 images, 10 classes).
    #[default]
    Digits,
    /// Random data of the configured shape, for benchmarks.
    Synthetic,
}

/// `[data]` of the classifiers. One default per field, in `Default`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    pub source: DataSource,
    /// The digits file (relative paths are relative to the working directory).
    pub path: PathBuf,
    /// Fraction held out for validation, after a seeded shuffle (0: no validation set).
    pub validation_fraction: f64,
    /// Seed of the train/validation split (fixed, independent of the training seed).
    pub split_seed: u64,
    /// Synthetic data only: number of samples, features and classes.
    pub samples: usize,
    pub features: usize,
    pub classes: usize,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            source: DataSource::Digits,
            path: PathBuf::from("data/digits.csv.gz"),
            validation_fraction: 0.2,
            split_seed: 0,
            samples: 4096,
            features: 784,
            classes: 10,
        }
    }
}

impl DataConfig {
    /// The shape of the data, known from the config alone (nothing is read).
    pub fn input(&self) -> InputShape {
        match self.source {
            DataSource::Digits => {
                let (h, w) = data::DIGITS_IMAGE;
                InputShape::image(h, w, data::DIGITS_CLASSES)
            }
            DataSource::Synthetic => InputShape::flat(self.features, self.classes),
        }
    }
}

/// The classifier app.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClassifierApp;

impl App for ClassifierApp {
    type ModelConfig = ModelSection;
    type DataConfig = DataConfig;
    type Item = ClassificationItem;

    fn name(&self, model: &ModelSection) -> String {
        model.name.clone()
    }

    fn check(&self, model: &ModelSection, data: &DataConfig) -> Result<(), AppError> {
        let vf = data.validation_fraction;
        if !(0.0..1.0).contains(&vf) {
            return Err(AppError::key(
                "data.validation_fraction",
                format!("must be in [0, 1) (got {vf})"),
            ));
        }
        if data.source == DataSource::Synthetic
            && (data.samples == 0 || data.features == 0 || data.classes < 2)
        {
            return Err(AppError::key(
                "data.samples/features/classes",
                "must be at least 1, 1 and 2 for synthetic data",
            ));
        }
        models::validate(&model.name, &model.options, &data.input())
            .map_err(|e| AppError(e.to_string()))
    }

    fn datasets(&self, d: &DataConfig) -> Result<Datasets<ClassificationItem>, AppError> {
        let items = match d.source {
            DataSource::Digits => {
                data::load_digits(&d.path).map_err(|e| AppError(e.to_string()))?
            }
            DataSource::Synthetic => {
                data::synthetic(d.samples, d.features, d.classes, d.split_seed)
            }
        };
        let (train, valid) =
            data::split_train_validation(items, d.validation_fraction, d.split_seed);
        if train.is_empty() {
            return Err(AppError::key(
                "data.validation_fraction",
                format!(
                    "no training samples left after holding out {}",
                    d.validation_fraction
                ),
            ));
        }
        let valid: Option<Arc<dyn Dataset<ClassificationItem>>> = if valid.is_empty() {
            None
        } else {
            Some(Arc::new(InMemDataset::new(valid)))
        };
        Ok(Datasets {
            train: Arc::new(InMemDataset::new(train)),
            valid,
        })
    }

    /// Inversely proportional to the class's frequency (`training.balance_classes`).
    fn sample_weights(&self, train: &dyn Dataset<ClassificationItem>) -> Option<Vec<f64>> {
        let labels: Vec<usize> = (0..train.len())
            .filter_map(|i| train.get(i).map(|item| item.label))
            .collect();
        let mut counts = vec![0usize; labels.iter().map(|l| l + 1).max().unwrap_or(0)];
        for &label in &labels {
            counts[label] += 1;
        }
        Some(labels.iter().map(|&l| 1.0 / counts[l] as f64).collect())
    }

    fn parameter_count(&self, model: &ModelSection, data: &DataConfig) -> Option<u64> {
        let device = Default::default();
        let lazy = DigitsModel::<Flex>::lazy(&model.name, &model.options, &data.input(), &device);
        lazy.ok().map(|m| models::lazy_param_count(&m))
    }
}

impl<B: AutodiffBackend> Learn<B> for ClassifierApp {
    type Model = DigitsModel<B>;
    type ValidModel = DigitsModel<B::InnerBackend>;
    type TrainBatcher = ClassificationBatcher;
    type ValidBatcher = ClassificationBatcher;

    fn model(
        &self,
        model: &ModelSection,
        data: &DataConfig,
        device: &B::Device,
    ) -> Result<DigitsModel<B>, AppError> {
        DigitsModel::from_options(&model.name, &model.options, &data.input(), device)
            .map_err(|e| AppError(e.to_string()))
    }

    fn batchers(
        &self,
        _model: &ModelSection,
        _data: &DataConfig,
    ) -> (ClassificationBatcher, ClassificationBatcher) {
        (ClassificationBatcher, ClassificationBatcher)
    }

    fn train_metrics(&self) -> Metrics<TrainSynced<Self, B>> {
        super::loss_and_accuracy()
    }

    fn valid_metrics(&self) -> Metrics<ValidSynced<Self, B>> {
        super::loss_and_accuracy()
    }
}
