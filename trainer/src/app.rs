//! What a user implements to train their own Burn model with this engine: an **app**.
//!
//! An app is one trait, [`App`], in which the user names everything the engine cannot know:
//!
//! - the app's own `[model]` and `[data]` TOML tables (serde types of the user's; an unknown or
//!   wrongly typed key is a usage error naming it) and a cheap pre-flight check of them;
//! - the data sets (any burn-dataset [`Dataset`]) and their item type;
//! - the model (burn-train's [`TrainStep`] and [`InferenceStep`] on the same Burn 0.22 module
//!   type), the [`Batcher`] that turns items into the model's input, and the burn-train metrics
//!   to show ([`Metrics`]).
//!
//! Burn 0.22 has no backend type parameter: the engine picks the [`Device`] from
//! `output.device` at run time, trains the model on its autodiff form and validates
//! `model.valid()` (the same type, without autodiff). The launcher uses only the device-free
//! methods (`check`, `parameter_count`), so a bad table is refused before any rank starts.
//!
//! Then `fn main() -> ExitCode { trainer::run::main_with(MyApp, trainer::program_info!()) }` is a complete `trainer` for the
//! user's model: `--config`, `--nproc-per-node`, multi-node, `--max-restarts`, `eval`, resume,
//! rank-0 checkpoints. See `examples/custom-model/` for a compiled example. A model that also
//! trains as pipeline stages is cut by a [`StageSplit`](crate::engine::pipeline::StageSplit) the
//! program gives beside the app ([`main_with_stages`](crate::run::main_with_stages)): the app
//! names what only the user knows, and nothing of the engine.

use std::fmt::Debug;
use std::sync::{Arc, Mutex, PoisonError};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::tensor::Device;
use burn::train::{InferenceStep, TrainStep};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::config::Config;
/// The metrics an app shows ([`App::train_metrics`], [`App::valid_metrics`]), here with every
/// other name an app needs.
pub use crate::report::metrics::Metrics;

/// The parameter counter for [`App::parameter_count`] (burn-ddp's).
pub use burn_ddp::parameter_count;

/// A problem with the app's own configuration or data: a usage error (exit code 2). Say what is
/// wrong, where (the key or file) and how to fix it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct AppError(pub String);

impl AppError {
    /// An error about the key `key` of the app's tables, e.g. `model.hidden`.
    pub fn key(key: &str, problem: impl std::fmt::Display) -> Self {
        Self(format!("{key}: {problem}"))
    }
}

/// The training and validation sets of a run. Both are read lazily, through
/// [`Dataset::get`] on the indices the distributed sampler gives this rank.
pub struct Datasets<I> {
    pub train: Arc<dyn Dataset<I>>,
    /// `None`: the run has no validation set (validation is skipped and said so).
    pub valid: Option<Arc<dyn Dataset<I>>>,
}

/// Why a `Dataset::get` of this process failed, as its data set reported it.
static ITEM_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// For a data set whose `get` fails for a reason it can say better than its error value does:
/// report the reason here, then return `Err`. The engine then stops the run with that reason
/// as a usage error (exit code 2). Since Burn 0.22, `Dataset::get` returns a `Result`, whose
/// error is the reason when none was reported here: returning
/// `Err(DatasetError::new(..))` alone is enough. The first reason not yet taken is kept.
pub fn report_item_error(reason: impl Into<String>) {
    let mut slot = ITEM_ERROR.lock().unwrap_or_else(PoisonError::into_inner);
    if slot.is_none() {
        *slot = Some(reason.into());
    }
}

/// The reason given to [`report_item_error`] since the last call, if any. The engine calls it
/// when a `get` returned an error.
pub fn take_item_error() -> Option<String> {
    ITEM_ERROR
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
}

/// Item `index` of `dataset` (`set` names it in messages, e.g. "training set"), or why not: an
/// index at or past `len()` (Burn's `Dataset::get` panics there, so it is checked first), or
/// the error `get` returned (the reason given to [`report_item_error`] first, if any).
pub(crate) fn read_item<I>(dataset: &dyn Dataset<I>, index: usize, set: &str) -> Result<I, String> {
    let len = dataset.len();
    if index >= len {
        return Err(format!(
            "the {set} has no item at index {index} (its len() is {len})"
        ));
    }
    dataset.get(index).map_err(|error| {
        let reason = take_item_error().unwrap_or_else(|| error.to_string());
        format!("cannot read item {index} of the {set}: {reason}")
    })
}

/// An app: the user's model, data and config tables, for the engine (module docs).
///
/// Required: the two tables, the item, the model and batcher types, and `datasets`, `model`,
/// `batcher`, `train_metrics`, `valid_metrics`. The rest has defaults.
///
/// The engine calls [`TrainStep::step`] on each micro-batch (its loss is expected to be a mean
/// over the micro-batch; the engine weights micro-batches by their share of the optimizer step),
/// averages the gradients across ranks once per optimizer step, and steps with
/// [`TrainStep::optimize`]. Validation runs [`InferenceStep::step`] on `model.valid()`, the same
/// type without autodiff, with batches made on the device without autodiff.
pub trait App: Send + Sync + 'static {
    /// The `[model]` table. Use `#[serde(deny_unknown_fields)]` so a misspelt key is an error.
    type ModelConfig: Serialize + DeserializeOwned + Clone + Debug + Send + Sync + 'static;
    /// The `[data]` table.
    type DataConfig: Serialize + DeserializeOwned + Clone + Debug + Send + Sync + 'static;
    /// One sample of the data sets.
    type Item: Clone + Send + Sync + 'static;
    /// The model: trained on the autodiff device, validated as `model.valid()`.
    type Model: Module + TrainStep + InferenceStep + core::fmt::Display + Debug + 'static;
    /// Items to the model's training and validation inputs (one type; when the two inputs are
    /// the same type, as in most models, one `Batcher` implementation serves both).
    type Batcher: Batcher<Self::Item, <Self::Model as TrainStep>::Input>
        + Batcher<Self::Item, <Self::Model as InferenceStep>::Input>
        + 'static;

    /// A short name for messages and checkpoint manifests. The default is the model type's
    /// name (`CirclesNet` for `my_crate::CirclesNet`).
    fn name(&self, model: &Self::ModelConfig) -> String {
        let _ = model;
        short_type_name(std::any::type_name::<Self::Model>()).to_string()
    }

    /// Checks the tables against each other before any rank starts. Must be cheap: it runs in
    /// the launcher and in every rank, and must not load or iterate the data set.
    fn check(&self, model: &Self::ModelConfig, data: &Self::DataConfig) -> Result<(), AppError> {
        let _ = (model, data);
        Ok(())
    }

    /// Opens the data sets. Called once per rank (never by the launcher); it may read files,
    /// but only `Dataset::get` on this rank's shard is called during training.
    fn datasets(&self, data: &Self::DataConfig) -> Result<Datasets<Self::Item>, AppError>;

    /// A freshly initialised model on `device` (this rank's training device, with autodiff).
    /// The engine seeds `device` with `training.seed` first and then broadcasts rank 0's
    /// parameters, so replicas start equal either way. `data` is there for sizes that come from
    /// the data (features, classes, vocabulary).
    fn model(
        &self,
        model: &Self::ModelConfig,
        data: &Self::DataConfig,
        device: &Device,
    ) -> Result<Self::Model, AppError>;

    /// The batcher for training and validation. It runs on the training thread (which owns the
    /// device); `training.num_workers` threads read the items ahead through `Dataset::get`.
    /// `device` is this rank's training device (its own GPU under CUDA); each batch is made on
    /// the device the engine passes to `Batcher::batch` (the training device for training, the
    /// same device without autodiff for validation).
    fn batcher(
        &self,
        model: &Self::ModelConfig,
        data: &Self::DataConfig,
        device: &Device,
    ) -> Self::Batcher;

    /// burn-train numeric metrics computed on the training outputs (after `ItemLazy::sync`),
    /// summed across ranks with their counts, logged every `training.log_every` steps.
    fn train_metrics(&self) -> Metrics<TrainItem<Self>>;

    /// The same for validation outputs, over every validation sample exactly once.
    fn valid_metrics(&self) -> Metrics<ValidItem<Self>>;

    /// Per-sample weights for `training.balance_classes` (weighted sampling with
    /// replacement), or `None` when the app has no notion of classes (then that setting is an
    /// error). The default is `None`.
    fn sample_weights(&self, train: &dyn Dataset<Self::Item>) -> Option<Vec<f64>> {
        let _ = train;
        None
    }

    /// How many float parameter values the model of these tables has, found without
    /// allocating them — e.g. build it with Burn's lazily initialised parameters and count with
    /// [`parameter_count`] (burn-ddp's, re-exported here), or use a formula. The pre-flight uses
    /// it to refuse, with the numbers, a model that cannot fit in memory before any rank starts.
    /// `None` (the default) skips that check.
    fn parameter_count(&self, model: &Self::ModelConfig, data: &Self::DataConfig) -> Option<u64> {
        let _ = (model, data);
        None
    }
}

/// The configuration of app `A`: the engine's sections and the app's own `[model]` and
/// `[data]` tables.
pub type AppConfig<A> = Config<<A as App>::ModelConfig, <A as App>::DataConfig>;

/// The last path segment of a type name, without generic arguments:
/// `my_crate::nets::CirclesNet<f32>` → `CirclesNet`.
fn short_type_name(full: &str) -> &str {
    let path = full.split('<').next().unwrap_or(full);
    path.rsplit("::").next().unwrap_or(path)
}

/// The training input of app `A`'s model (its batcher's output; every pipeline stage's
/// micro-batch).
pub type TrainInput<A> = <<A as App>::Model as TrainStep>::Input;
/// The training output of app `A` (what its training metrics read, after `ItemLazy::sync`).
pub type TrainItem<A> = <<A as App>::Model as TrainStep>::Output;
/// The validation output of app `A`.
pub type ValidItem<A> = <<A as App>::Model as InferenceStep>::Output;

#[cfg(test)]
mod tests {
    use super::short_type_name;

    #[test]
    fn the_default_app_name_is_the_model_type_without_its_path() {
        assert_eq!(short_type_name("my_crate::nets::CirclesNet"), "CirclesNet");
        assert_eq!(short_type_name("a::Net<b::Inner<c::D>>"), "Net");
        assert_eq!(short_type_name("Plain"), "Plain");
    }
}
