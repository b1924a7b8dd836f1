//! What the built-in apps share: the `[model]` table's `name`, the split of one generated data
//! set by index, the classifiers' metrics.

use std::sync::Arc;

use burn::data::dataset::transform::PartialDataset;
use burn::data::dataset::Dataset;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::ClassificationOutput;

use crate::app::Datasets;
use crate::report::metrics::Metrics;

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
