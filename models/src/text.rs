//! `text`: a small transformer encoder that classifies token sequences, its
//! data items and padding batcher, and a lazily computed synthetic data set.

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError as BurnDatasetError};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{TransformerEncoder, TransformerEncoderConfig};
use burn::nn::{Dropout, DropoutConfig, Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::prelude::*;
use burn::train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use serde::{Deserialize, Serialize};

use crate::registry::draw_params;
use crate::{check_dropout, oversized_layer, CheckError, DatasetError};
use burn_ddp::mark_block;
use burn_ddp::rng::SplitMix64;

/// Configuration of a [`TextClassifier`].
///
/// ```toml
/// vocab_size = 32   # token ids are 0..vocab_size
/// max_len = 32      # longest sequence (positions with a learned embedding)
/// d_model = 32      # width of the embeddings and of the encoder
/// heads = 2         # attention heads; must divide d_model
/// layers = 1        # transformer encoder layers
/// d_ff = 64         # hidden width of each layer's feed-forward network
/// dropout = 0.0     # in the encoder and on the embeddings, training only
/// classes = 2       # width of the logits
/// ```
///
/// Every key is optional (the values above are the defaults) and an unknown
/// key is a deserialization error.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TextClassifierConfig {
    /// Number of token ids (ids are `0..vocab_size`). Default 32.
    pub vocab_size: usize,
    /// Longest sequence the model takes. Default 32.
    pub max_len: usize,
    /// Width of the embeddings and of the encoder. Default 32.
    pub d_model: usize,
    /// Attention heads per layer; must divide `d_model`. Default 2.
    pub heads: usize,
    /// Transformer encoder layers. Default 1.
    pub layers: usize,
    /// Hidden width of each layer's position-wise feed-forward network. Default 64.
    pub d_ff: usize,
    /// Dropout probability, `0 <= p < 1`, on the embeddings and inside the
    /// encoder (attention weights, residual branches). Default 0.
    pub dropout: f64,
    /// Number of classes. Default 2.
    pub classes: usize,
}

impl Default for TextClassifierConfig {
    fn default() -> Self {
        Self {
            vocab_size: 32,
            max_len: 32,
            d_model: 32,
            heads: 2,
            layers: 1,
            d_ff: 64,
            dropout: 0.0,
            classes: 2,
        }
    }
}

impl TextClassifierConfig {
    /// Checks the values against each other, without allocating any tensor.
    ///
    /// # Errors
    ///
    /// [`CheckError::Option`] naming the key: a size that is 0, `d_model` not
    /// divisible by `heads` (names `heads`), `dropout` outside `[0, 1)`, or a
    /// layer with more than [`MAX_LAYER_WEIGHTS`](crate::MAX_LAYER_WEIGHTS)
    /// weights (names the larger of the layer's two sizes, e.g. `vocab_size`
    /// for `vocab_size = 100000000`).
    pub fn check(&self) -> Result<(), CheckError> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("max_len", self.max_len),
            ("d_model", self.d_model),
            ("heads", self.heads),
            ("layers", self.layers),
            ("d_ff", self.d_ff),
            ("classes", self.classes),
        ];
        if let Some((field, _)) = sizes.iter().find(|(_, value)| *value == 0) {
            return Err(CheckError::option(field, "must be positive, found 0"));
        }
        let indivisible = !self.d_model.is_multiple_of(self.heads);
        if indivisible {
            return Err(CheckError::option(
                "heads",
                format!(
                    "must divide d_model = {}, found {} heads",
                    self.d_model, self.heads
                ),
            ));
        }
        check_dropout(self.dropout)?;
        let d_model = ("d_model", self.d_model);
        let layers = [
            (
                "the token embedding",
                ("vocab_size", self.vocab_size),
                d_model,
            ),
            ("the position embedding", ("max_len", self.max_len), d_model),
            ("each attention projection", d_model, d_model),
            ("each feed-forward layer", d_model, ("d_ff", self.d_ff)),
            ("the output layer", d_model, ("classes", self.classes)),
        ];
        for (layer, rows, columns) in layers {
            if let Some(message) = oversized_layer(layer, rows.1, columns.1) {
                let field = if rows.1 >= columns.1 {
                    rows.0
                } else {
                    columns.0
                };
                return Err(CheckError::option(field, message));
            }
        }
        Ok(())
    }

    /// Initialises a [`TextClassifier`] on `device`, drawing every parameter
    /// from the device's RNG (embeddings from `N(0, 1)`, Burn's defaults for
    /// the encoder and output layer) in declaration order before returning, so
    /// the model depends only on the RNG state (`device.seed`).
    ///
    /// # Panics
    ///
    /// If [`check`](Self::check) fails (as Burn's configs do for invalid
    /// values); call it first.
    pub fn init(&self, device: &Device) -> TextClassifier {
        let model = self.init_lazy(device);
        draw_params(&model);
        model
    }

    /// The encoder's configuration (pre-norm; its layers are also built one by one by
    /// [`init_stage`](Self::init_stage)).
    pub(crate) fn encoder_config(&self) -> TransformerEncoderConfig {
        TransformerEncoderConfig::new(self.d_model, self.d_ff, self.heads, self.layers)
            .with_dropout(self.dropout)
            .with_norm_first(true)
    }

    /// [`init`](Self::init) without drawing the parameters (see
    /// [`burn_ddp::parameter_count`]).
    ///
    /// # Panics
    ///
    /// As [`init`](Self::init).
    pub fn init_lazy(&self, device: &Device) -> TextClassifier {
        if let Err(error) = self.check() {
            panic!(
                "TextClassifierConfig::init: invalid configuration (call check first): {error:?}"
            );
        }
        TextClassifier {
            tokens: EmbeddingConfig::new(self.vocab_size, self.d_model).init(device),
            positions: EmbeddingConfig::new(self.max_len, self.d_model).init(device),
            encoder: self.encoder_config().init(device),
            output: LinearConfig::new(self.d_model, self.classes).init(device),
            dropout: (self.dropout > 0.0).then(|| DropoutConfig::new(self.dropout).init()),
            max_len: self.max_len,
        }
    }
}

/// Transformer text classifier:
///
/// `token embedding + learned position embedding [-> Dropout] ->
///  TransformerEncoder (pre-norm, padding masked) -> mean over the non-padding
///  positions -> Linear`.
///
/// Built by [`TextClassifierConfig::init`]. Trained by cross-entropy through
/// burn-train's [`TrainStep`]; [`InferenceStep`] evaluates the same loss.
#[derive(Module, Debug)]
pub struct TextClassifier {
    tokens: Embedding,
    positions: Embedding,
    encoder: TransformerEncoder,
    output: Linear,
    /// On the embeddings; present when `dropout > 0`.
    dropout: Option<Dropout>,
    /// Rows of the position embedding.
    max_len: usize,
}

impl TextClassifier {
    /// Longest sequence the model takes.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// `tokens`: `[batch, len]` token ids in `0..vocab_size`; `mask_pad`:
    /// `[batch, len]`, `true` at padding positions (Burn's convention, as in
    /// `TransformerEncoderInput::mask_pad`). Returns logits `[batch, classes]`.
    ///
    /// Padding positions are ignored: no position attends to them and they
    /// are left out of the mean, so the logits of a sequence do not depend on
    /// how much padding follows it or on the pad token. A row that is all
    /// padding gets the logits of a zero pooled vector.
    ///
    /// Dropout is active only on an autodiff device, as in Burn: the
    /// `valid()` copy evaluates deterministically.
    ///
    /// # Panics
    ///
    /// If `len` is 0 or above `max_len`, or if the shapes of `tokens` and
    /// `mask_pad` differ. A token id outside `0..vocab_size` is not checked
    /// (that would need a device-to-host read): Burn's embedding lookup
    /// panics or reads arbitrary values depending on the backend.
    pub fn forward(&self, tokens: Tensor<2, Int>, mask_pad: Tensor<2, Bool>) -> Tensor<2> {
        let [batch, len] = tokens.dims();
        assert!(
            (1..=self.max_len).contains(&len),
            "TextClassifier::forward: sequences of length {len}, but the model takes 1 to {} \
             positions (max_len)",
            self.max_len
        );
        assert_eq!(
            mask_pad.dims(),
            [batch, len],
            "TextClassifier::forward: mask_pad must have the shape of tokens"
        );
        let mut x = embed(&self.tokens, &self.positions, self.dropout.as_ref(), tokens);
        // The encoder's layers, one by one (what `TransformerEncoder::forward` does), each a
        // block for gradient overlap (an identity outside it); the embeddings' gradients are
        // summed after backward.
        for layer in &self.encoder.layers {
            x = mark_block(&x, layer).forward(x, Some(mask_pad.clone()), None);
        }
        classify(&self.output, x, mask_pad)
    }

    /// Classifies `batch` and returns the cross-entropy loss (mean over the
    /// batch) with the logits and labels, as burn-train's metrics expect.
    pub fn forward_classification(&self, batch: TextBatch) -> ClassificationOutput {
        let logits = self.forward(batch.tokens, batch.mask_pad);
        let loss = cross_entropy(logits.clone(), batch.labels.clone());
        ClassificationOutput::new(loss, logits, batch.labels)
    }
}

impl TrainStep for TextClassifier {
    type Input = TextBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: TextBatch) -> TrainOutput<ClassificationOutput> {
        let item = self.forward_classification(batch);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for TextClassifier {
    type Input = TextBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: TextBatch) -> ClassificationOutput {
        self.forward_classification(batch)
    }
}

/// One labelled token sequence (of any length; the batcher pads).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct TextItem {
    /// Token ids, without padding.
    pub tokens: Vec<u32>,
    /// Class index.
    pub label: usize,
}

/// `tokens` (`[batch, len]`) to the encoder's input `[batch, len, d_model]`: token embedding
/// plus learned position embedding, then the dropout if any. The one home of the model's
/// input, for the whole model and its first pipeline stage.
pub(crate) fn embed(
    token_embedding: &Embedding,
    position_embedding: &Embedding,
    dropout: Option<&Dropout>,
    tokens: Tensor<2, Int>,
) -> Tensor<3> {
    let [batch, len] = tokens.dims();
    let device = tokens.device();
    // len <= max_len, and check() bounds max_len by 2^28: lossless.
    let positions = Tensor::<1, Int>::arange(0..len as i64, &device)
        .reshape([1, len])
        .repeat_dim(0, batch);
    // Marked blocks too: ZeRO stage 3 shards the embedding tables with the layers (for
    // gradient overlap a block entered with token ids is summed after backward).
    let tokens = mark_block(&tokens, token_embedding).forward(tokens);
    let x = tokens + mark_block(&positions, position_embedding).forward(positions);
    match dropout {
        Some(dropout) => dropout.forward(x),
        None => x,
    }
}

/// The encoder's output `[batch, len, d_model]` to logits `[batch, classes]`: the mean over
/// the non-padding positions, then `output`. The one home of the model's head, for the whole
/// model and its last pipeline stage.
pub(crate) fn classify(output: &Linear, x: Tensor<3>, mask_pad: Tensor<2, Bool>) -> Tensor<2> {
    let [batch, len, d_model] = x.dims();
    // mask_fill rather than a product with 0, so that nothing computed at
    // a padding position (even a non-finite value) reaches the mean.
    let pad = mask_pad
        .clone()
        .unsqueeze_dim::<3>(2)
        .expand([batch, len, d_model]);
    let sum = x.mask_fill(pad, 0.0).sum_dim(1).reshape([batch, d_model]);
    let count = mask_pad.bool_not().float().sum_dim(1).clamp_min(1.0);
    let pooled = sum / count;
    mark_block(&pooled, output).forward(pooled)
}

/// The cross-entropy loss (mean over the batch) of `logits` against `labels`.
pub(crate) fn cross_entropy(logits: Tensor<2>, labels: Tensor<1, Int>) -> Tensor<1> {
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, labels)
}

/// A padded batch of [`TextItem`]s, as made by [`TextBatcher`].
#[derive(Clone, Debug)]
pub struct TextBatch {
    /// `[batch, len]`: each sequence followed by pad tokens up to `len`.
    pub tokens: Tensor<2, Int>,
    /// `[batch, len]`: `true` at the padding positions.
    pub mask_pad: Tensor<2, Bool>,
    /// `[batch]`: the class indices.
    pub labels: Tensor<1, Int>,
}

/// Pads [`TextItem`]s to the longest sequence of the batch (at least one
/// position, so a batch of empty sequences is all padding rather than
/// zero-width) and stacks them in item order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TextBatcher {
    /// The token id written at padding positions (0 for [`SyntheticText`]).
    /// The model ignores it, but it must still be a valid id (`< vocab_size`).
    pub pad_token: u32,
}

impl Batcher<TextItem, TextBatch> for TextBatcher {
    /// A label too large for `i64` (far above any class count) is passed on
    /// as `i64::MAX`, still out of range.
    fn batch(&self, items: Vec<TextItem>, device: &Device) -> TextBatch {
        let batch = items.len();
        let len = items
            .iter()
            .map(|item| item.tokens.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let mut tokens = Vec::with_capacity(batch * len);
        let mut mask = Vec::with_capacity(batch * len);
        let mut labels = Vec::with_capacity(batch);
        let pad = i64::from(self.pad_token);
        for item in &items {
            let padding = len - item.tokens.len();
            tokens.extend(item.tokens.iter().map(|&token| i64::from(token)));
            tokens.extend(core::iter::repeat_n(pad, padding));
            mask.extend(core::iter::repeat_n(false, item.tokens.len()));
            mask.extend(core::iter::repeat_n(true, padding));
            labels.push(i64::try_from(item.label).unwrap_or(i64::MAX));
        }
        TextBatch {
            tokens: Tensor::from_data(TensorData::new(tokens, [batch, len]), device),
            mask_pad: Tensor::from_data(TensorData::new(mask, [batch, len]), device),
            labels: Tensor::from_data(TensorData::new(labels, [batch]), device),
        }
    }
}

/// The pad token of [`SyntheticText`]; [`RESERVED_TOKEN`] is never generated
/// either, and the other tokens are `2..vocab_size`.
pub const PAD_TOKEN: u32 = 0;
/// A token id that [`SyntheticText`] never generates (free for, e.g., a class
/// token).
pub const RESERVED_TOKEN: u32 = 1;

/// A synthetic two-class text data set computed on demand: item `index`
/// depends only on `(seed, index)`, nothing per item is stored, and any index
/// is as cheap as any other.
///
/// Each item has a length uniform in `min_len..=max_len` and tokens in
/// `2..vocab_size` ([`PAD_TOKEN`] and [`RESERVED_TOKEN`] never occur). Its
/// label is 1 if token 2 occurs more often than token 3, else 0. To make ties
/// rare and the classes balanced, each sequence favours one of the two tokens
/// (chosen with probability 1/2): a token is the favoured one with probability
/// 0.35, the other one with probability 0.15, and uniform over
/// `4..vocab_size` otherwise (for `vocab_size = 4`, 0.7 and 0.3). A tie is
/// broken by changing the last token: a 2 becomes a 3, a 3 becomes a 2,
/// anything else becomes the favoured token. The label is thus a function of
/// the token counts alone, which a mean-pooling model can represent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyntheticText {
    samples: usize,
    vocab_size: u32,
    min_len: usize,
    max_len: usize,
    seed: u64,
}

impl SyntheticText {
    /// `samples` items with token ids below `vocab_size` and lengths in
    /// `min_len..=max_len`, drawn from `seed`. Allocates nothing.
    ///
    /// # Errors
    ///
    /// [`DatasetError::InvalidArgument`] if `vocab_size < 4` (tokens 2 and 3
    /// must exist) or above `u32::MAX`, if `min_len` is 0, or if
    /// `min_len > max_len`.
    pub fn new(
        samples: usize,
        vocab_size: usize,
        min_len: usize,
        max_len: usize,
        seed: u64,
    ) -> Result<Self, DatasetError> {
        let invalid = |argument, message: String| DatasetError::InvalidArgument {
            dataset: "SyntheticText",
            argument,
            message,
        };
        let vocab = u32::try_from(vocab_size)
            .ok()
            .filter(|&vocab| vocab >= 4)
            .ok_or_else(|| {
                invalid(
                    "vocab_size",
                    format!("must be in 4..=u32::MAX (tokens 2 and 3 decide the label), found {vocab_size}"),
                )
            })?;
        if min_len == 0 {
            return Err(invalid("min_len", "must be positive, found 0".to_owned()));
        }
        if min_len > max_len {
            return Err(invalid(
                "max_len",
                format!("must be at least min_len = {min_len}, found {max_len}"),
            ));
        }
        Ok(Self {
            samples,
            vocab_size: vocab,
            min_len,
            max_len,
            seed,
        })
    }

    /// Number of classes (2).
    #[must_use]
    pub fn classes(&self) -> usize {
        2
    }
}

impl Dataset<TextItem> for SyntheticText {
    /// The item at `index`; never an error (the item is computed).
    ///
    /// # Panics
    ///
    /// If `index >= len()`, as Burn's `Dataset::get` contract says.
    fn get(&self, index: usize) -> Result<TextItem, BurnDatasetError> {
        assert!(
            index < self.samples,
            "SyntheticText::get: index {index} out of range (len {})",
            self.samples
        );
        // `usize` is at most 64 bits wide: lossless.
        let mut rng = SplitMix64::stream(self.seed, index as u64);
        let len = self.min_len + rng.index(self.max_len - self.min_len + 1);
        let (favoured, other) = if rng.index(2) == 1 { (2, 3) } else { (3, 2) };
        let others = self.vocab_size - 4;
        let (p_favoured, p_other) = if others == 0 { (0.7, 1.0) } else { (0.35, 0.5) };
        let mut tokens: Vec<u32> = (0..len)
            .map(|_| {
                let u = rng.next_f32();
                if u < p_favoured {
                    favoured
                } else if u < p_other {
                    other
                } else {
                    // `others` is a u32, and below() returns less than it.
                    4 + rng.index(others as usize) as u32
                }
            })
            .collect();
        let count = |tokens: &[u32], token| tokens.iter().filter(|&&t| t == token).count();
        if count(&tokens, 2) == count(&tokens, 3) {
            if let Some(last) = tokens.last_mut() {
                *last = match *last {
                    2 => 3,
                    3 => 2,
                    _ => favoured,
                };
            }
        }
        let label = usize::from(count(&tokens, 2) > count(&tokens, 3));
        Ok(TextItem { tokens, label })
    }

    fn len(&self) -> usize {
        self.samples
    }
}

#[cfg(test)]
mod tests;
