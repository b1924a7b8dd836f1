//! `image_folder` in a build without the cargo feature `image-folder` (`crate::features`): the
//! same name, refusing with the error that names the feature. A config that passed its checks
//! never reaches it: the checks refuse first, with exit code 2.

use std::path::Path;

use burn::data::dataset::Dataset;

use crate::data::ClassificationItem;
use crate::features::Feature;
use crate::sources::error::SourceError;

pub fn dataset(
    _root: &Path,
    _labels: Option<&[String]>,
    _classes: usize,
    _height: u32,
    _width: u32,
) -> Result<Box<dyn Dataset<ClassificationItem>>, SourceError> {
    Err(Feature::ImageFolder
        .missing("data.source = \"image-folder\"")
        .into())
}
