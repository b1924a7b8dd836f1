//! `tensorboard` in a build without the cargo feature `tensorboard` (`crate::features`): the
//! same names, refusing with the error that names the feature. A config asking for
//! `output.tensorboard` is refused by the pre-flight first, with exit code 2.

use std::io;
use std::path::Path;

use crate::features::Feature;
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
