//! Stand-ins for the optional parts a build lacks (module docs of `crate::backend`): the names
//! the engine calls, refusing with the error that names the cargo feature. A config that
//! passed its checks never reaches them: the checks refuse first, with exit code 2.

/// Without the `sqlite` feature.
#[cfg(not(feature = "sqlite"))]
pub(crate) mod sqlite {
    use std::path::Path;

    use burn::data::dataset::Dataset;

    use crate::backend::features::Feature;
    use crate::sources::error::SourceError;

    pub fn dataset<I, D>(
        _path: &Path,
        _table: &str,
        _decoder: D,
    ) -> Result<Box<dyn Dataset<I>>, SourceError> {
        Err(Feature::Sqlite.missing("data.source = \"sqlite\"").into())
    }
}

/// Without the `image-folder` feature.
#[cfg(not(feature = "image-folder"))]
pub(crate) mod image_folder {
    use std::path::Path;

    use burn::data::dataset::Dataset;

    use crate::backend::features::Feature;
    use crate::data::ClassificationItem;
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
}

/// Without the `plots` feature.
#[cfg(not(feature = "plots"))]
pub(crate) mod draw {
    use std::path::Path;

    use crate::backend::features::Feature;
    use crate::report::plot::charts::Chart;
    use crate::report::plot::error::PlotError;

    pub fn draw(_chart: &Chart, _path: &Path) -> Result<(), PlotError> {
        Err(Feature::Plots.missing("drawing charts").into())
    }
}

/// Without the `tensorboard` feature.
#[cfg(not(feature = "tensorboard"))]
pub(crate) mod tensorboard {
    use std::io;
    use std::path::Path;

    use crate::backend::features::Feature;
    use crate::report::record::Record;

    /// Never made: [`EventWriter::create`] refuses.
    pub enum EventWriter {}

    impl EventWriter {
        pub fn create(_dir: &Path) -> io::Result<Self> {
            Err(io::Error::other(
                Feature::Tensorboard.missing("output.tensorboard = true"),
            ))
        }

        pub fn path(&self) -> &Path {
            match *self {}
        }

        pub fn record(&mut self, _record: &Record) -> io::Result<()> {
            match *self {}
        }
    }
}
