//! Every registered model can be trained the way the trainer does it: Adam on
//! cross-entropy through a `ModelTask`, with a `valid()` copy for evaluation.

use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams};
use burn::prelude::*;
use models::{with_model, Classifier, InputShape, ModelTask, MODEL_NAMES};

const SAMPLES: usize = 32;
const FEATURES: usize = 64;
const CLASSES: usize = 10;

/// Fits one fixed batch for `steps` Adam steps; returns the loss before and
/// after, and the largest difference between the trained model's logits and
/// its `valid()` copy's.
struct FitBatch {
    steps: usize,
}

impl ModelTask for FitBatch {
    type Output = (f32, f32, f32);

    fn run<M: Classifier + 'static>(self, mut model: M) -> Self::Output {
        let device = Device::flex().autodiff();
        // Fixed pseudo-random pixels in [0, 1] and balanced labels.
        let pixels = (0..SAMPLES * FEATURES)
            .map(|i| ((i as u64 * 2_654_435_761) % 17) as f32 / 16.0)
            .collect::<Vec<_>>();
        let labels = (0..SAMPLES as i64)
            .map(|i| i % CLASSES as i64)
            .collect::<Vec<_>>();
        let inputs = Tensor::<2>::from_data(TensorData::new(pixels, [SAMPLES, FEATURES]), &device);
        let targets = Tensor::<1, Int>::from_data(TensorData::new(labels, [SAMPLES]), &device);
        let loss_fn = CrossEntropyLossConfig::new().init(&device);
        let mut optimizer = AdamConfig::new().init();

        let mut losses = Vec::with_capacity(self.steps);
        for _ in 0..self.steps {
            let loss = loss_fn.forward(model.forward(inputs.clone()), targets.clone());
            losses.push(loss.clone().into_scalar::<f32>());
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(1e-2, model, grads);
        }

        let train_logits = model.forward(inputs.clone()).without_autodiff();
        let valid_logits = model.valid().forward(inputs.without_autodiff());
        let max_diff = (train_logits - valid_logits)
            .abs()
            .max()
            .into_scalar::<f32>();
        (losses[0], losses[self.steps - 1], max_diff)
    }
}

#[test]
fn every_model_fits_a_batch_and_valid_copy_agrees() {
    let input = InputShape::image(8, 8, CLASSES);
    for name in MODEL_NAMES {
        let task = FitBatch { steps: 40 };
        let (first, last, max_diff) = with_model(
            name,
            &toml::Table::new(),
            &input,
            &Device::flex().autodiff(),
            task,
        )
        .expect("default options are valid");
        assert!(
            first.is_finite() && last.is_finite(),
            "{name}: {first} -> {last}"
        );
        assert!(last < 0.5 * first, "{name}: loss {first} -> {last}");
        assert!(
            max_diff < 1e-4,
            "{name}: valid() logits differ by {max_diff}"
        );
    }
}
