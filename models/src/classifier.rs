//! The digits classifiers ([`Mlp`], [`Cnn`]) under burn-train's training
//! contract: a batch type, [`TrainStep`] / [`InferenceStep`] on each model,
//! and [`DigitsModel`], one concrete type for whichever of them the `[model]`
//! table names.

use burn::nn::loss::CrossEntropyLossConfig;
use burn::prelude::*;
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};

use crate::registry::{draw_params, parse};
use crate::{Classifier, Cnn, CnnOptions, InputShape, Mlp, MlpOptions, ModelError};

/// A batch of flat features with class labels, the input of the
/// [`TrainStep`] and [`InferenceStep`] of every [`Classifier`] in this crate.
#[derive(Clone, Debug)]
pub struct FeaturesBatch {
    /// `[batch, features]` (images flattened row-major).
    pub inputs: Tensor<2>,
    /// `[batch]`: class indices in `0..classes`.
    pub targets: Tensor<1, Int>,
}

/// Classifies `batch` with `model` and returns the cross-entropy loss (mean
/// over the batch) with the logits and targets, as burn-train's classification
/// metrics expect.
pub fn classification_output<M: Classifier>(
    model: &M,
    batch: FeaturesBatch,
) -> ClassificationOutput {
    let logits = model.forward(batch.inputs);
    let loss = CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits.clone(), batch.targets.clone());
    ClassificationOutput::new(loss, logits, batch.targets)
}

/// Implements burn-train's steps on a [`Classifier`] with [`FeaturesBatch`]
/// input: cross-entropy, backward pass for training (on an autodiff device).
macro_rules! classification_steps {
    ($($model:ident),+ $(,)?) => {$(
        impl TrainStep for $model {
            type Input = FeaturesBatch;
            type Output = ClassificationOutput;

            fn step(&self, batch: FeaturesBatch) -> TrainOutput<ClassificationOutput> {
                let item = classification_output(self, batch);
                TrainOutput::new(self, item.loss.backward(), item)
            }
        }

        impl InferenceStep for $model {
            type Input = FeaturesBatch;
            type Output = ClassificationOutput;

            fn step(&self, batch: FeaturesBatch) -> ClassificationOutput {
                classification_output(self, batch)
            }
        }
    )+};
}

classification_steps!(Mlp, Cnn, DigitsModel);

/// Names accepted by [`DigitsModel::from_options`]: every name of
/// [`MODEL_NAMES`](crate::MODEL_NAMES), one per variant.
pub const DIGITS_MODEL_NAMES: &[&str] = &["mlp", "cnn"];

/// One type for any registered classifier, chosen at run time by name: for
/// code that needs a concrete model type (burn-train's `Learner`, a
/// checkpoint record) rather than the generic [`ModelTask`](crate::ModelTask)
/// of [`with_model`](crate::with_model).
///
/// A Burn enum module: its record is that of the variant, so a record saved
/// from one variant loads only into the same variant with the same options.
// A model is built once and then moved by value a few times per step at
// most; the size difference of the variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum DigitsModel {
    /// The `mlp` model.
    Mlp(Mlp),
    /// The `cnn` model.
    Cnn(Cnn),
}

impl DigitsModel {
    /// Builds the model `name` with `options` for `input` on `device`, with
    /// the same contract as [`with_model`](crate::with_model): `options` is
    /// the `[model]` table (a `name` key is ignored), parsed and validated
    /// exactly as [`validate`](crate::validate) does, and every parameter is
    /// drawn from the device's RNG, in declaration order, before this
    /// returns. So after `device.seed(seed)` the parameters are those
    /// `with_model` would give, on every rank.
    ///
    /// # Errors
    ///
    /// [`ModelError::UnknownModel`] (listing [`DIGITS_MODEL_NAMES`]),
    /// [`ModelError::InvalidOptions`] or [`ModelError::IncompatibleInput`];
    /// nothing is allocated on `device` in that case.
    pub fn from_options(
        name: &str,
        options: &toml::Table,
        input: &InputShape,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let model = Self::lazy(name, options, input, device)?;
        draw_params(&model);
        Ok(model)
    }

    /// [`from_options`](Self::from_options) without drawing the parameters: nothing of the
    /// parameters' size is allocated until first use (see [`burn_ddp::parameter_count`]).
    pub fn lazy(
        name: &str,
        options: &toml::Table,
        input: &InputShape,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let model = match name {
            "mlp" => Self::Mlp(parse::<MlpOptions>("mlp", options, input)?.init(input, device)),
            "cnn" => Self::Cnn(parse::<CnnOptions>("cnn", options, input)?.init(input, device)),
            _ => {
                return Err(ModelError::UnknownModel {
                    name: name.to_owned(),
                    known: DIGITS_MODEL_NAMES,
                })
            }
        };
        Ok(model)
    }

    /// The registry name of the variant (`"mlp"` or `"cnn"`).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Mlp(_) => "mlp",
            Self::Cnn(_) => "cnn",
        }
    }
}

impl Classifier for DigitsModel {
    fn forward(&self, inputs: Tensor<2>) -> Tensor<2> {
        match self {
            Self::Mlp(model) => model.forward(inputs),
            Self::Cnn(model) => model.forward(inputs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{autodiff_device, device, digits, table};
    use crate::MODEL_NAMES;
    use burn::optim::AdamConfig;

    #[test]
    fn every_registered_model_has_a_variant() {
        assert_eq!(DIGITS_MODEL_NAMES, MODEL_NAMES);
        for name in MODEL_NAMES {
            let model = DigitsModel::from_options(name, &toml::Table::new(), &digits(), &device())
                .expect("defaults are valid");
            assert_eq!(model.name(), *name);
            let logits = model.forward(Tensor::zeros([3, 64], &device()));
            assert_eq!(logits.dims(), [3, 10], "{name}");
        }
    }

    #[test]
    fn from_options_reports_what_validate_reports() {
        let device = device();
        for (name, options, input) in [
            ("mlp", "hiden = 3", digits()),
            ("mlp", "hidden = \"8\"", digits()),
            ("cnn", "dropout = 1.0", digits()),
            ("cnn", "", InputShape::flat(64, 10)),
            ("resnet", "", digits()),
        ] {
            let expected = crate::validate(name, &table(options), &input).unwrap_err();
            let error =
                DigitsModel::from_options(name, &table(options), &input, &device).unwrap_err();
            assert_eq!(error, expected, "{name} {options:?}");
        }
        // Options are applied.
        let model = DigitsModel::from_options(
            "mlp",
            &table("name = \"mlp\"\nhidden = [7]"),
            &InputShape::flat(5, 2),
            &device,
        )
        .expect("valid");
        assert_eq!(model.num_params(), 5 * 7 + 7 + 7 * 2 + 2);
    }

    #[test]
    fn every_parameter_is_drawn() {
        use burn::module::{ModuleVisitor, Param};

        struct Count(usize, usize);

        impl ModuleVisitor for Count {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                self.0 += 1;
                self.1 += usize::from(param.is_initialized());
            }
        }

        for name in DIGITS_MODEL_NAMES {
            let model = DigitsModel::from_options(name, &toml::Table::new(), &digits(), &device())
                .expect("valid");
            let mut count = Count(0, 0);
            model.visit(&mut count);
            assert!(count.0 > 0);
            assert_eq!(count.0, count.1, "{name}");
        }
    }

    fn digits_batch(samples: usize, device: &Device) -> FeaturesBatch {
        let pixels = (0..samples * 64)
            .map(|i| ((i as u64 * 2_654_435_761) % 17) as f32 / 16.0)
            .collect::<Vec<_>>();
        let labels = (0..samples as i64).map(|i| i % 10).collect::<Vec<_>>();
        FeaturesBatch {
            inputs: Tensor::from_data(TensorData::new(pixels, [samples, 64]), device),
            targets: Tensor::from_data(TensorData::new(labels, [samples]), device),
        }
    }

    /// Runs `steps` Adam steps through `TrainStep` on one fixed batch; returns
    /// the `InferenceStep` loss of the `valid()` copy before and after.
    fn fit<M>(mut model: M, steps: usize) -> (f32, f32)
    where
        M: Module
            + TrainStep<Input = FeaturesBatch, Output = ClassificationOutput>
            + InferenceStep<Input = FeaturesBatch, Output = ClassificationOutput>,
    {
        let batch = digits_batch(32, &autodiff_device());
        let valid_loss = |model: &M| {
            let output = InferenceStep::step(&model.valid(), digits_batch(32, &device()));
            assert_eq!(output.output.dims(), [32, 10]);
            output.loss.into_scalar::<f32>()
        };
        let before = valid_loss(&model);
        let mut optimizer = AdamConfig::new().init();
        for _ in 0..steps {
            let output = TrainStep::step(&model, batch.clone());
            assert_eq!(output.item.loss.dims(), [1]);
            model = optimizer.step(1e-2, model, output.grads);
        }
        (before, valid_loss(&model))
    }

    #[test]
    fn train_steps_reduce_the_loss() {
        let device = autodiff_device();
        // Seeded: an unlucky random start of the small CNN once missed the bar (the other
        // tests of this binary may draw from the same generator meanwhile, so the start is
        // not fixed, only a good one likely).
        device.seed(11);
        let input = digits();
        let mlp = MlpOptions::default().init(&input, &device);
        let (before, after) = fit(mlp, 40);
        assert!(after < 0.6 * before, "mlp: {before} -> {after}");
        let cnn = CnnOptions {
            channels: [8, 16],
            hidden: 32,
            dropout: 0.0,
            batch_norm: true,
            sync_batch_norm: false,
        }
        .init(&input, &device);
        let (before, after) = fit(cnn, 40);
        assert!(after < 0.6 * before, "cnn: {before} -> {after}");
        for name in DIGITS_MODEL_NAMES {
            let model = DigitsModel::from_options(name, &table("dropout = 0.1"), &input, &device)
                .expect("valid");
            let (before, after) = fit(model, 40);
            assert!(
                after < 0.6 * before,
                "DigitsModel {name}: {before} -> {after}"
            );
        }
    }
}
