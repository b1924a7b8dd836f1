//! Reference models for `burn-ddp`, on any Burn device (Burn 0.22 picks the
//! backend at run time from the [`Device`]).
//!
//! # Digits classifiers (the registry)
//!
//! Every model of the registry takes flat features `[batch, features]`
//! (images flattened row-major) and returns logits `[batch, classes]`; see
//! [`Classifier`]. The trainer never names a model type: it passes the
//! `[model]` table of the user's TOML to [`with_model`] (or [`validate`] to
//! check it before starting any process), and the registry builds the model
//! and hands it to a [`ModelTask`]. [`DigitsModel::from_options`] builds the
//! same model as one concrete enum type instead.
//!
//! | name  | options and defaults ([`MlpOptions`], [`CnnOptions`]) | input            |
//! |-------|-------------------------------------------------------|------------------|
//! | `mlp` | `hidden = [128]`, `dropout = 0.0`                     | any              |
//! | `cnn` | `channels = [16, 32]`, `hidden = 64`, `dropout = 0.0` | 1-channel images |
//!
//! ```toml
//! [model]
//! name = "cnn"
//! channels = [16, 32]
//! dropout = 0.1
//! ```
//!
//! Options are strict: an unknown key, a wrongly typed value or an out-of-range
//! value is a [`ModelError::InvalidOptions`] that names the key.
//!
//! Initialisation draws only from the device's RNG, and [`with_model`] draws
//! every parameter before handing the model over (Burn initialises parameters
//! lazily), so a model is identical on every rank after
//! `device.seed(seed)`.
//!
//! # burn-train models
//!
//! Every model implements burn-train's [`TrainStep`](burn::train::TrainStep)
//! (on an autodiff device: forward, loss, backward) and
//! [`InferenceStep`](burn::train::InferenceStep) (on any device, typically the
//! `valid()` copy: forward and loss), so it can be trained by `burn::train`'s `Learner` or by a loop that
//! calls `TrainStep::step` and an optimizer:
//!
//! | model             | config ([`serde`], strict, defaults)   | batch (batcher)                     | loss, output                     | synthetic data          |
//! |-------------------|----------------------------------------|-------------------------------------|----------------------------------|-------------------------|
//! | [`Mlp`], [`Cnn`], [`DigitsModel`] | [`MlpOptions`], [`CnnOptions`] (registry) | [`FeaturesBatch`]    | cross-entropy, `ClassificationOutput` | -                 |
//! | [`RegressionModel`] | [`RegressionConfig`]: `hidden = [64]`, `dropout = 0.0` | [`RegressionBatch`] ([`RegressionBatcher`]) | mean squared error, `RegressionOutput` | [`SyntheticRegression`] |
//! | [`TextClassifier`] | [`TextClassifierConfig`]: `vocab_size = 32`, `max_len = 32`, `d_model = 32`, `heads = 2`, `layers = 1`, `d_ff = 64`, `dropout = 0.0`, `classes = 2` | [`TextBatch`] ([`TextBatcher`], pads) | cross-entropy, `ClassificationOutput` | [`SyntheticText`] |
//!
//! [`RegressionConfig::check`] and [`TextClassifierConfig::check`] name the
//! key at fault ([`CheckError`]), including for a layer above
//! [`MAX_LAYER_WEIGHTS`]; their `init` functions, like
//! [`DigitsModel::from_options`], draw every parameter before returning, as
//! [`with_model`] does. The synthetic data sets compute item `index` from
//! `(seed, index)` on demand and store nothing.
//!
//! # Adding a model
//!
//! One file and one registry line. Write `src/linear_probe.rs` with an
//! options struct (serde, `deny_unknown_fields`, a default for every field)
//! that implements [`ModelOptions`], and a `#[derive(Module, Debug)]` struct
//! that implements [`Classifier`] (this example is compiled as a doc test,
//! hence `models::`; inside the crate write `crate::`):
//!
//! ```
//! use burn::nn::{Linear, LinearConfig};
//! use burn::prelude::*;
//! use serde::Deserialize;
//!
//! use models::{CheckError, Classifier, InputShape, ModelOptions, ModelTask};
//!
//! #[derive(Clone, Debug, Default, Deserialize)]
//! #[serde(default, deny_unknown_fields)]
//! pub struct LinearProbeOptions {}
//!
//! #[derive(Module, Debug)]
//! pub struct LinearProbe {
//!     linear: Linear,
//! }
//!
//! impl Classifier for LinearProbe {
//!     fn forward(&self, inputs: Tensor<2>) -> Tensor<2> {
//!         self.linear.forward(inputs)
//!     }
//! }
//!
//! impl ModelOptions for LinearProbeOptions {
//!     fn check(&self, _input: &InputShape) -> Result<(), CheckError> {
//!         Ok(())
//!     }
//!     fn build<T: ModelTask>(&self, input: &InputShape, device: &Device, task: T) -> T::Output {
//!         let linear = LinearConfig::new(input.features, input.classes).init(device);
//!         task.run(LinearProbe { linear })
//!     }
//! }
//! ```
//!
//! then declare the module in `lib.rs` (`mod linear_probe;` plus a `pub use`)
//! and add its line to the `registry!` list in `src/registry.rs`:
//!
//! ```text
//! registry! {
//!     "mlp" => MlpOptions,
//!     "cnn" => CnnOptions,
//!     "linear_probe" => LinearProbeOptions,
//! }
//! ```
//!
//! The name appears in [`MODEL_NAMES`] and in the "unknown model" error from
//! then on. For burn-train, also add a variant to [`DigitsModel`] (with its
//! arm in `DigitsModel::from_options` and its name in [`DIGITS_MODEL_NAMES`];
//! a unit test checks that the two name lists agree) and the model type to
//! the `classification_steps!` line in `src/classifier.rs`.

#![warn(missing_docs)]

use burn::prelude::*;
use serde::de::DeserializeOwned;

mod classifier;
mod cnn;
mod error;
mod mlp;
mod norm;
mod registry;
mod regression;
mod text;
mod text_stage;

pub use classifier::{classification_output, DigitsModel, FeaturesBatch, DIGITS_MODEL_NAMES};
pub use cnn::{Cnn, CnnOptions};
pub use error::{CheckError, DatasetError, ModelError};
pub use mlp::{Mlp, MlpOptions};
pub use registry::{validate, with_model, MODEL_NAMES};
pub use regression::{
    RegressionBatch, RegressionBatcher, RegressionConfig, RegressionItem, RegressionModel,
    SyntheticRegression, SYNTHETIC_REGRESSION_NOISE,
};
pub use text::{
    SyntheticText, TextBatch, TextBatcher, TextClassifier, TextClassifierConfig, TextItem,
    PAD_TOKEN, RESERVED_TOKEN,
};
pub use text_stage::TextClassifierStage;

/// A classifier the trainer can train: flat features in, logits out.
pub trait Classifier: Module + core::fmt::Debug {
    /// `inputs`: [batch, features] (images flattened row-major). Returns logits [batch, classes].
    ///
    /// Layers with train-only behaviour (dropout) are active only on an
    /// autodiff device, as in Burn: the `valid()` copy of a model evaluates
    /// deterministically.
    fn forward(&self, inputs: Tensor<2>) -> Tensor<2>;
}

/// What a model needs to know about the data.
#[derive(Clone, Debug, PartialEq)]
pub struct InputShape {
    /// Number of input features per sample (the width of `inputs`).
    pub features: usize,
    /// Number of classes (the width of the logits).
    pub classes: usize,
    /// Some((height, width)) for image data (height*width == features), None otherwise
    pub image: Option<(usize, usize)>,
}

impl InputShape {
    /// Flat (non-image) data with `features` features per sample.
    #[must_use]
    pub fn flat(features: usize, classes: usize) -> Self {
        Self {
            features,
            classes,
            image: None,
        }
    }

    /// Single-channel `height` x `width` images, flattened row-major.
    #[must_use]
    pub fn image(height: usize, width: usize, classes: usize) -> Self {
        Self {
            features: height * width,
            classes,
            image: Some((height, width)),
        }
    }
}

/// Work the trainer does with a concrete model type (the registry calls `run`
/// with the model it built).
///
/// The model's type is only known inside the registry, so the work is a
/// generic function over it; its `valid()` copy has the same type.
pub trait ModelTask {
    /// What the work returns; [`with_model`] passes it through.
    type Output;
    /// Runs the work with a freshly initialised model on the device given to [`with_model`].
    fn run<M: Classifier + 'static>(self, model: M) -> Self::Output;
}

/// The options of one kind of model: deserialized from the `[model]` table
/// (without its `name` key), checked against the data, then used to build the
/// model.
///
/// Implementors use `#[serde(default, deny_unknown_fields)]` so that every key
/// is optional and a misspelt key is an error.
pub trait ModelOptions: DeserializeOwned + Default + core::fmt::Debug {
    /// Checks the option values against each other and against the data,
    /// without allocating any tensor. [`build`](Self::build) is only called
    /// after this returned `Ok`, so it may rely on what is checked here.
    ///
    /// # Errors
    ///
    /// [`CheckError::Option`] naming the key of an out-of-range or
    /// inconsistent value, or [`CheckError::Input`] for data the model cannot
    /// take. Type errors and unknown keys never get here: deserialization
    /// reports them.
    fn check(&self, input: &InputShape) -> Result<(), CheckError>;

    /// Initialises the model on `device` (drawing only from the device's
    /// seeded RNG) and passes it to `task`.
    fn build<T: ModelTask>(&self, input: &InputShape, device: &Device, task: T) -> T::Output;
}

/// Checks a `dropout` probability option: `0 <= p < 1`. Burn's
/// `DropoutConfig::init` panics outside `[0, 1]`, and `p = 1` would zero every
/// activation (and rescale by `1 / 0`).
pub(crate) fn check_dropout(dropout: f64) -> Result<(), CheckError> {
    if (0.0..1.0).contains(&dropout) {
        Ok(())
    } else {
        Err(CheckError::option(
            "dropout",
            format!("expected a probability in [0, 1), found {dropout}"),
        ))
    }
}

/// The most weights one layer of a model may have: `2^28` (1 GiB of `f32`).
///
/// The `check` functions reject larger layers by naming the option at fault,
/// so that a mistyped width (`hidden = [100000000]`) is a clear error rather
/// than an allocation failure that aborts the process.
pub const MAX_LAYER_WEIGHTS: usize = 1 << 28;

/// What is wrong with a layer of `inputs x outputs` weights, if it is larger
/// than [`MAX_LAYER_WEIGHTS`] (or its size overflows `usize`); `layer` names it
/// in the message.
pub(crate) fn oversized_layer(layer: &str, inputs: usize, outputs: usize) -> Option<String> {
    match inputs.checked_mul(outputs) {
        Some(weights) if weights <= MAX_LAYER_WEIGHTS => None,
        weights => Some(format!(
            "{layer} would have {inputs} x {outputs} = {} weights, more than the limit of \
             {MAX_LAYER_WEIGHTS} (2^28) per layer; is a size mistyped?",
            weights.map_or_else(|| "more than usize::MAX".to_owned(), |w| w.to_string()),
        )),
    }
}

#[cfg(test)]
pub(crate) mod test_util {
    use super::*;

    /// The plain (non-autodiff) CPU device of the unit tests.
    pub fn device() -> Device {
        Device::flex()
    }

    /// The autodiff CPU device of the unit tests (training).
    pub fn autodiff_device() -> Device {
        Device::flex().autodiff()
    }

    /// Parses a TOML snippet into the `[model]` table the trainer would pass.
    pub fn table(src: &str) -> toml::Table {
        src.parse::<toml::Table>().expect("test TOML is valid")
    }

    /// The shape of the 8x8 digits data.
    pub fn digits() -> InputShape {
        InputShape::image(8, 8, 10)
    }

    /// A [`ModelTask`] that runs one forward pass on the (autodiff) model and
    /// one on its `valid()` copy, and returns both output shapes.
    pub struct ForwardShapes {
        pub batch: usize,
        pub features: usize,
    }

    impl ModelTask for ForwardShapes {
        type Output = ([usize; 2], [usize; 2]);

        fn run<M: Classifier + 'static>(self, model: M) -> Self::Output {
            let inputs = Tensor::<2>::ones([self.batch, self.features], &autodiff_device());
            let train = model.forward(inputs.clone()).dims();
            let valid = model.valid().forward(inputs.without_autodiff()).dims();
            (train, valid)
        }
    }
}
