use super::*;
use crate::test_util::{autodiff_device, device};
use burn::optim::AdamConfig;

fn small() -> TextClassifierConfig {
    TextClassifierConfig {
        vocab_size: 12,
        max_len: 10,
        d_model: 8,
        heads: 2,
        layers: 2,
        d_ff: 16,
        dropout: 0.0,
        classes: 3,
    }
}

fn batch(items: &[TextItem], pad_token: u32) -> TextBatch {
    batch_on(items, pad_token, &device())
}

fn batch_on(items: &[TextItem], pad_token: u32, device: &Device) -> TextBatch {
    TextBatcher { pad_token }.batch(items.to_vec(), device)
}

fn item(tokens: &[u32], label: usize) -> TextItem {
    TextItem {
        tokens: tokens.to_vec(),
        label,
    }
}

fn logits(model: &TextClassifier, batch: TextBatch) -> Vec<f32> {
    let logits = model.forward(batch.tokens, batch.mask_pad);
    logits.into_data().try_to_vec::<f32>().expect("f32 logits")
}

fn assert_close(a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
    }
}

#[test]
fn forward_shape() {
    let device = device();
    let model = small().init(&device);
    assert_eq!(model.max_len(), 10);
    let tokens = Tensor::<2, Int>::ones([4, 10], &device);
    let mask = Tensor::<2, Bool>::from_data(TensorData::new(vec![false; 40], [4, 10]), &device);
    assert_eq!(model.forward(tokens, mask).dims(), [4, 3]);
    let model = TextClassifierConfig {
        dropout: 0.3,
        ..small()
    }
    .init(&autodiff_device());
    let items = [item(&[2, 3, 4], 0), item(&[5], 1)];
    let b = batch_on(&items, 0, &autodiff_device());
    assert_eq!(model.forward(b.tokens, b.mask_pad).dims(), [2, 3]);
}

#[test]
fn default_parameter_count() {
    let model = TextClassifierConfig::default().init(&device());
    let (d, ff) = (32, 64);
    let embeddings = 32 * d + 32 * d;
    let attention = 4 * (d * d + d);
    let feed_forward = d * ff + ff + ff * d + d;
    let norms = 2 * 2 * d;
    let output = d * 2 + 2;
    assert_eq!(
        model.num_params(),
        embeddings + attention + feed_forward + norms + output
    );
}

#[test]
fn padding_is_ignored() {
    let model = small().init(&device());
    let short = [5, 2, 3, 7];
    let alone = logits(&model, batch(&[item(&short, 0)], 0));
    // The same sequence padded (with two different pad tokens) next to a
    // longer one.
    for pad in [0, 9] {
        let items = [item(&short, 0), item(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 1)];
        let padded = logits(&model, batch(&items, pad));
        assert_close(&alone, &padded[..3]);
    }
    // An explicit mask over garbage tokens, up to max_len.
    let device = device();
    let tokens = Tensor::<2, Int>::from_data(
        TensorData::new(vec![5i64, 2, 3, 7, 11, 4, 1, 0, 8, 6], [1, 10]),
        &device,
    );
    let mask = Tensor::<2, Bool>::from_data(
        TensorData::new((0..10).map(|i| i >= 4).collect::<Vec<_>>(), [1, 10]),
        &device,
    );
    let masked = model.forward(tokens.clone(), mask);
    assert_close(
        &alone,
        &masked.into_data().try_to_vec::<f32>().expect("f32"),
    );
    // Without the mask the extra tokens do change the logits.
    let unmasked = model.forward(
        tokens,
        Tensor::from_data(TensorData::new(vec![false; 10], [1, 10]), &device),
    );
    let unmasked = unmasked.into_data().try_to_vec::<f32>().expect("f32");
    assert!(alone
        .iter()
        .zip(&unmasked)
        .any(|(a, b)| (a - b).abs() > 1e-4));
}

#[test]
fn all_padding_row_is_finite() {
    let model = small().init(&device());
    let out = logits(&model, batch(&[item(&[], 0), item(&[2, 3], 1)], 0));
    assert!(out.iter().all(|x| x.is_finite()), "{out:?}");
}

#[test]
#[should_panic(expected = "max_len")]
fn too_long_sequences_panic_with_a_message() {
    let model = small().init(&device());
    let b = batch(&[item(&[2; 11], 0)], 0);
    let _ = model.forward(b.tokens, b.mask_pad);
}

#[test]
fn batcher_pads_to_the_longest_sequence() {
    let items = [item(&[4, 5], 1), item(&[6, 7, 8, 9], 0), item(&[], 1)];
    let b = batch(&items, 3);
    assert_eq!(b.tokens.dims(), [3, 4]);
    assert_eq!(
        b.tokens
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .ok(),
        Some(vec![4, 5, 3, 3, 6, 7, 8, 9, 3, 3, 3, 3])
    );
    assert_eq!(
        b.mask_pad.into_data().try_to_vec::<bool>().ok(),
        Some(vec![
            false, false, true, true, false, false, false, false, true, true, true, true
        ])
    );
    assert_eq!(
        b.labels
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .ok(),
        Some(vec![1, 0, 1])
    );
    // Only empty sequences: one padding position, not zero width.
    let b = batch(&[item(&[], 0)], 0);
    assert_eq!(b.tokens.dims(), [1, 1]);
    assert_eq!(
        b.mask_pad.into_data().try_to_vec::<bool>().ok(),
        Some(vec![true])
    );
}

#[test]
fn config_serde_is_strict_with_defaults() {
    let parsed: TextClassifierConfig = toml::from_str("").expect("all keys optional");
    assert_eq!(parsed, TextClassifierConfig::default());
    let parsed: TextClassifierConfig = toml::from_str("heads = 4\nclasses = 5").expect("ok");
    assert_eq!((parsed.heads, parsed.classes, parsed.d_model), (4, 5, 32));
    let error = toml::from_str::<TextClassifierConfig>("n_heads = 4").unwrap_err();
    assert!(error.to_string().contains("n_heads"), "{error}");
    let text = toml::to_string(&parsed).expect("serializes");
    assert_eq!(toml::from_str::<TextClassifierConfig>(&text), Ok(parsed));
}

#[test]
fn check_names_the_key() {
    fn field(config: TextClassifierConfig) -> Option<&'static str> {
        match config.check() {
            Err(CheckError::Option { field, .. }) => Some(field),
            _ => None,
        }
    }
    let base = TextClassifierConfig::default();
    assert_eq!(base.check(), Ok(()));
    type Edit = fn(&mut TextClassifierConfig);
    let cases: [(Edit, &str); 14] = [
        (|c| c.vocab_size = 0, "vocab_size"),
        (|c| c.max_len = 0, "max_len"),
        (|c| c.d_model = 0, "d_model"),
        (|c| c.heads = 0, "heads"),
        (|c| c.layers = 0, "layers"),
        (|c| c.d_ff = 0, "d_ff"),
        (|c| c.classes = 0, "classes"),
        (|c| c.heads = 3, "heads"),
        (|c| c.dropout = 1.0, "dropout"),
        (|c| c.dropout = -0.5, "dropout"),
        (|c| c.vocab_size = 100_000_000, "vocab_size"),
        (|c| c.max_len = usize::MAX, "max_len"),
        (|c| c.d_ff = 1 << 30, "d_ff"),
        (|c| c.d_model = 1 << 15, "d_model"),
    ];
    for (edit, key) in cases {
        let mut config = base.clone();
        edit(&mut config);
        assert_eq!(field(config.clone()), Some(key), "{config:?}");
    }
    let Err(CheckError::Option { message, .. }) = TextClassifierConfig {
        vocab_size: 100_000_000,
        ..base
    }
    .check() else {
        unreachable!()
    };
    assert!(
        message.contains("token embedding") && message.contains("2^28"),
        "{message}"
    );
}

#[test]
fn dataset_is_deterministic_and_well_formed() {
    let data = SyntheticText::new(500, 10, 3, 12, 5).expect("valid");
    assert_eq!(data.len(), 500);
    assert_eq!(data.classes(), 2);
    let mut labels = [0usize; 2];
    for index in 0..500 {
        let item = data.get(index).expect("in range");
        assert_eq!(data.get(index).expect("in range"), item);
        assert!((3..=12).contains(&item.tokens.len()), "{item:?}");
        assert!(item.tokens.iter().all(|t| (2..10).contains(t)), "{item:?}");
        let count = |token| item.tokens.iter().filter(|&&t| t == token).count();
        assert_ne!(count(2), count(3), "{item:?}");
        assert_eq!(item.label, usize::from(count(2) > count(3)));
        labels[item.label] += 1;
    }
    assert!(labels[0] > 200 && labels[1] > 200, "{labels:?}");
    let other = SyntheticText::new(500, 10, 3, 12, 6).expect("valid");
    assert!((0..20).any(|i| other.get(i).expect("in range") != data.get(i).expect("in range")));
    // Only tokens 2 and 3 when there are no others.
    let tiny = SyntheticText::new(50, 4, 1, 1, 0).expect("valid");
    for item in (0..50).map(|i| tiny.get(i).expect("in range")) {
        assert_eq!(item.tokens.len(), 1);
        assert_eq!(item.label, usize::from(item.tokens[0] == 2));
    }
}

#[test]
fn dataset_is_lazy() {
    let data = SyntheticText::new(usize::MAX, 32, 1, 32, 0).expect("valid");
    assert_eq!(data.len(), usize::MAX);
    assert!(data.get(usize::MAX - 1).is_ok());
}

#[test]
#[should_panic(expected = "index 500 out of range")]
fn dataset_get_past_the_end_panics() {
    let data = SyntheticText::new(500, 10, 3, 12, 5).expect("valid");
    let _ = data.get(500);
}

#[test]
fn dataset_rejects_bad_arguments() {
    let argument = |result: Result<SyntheticText, DatasetError>| match result {
        Err(DatasetError::InvalidArgument { argument, .. }) => Some(argument),
        Ok(_) => None,
    };
    assert_eq!(
        argument(SyntheticText::new(1, 3, 1, 2, 0)),
        Some("vocab_size")
    );
    assert_eq!(
        argument(SyntheticText::new(1, usize::MAX, 1, 2, 0)),
        Some("vocab_size")
    );
    assert_eq!(argument(SyntheticText::new(1, 8, 0, 2, 0)), Some("min_len"));
    assert_eq!(argument(SyntheticText::new(1, 8, 3, 2, 0)), Some("max_len"));
    let message = SyntheticText::new(1, 8, 3, 2, 0).unwrap_err().to_string();
    assert!(
        message.contains("`max_len`") && message.contains("SyntheticText"),
        "{message}"
    );
}

/// Trains on `train` items for `epochs` with Adam (batch 32) and returns
/// the mean training loss of the first and last epoch and the accuracy of
/// the `valid()` copy on `test` items.
fn fit(
    config: &TextClassifierConfig,
    data: &SyntheticText,
    train: core::ops::Range<usize>,
    test: core::ops::Range<usize>,
    epochs: usize,
) -> (f32, f32, f32) {
    let device = autodiff_device();
    let batcher = TextBatcher {
        pad_token: PAD_TOKEN,
    };
    let batches = |range: core::ops::Range<usize>| -> Vec<Vec<TextItem>> {
        let items: Vec<TextItem> = range.map(|i| data.get(i).expect("in range")).collect();
        items.chunks(32).map(<[TextItem]>::to_vec).collect()
    };
    let mut model = config.init(&device);
    let mut optimizer = AdamConfig::new().init();
    let mut epoch_losses = Vec::new();
    for _ in 0..epochs {
        let mut total = 0.0;
        let train_batches = batches(train.clone());
        for items in &train_batches {
            let batch: TextBatch = batcher.batch(items.clone(), &device);
            let output = TrainStep::step(&model, batch);
            total += output.item.loss.clone().into_scalar::<f32>();
            model = optimizer.step(3e-3, model, output.grads);
        }
        epoch_losses.push(total / train_batches.len() as f32);
    }
    let valid = model.valid();
    let (mut hits, mut seen) = (0, 0);
    for items in batches(test) {
        let batch = batcher.batch(items, &device.clone().without_autodiff());
        let output = InferenceStep::step(&valid, batch);
        seen += output.output.dims()[0];
        let predicted = output.output.argmax(1).reshape([-1]);
        hits += predicted
            .equal(output.targets)
            .int()
            .sum()
            .into_scalar::<i64>();
    }
    let first = epoch_losses[0];
    let last = epoch_losses[epoch_losses.len() - 1];
    (first, last, hits as f32 / seen as f32)
}

#[test]
fn train_step_reduces_the_loss() {
    let data = SyntheticText::new(256, 12, 4, 10, 3).expect("valid");
    let (first, last, _) = fit(&small(), &data, 0..256, 0..0, 4);
    assert!(last.is_finite() && last < 0.8 * first, "{first} -> {last}");
}

/// The synthetic task is learnable by the default model: above 90% held-out
/// accuracy after two epochs on 2000 samples.
#[test]
fn default_model_learns_the_synthetic_task() {
    let config = TextClassifierConfig::default();
    let data = SyntheticText::new(2500, config.vocab_size, 8, config.max_len, 11).expect("valid");
    let (first, last, accuracy) = fit(&config, &data, 0..2000, 2000..2500, 2);
    assert!(
        accuracy > 0.9,
        "accuracy {accuracy}, loss {first} -> {last}"
    );
}
