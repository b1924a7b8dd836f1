//! The user's own data for the built-in apps: `[data] source = "csv" | "sqlite" |
//! "image-folder"` (classifier) and `"csv" | "sqlite"` (regression).
//!
//! | source | file | opening (every rank, once) | `get(i)` |
//! |---|---|---|---|
//! | [`csv`] | a CSV file with a header | one pass: record offsets, every record checked | one positioned read, one record parsed |
//! | `sqlite` | a table in burn-dataset's `SqliteDataset` format | one query: every row checked | one query: row `row_id = i + 1` |
//! | `image-folder` | `root/<class>/<image>` | the folders listed | one image decoded, grey, resized |
//!
//! SQLite and images are read by `sqlite_dataset` and `image_folder` (cargo features `sqlite`
//! and `image-folder`, in the `trainer` binary's default features; without them their
//! stand-ins refuse, `crate::features`): [`sqlite`] holds what the config names (the table),
//! checked without them.
//!
//! Each is a Burn `Dataset` over the whole file; [`split`] makes the training and validation
//! sets from it (a seeded shuffle of the indices, as the digits are split) without reading
//! anything, so a rank reads only the items of its shard ([`counting`] shows it). Opening
//! checks every row of a table (a bad cell fails before training, naming its line or `row_id`
//! and column) but keeps no values; images are only checked when read. Every error is a
//! [`SourceError`] naming the file and the place; the apps make it an `AppError` (exit 2).

pub mod counting;
pub mod csv;
pub mod error;
pub mod schema;
pub mod sqlite;
pub mod table;

// The optional readers (`crate::features`): each real module with its cargo feature, its
// stand-in with the same names without it.
#[cfg(feature = "image-folder")]
pub(crate) mod image_folder;
#[cfg(not(feature = "image-folder"))]
#[path = "image_folder_stand_in.rs"]
pub(crate) mod image_folder;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite_dataset;
#[cfg(not(feature = "sqlite"))]
#[path = "sqlite_dataset_stand_in.rs"]
pub(crate) mod sqlite_dataset;

use std::sync::Arc;

use burn::data::dataset::transform::SelectionDataset;
use burn::data::dataset::Dataset;
use burn_ddp::rng::SplitMix64;

pub use error::SourceError;

use crate::app::{AppError, Datasets};

/// The training and validation sets of `all`: its indices shuffled with `seed`, the last
/// `round(len * validation_fraction)` of them for validation (none when that is 0), the rest
/// for training. Reads nothing: the sets map their indices to `all`'s.
///
/// The same split as `crate::data::split_train_validation` gives for the same items.
pub fn split<I, D>(all: D, validation_fraction: f64, seed: u64) -> Datasets<I>
where
    I: Clone + Send + Sync + 'static,
    D: Dataset<I> + 'static,
{
    let all = Arc::new(all);
    let len = all.len();
    let mut indices: Vec<usize> = (0..len).collect();
    SplitMix64::new(seed).shuffle(&mut indices);
    // Exact for any realistic size (< 2^53 items).
    let valid_len = ((len as f64 * validation_fraction).round() as usize).min(len);
    let valid = indices.split_off(len - valid_len);
    let subset = |indices: Vec<usize>| -> Arc<dyn Dataset<I>> {
        Arc::new(SelectionDataset::<D, I>::from_indices_checked(
            all.clone(),
            indices,
        ))
    };
    Datasets {
        train: subset(indices),
        valid: (!valid.is_empty()).then(|| subset(valid)),
    }
}

impl From<SourceError> for AppError {
    fn from(error: SourceError) -> Self {
        AppError(error.to_string())
    }
}

#[cfg(test)]
mod tests {
    use burn::data::dataset::InMemDataset;

    use super::*;
    use crate::data::{split_train_validation, ClassificationItem};

    #[test]
    fn split_is_the_digits_split_and_reads_nothing() {
        let items: Vec<ClassificationItem> = (0..50)
            .map(|label| ClassificationItem {
                features: vec![label as f32],
                label,
            })
            .collect();
        let (train, valid) = split_train_validation(items.clone(), 0.2, 9);
        let sets = split(InMemDataset::new(items), 0.2, 9);
        let all = |d: &dyn Dataset<ClassificationItem>| {
            (0..d.len()).map(|i| d.get(i).unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(all(&*sets.train), train);
        assert_eq!(sets.valid.as_deref().map(all), Some(valid));

        let whole = split(InMemDataset::new(vec![1u8, 2, 3]), 0.0, 1);
        assert_eq!(whole.train.len(), 3);
        assert!(whole.valid.is_none());
    }
}
