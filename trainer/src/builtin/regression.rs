//! `[model] name = "regression"`: an MLP regressor (MSE, burn-train's `RegressionOutput`) on
//! lazily generated synthetic data or the user's own (a CSV file, an SQLite table:
//! [`crate::sources`]), as a user's app would be written.

use std::path::PathBuf;
use std::sync::Arc;

use burn::tensor::Device;
use burn::train::metric::LossMetric;
use models::{
    RegressionBatcher, RegressionConfig, RegressionItem, RegressionModel, SyntheticRegression,
};
use serde::{Deserialize, Serialize};

use super::parts::{split_by_index, Named};
use crate::app::{App, AppError, Datasets, TrainItem, ValidItem};
use crate::features::Feature;
use crate::report::metrics::Metrics;
use crate::sources::counting::count_reads_if_asked;
use crate::sources::schema::{self, Features, Targets, ValueColumns};
use crate::sources::{self, csv, sqlite, sqlite_dataset};

/// The `[model] name` of this app.
pub const NAME: &str = "regression";

/// Where the regression data comes from.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum RegressionSource {
    /// Generated per index (nothing is held in memory).
    #[default]
    Synthetic,
    /// A CSV file: named feature and target columns ([`crate::sources::csv`]).
    Csv,
    /// A table of an SQLite database in burn-dataset's format ([`crate::sources::sqlite`];
    /// cargo feature `sqlite`).
    Sqlite,
}

/// `[data]`: synthetic regression data, generated per index, or a CSV file or SQLite table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RegressionData {
    pub source: RegressionSource,
    /// Synthetic: training samples.
    pub samples: usize,
    /// Synthetic: validation samples (drawn from the same function, at other indices).
    pub validation_samples: usize,
    /// Synthetic: the number of features; csv, sqlite: the feature columns, in order.
    pub features: Features,
    /// Synthetic: the number of targets.
    pub targets: usize,
    /// Synthetic: the seed of the data.
    pub seed: u64,
    /// csv, sqlite: the file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// csv, sqlite: the target column, or several (`["y1", "y2"]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<Targets>,
    /// sqlite: the table (Burn's split name); default "train".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub table: Option<String>,
    /// csv, sqlite: fraction held out for validation, after a seeded shuffle (0: none).
    pub validation_fraction: f64,
    /// csv, sqlite: seed of that split.
    pub split_seed: u64,
}

impl Default for RegressionData {
    fn default() -> Self {
        Self {
            source: RegressionSource::Synthetic,
            samples: 2048,
            validation_samples: 512,
            features: Features::Count(8),
            targets: 2,
            seed: 0,
            path: None,
            target: None,
            table: None,
            validation_fraction: 0.2,
            split_seed: 0,
        }
    }
}

impl RegressionData {
    /// Features and targets per sample, from the config alone.
    pub fn shape(&self) -> (usize, usize) {
        match self.source {
            RegressionSource::Synthetic => (self.features.len(), self.targets),
            RegressionSource::Csv | RegressionSource::Sqlite => (
                self.features.len(),
                self.target.as_ref().map_or(0, |t| t.columns().len()),
            ),
        }
    }

    fn table(&self) -> &str {
        self.table.as_deref().unwrap_or(sqlite::DEFAULT_TABLE)
    }

    /// Checks the keys of this source against each other (cheap: the config only).
    fn check_source(&self) -> Result<(), AppError> {
        if self.source == RegressionSource::Sqlite {
            Feature::Sqlite
                .require("data.source = \"sqlite\"")
                .map_err(|e| AppError(e.to_string()))?;
        }
        let files = self.source != RegressionSource::Synthetic;
        if !files {
            for (key, set) in [
                ("data.path", self.path.is_some()),
                ("data.target", self.target.is_some()),
                ("data.table", self.table.is_some()),
                ("data.features", self.features.columns().is_some()),
            ] {
                if set {
                    return Err(AppError::key(
                        key,
                        "is for source = \"csv\" or \"sqlite\", not \"synthetic\"",
                    ));
                }
            }
            if self.samples == 0 || self.features.is_empty() || self.targets == 0 {
                return Err(AppError::key(
                    "data.samples/features/targets",
                    "must each be at least 1",
                ));
            }
            return Ok(());
        }
        if self.table.is_some() && self.source != RegressionSource::Sqlite {
            return Err(AppError::key("data.table", "is for source = \"sqlite\""));
        }
        if self.path.is_none() {
            return Err(AppError::key(
                "data.path",
                "is missing: name the file of a csv or sqlite source",
            ));
        }
        let vf = self.validation_fraction;
        if !(0.0..1.0).contains(&vf) {
            return Err(AppError::key(
                "data.validation_fraction",
                format!("must be in [0, 1) (got {vf})"),
            ));
        }
        let targets = self
            .target
            .as_ref()
            .map(Targets::columns)
            .unwrap_or_default();
        schema::check_columns(&self.features, &targets)?;
        if self.source == RegressionSource::Sqlite {
            sqlite::check_table_name(self.table())?;
        }
        Ok(())
    }

    /// The columns to read (csv, sqlite; after [`Self::check_source`]).
    fn value_columns(&self) -> ValueColumns {
        ValueColumns::new(
            self.features.columns().unwrap_or_default().to_vec(),
            self.target
                .as_ref()
                .map(Targets::columns)
                .unwrap_or_default(),
        )
    }
}

/// The regression app.
#[derive(Debug, Clone, Copy, Default)]
pub struct RegressionApp;

impl App for RegressionApp {
    type ModelConfig = Named<RegressionConfig>;
    type DataConfig = RegressionData;
    type Item = RegressionItem;
    type Model = RegressionModel;
    type Batcher = RegressionBatcher;

    fn name(&self, model: &Self::ModelConfig) -> String {
        model.name.clone()
    }

    fn check(&self, model: &Self::ModelConfig, data: &RegressionData) -> Result<(), AppError> {
        data.check_source()?;
        let (features, targets) = data.shape();
        model
            .config
            .check(features, targets)
            .map_err(|e| AppError(e.to_string()))
    }

    fn datasets(&self, d: &RegressionData) -> Result<Datasets<RegressionItem>, AppError> {
        let (vf, seed) = (d.validation_fraction, d.split_seed);
        let path = d.path.clone().unwrap_or_default();
        let sets = match d.source {
            RegressionSource::Synthetic => {
                let all = Arc::new(SyntheticRegression::new(
                    d.samples + d.validation_samples,
                    d.features.len(),
                    d.targets,
                    d.seed,
                ));
                split_by_index(all, d.samples, d.validation_samples)
            }
            RegressionSource::Csv => sources::split(csv::open(&path, d.value_columns())?, vf, seed),
            RegressionSource::Sqlite => {
                let table = sqlite_dataset::dataset(&path, d.table(), d.value_columns())?;
                sources::split(table, vf, seed)
            }
        };
        if sets.train.is_empty() {
            return Err(AppError::key(
                "data.validation_fraction",
                format!("no training samples left after holding out {vf}"),
            ));
        }
        count_reads_if_asked(sets)
    }

    fn parameter_count(&self, model: &Self::ModelConfig, d: &RegressionData) -> Option<u64> {
        let (features, targets) = d.shape();
        let lazy = model.config.init_lazy(features, targets, &Device::flex());
        Some(burn_ddp::parameter_count(&lazy))
    }

    fn model(
        &self,
        model: &Self::ModelConfig,
        data: &RegressionData,
        device: &Device,
    ) -> Result<RegressionModel, AppError> {
        let (features, targets) = data.shape();
        Ok(model.config.init(features, targets, device))
    }

    fn batcher(
        &self,
        _model: &Self::ModelConfig,
        _data: &RegressionData,
        _device: &Device,
    ) -> RegressionBatcher {
        RegressionBatcher
    }

    fn train_metrics(&self) -> Metrics<TrainItem<Self>> {
        Metrics::new().with(LossMetric::new())
    }

    fn valid_metrics(&self) -> Metrics<ValidItem<Self>> {
        Metrics::new().with(LossMetric::new())
    }
}
