//! `mlp`: a multi-layer perceptron on flat features.

use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig, Relu};
use burn::prelude::*;
use burn_ddp::mark_block;
use serde::Deserialize;

use crate::{check_dropout, CheckError, Classifier, InputShape, ModelOptions, ModelTask};

/// Options of the `mlp` model (keys of the `[model]` table).
///
/// ```toml
/// [model]
/// name = "mlp"
/// hidden = [256, 128]   # hidden layer widths; [] gives a linear (softmax regression) model
/// dropout = 0.1         # after each hidden ReLU, training only
/// ```
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MlpOptions {
    /// Widths of the hidden layers, input side first. Default `[128]`.
    pub hidden: Vec<usize>,
    /// Dropout probability after each hidden activation, `0 <= p < 1`;
    /// `0` (the default) adds no dropout layer.
    pub dropout: f64,
}

impl Default for MlpOptions {
    fn default() -> Self {
        Self {
            hidden: vec![128],
            dropout: 0.0,
        }
    }
}

impl MlpOptions {
    /// Initialises an [`Mlp`] for `input` on `device`, drawing the weights
    /// from the device's RNG (Burn's default Kaiming-uniform initialisation).
    ///
    /// # Panics
    ///
    /// If the options do not pass [`ModelOptions::check`] (as Burn's layer
    /// configs do for invalid values); the registry always checks first.
    pub fn init(&self, input: &InputShape, device: &Device) -> Mlp {
        let mut width = input.features;
        let mut hidden = Vec::with_capacity(self.hidden.len());
        for &next in &self.hidden {
            hidden.push(LinearConfig::new(width, next).init(device));
            width = next;
        }
        Mlp {
            hidden,
            output: LinearConfig::new(width, input.classes).init(device),
            activation: Relu::new(),
            dropout: (self.dropout > 0.0).then(|| DropoutConfig::new(self.dropout).init()),
        }
    }
}

impl ModelOptions for MlpOptions {
    fn check(&self, _input: &InputShape) -> Result<(), CheckError> {
        if let Some(index) = self.hidden.iter().position(|&width| width == 0) {
            return Err(CheckError::option(
                "hidden",
                format!("layer widths must be positive, found 0 at index {index}"),
            ));
        }
        check_dropout(self.dropout)
    }

    fn build<T: ModelTask>(&self, input: &InputShape, device: &Device, task: T) -> T::Output {
        task.run(self.init(input, device))
    }
}

/// Multi-layer perceptron: `(Linear -> ReLU [-> Dropout])* -> Linear`.
///
/// Built by [`MlpOptions::init`]. Input `[batch, features]`, output logits
/// `[batch, classes]`.
#[derive(Module, Debug)]
pub struct Mlp {
    /// Hidden layers, input side first.
    hidden: Vec<Linear>,
    /// Output layer, producing the logits.
    output: Linear,
    activation: Relu,
    /// Present when `dropout > 0`.
    dropout: Option<Dropout>,
}

impl Classifier for Mlp {
    fn forward(&self, inputs: Tensor<2>) -> Tensor<2> {
        // Each layer is a block for gradient overlap: its gradients go on the wire as soon as
        // backward has passed it (an identity otherwise).
        let mut x = inputs;
        for layer in &self.hidden {
            x = self.activation.forward(mark_block(&x, layer).forward(x));
            if let Some(dropout) = &self.dropout {
                x = dropout.forward(x);
            }
        }
        mark_block(&x, &self.output).forward(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{autodiff_device, device};

    #[test]
    fn forward_shape() {
        let device = device();
        let input = InputShape::flat(64, 10);
        for hidden in [vec![], vec![128], vec![32, 16]] {
            let options = MlpOptions {
                hidden,
                dropout: 0.0,
            };
            let model = options.init(&input, &device);
            let logits = model.forward(Tensor::zeros([5, 64], &device));
            assert_eq!(logits.dims(), [5, 10], "{options:?}");
        }
    }

    #[test]
    fn forward_shape_autodiff_with_dropout() {
        let device = autodiff_device();
        let options = MlpOptions {
            hidden: vec![32],
            dropout: 0.5,
        };
        let model = options.init(&InputShape::flat(7, 3), &device);
        let logits = model.forward(Tensor::ones([4, 7], &device));
        assert_eq!(logits.dims(), [4, 3]);
    }

    #[test]
    fn parameter_count() {
        let model = MlpOptions::default().init(&InputShape::flat(64, 10), &device());
        assert_eq!(model.num_params(), 64 * 128 + 128 + 128 * 10 + 10);
    }

    #[test]
    fn check_rejects_zero_width_and_bad_dropout() {
        let input = InputShape::flat(4, 2);
        let zero = MlpOptions {
            hidden: vec![8, 0],
            dropout: 0.0,
        };
        assert!(matches!(
            zero.check(&input),
            Err(CheckError::Option {
                field: "hidden",
                ..
            })
        ));
        for dropout in [-0.1, 1.0, f64::NAN] {
            let bad = MlpOptions {
                hidden: vec![8],
                dropout,
            };
            assert!(matches!(
                bad.check(&input),
                Err(CheckError::Option {
                    field: "dropout",
                    ..
                })
            ));
        }
    }
}
