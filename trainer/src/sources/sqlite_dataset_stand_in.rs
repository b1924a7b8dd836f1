//! `sqlite_dataset` in a build without the cargo feature `sqlite` (`crate::features`): the same
//! name, refusing with the error that names the feature. A config that passed its checks never
//! reaches it: the checks refuse first, with exit code 2.

use std::path::Path;

use burn::data::dataset::Dataset;

use crate::features::Feature;
use crate::sources::error::SourceError;

pub fn dataset<I, D>(
    _path: &Path,
    _table: &str,
    _decoder: D,
) -> Result<Box<dyn Dataset<I>>, SourceError> {
    Err(Feature::Sqlite.missing("data.source = \"sqlite\"").into())
}
