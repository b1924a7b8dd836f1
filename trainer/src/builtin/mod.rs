//! The reference models as apps of the engine, exactly as a user's crate would write them
//! (no special cases in the engine): the `trainer` binary picks one by `[model] name`.
//!
//! | `[model] name` | app | data | metrics |
//! |---|---|---|---|
//! | `mlp`, `cnn` | [`classifier::ClassifierApp`] | digits (vendored), synthetic, csv, sqlite, image-folder ([`crate::sources`]) | loss, accuracy |
//! | `regression` | [`regression::RegressionApp`] | synthetic (lazy), csv, sqlite | loss |
//! | `text_transformer` | [`text::TextApp`] | synthetic token sequences (lazy) | loss, accuracy |

pub mod classifier;
pub mod regression;
pub mod text;

use std::path::Path;
use std::sync::Arc;

use burn::data::dataset::transform::PartialDataset;
use burn::data::dataset::Dataset;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::ClassificationOutput;

use crate::app::{App, Datasets};
use crate::metrics::Metrics;
use crate::pipeline::StageSplit;

use crate::config::ConfigError;

/// Work to do with the app a config file names ([`with_app`]): a generic function over the
/// app type (the device is chosen at run time, inside), given the app's pipeline split where
/// its model has one.
pub trait WithApp {
    type Output;
    fn run<A: App + Clone>(self, app: A, stages: Option<StageSplit<A>>) -> Self::Output;
}

/// Every `[model] name` the built-in apps know.
pub fn model_names() -> Vec<&'static str> {
    let mut names = models::MODEL_NAMES.to_vec();
    names.extend([regression::NAME, text::NAME]);
    names
}

/// Reads `[model] name` from the config file and runs `task` with its app.
pub fn with_app<T: WithApp>(config: &Path, task: T) -> Result<T::Output, ConfigError> {
    let text = std::fs::read_to_string(config).map_err(|source| ConfigError::Read {
        path: config.to_path_buf(),
        source,
    })?;
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| ConfigError::Parse {
            path: config.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })?;
    let name = table
        .get("model")
        .and_then(|m| m.get("name"))
        .and_then(|n| n.as_str())
        .ok_or_else(|| ConfigError::Invalid {
            path: config.to_path_buf(),
            field: "model.name",
            problem: format!("is missing: name one of {:?}", model_names()),
        })?;
    match name {
        regression::NAME => Ok(task.run(regression::RegressionApp, None)),
        text::NAME => Ok(task.run(text::TextApp, Some(text::stages()))),
        n if models::MODEL_NAMES.contains(&n) => Ok(task.run(classifier::ClassifierApp, None)),
        other => Err(ConfigError::Invalid {
            path: config.to_path_buf(),
            field: "model.name",
            problem: format!(
                "\"{other}\" is not a known model; known: {:?}",
                model_names()
            ),
        }),
    }
}

/// Training set = indices `0..train` of `all`, validation set = the next `valid` (none when
/// 0): one generator, one task, read lazily through Burn's `PartialDataset`.
pub fn split_by_index<I, D>(all: D, train: usize, valid: usize) -> Datasets<I>
where
    I: Clone + Send + Sync + 'static,
    D: Dataset<I> + Clone + 'static,
{
    Datasets {
        train: Arc::new(PartialDataset::new(all.clone(), 0, train)),
        valid: (valid > 0).then(|| {
            Arc::new(PartialDataset::new(all, train, train + valid)) as Arc<dyn Dataset<I>>
        }),
    }
}

/// burn-train's loss and accuracy, for classifiers' outputs.
pub fn loss_and_accuracy() -> Metrics<ClassificationOutput> {
    Metrics::new()
        .with(LossMetric::new())
        .with(AccuracyMetric::new())
}

/// A `[model]` table with a `name` key (which picks the app) and the model's own keys, checked
/// by `T` (`deny_unknown_fields` there names a misspelt key).
#[derive(Debug, Clone, PartialEq)]
pub struct Named<T> {
    pub name: String,
    pub config: T,
}

impl<T: serde::Serialize> serde::Serialize for Named<T> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error;
        let mut table = toml::Table::try_from(&self.config).map_err(S::Error::custom)?;
        table.insert("name".into(), toml::Value::String(self.name.clone()));
        table.serialize(serializer)
    }
}

impl<'de, T: serde::de::DeserializeOwned> serde::Deserialize<'de> for Named<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut table = toml::Table::deserialize(deserializer)?;
        let name = match table.remove("name") {
            Some(toml::Value::String(name)) => name,
            _ => return Err(D::Error::missing_field("name")),
        };
        let config = toml::Value::Table(table)
            .try_into()
            .map_err(|e: toml::de::Error| D::Error::custom(e.message()))?;
        Ok(Self { name, config })
    }
}
