//! Training data: the vendored 8x8 digits, a seeded train/validation split,
//! synthetic data for benchmarks, and the Burn batcher.
//!
//! Items are plain [`ClassificationItem`]s (flat `f32` features and a class
//! index); wrap them in Burn's `InMemDataset` to
//! serve them, and turn a list of them into tensors with
//! [`ClassificationBatcher`].

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};

use burn::data::dataloader::batcher::Batcher;
use burn::prelude::*;
use burn_ddp::rng::SplitMix64;
use flate2::read::MultiGzDecoder;

/// Height and width of a digits image.
pub const DIGITS_IMAGE: (usize, usize) = (8, 8);
/// Features per digits sample: the 8x8 pixels, row-major.
pub const DIGITS_FEATURES: usize = DIGITS_IMAGE.0 * DIGITS_IMAGE.1;
/// Classes of the digits data: the digits 0 to 9.
pub const DIGITS_CLASSES: usize = 10;
/// Largest pixel value in the digits file; pixels are divided by it.
const DIGITS_MAX_PIXEL: u8 = 16;

/// One sample: flat features and a class index.
#[derive(Clone, Debug, PartialEq)]
pub struct ClassificationItem {
    /// Input features; for images, the pixels flattened row-major.
    pub features: Vec<f32>,
    /// Class index, `0 <= label < classes`.
    pub label: usize,
}

/// Why a data file could not be loaded. Every message names the file; parse
/// errors also give the 1-based line and column and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file could not be opened (missing, unreadable).
    #[error(
        "cannot open data file '{}': {} (set data.path in the config)",
        path.display(),
        io_message(error)
    )]
    Open {
        /// The path as given.
        path: PathBuf,
        /// The error from the operating system.
        error: io::Error,
    },

    /// Reading or decompressing failed part way (corrupt gzip, not UTF-8).
    #[error(
        "cannot read data file '{}' at line {line}: {}",
        path.display(),
        io_message(error)
    )]
    Read {
        /// The path as given.
        path: PathBuf,
        /// 1-based line being read when the error happened.
        line: usize,
        /// The error from the reader or the gzip decoder.
        error: io::Error,
    },

    /// A row does not have the expected format.
    #[error("{} line {line}{}: {message}", path.display(), column_suffix(*column))]
    Parse {
        /// The path as given.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// 1-based column (comma-separated field) at fault, if one is.
        column: Option<usize>,
        /// What was expected and what was found.
        message: String,
    },

    /// The file holds no rows.
    #[error("data file '{}' contains no samples", path.display())]
    Empty {
        /// The path as given.
        path: PathBuf,
    },
}

/// ", column N" for a parse error at a known column, "" otherwise.
fn column_suffix(column: Option<usize>) -> String {
    column.map(|c| format!(", column {c}")).unwrap_or_default()
}

/// An I/O error's message without the " (os error N)" suffix that `Display`
/// adds, so that messages read "No such file or directory".
pub(crate) fn io_message(error: &io::Error) -> String {
    let message = error.to_string();
    match error.raw_os_error() {
        Some(code) => message
            .strip_suffix(&format!(" (os error {code})"))
            .map_or_else(|| message.clone(), str::to_owned),
        None => message,
    }
}

/// Loads the UCI 8x8 handwritten digits from a CSV file (see `data/README.md`).
///
/// Format: no header; one sample per line; 65 comma-separated integers: 64
/// pixels (an 8x8 image, row-major) in `0..=16`, then the label in `0..=9`.
/// The file may be gzip-compressed (recognised by its magic bytes, whatever
/// its name) or plain text. Blank lines are skipped. Pixels are scaled to
/// `[0, 1]` by dividing by 16. Items are returned in file order.
///
/// # Errors
///
/// [`DataError::Open`] if the file cannot be opened, [`DataError::Read`] if it
/// cannot be read or decompressed, [`DataError::Parse`] (with line and column)
/// for a malformed row, [`DataError::Empty`] if there are no rows.
pub fn load_digits(path: &Path) -> Result<Vec<ClassificationItem>, DataError> {
    let open_error = |error| DataError::Open {
        path: path.to_owned(),
        error,
    };
    let mut file = BufReader::new(File::open(path).map_err(open_error)?);
    let is_gzip = file
        .fill_buf()
        .map_err(open_error)?
        .starts_with(&[0x1f, 0x8b]);
    let reader: Box<dyn BufRead> = if is_gzip {
        Box::new(BufReader::new(MultiGzDecoder::new(file)))
    } else {
        Box::new(file)
    };

    let mut items = Vec::new();
    for (index, line) in reader.lines().enumerate() {
        let line_number = index + 1;
        let line = line.map_err(|error| DataError::Read {
            path: path.to_owned(),
            line: line_number,
            error,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let item = parse_digits_row(&line).map_err(|(column, message)| DataError::Parse {
            path: path.to_owned(),
            line: line_number,
            column,
            message,
        })?;
        items.push(item);
    }
    if items.is_empty() {
        return Err(DataError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(items)
}

/// Parses one digits row; on error returns the 1-based column at fault (if
/// one is) and what was expected.
fn parse_digits_row(line: &str) -> Result<ClassificationItem, (Option<usize>, String)> {
    let fields: Vec<&str> = line.split(',').map(str::trim).collect();
    if fields.len() != DIGITS_FEATURES + 1 {
        return Err((
            None,
            format!(
                "expected {} comma-separated values ({DIGITS_FEATURES} pixels + label), found {}",
                DIGITS_FEATURES + 1,
                fields.len()
            ),
        ));
    }
    let parse = |column: usize, what: &str, max: u8| -> Result<u8, (Option<usize>, String)> {
        let field = fields[column];
        match field.parse::<u8>() {
            Ok(value) if value <= max => Ok(value),
            _ => Err((
                Some(column + 1),
                format!("expected {what} (an integer in 0..={max}), found {field:?}"),
            )),
        }
    };
    let features = (0..DIGITS_FEATURES)
        .map(|column| {
            let pixel = parse(column, "a pixel value", DIGITS_MAX_PIXEL)?;
            Ok(f32::from(pixel) / f32::from(DIGITS_MAX_PIXEL))
        })
        .collect::<Result<Vec<f32>, _>>()?;
    // DIGITS_CLASSES - 1 = 9 fits in a u8.
    let label = parse(DIGITS_FEATURES, "a label", (DIGITS_CLASSES - 1) as u8)?;
    Ok(ClassificationItem {
        features,
        label: usize::from(label),
    })
}

/// Shuffles `items` with `seed`, then splits them: the first
/// `n - round(n * validation_fraction)` items are the training set, the rest
/// the validation set. Returns `(train, validation)`.
///
/// The shuffle matters: the digits file is ordered by writer group, so a split
/// without it would validate on unseen writers only. The result depends only
/// on the items, the fraction and the seed, so every rank computes the same
/// split (the shuffle uses a self-contained splitmix64 generator).
///
/// # Panics
///
/// If `validation_fraction` is not in `[0, 1]` (validate the configuration
/// first).
pub fn split_train_validation(
    mut items: Vec<ClassificationItem>,
    validation_fraction: f64,
    seed: u64,
) -> (Vec<ClassificationItem>, Vec<ClassificationItem>) {
    assert!(
        (0.0..=1.0).contains(&validation_fraction),
        "validation_fraction must be in [0, 1], got {validation_fraction}"
    );
    let mut rng = SplitMix64::new(seed);
    rng.shuffle(&mut items);
    // Exact for any realistic dataset size (< 2^53 items).
    let validation_len = (items.len() as f64 * validation_fraction).round() as usize;
    let validation = items.split_off(items.len() - validation_len.min(items.len()));
    (items, validation)
}

/// Deterministic random classification data for benchmarks and tests.
///
/// Features are uniform in `[0, 1)`; the label of a sample is the argmax of a
/// fixed random linear projection of its centred features, so the classes are
/// linearly separable (learnable) and roughly balanced. The result depends
/// only on the arguments.
///
/// # Panics
///
/// If `classes == 0` while `samples > 0`.
pub fn synthetic(
    samples: usize,
    features: usize,
    classes: usize,
    seed: u64,
) -> Vec<ClassificationItem> {
    assert!(
        classes > 0 || samples == 0,
        "synthetic data needs at least one class"
    );
    let mut rng = SplitMix64::new(seed);
    // projection[f * classes + c]: weight of feature f for class c, in [-1, 1).
    let projection: Vec<f32> = (0..features * classes)
        .map(|_| rng.symmetric_f32())
        .collect();
    (0..samples)
        .map(|_| {
            let features: Vec<f32> = (0..features).map(|_| rng.next_f32()).collect();
            let mut scores = vec![0.0f32; classes];
            for (value, weights) in features.iter().zip(projection.chunks_exact(classes)) {
                for (score, weight) in scores.iter_mut().zip(weights) {
                    *score += (value - 0.5) * weight;
                }
            }
            let label = scores
                .iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |best, (class, &score)| {
                    if score > best.1 {
                        (class, score)
                    } else {
                        best
                    }
                })
                .0;
            ClassificationItem { features, label }
        })
        .collect()
}

/// A batch of [`ClassificationItem`]s as tensors: the input of the reference classifiers'
/// `TrainStep` / `InferenceStep` (`inputs` `[batch, features]`, `targets` `[batch]`).
pub type ClassificationBatch = models::FeaturesBatch;

/// Stacks items into a [`ClassificationBatch`], one `Tensor::from_data` per
/// tensor, in item order.
#[derive(Clone, Copy, Debug, Default)]
pub struct ClassificationBatcher;

impl Batcher<ClassificationItem, ClassificationBatch> for ClassificationBatcher {
    /// # Panics
    ///
    /// If the items do not all have the same number of features (items from
    /// one loader always do).
    fn batch(&self, items: Vec<ClassificationItem>, device: &Device) -> ClassificationBatch {
        let batch_size = items.len();
        let features = items.first().map_or(0, |item| item.features.len());
        let mut inputs = Vec::with_capacity(batch_size * features);
        let mut targets = Vec::with_capacity(batch_size);
        for (index, item) in items.into_iter().enumerate() {
            assert_eq!(
                item.features.len(),
                features,
                "item {index} of the batch has {} features, item 0 has {features}",
                item.features.len()
            );
            inputs.extend(item.features);
            targets.push(item.label as i64);
        }
        models::FeaturesBatch {
            inputs: Tensor::from_data(TensorData::new(inputs, [batch_size, features]), device),
            targets: Tensor::from_data(TensorData::new(targets, [batch_size]), device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::data::dataset::Dataset;
    use burn::data::dataset::InMemDataset;
    use std::io::Write;

    fn digits_path() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/digits.csv.gz")
    }

    /// A file under the temp dir, removed on drop.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(name: &str, contents: &[u8]) -> Self {
            let path = std::env::temp_dir()
                .join(format!("burn-ddp-data-test-{}-{name}", std::process::id()));
            std::fs::write(&path, contents).expect("write temp file");
            Self(path)
        }

        fn gzip(name: &str, text: &str) -> Self {
            let mut encoder =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            encoder.write_all(text.as_bytes()).expect("gzip");
            Self::new(name, &encoder.finish().expect("gzip"))
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn row(pixel: &str, label: &str) -> String {
        let mut fields = vec![pixel; DIGITS_FEATURES];
        fields.push(label);
        fields.join(",")
    }

    #[test]
    fn loads_vendored_digits() {
        let items = load_digits(&digits_path()).expect("vendored file loads");
        assert_eq!(items.len(), 1797);
        let mut per_class = [0usize; DIGITS_CLASSES];
        for item in &items {
            assert_eq!(item.features.len(), DIGITS_FEATURES);
            assert!(item.features.iter().all(|&p| (0.0..=1.0).contains(&p)));
            per_class[item.label] += 1;
        }
        assert!(
            per_class.iter().all(|&n| (170..=190).contains(&n)),
            "{per_class:?}"
        );
        // First row of the file: 0,0,5,13,9,1,0,0,... label 0.
        assert_eq!(items[0].label, 0);
        assert_eq!(
            &items[0].features[..4],
            &[0.0, 0.0, 5.0 / 16.0, 13.0 / 16.0]
        );
        assert!(items.iter().any(|item| item.features.contains(&1.0)));
    }

    #[test]
    fn loads_plain_csv_and_skips_blank_lines() {
        let text = format!("{}\n\n{}\r\n", row("16", "3"), row("0", "9"));
        let file = TempFile::new("plain.csv", text.as_bytes());
        let items = load_digits(&file.0).expect("loads");
        assert_eq!(items.len(), 2);
        assert_eq!((items[0].label, items[0].features[0]), (3, 1.0));
        assert_eq!((items[1].label, items[1].features[63]), (9, 0.0));
    }

    #[test]
    fn missing_file_names_it_and_the_config_key() {
        let path = std::env::temp_dir().join("burn-ddp-no-such-file.csv.gz");
        let error = load_digits(&path).unwrap_err();
        assert!(
            matches!(&error, DataError::Open { error, .. } if error.kind() == io::ErrorKind::NotFound)
        );
        assert_eq!(
            error.to_string(),
            format!(
                "cannot open data file '{}': No such file or directory (set data.path in the config)",
                path.display()
            )
        );
    }

    #[test]
    fn short_row_names_line_and_count() {
        let good = row("1", "2");
        let short = good
            .rsplit_once(',')
            .map(|(head, _)| head.to_owned())
            .unwrap_or_default();
        let file = TempFile::gzip("short.csv.gz", &format!("{good}\n{good}\n{short}\n"));
        let error = load_digits(&file.0).unwrap_err();
        assert!(
            matches!(
                error,
                DataError::Parse {
                    line: 3,
                    column: None,
                    ..
                }
            ),
            "{error:?}"
        );
        assert_eq!(
            error.to_string(),
            format!(
                "{} line 3: expected 65 comma-separated values (64 pixels + label), found 64",
                file.0.display()
            )
        );
    }

    #[test]
    fn bad_values_name_line_and_column() {
        let mut fields: Vec<String> = row("0", "0").split(',').map(str::to_owned).collect();
        fields[6] = "abc".to_owned();
        let cases = [
            (
                fields.join(","),
                7,
                "expected a pixel value (an integer in 0..=16), found \"abc\"",
            ),
            (
                row("17", "1"),
                1,
                "expected a pixel value (an integer in 0..=16), found \"17\"",
            ),
            (
                row("2", "10"),
                65,
                "expected a label (an integer in 0..=9), found \"10\"",
            ),
            (
                row("-1", "1"),
                1,
                "expected a pixel value (an integer in 0..=16), found \"-1\"",
            ),
            (
                row("1.5", "1"),
                1,
                "expected a pixel value (an integer in 0..=16), found \"1.5\"",
            ),
        ];
        for (bad, column, expected) in cases {
            let file = TempFile::gzip("bad.csv.gz", &format!("{}\n{bad}\n", row("0", "0")));
            let error = load_digits(&file.0).unwrap_err();
            assert!(
                matches!(&error, DataError::Parse { line: 2, column: Some(c), .. } if *c == column),
                "{error:?}"
            );
            assert_eq!(
                error.to_string(),
                format!("{} line 2, column {column}: {expected}", file.0.display())
            );
        }
    }

    #[test]
    fn corrupt_gzip_and_empty_files_are_errors() {
        let mut bytes = std::fs::read(digits_path()).expect("read vendored file");
        bytes.truncate(bytes.len() / 2);
        let truncated = TempFile::new("truncated.csv.gz", &bytes);
        let error = load_digits(&truncated.0).unwrap_err();
        assert!(matches!(error, DataError::Read { .. }), "{error:?}");
        assert!(error
            .to_string()
            .contains(&truncated.0.display().to_string()));

        let empty = TempFile::new("empty.csv", b"");
        let error = load_digits(&empty.0).unwrap_err();
        assert!(matches!(error, DataError::Empty { .. }), "{error:?}");
    }

    #[test]
    fn split_sizes_and_determinism() {
        let items = synthetic(1797, 4, 3, 1);
        let (train, validation) = split_train_validation(items.clone(), 0.2, 42);
        assert_eq!((train.len(), validation.len()), (1438, 359));
        let (train_again, validation_again) = split_train_validation(items.clone(), 0.2, 42);
        assert_eq!((&train, &validation), (&train_again, &validation_again));
        let (other_train, _) = split_train_validation(items.clone(), 0.2, 43);
        assert_ne!(train, other_train);

        // A permutation of the input: nothing lost or duplicated.
        let mut all: Vec<_> = train
            .iter()
            .chain(&validation)
            .map(|i| format!("{i:?}"))
            .collect();
        let mut original: Vec<_> = items.iter().map(|i| format!("{i:?}")).collect();
        all.sort();
        original.sort();
        assert_eq!(all, original);

        assert_eq!(split_train_validation(items.clone(), 0.0, 1).1.len(), 0);
        assert_eq!(split_train_validation(items.clone(), 1.0, 1).0.len(), 0);
        let (train, validation) = split_train_validation(Vec::new(), 0.5, 1);
        assert!(train.is_empty() && validation.is_empty());
    }

    #[test]
    fn split_is_stable_across_versions() {
        // Pins the PRNG and the shuffle: changing either changes every
        // rank's split and breaks resuming old runs. The expected order was
        // cross-checked with an independent splitmix64 + Fisher–Yates (whose
        // first output for seed 0 is 0xe220a8397b1dcdaf, as published).
        let items: Vec<_> = (0..10)
            .map(|label| ClassificationItem {
                features: Vec::new(),
                label,
            })
            .collect();
        let (train, validation) = split_train_validation(items, 0.3, 7);
        let labels =
            |items: &[ClassificationItem]| items.iter().map(|i| i.label).collect::<Vec<_>>();
        assert_eq!(
            (labels(&train), labels(&validation)),
            (vec![9, 5, 8, 6, 1, 2, 4], vec![7, 0, 3])
        );
        assert_eq!(SplitMix64::new(0).next_u64(), 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn split_shuffles_digits_classes() {
        let items = load_digits(&digits_path()).expect("loads");
        let (_, validation) = split_train_validation(items, 0.2, 0);
        let mut per_class = [0usize; DIGITS_CLASSES];
        for item in &validation {
            per_class[item.label] += 1;
        }
        assert!(per_class.iter().all(|&n| n >= 20), "{per_class:?}");
    }

    #[test]
    fn synthetic_is_deterministic_and_spread_over_classes() {
        let items = synthetic(1000, 16, 5, 3);
        assert_eq!(items, synthetic(1000, 16, 5, 3));
        assert_ne!(items, synthetic(1000, 16, 5, 4));
        let mut per_class = [0usize; 5];
        for item in &items {
            assert_eq!(item.features.len(), 16);
            assert!(item.features.iter().all(|&x| (0.0..1.0).contains(&x)));
            per_class[item.label] += 1;
        }
        assert!(per_class.iter().all(|&n| n >= 50), "{per_class:?}");
        assert!(synthetic(0, 3, 0, 1).is_empty());
    }

    #[test]
    fn dataset_and_batcher_stack_items_in_order() {
        let dataset = InMemDataset::new(synthetic(5, 3, 4, 9));
        assert_eq!(dataset.len(), 5);
        let items: Vec<_> = (0..dataset.len())
            .map(|i| dataset.get(i).expect("in memory"))
            .collect();
        let device = Device::flex();
        let batch: ClassificationBatch = ClassificationBatcher.batch(items.clone(), &device);
        assert_eq!(batch.inputs.dims(), [5, 3]);
        assert_eq!(batch.targets.dims(), [5]);
        let inputs = batch.inputs.into_data().try_to_vec::<f32>().expect("f32");
        let expected: Vec<f32> = items.iter().flat_map(|i| i.features.clone()).collect();
        assert_eq!(inputs, expected);
        let targets = batch
            .targets
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .expect("i64");
        let expected: Vec<i64> = items.iter().map(|i| i.label as i64).collect();
        assert_eq!(targets, expected);
    }
}
