//! The digits classifiers (`[model] name = "mlp" | "cnn"`) as an app of the engine: the
//! vendored UCI digits, synthetic data, or the user's own (a CSV file, an SQLite table, an
//! image folder: [`crate::sources`]); cross-entropy, loss and accuracy metrics.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::data::dataset::{Dataset, InMemDataset};
use burn::tensor::Device;
use models::{DigitsModel, InputShape};
use serde::{Deserialize, Serialize};

use crate::app::{App, AppError, Datasets, TrainItem, ValidItem};
use crate::data::{self, ClassificationBatcher, ClassificationItem};
use crate::features::Feature;
use crate::report::metrics::Metrics;
use crate::sources::counting::count_reads_if_asked;
use crate::sources::schema::{self, ClassColumns, Features};
use crate::sources::{self, csv, image_folder, sqlite, sqlite_dataset};

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
    /// A CSV file: named feature columns and a class column ([`crate::sources::csv`]).
    Csv,
    /// A table of an SQLite database in burn-dataset's format ([`crate::sources::sqlite`];
    /// cargo feature `sqlite`).
    Sqlite,
    /// One sub-folder of images per class (cargo feature `image-folder`).
    #[serde(rename = "image-folder", alias = "image_folder")]
    ImageFolder,
}

impl DataSource {
    /// The name in the config.
    pub fn name(self) -> &'static str {
        match self {
            Self::Digits => "digits",
            Self::Synthetic => "synthetic",
            Self::Csv => "csv",
            Self::Sqlite => "sqlite",
            Self::ImageFolder => "image-folder",
        }
    }
}

/// `[data]` of the classifiers. One default per field, in `Default`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    pub source: DataSource,
    /// The digits file, CSV file, SQLite database or image folder (relative paths are relative
    /// to the working directory).
    pub path: PathBuf,
    /// Fraction held out for validation, after a seeded shuffle (0: no validation set).
    pub validation_fraction: f64,
    /// Seed of the train/validation split (fixed, independent of the training seed).
    pub split_seed: u64,
    /// Synthetic data only: number of samples.
    pub samples: usize,
    /// Synthetic data: the number of features; csv, sqlite: the feature columns, in order.
    pub features: Features,
    /// Number of classes: synthetic (default 10), csv, sqlite, image-folder (required unless
    /// `labels` names them). Not used by the digits (10).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub classes: Option<usize>,
    /// csv, sqlite: the class column, holding a class index in `0..classes` or one of `labels`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// The class names, class `i` the `i`-th: the values of the `target` column (csv, sqlite)
    /// or the class sub-folders to use (image-folder).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub labels: Option<Vec<String>>,
    /// sqlite: the table (Burn's split name); default "train".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub table: Option<String>,
    /// `[height, width]`: image-folder (required; images are resized to it); csv, sqlite
    /// (optional: the features are a row-major one-channel image, as the CNN needs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_size: Option<[usize; 2]>,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            source: DataSource::Digits,
            path: PathBuf::from(DIGITS_PATH),
            validation_fraction: 0.2,
            split_seed: 0,
            samples: 4096,
            features: Features::Count(784),
            classes: None,
            target: None,
            labels: None,
            table: None,
            image_size: None,
        }
    }
}

/// The default `data.path`: the vendored digits.
const DIGITS_PATH: &str = "data/digits.csv.gz";
/// Classes of synthetic data when `data.classes` is not given.
const SYNTHETIC_CLASSES: usize = 10;
/// The largest `data.image_size` side, to catch a mistyped size before allocating it.
const MAX_IMAGE_SIDE: usize = 1 << 14;

impl DataConfig {
    /// The shape of the data, known from the config alone (nothing is read).
    pub fn input(&self) -> InputShape {
        let classes = self.class_count();
        match (self.source, self.image_size) {
            (DataSource::Digits, _) => {
                let (h, w) = data::DIGITS_IMAGE;
                InputShape::image(h, w, data::DIGITS_CLASSES)
            }
            (DataSource::Synthetic, _) => InputShape::flat(self.features.len(), classes),
            (DataSource::ImageFolder | DataSource::Csv | DataSource::Sqlite, Some([h, w])) => {
                InputShape::image(h, w, classes)
            }
            (DataSource::ImageFolder, None) => InputShape::image(0, 0, classes),
            (DataSource::Csv | DataSource::Sqlite, None) => {
                InputShape::flat(self.features.len(), classes)
            }
        }
    }

    /// Number of classes: the labels', else `data.classes` (synthetic: 10 by default).
    fn class_count(&self) -> usize {
        match (&self.labels, self.source) {
            (_, DataSource::Digits) => data::DIGITS_CLASSES,
            (Some(labels), _) => labels.len(),
            (None, _) => self.classes.unwrap_or(SYNTHETIC_CLASSES),
        }
    }

    /// The table (sqlite).
    fn table(&self) -> &str {
        self.table.as_deref().unwrap_or(sqlite::DEFAULT_TABLE)
    }

    /// Checks the keys of this source against each other (cheap: the config only).
    fn check_source(&self) -> Result<(), AppError> {
        self.check_keys_belong_to_source()?;
        let source = self.source;
        match source {
            DataSource::Digits => return Ok(()),
            DataSource::Synthetic => {
                if self.samples == 0 || self.features.is_empty() || self.class_count() < 2 {
                    return Err(AppError::key(
                        "data.samples/features/classes",
                        "must be at least 1, 1 and 2 for synthetic data",
                    ));
                }
                return Ok(());
            }
            DataSource::Csv => {}
            DataSource::Sqlite => Feature::Sqlite
                .require("data.source = \"sqlite\"")
                .map_err(|e| AppError(e.to_string()))?,
            DataSource::ImageFolder => Feature::ImageFolder
                .require("data.source = \"image-folder\"")
                .map_err(|e| AppError(e.to_string()))?,
        }
        let tables = matches!(source, DataSource::Csv | DataSource::Sqlite);
        if self.path == Path::new(DIGITS_PATH) {
            return Err(AppError::key(
                "data.path",
                format!(
                    "is missing: name the {} for source = \"{}\" (the default is the digits file)",
                    if tables { "file" } else { "image folder" },
                    source.name()
                ),
            ));
        }
        self.check_classes()?;
        self.check_image_size(tables)?;
        if tables {
            let target: Vec<String> = self.target.iter().cloned().collect();
            schema::check_columns(&self.features, &target)?;
        }
        if source == DataSource::Sqlite {
            sqlite::check_table_name(self.table())?;
        }
        Ok(())
    }

    /// Refuses a key set for a source that does not read it.
    fn check_keys_belong_to_source(&self) -> Result<(), AppError> {
        let source = self.source;
        let only = |key: &str, set: bool, sources: &str| {
            if set {
                Err(AppError::key(
                    key,
                    format!("is for source = {sources}, not \"{}\"", source.name()),
                ))
            } else {
                Ok(())
            }
        };
        let tables = matches!(source, DataSource::Csv | DataSource::Sqlite);
        let files = tables || source == DataSource::ImageFolder;
        only(
            "data.target",
            self.target.is_some() && !tables,
            "\"csv\" or \"sqlite\"",
        )?;
        only(
            "data.table",
            self.table.is_some() && source != DataSource::Sqlite,
            "\"sqlite\"",
        )?;
        only(
            "data.labels",
            self.labels.is_some() && !files,
            "\"csv\", \"sqlite\" or \"image-folder\"",
        )?;
        only(
            "data.image_size",
            self.image_size.is_some() && !files,
            "\"csv\", \"sqlite\" or \"image-folder\"",
        )?;
        only(
            "data.features",
            self.features.columns().is_some() && !tables,
            "\"csv\" or \"sqlite\" (a list of columns)",
        )
    }

    /// `data.labels` and `data.classes` of a file source: at least 2 classes, named once
    /// each, and the two keys agreeing.
    fn check_classes(&self) -> Result<(), AppError> {
        let Some(labels) = &self.labels else {
            return match self.classes {
                None => Err(AppError::key(
                    "data.classes",
                    format!(
                        "is missing: give the number of classes (or name them with data.labels) for source = \"{}\"",
                        self.source.name()
                    ),
                )),
                Some(c) if c < 2 => Err(AppError::key("data.classes", "must be at least 2")),
                Some(_) => Ok(()),
            };
        };
        if labels.len() < 2 {
            return Err(AppError::key("data.labels", "must name at least 2 classes"));
        }
        if let Some(i) = (1..labels.len()).find(|&i| labels[..i].contains(&labels[i])) {
            return Err(AppError::key(
                "data.labels",
                format!("names \"{}\" twice", labels[i]),
            ));
        }
        if self.classes.is_some_and(|c| c != labels.len()) {
            return Err(AppError::key(
                "data.classes",
                format!(
                    "is {}, but data.labels names {} classes (leave data.classes out)",
                    self.classes.unwrap_or_default(),
                    labels.len()
                ),
            ));
        }
        Ok(())
    }

    /// `data.image_size`: required for an image folder, sides in range, and for a table as
    /// many pixels as feature columns.
    fn check_image_size(&self, tables: bool) -> Result<(), AppError> {
        if self.source == DataSource::ImageFolder && self.image_size.is_none() {
            return Err(AppError::key(
                "data.image_size",
                "is missing: give [height, width] for source = \"image-folder\" (images are resized to it)",
            ));
        }
        let Some([h, w]) = self.image_size else {
            return Ok(());
        };
        if !(1..=MAX_IMAGE_SIDE).contains(&h) || !(1..=MAX_IMAGE_SIDE).contains(&w) {
            return Err(AppError::key(
                "data.image_size",
                format!("sides must be in 1..={MAX_IMAGE_SIDE} (got [{h}, {w}])"),
            ));
        }
        if tables && h * w != self.features.len() {
            return Err(AppError::key(
                "data.image_size",
                format!(
                    "[{h}, {w}] is {} pixels, but data.features names {} columns",
                    h * w,
                    self.features.len()
                ),
            ));
        }
        Ok(())
    }

    /// The columns to read (csv, sqlite; after [`Self::check_source`]).
    fn class_columns(&self) -> ClassColumns {
        ClassColumns::new(
            self.features.columns().unwrap_or_default().to_vec(),
            self.target.clone().unwrap_or_default(),
            self.class_count(),
            self.labels.clone(),
        )
    }
}

/// The classifier app.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClassifierApp;

impl App for ClassifierApp {
    type ModelConfig = ModelSection;
    type DataConfig = DataConfig;
    type Item = ClassificationItem;
    type Model = DigitsModel;
    type Batcher = ClassificationBatcher;

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
        data.check_source()?;
        models::validate(&model.name, &model.options, &data.input())
            .map_err(|e| AppError(e.to_string()))
    }

    fn datasets(&self, d: &DataConfig) -> Result<Datasets<ClassificationItem>, AppError> {
        let (vf, seed) = (d.validation_fraction, d.split_seed);
        let sets = match d.source {
            DataSource::Digits | DataSource::Synthetic => {
                let items = if d.source == DataSource::Digits {
                    data::load_digits(&d.path).map_err(|e| AppError(e.to_string()))?
                } else {
                    data::synthetic(d.samples, d.features.len(), d.class_count(), seed)
                };
                let (train, valid) = data::split_train_validation(items, vf, seed);
                Datasets {
                    train: Arc::new(InMemDataset::new(train)),
                    valid: (!valid.is_empty()).then(|| {
                        Arc::new(InMemDataset::new(valid)) as Arc<dyn Dataset<ClassificationItem>>
                    }),
                }
            }
            DataSource::Csv => sources::split(csv::open(&d.path, d.class_columns())?, vf, seed),
            DataSource::Sqlite => {
                let table = sqlite_dataset::dataset(&d.path, d.table(), d.class_columns())?;
                sources::split(table, vf, seed)
            }
            DataSource::ImageFolder => {
                let [h, w] = d.image_size.unwrap_or_default();
                let side = |s: usize| u32::try_from(s).unwrap_or(u32::MAX);
                let labels = d.labels.as_deref();
                let folder =
                    image_folder::dataset(&d.path, labels, d.class_count(), side(h), side(w))?;
                sources::split(folder, vf, seed)
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

    /// Inversely proportional to the class's frequency (`training.balance_classes`).
    fn sample_weights(&self, train: &dyn Dataset<ClassificationItem>) -> Option<Vec<f64>> {
        let labels: Vec<usize> = (0..train.len())
            .filter_map(|i| train.get(i).ok().map(|item| item.label))
            .collect();
        let mut counts = vec![0usize; labels.iter().map(|l| l + 1).max().unwrap_or(0)];
        for &label in &labels {
            counts[label] += 1;
        }
        Some(labels.iter().map(|&l| 1.0 / counts[l] as f64).collect())
    }

    fn parameter_count(&self, model: &ModelSection, data: &DataConfig) -> Option<u64> {
        // Lazy parameters: nothing of the model's size is allocated.
        let device = Device::flex();
        let lazy = DigitsModel::lazy(&model.name, &model.options, &data.input(), &device);
        lazy.ok().map(|m| burn_ddp::parameter_count(&m))
    }

    fn model(
        &self,
        model: &ModelSection,
        data: &DataConfig,
        device: &Device,
    ) -> Result<DigitsModel, AppError> {
        DigitsModel::from_options(&model.name, &model.options, &data.input(), device)
            .map_err(|e| AppError(e.to_string()))
    }

    fn batcher(
        &self,
        _model: &ModelSection,
        _data: &DataConfig,
        _device: &Device,
    ) -> ClassificationBatcher {
        ClassificationBatcher
    }

    fn train_metrics(&self) -> Metrics<TrainItem<Self>> {
        super::parts::loss_and_accuracy()
    }

    fn valid_metrics(&self) -> Metrics<ValidItem<Self>> {
        super::parts::loss_and_accuracy()
    }
}
