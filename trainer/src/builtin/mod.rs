//! The reference models as apps of the engine, exactly as a user's crate would write them
//! (no special cases in the engine): the `trainer` binary picks one by `[model] name`.
//!
//! | `[model] name` | app | data | metrics |
//! |---|---|---|---|
//! | `mlp`, `cnn` | [`classifier::ClassifierApp`] | digits (vendored), synthetic, csv, sqlite, image-folder ([`crate::sources`]) | loss, accuracy |
//! | `regression` | [`regression::RegressionApp`] | synthetic (lazy), csv, sqlite | loss |
//! | `text_transformer` | [`text::TextApp`] | synthetic token sequences (lazy) | loss, accuracy |

pub mod classifier;
mod parts;
pub mod regression;
pub mod text;

pub use parts::{loss_and_accuracy, split_by_index, Named};

use std::path::Path;

use crate::app::App;
use crate::engine::pipeline::StageSplit;

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
