//! `regression`: a multi-layer perceptron predicting real-valued targets, its
//! data items and batcher, and a lazily computed synthetic data set.

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::nn::loss::{MseLoss, Reduction};
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn::train::{InferenceStep, RegressionOutput, TrainOutput, TrainStep};
use serde::{Deserialize, Serialize};

use crate::registry::draw_params;
use crate::{check_dropout, oversized_layer, CheckError};
use burn_ddp::mark_block;
use burn_ddp::rng::SplitMix64;

/// Configuration of a [`RegressionModel`].
///
/// ```toml
/// hidden = [64, 64]   # hidden layer widths; [] gives linear regression
/// dropout = 0.1       # after each hidden ReLU, training only
/// ```
///
/// Every key is optional and an unknown key is a deserialization error.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegressionConfig {
    /// Widths of the hidden layers, input side first. Default `[64]`.
    pub hidden: Vec<usize>,
    /// Dropout probability after each hidden activation, `0 <= p < 1`;
    /// `0` (the default) adds no dropout layer.
    pub dropout: f64,
}

impl Default for RegressionConfig {
    fn default() -> Self {
        Self {
            hidden: vec![64],
            dropout: 0.0,
        }
    }
}

impl RegressionConfig {
    /// Checks the configuration for data with `features` inputs and `targets`
    /// outputs per sample, without allocating any tensor.
    ///
    /// # Errors
    ///
    /// - [`CheckError::Input`] if `features` or `targets` is 0, or if
    ///   `hidden = []` and the single `features x targets` layer has more than
    ///   [`MAX_LAYER_WEIGHTS`](crate::MAX_LAYER_WEIGHTS) weights;
    /// - [`CheckError::Option`] naming `hidden` for a zero width or for a layer
    ///   with more than [`MAX_LAYER_WEIGHTS`](crate::MAX_LAYER_WEIGHTS)
    ///   weights, or naming `dropout` for a value outside `[0, 1)`.
    pub fn check(&self, features: usize, targets: usize) -> Result<(), CheckError> {
        if features == 0 || targets == 0 {
            return Err(CheckError::input(format!(
                "it needs at least one feature and one target, but got {features} features \
                 and {targets} targets"
            )));
        }
        if let Some(index) = self.hidden.iter().position(|&width| width == 0) {
            return Err(CheckError::option(
                "hidden",
                format!("layer widths must be positive, found 0 at index {index}"),
            ));
        }
        check_dropout(self.dropout)?;
        let widths: Vec<usize> = core::iter::once(features)
            .chain(self.hidden.iter().copied())
            .chain(core::iter::once(targets))
            .collect();
        for (index, pair) in widths.windows(2).enumerate() {
            let layer = format!("layer {index} ({} -> {})", pair[0], pair[1]);
            if let Some(message) = oversized_layer(&layer, pair[0], pair[1]) {
                return Err(if self.hidden.is_empty() {
                    CheckError::input(message)
                } else {
                    CheckError::option("hidden", message)
                });
            }
        }
        Ok(())
    }

    /// Initialises a [`RegressionModel`] with `features` inputs and `targets`
    /// outputs on `device`, drawing the weights from the device's RNG (Burn's
    /// default Kaiming-uniform initialisation). Every parameter is drawn, in
    /// declaration order, before this returns, so the model depends only on
    /// the RNG state (`device.seed`) and not on later use.
    ///
    /// # Panics
    ///
    /// If [`check`](Self::check) fails for `features` and `targets` (as Burn's
    /// layer configs do for invalid values); call it first.
    pub fn init(&self, features: usize, targets: usize, device: &Device) -> RegressionModel {
        let model = self.init_lazy(features, targets, device);
        draw_params(&model);
        model
    }

    /// [`init`](Self::init) without drawing the parameters (see
    /// [`burn_ddp::parameter_count`]).
    ///
    /// # Panics
    ///
    /// As [`init`](Self::init).
    pub fn init_lazy(&self, features: usize, targets: usize, device: &Device) -> RegressionModel {
        if let Err(error) = self.check(features, targets) {
            panic!("RegressionConfig::init: invalid configuration (call check first): {error:?}");
        }
        let mut width = features;
        let mut hidden = Vec::with_capacity(self.hidden.len());
        for &next in &self.hidden {
            hidden.push(LinearConfig::new(width, next).init(device));
            width = next;
        }
        RegressionModel {
            hidden,
            output: LinearConfig::new(width, targets).init(device),
            activation: Relu::new(),
            dropout: (self.dropout > 0.0).then(|| DropoutConfig::new(self.dropout).init()),
        }
    }
}

/// Regression MLP: `(Linear -> ReLU [-> Dropout])* -> Linear`.
///
/// Built by [`RegressionConfig::init`]. Input `[batch, features]`, output
/// `[batch, targets]` (unbounded real values). Trained by mean squared error
/// through burn-train's [`TrainStep`]; [`InferenceStep`] evaluates the same
/// loss.
#[derive(Module, Debug)]
pub struct RegressionModel {
    /// Hidden layers, input side first.
    hidden: Vec<Linear>,
    /// Output layer, producing the predictions.
    output: Linear,
    activation: Relu,
    /// Present when `dropout > 0`.
    dropout: Option<Dropout>,
}

impl RegressionModel {
    /// `inputs`: `[batch, features]`. Returns the predictions `[batch, targets]`.
    ///
    /// Dropout is active only on an autodiff device, as in Burn: the
    /// `valid()` copy evaluates deterministically.
    pub fn forward(&self, inputs: Tensor<2>) -> Tensor<2> {
        // Each layer is a block for gradient overlap (an identity outside it).
        let mut x = inputs;
        for layer in &self.hidden {
            x = self.activation.forward(mark_block(&x, layer).forward(x));
            if let Some(dropout) = &self.dropout {
                x = dropout.forward(x);
            }
        }
        mark_block(&x, &self.output).forward(x)
    }

    /// Predicts `batch.inputs` and returns the mean squared error against
    /// `batch.targets` (a 1-element loss, averaged over samples and targets)
    /// with the predictions and targets, as burn-train's metrics expect.
    pub fn forward_regression(&self, batch: RegressionBatch) -> RegressionOutput {
        let output = self.forward(batch.inputs);
        let loss = MseLoss::new().forward(output.clone(), batch.targets.clone(), Reduction::Mean);
        RegressionOutput::new(loss, output, batch.targets)
    }
}

impl TrainStep for RegressionModel {
    type Input = RegressionBatch;
    type Output = RegressionOutput;

    fn step(&self, batch: RegressionBatch) -> TrainOutput<RegressionOutput> {
        let item = self.forward_regression(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for RegressionModel {
    type Input = RegressionBatch;
    type Output = RegressionOutput;

    fn step(&self, batch: RegressionBatch) -> RegressionOutput {
        self.forward_regression(batch)
    }
}

/// One regression sample.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct RegressionItem {
    /// The inputs.
    pub features: Vec<f32>,
    /// The values to predict.
    pub targets: Vec<f32>,
}

/// A batch of [`RegressionItem`]s, as made by [`RegressionBatcher`].
#[derive(Clone, Debug)]
pub struct RegressionBatch {
    /// `[batch, features]`.
    pub inputs: Tensor<2>,
    /// `[batch, targets]`.
    pub targets: Tensor<2>,
}

/// Stacks [`RegressionItem`]s into a [`RegressionBatch`], in item order.
#[derive(Clone, Copy, Debug, Default)]
pub struct RegressionBatcher;

impl Batcher<RegressionItem, RegressionBatch> for RegressionBatcher {
    /// An empty `items` gives `[0, 0]` tensors.
    ///
    /// # Panics
    ///
    /// If the items do not all have as many features and targets as the first
    /// one (the `Batcher` contract has no way to report an error).
    fn batch(&self, items: Vec<RegressionItem>, device: &Device) -> RegressionBatch {
        let (features, targets) = items
            .first()
            .map_or((0, 0), |item| (item.features.len(), item.targets.len()));
        let mut inputs = Vec::with_capacity(items.len() * features);
        let mut outputs = Vec::with_capacity(items.len() * targets);
        for (index, item) in items.iter().enumerate() {
            assert!(
                item.features.len() == features && item.targets.len() == targets,
                "RegressionBatcher: item {index} of the batch has {} features and {} targets, \
                 but item 0 has {features} and {targets}",
                item.features.len(),
                item.targets.len(),
            );
            inputs.extend_from_slice(&item.features);
            outputs.extend_from_slice(&item.targets);
        }
        let batch = items.len();
        RegressionBatch {
            inputs: Tensor::from_data(TensorData::new(inputs, [batch, features]), device),
            targets: Tensor::from_data(TensorData::new(outputs, [batch, targets]), device),
        }
    }
}

/// Half-width of the uniform noise added to every target of
/// [`SyntheticRegression`] (standard deviation `0.05 / sqrt(3) ≈ 0.029`).
pub const SYNTHETIC_REGRESSION_NOISE: f32 = 0.05;

/// A synthetic regression data set computed on demand: item `index` depends
/// only on `(seed, index)`, nothing is stored (not even the weights below),
/// and any index is as cheap as any other: `O(features x targets)`.
///
/// Features `x_i` are uniform in `[-1, 1)`. Target `j` is
///
/// `y_j = sum_i w_ji x_i + 0.5 sin((j + 1) x_0) + e_j`
///
/// with weights `w_ji` uniform in `[-1, 1) / sqrt(features)` (drawn from the
/// seed alone, the same for every item) and noise `e_j` uniform in
/// `[-0.05, 0.05)` ([`SYNTHETIC_REGRESSION_NOISE`]), so the best possible mean
/// squared error is about `8.3e-4`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyntheticRegression {
    samples: usize,
    features: usize,
    targets: usize,
    seed: u64,
}

/// Mixed into the seed for the generator streams of the weights (one stream
/// per target), which must not be the item streams (one per index).
const WEIGHT_SEED: u64 = 0x5745_4947_4854_5321;

impl SyntheticRegression {
    /// `samples` items of `features` inputs and `targets` outputs, drawn from
    /// `seed`. Allocates nothing.
    #[must_use]
    pub fn new(samples: usize, features: usize, targets: usize, seed: u64) -> Self {
        Self {
            samples,
            features,
            targets,
            seed,
        }
    }

    /// Inputs per item.
    #[must_use]
    pub fn features(&self) -> usize {
        self.features
    }

    /// Outputs per item.
    #[must_use]
    pub fn targets(&self) -> usize {
        self.targets
    }

    /// The weights `w_j0 .. w_j(features-1)` of target `j`.
    fn weights(&self, j: usize) -> impl Iterator<Item = f32> {
        // `usize` is at most 64 bits wide: lossless.
        let mut rng = SplitMix64::stream(self.seed ^ WEIGHT_SEED, j as u64);
        // Any rounding of the feature count only scales the weights.
        let scale = 1.0 / (self.features.max(1) as f32).sqrt();
        (0..self.features).map(move |_| rng.symmetric_f32() * scale)
    }
}

impl Dataset<RegressionItem> for SyntheticRegression {
    /// The item at `index`; never an error (the item is computed).
    ///
    /// # Panics
    ///
    /// If `index >= len()`, as Burn's `Dataset::get` contract says.
    fn get(&self, index: usize) -> Result<RegressionItem, DatasetError> {
        assert!(
            index < self.samples,
            "SyntheticRegression::get: index {index} out of range (len {})",
            self.samples
        );
        // `usize` is at most 64 bits wide: lossless.
        let mut rng = SplitMix64::stream(self.seed, index as u64);
        let features: Vec<f32> = (0..self.features).map(|_| rng.symmetric_f32()).collect();
        let first = features.first().copied().unwrap_or(0.0);
        let targets = (0..self.targets)
            .map(|j| {
                let linear: f32 = self.weights(j).zip(&features).map(|(w, x)| w * x).sum();
                let wave = 0.5 * ((j + 1) as f32 * first).sin();
                linear + wave + SYNTHETIC_REGRESSION_NOISE * rng.symmetric_f32()
            })
            .collect();
        Ok(RegressionItem { features, targets })
    }

    fn len(&self) -> usize {
        self.samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{autodiff_device, device};
    use burn::optim::AdamConfig;

    #[test]
    fn forward_shape() {
        let device = device();
        for hidden in [vec![], vec![16], vec![8, 4]] {
            let config = RegressionConfig {
                hidden,
                dropout: 0.0,
            };
            config.check(5, 3).expect("valid");
            let model = config.init(5, 3, &device);
            let output = model.forward(Tensor::zeros([7, 5], &device));
            assert_eq!(output.dims(), [7, 3], "{config:?}");
        }
        let model = RegressionConfig {
            hidden: vec![8],
            dropout: 0.5,
        }
        .init(4, 2, &autodiff_device());
        assert_eq!(
            model
                .forward(Tensor::ones([3, 4], &autodiff_device()))
                .dims(),
            [3, 2]
        );
    }

    #[test]
    fn parameter_count_and_eager_init() {
        let model = RegressionConfig::default().init(10, 2, &device());
        assert_eq!(model.num_params(), 10 * 64 + 64 + 64 * 2 + 2);
    }

    #[test]
    fn config_serde_is_strict_with_defaults() {
        let parsed: RegressionConfig = toml::from_str("").expect("all keys optional");
        assert_eq!(parsed, RegressionConfig::default());
        let parsed: RegressionConfig = toml::from_str("hidden = [3, 2]").expect("valid");
        assert_eq!(parsed.hidden, [3, 2]);
        assert_eq!(parsed.dropout, 0.0);
        let error = toml::from_str::<RegressionConfig>("hiden = [3]").unwrap_err();
        assert!(error.to_string().contains("hiden"), "{error}");
        let text = toml::to_string(&parsed).expect("serializes");
        assert_eq!(toml::from_str::<RegressionConfig>(&text), Ok(parsed));
    }

    fn field(result: Result<(), CheckError>) -> Option<&'static str> {
        match result {
            Err(CheckError::Option { field, .. }) => Some(field),
            _ => None,
        }
    }

    #[test]
    fn check_names_the_key() {
        let config = |hidden: Vec<usize>, dropout| RegressionConfig { hidden, dropout };
        assert_eq!(config(vec![8], 0.0).check(4, 1), Ok(()));
        assert_eq!(field(config(vec![8, 0], 0.0).check(4, 1)), Some("hidden"));
        for dropout in [-0.1, 1.0, f64::NAN] {
            assert_eq!(field(config(vec![8], dropout).check(4, 1)), Some("dropout"));
        }
        // A mistyped width is a message, not an allocation failure.
        let huge = config(vec![100_000_000], 0.0).check(64, 1);
        assert_eq!(field(huge.clone()), Some("hidden"));
        let Err(CheckError::Option { message, .. }) = huge else {
            unreachable!()
        };
        assert!(
            message.contains("100000000") && message.contains("2^28"),
            "{message}"
        );
        assert_eq!(
            field(config(vec![usize::MAX, 2], 0.0).check(4, 1)),
            Some("hidden")
        );
        // Exactly at the limit is fine.
        assert_eq!(config(vec![1 << 14], 0.0).check(1 << 14, 1), Ok(()));
    }

    #[test]
    fn check_rejects_bad_data() {
        let config = RegressionConfig::default();
        assert!(matches!(config.check(0, 1), Err(CheckError::Input(_))));
        assert!(matches!(config.check(3, 0), Err(CheckError::Input(_))));
        let linear = RegressionConfig {
            hidden: vec![],
            dropout: 0.0,
        };
        assert!(matches!(
            linear.check(1 << 20, 1 << 10),
            Err(CheckError::Input(_))
        ));
    }

    #[test]
    #[should_panic(expected = "call check first")]
    fn init_panics_on_an_unchecked_config() {
        let config = RegressionConfig {
            hidden: vec![0],
            dropout: 0.0,
        };
        let _ = config.init(2, 1, &device());
    }

    #[test]
    fn dataset_is_deterministic() {
        let data = SyntheticRegression::new(100, 6, 2, 42);
        assert_eq!(data.len(), 100);
        assert_eq!((data.features(), data.targets()), (6, 2));
        let get = |data: &SyntheticRegression, index| data.get(index).expect("in range");
        let item = get(&data, 17);
        assert_eq!(item.features.len(), 6);
        assert_eq!(item.targets.len(), 2);
        assert!(item.features.iter().all(|x| (-1.0..1.0).contains(x)));
        assert_eq!(get(&data, 17), item);
        assert_eq!(get(&SyntheticRegression::new(100, 6, 2, 42), 17), item);
        assert_ne!(get(&data, 18), item);
        assert_ne!(get(&SyntheticRegression::new(100, 6, 2, 43), 17), item);
    }

    #[test]
    #[should_panic(expected = "index 100 out of range")]
    fn dataset_get_past_the_end_panics() {
        let _ = SyntheticRegression::new(100, 6, 2, 42).get(100);
    }

    #[test]
    fn dataset_is_lazy() {
        // Storing usize::MAX items would be impossible.
        let data = SyntheticRegression::new(usize::MAX, 3, usize::MAX, 0);
        assert_eq!(data.targets(), usize::MAX);
        let data = SyntheticRegression::new(usize::MAX, 3, 1, 0);
        assert_eq!(data.len(), usize::MAX);
        assert!(data.get(usize::MAX - 1).is_ok());
    }

    #[test]
    fn targets_follow_the_documented_function() {
        let data = SyntheticRegression::new(50, 4, 3, 9);
        for index in 0..50 {
            let item = data.get(index).expect("in range");
            for (j, &y) in item.targets.iter().enumerate() {
                let weights: Vec<f32> = data.weights(j).collect();
                assert_eq!(weights.len(), 4);
                assert!(weights.iter().all(|w| w.abs() <= 0.5), "{weights:?}");
                let linear: f32 = weights.iter().zip(&item.features).map(|(w, x)| w * x).sum();
                let clean = linear + 0.5 * ((j + 1) as f32 * item.features[0]).sin();
                assert!(
                    (y - clean).abs() <= SYNTHETIC_REGRESSION_NOISE,
                    "{index}/{j}"
                );
            }
        }
    }

    #[test]
    fn batcher_stacks_items_in_order() {
        let device = device();
        let items = vec![
            RegressionItem {
                features: vec![1.0, 2.0],
                targets: vec![3.0],
            },
            RegressionItem {
                features: vec![4.0, 5.0],
                targets: vec![6.0],
            },
        ];
        let batch: RegressionBatch = RegressionBatcher.batch(items, &device);
        assert_eq!(batch.inputs.dims(), [2, 2]);
        assert_eq!(batch.targets.dims(), [2, 1]);
        assert_eq!(
            batch.inputs.into_data().try_to_vec::<f32>().ok(),
            Some(vec![1.0, 2.0, 4.0, 5.0])
        );
        assert_eq!(
            batch.targets.into_data().try_to_vec::<f32>().ok(),
            Some(vec![3.0, 6.0])
        );
    }

    #[test]
    #[should_panic(expected = "item 1 of the batch has 1 features")]
    fn batcher_rejects_ragged_items() {
        let items = vec![
            RegressionItem {
                features: vec![1.0, 2.0],
                targets: vec![3.0],
            },
            RegressionItem {
                features: vec![4.0],
                targets: vec![6.0],
            },
        ];
        let _: RegressionBatch = RegressionBatcher.batch(items, &device());
    }

    #[test]
    fn train_step_reduces_the_loss() {
        let device = autodiff_device();
        let data = SyntheticRegression::new(256, 8, 2, 1);
        let config = RegressionConfig {
            hidden: vec![32],
            dropout: 0.0,
        };
        let mut model = config.init(8, 2, &device);
        let mut optimizer = AdamConfig::new().init();
        let batches: Vec<RegressionBatch> = (0..4)
            .map(|b| {
                let items = (b * 64..(b + 1) * 64)
                    .map(|i| data.get(i).expect("computed"))
                    .collect();
                RegressionBatcher.batch(items, &device)
            })
            .collect();
        let epoch_loss = |model: &RegressionModel| -> f32 {
            let valid = model.valid();
            let total: f32 = batches
                .iter()
                .map(|batch| {
                    let batch = RegressionBatch {
                        inputs: batch.inputs.clone().without_autodiff(),
                        targets: batch.targets.clone().without_autodiff(),
                    };
                    let output = InferenceStep::step(&valid, batch);
                    assert_eq!(output.output.dims(), [64, 2]);
                    output.loss.into_scalar::<f32>()
                })
                .sum();
            total / batches.len() as f32
        };
        let before = epoch_loss(&model);
        for _ in 0..15 {
            for batch in &batches {
                let output = TrainStep::step(&model, batch.clone());
                assert_eq!(output.item.loss.dims(), [1]);
                model = optimizer.step(1e-2, model, output.grads);
            }
        }
        let after = epoch_loss(&model);
        assert!(
            after.is_finite() && after < 0.2 * before,
            "{before} -> {after}"
        );
    }
}
