//! What a user implements to train their own Burn model with this engine: an **app**.
//!
//! An app has two halves, so that the backend-independent half (config tables, data sets) is
//! written once and the model half is generic over the Burn backend, exactly as Burn's own
//! examples write `fn train<B: AutodiffBackend>(...)`:
//!
//! - [`App`]: the app's own `[model]` and `[data]` TOML tables (serde types of the user's; an
//!   unknown or wrongly typed key is a usage error naming it), a cheap pre-flight check, and the
//!   data sets (any burn-dataset [`Dataset`]).
//! - [`Learn<B>`]: the model (burn-train's [`TrainStep`] on the autodiff model, [`InferenceStep`]
//!   on its inner module), the [`Batcher`]s that turn items into the model's input types, and
//!   the burn-train metrics to show ([`Metrics`]). Implement it for every `B: AutodiffBackend`
//!   (`impl<B: AutodiffBackend> Learn<B> for MyApp`) and the engine picks the backend from
//!   `output.device`.
//!
//! Then `fn main() -> ExitCode { trainer::run::main_with(MyApp, trainer::program_info!()) }` is a complete `trainer` for the
//! user's model: `--config`, `--nproc-per-node`, multi-node, `--max-restarts`, `eval`, resume,
//! rank-0 checkpoints. See `examples/custom-model/` for a compiled example.

use std::fmt::Debug;
use std::sync::{Arc, Mutex, PoisonError};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::module::{AutodiffModule, Module};
use burn::tensor::backend::AutodiffBackend;
use burn::train::{InferenceStep, ItemLazy, TrainStep};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::metrics::Metrics;

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

/// Why a `Dataset::get` of this process returned `None`, as its data set reported it.
static ITEM_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// For a data set whose `get` can fail for a reason it can name (a corrupt image, a file changed
/// since it was opened): report the reason here, then return `None`. The engine then stops the
/// run with that reason as a usage error (exit code 2) instead of its generic "returned no
/// item". (`Dataset::get` has no error channel; this is one, per process.) The first reason not
/// yet taken is kept.
pub fn report_item_error(reason: impl Into<String>) {
    let mut slot = ITEM_ERROR.lock().unwrap_or_else(PoisonError::into_inner);
    if slot.is_none() {
        *slot = Some(reason.into());
    }
}

/// The reason given to [`report_item_error`] since the last call, if any. The engine calls it
/// when a `get` returned `None`.
pub fn take_item_error() -> Option<String> {
    ITEM_ERROR
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
}

/// The backend-independent half of an app (module docs).
pub trait App: Send + Sync + 'static {
    /// The `[model]` table. Use `#[serde(deny_unknown_fields)]` so a misspelt key is an error.
    type ModelConfig: Serialize + DeserializeOwned + Clone + Debug + Send + Sync + 'static;
    /// The `[data]` table.
    type DataConfig: Serialize + DeserializeOwned + Clone + Debug + Send + Sync + 'static;
    /// One sample of the data sets.
    type Item: Clone + Send + Sync + 'static;

    /// A short name for messages and checkpoint manifests (e.g. the model's name).
    fn name(&self, model: &Self::ModelConfig) -> String;

    /// Checks the tables against each other before any rank starts. Must be cheap: it runs in
    /// the launcher and in every rank, and must not load or iterate the data set.
    fn check(&self, model: &Self::ModelConfig, data: &Self::DataConfig) -> Result<(), AppError> {
        let _ = (model, data);
        Ok(())
    }

    /// Opens the data sets. Called once per rank (never by the launcher); it may read files,
    /// but only `Dataset::get` on this rank's shard is called during training.
    fn datasets(&self, data: &Self::DataConfig) -> Result<Datasets<Self::Item>, AppError>;

    /// Per-sample weights for `training.balance_classes` (weighted sampling with
    /// replacement), or `None` when the app has no notion of classes (then that setting is an
    /// error). The default is `None`.
    fn sample_weights(&self, train: &dyn Dataset<Self::Item>) -> Option<Vec<f64>> {
        let _ = train;
        None
    }

    /// How many float parameter values the model of these tables has, found without
    /// allocating them — e.g. build it with Burn's lazily initialised parameters and count with
    /// [`parameter_count`] (burn-ddp's, re-exported here), or use a formula. The pre-flight uses it to refuse, with the
    /// numbers, a model that cannot fit in memory before any rank starts. `None` (the default)
    /// skips that check.
    fn parameter_count(&self, model: &Self::ModelConfig, data: &Self::DataConfig) -> Option<u64> {
        let _ = (model, data);
        None
    }
}

/// The model half of an app, for one backend `B` (module docs).
///
/// The engine calls [`TrainStep::step`] on each micro-batch (its loss is expected to be a mean
/// over the micro-batch; the engine weights micro-batches by their share of the optimizer step),
/// averages the gradients across ranks once per optimizer step, and steps with
/// [`TrainStep::optimize`]. Validation runs [`InferenceStep::step`] on the inner module.
pub trait Learn<B: AutodiffBackend>: App {
    /// The trainable model.
    type Model: AutodiffModule<B, InnerModule = Self::ValidModel> + TrainStep + Debug + 'static;
    /// The model without autodiff, for validation.
    type ValidModel: Module<B::InnerBackend> + InferenceStep + 'static;
    /// Items to the training input.
    type TrainBatcher: Batcher<B, Self::Item, <Self::Model as TrainStep>::Input> + 'static;
    /// Items to the validation input.
    type ValidBatcher: Batcher<B::InnerBackend, Self::Item, <Self::ValidModel as InferenceStep>::Input>
        + 'static;

    /// A freshly initialised model on `device`. The engine seeds `B` with `training.seed`
    /// first and then broadcasts rank 0's parameters, so replicas start equal either way.
    /// `data` is there for sizes that come from the data (features, classes, vocabulary).
    fn model(
        &self,
        model: &Self::ModelConfig,
        data: &Self::DataConfig,
        device: &B::Device,
    ) -> Result<Self::Model, AppError>;

    /// The batchers for training and validation. They run on the training thread (which owns
    /// the device); `training.num_workers` threads read the items ahead through
    /// `Dataset::get`. `device` is this rank's (its own GPU under CUDA), the device every
    /// batch is also made on: a batcher that keeps a device keeps this one.
    fn batchers(
        &self,
        model: &Self::ModelConfig,
        data: &Self::DataConfig,
        device: &B::Device,
    ) -> (Self::TrainBatcher, Self::ValidBatcher);

    /// burn-train numeric metrics computed on the training outputs (after `ItemLazy::sync`),
    /// summed across ranks with their counts, logged every `training.log_every` steps.
    fn train_metrics(&self) -> Metrics<TrainSynced<Self, B>>;

    /// The same for validation outputs, over every validation sample exactly once.
    fn valid_metrics(&self) -> Metrics<ValidSynced<Self, B>>;
}

/// The synced training output of app `A` on backend `B` (what its training metrics read).
pub type TrainSynced<A, B> = <<<A as Learn<B>>::Model as TrainStep>::Output as ItemLazy>::ItemSync;
/// The synced validation output of app `A` on backend `B`.
pub type ValidSynced<A, B> =
    <<<A as Learn<B>>::ValidModel as InferenceStep>::Output as ItemLazy>::ItemSync;
