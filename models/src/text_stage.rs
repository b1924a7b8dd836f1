//! The [`TextClassifier`](crate::TextClassifier) cut into pipeline stages: the embeddings on
//! the first stage, the encoder layers spread over the stages in order, the pooling and
//! output layer on the last (burn-ddp's [`PipelineStage`]).
//!
//! A stage holds only its own parameters, under the whole model's names
//! (`encoder.layers.3.…` stays `encoder.layers.3.…` on whichever stage holds layer 3), so the
//! stages' weight files together are the whole model's, key for key.

use std::ops::Range;

use burn::nn::transformer::TransformerEncoderLayer;
use burn::nn::{Dropout, DropoutConfig, Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::prelude::*;
use burn::train::ClassificationOutput;
use burn_ddp::pipeline::{stage_layers, PipelineStage};

use crate::registry::draw_params;
use crate::text::{classify, cross_entropy, embed};
use crate::{TextBatch, TextClassifierConfig};

/// Stage `stage` of `stages` of a [`TextClassifier`](crate::TextClassifier) (built by
/// [`TextClassifierConfig::init_stage`]). Activations between stages are the encoder's
/// hidden states `[batch, len, d_model]`; the last stage's output is the logits as
/// `[batch, 1, classes]` (a pipeline stage returns one tensor rank).
#[derive(Module, Debug)]
pub struct TextClassifierStage {
    /// First stage only (as the two embeddings and their dropout).
    tokens: Option<Embedding>,
    positions: Option<Embedding>,
    dropout: Option<Dropout>,
    encoder: StageEncoder,
    /// Last stage only.
    output: Option<Linear>,
}

/// The encoder layers of one stage, at their global indices (`None` elsewhere), so that their
/// parameters keep the whole model's names.
#[derive(Module, Debug)]
struct StageEncoder {
    layers: Vec<Option<TransformerEncoderLayer>>,
}

impl TextClassifierConfig {
    /// Stage `stage` of `stages` of the model [`init`](Self::init) builds with the same
    /// device RNG state: the stage's parameters equal the whole model's, since every part is
    /// drawn in the whole model's order — the parts of other stages one at a time and
    /// dropped at once, so a stage never holds more than its own parameters and one other
    /// part.
    /// The encoder's layers are cut as [`stage_layers`] says.
    ///
    /// # Panics
    ///
    /// If [`check`](Self::check) fails, or `stage >= stages`.
    pub fn init_stage(&self, stage: usize, stages: usize, device: &Device) -> TextClassifierStage {
        if let Err(error) = self.check() {
            panic!("TextClassifierConfig::init_stage: invalid configuration (call check first): {error:?}");
        }
        assert!(stage < stages, "stage {stage} of {stages}");
        let (first, last) = (stage == 0, stage + 1 == stages);
        let own: Range<usize> = stage_layers(self.layers, stages, stage);
        // `then_some` drops a part that is not this stage's right after it is drawn.
        let tokens = first.then_some(drawn(
            EmbeddingConfig::new(self.vocab_size, self.d_model).init(device),
        ));
        let positions = first.then_some(drawn(
            EmbeddingConfig::new(self.max_len, self.d_model).init(device),
        ));
        let encoder = self.encoder_config();
        let layers = (0..self.layers)
            .map(|i| {
                let layer = drawn(TransformerEncoderLayer::new(&encoder, device));
                own.contains(&i).then_some(layer)
            })
            .collect();
        let output = last.then_some(drawn(
            LinearConfig::new(self.d_model, self.classes).init(device),
        ));
        TextClassifierStage {
            tokens,
            positions,
            dropout: (first && self.dropout > 0.0).then(|| DropoutConfig::new(self.dropout).init()),
            encoder: StageEncoder { layers },
            output,
        }
    }
}

/// `module` with its parameters drawn now (the device RNG's next values).
fn drawn<M: Module>(module: M) -> M {
    draw_params(&module);
    module
}

impl TextClassifierStage {
    /// The logits `[batch, classes]` of the last stage's output.
    fn logits(output: Tensor<3>) -> Tensor<2> {
        let [batch, _, classes] = output.dims();
        output.reshape([batch, classes])
    }

    /// What [`TextClassifier::forward_classification`](crate::TextClassifier::forward_classification)
    /// gives, from the last stage's output and its `loss` on `batch`: the output the
    /// classifier's metrics (loss, accuracy) read.
    pub fn classification(
        output: Tensor<3>,
        loss: Tensor<1>,
        batch: &TextBatch,
    ) -> ClassificationOutput {
        ClassificationOutput::new(loss, Self::logits(output), batch.labels.clone())
    }
}

impl PipelineStage<3> for TextClassifierStage {
    type Batch = TextBatch;

    fn forward(&self, activation: Option<Tensor<3>>, batch: &TextBatch) -> Tensor<3> {
        let mut x = match (&self.tokens, &self.positions, activation) {
            (Some(tokens), Some(positions), _) => embed(
                tokens,
                positions,
                self.dropout.as_ref(),
                batch.tokens.clone(),
            ),
            (_, _, Some(x)) => x,
            _ => unreachable!("burn-ddp gives every stage after the first its input"),
        };
        for layer in self.encoder.layers.iter().flatten() {
            x = layer.forward(x, Some(batch.mask_pad.clone()), None);
        }
        match &self.output {
            Some(output) => {
                let logits = classify(output, x, batch.mask_pad.clone());
                let [rows, classes] = logits.dims();
                logits.reshape([rows, 1, classes])
            }
            None => x,
        }
    }

    fn loss(&self, output: Tensor<3>, batch: &TextBatch) -> Tensor<1> {
        cross_entropy(Self::logits(output), batch.labels.clone())
    }
}

#[cfg(test)]
mod tests {
    use burn::data::dataloader::batcher::Batcher;
    use burn::module::ModuleVisitor;
    use burn::module::Param;
    use std::collections::BTreeMap;

    use super::*;
    use crate::{TextBatcher, TextItem};

    fn parameters<M: Module>(module: &M) -> BTreeMap<String, Vec<f32>> {
        struct Collect(BTreeMap<String, Vec<f32>>, Vec<String>);
        impl ModuleVisitor for Collect {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.1.push(name.to_string());
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.1.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let key = self.1.join(".");
                let values = param
                    .val()
                    .into_data()
                    .try_to_vec::<f32>()
                    .expect("f32 values");
                self.0.insert(key, values);
            }
        }
        let mut collect = Collect(BTreeMap::new(), Vec::new());
        module.visit(&mut collect);
        collect.0
    }

    fn config() -> TextClassifierConfig {
        TextClassifierConfig {
            layers: 3,
            ..Default::default()
        }
    }

    /// Runs the ignored test `name` of this binary alone in a child process: Flex's RNG is
    /// process-wide and the other tests draw from it concurrently, so a check that seeds it
    /// twice and compares the draws runs where nothing else draws.
    fn alone(name: &str) {
        let exe = std::env::current_exe().expect("the test binary's path");
        let out = std::process::Command::new(exe)
            .args(["--ignored", "--exact", "--test-threads=1", name])
            .output()
            .expect("the test binary runs");
        let log = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}:\n{log}");
        assert!(log.contains("1 passed"), "{name} did not run:\n{log}");
    }

    #[test]
    fn stages_hold_the_whole_models_parameters_and_compute_its_logits() {
        alone("text_stage::tests::stage_parameters_alone");
        alone("text_stage::tests::stage_logits_alone");
    }

    #[test]
    #[ignore = "run alone by stages_hold_the_whole_models_parameters_and_compute_its_logits"]
    fn stage_parameters_alone() {
        let device = Device::flex();
        device.seed(11);
        let whole = parameters(&config().init(&device));
        for stages in [1, 2, 3] {
            let mut joined = BTreeMap::new();
            for stage in 0..stages {
                device.seed(11);
                let part = parameters(&config().init_stage(stage, stages, &device));
                for (key, values) in part {
                    assert!(joined.insert(key.clone(), values).is_none(), "{key} twice");
                }
            }
            let differ: Vec<_> = whole
                .iter()
                .filter(|(k, v)| joined.get(*k) != Some(v))
                .map(|(k, _)| k.clone())
                .collect();
            assert_eq!(joined.len(), whole.len(), "{stages} stages: keys");
            assert!(differ.is_empty(), "{stages} stages: {differ:?}");
        }
    }

    #[test]
    #[ignore = "run alone by stages_hold_the_whole_models_parameters_and_compute_its_logits"]
    fn stage_logits_alone() {
        let device = Device::flex();
        device.seed(3);
        let whole = config().init(&device);
        let stages: Vec<_> = (0..2)
            .map(|s| {
                device.seed(3);
                config().init_stage(s, 2, &device)
            })
            .collect();
        let items = vec![
            TextItem {
                tokens: vec![3, 4, 5],
                label: 1,
            },
            TextItem {
                tokens: vec![7],
                label: 0,
            },
        ];
        let batch: TextBatch = TextBatcher { pad_token: 0 }.batch(items, &device);
        let expected = whole.forward(batch.tokens.clone(), batch.mask_pad.clone());
        let hidden = stages[0].forward(None, &batch);
        let logits = TextClassifierStage::logits(stages[1].forward(Some(hidden), &batch));
        let (a, b) = (
            expected
                .into_data()
                .try_to_vec::<f32>()
                .expect("f32 values"),
            logits.into_data().try_to_vec::<f32>().expect("f32 values"),
        );
        assert_eq!(a.len(), b.len());
        let diff = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        assert!(diff < 1e-6, "max |Δ| {diff}");
    }
}
