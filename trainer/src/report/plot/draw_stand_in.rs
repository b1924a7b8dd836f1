//! `draw` in a build without the cargo feature `plots` (`crate::features`): the same name,
//! refusing with the error that names the feature. `write_plots` asks for the feature first,
//! so it is never reached.

use std::path::Path;

use crate::features::Feature;
use crate::report::plot::charts::Chart;
use crate::report::plot::error::PlotError;

pub fn draw(_chart: &Chart, _path: &Path) -> Result<(), PlotError> {
    Err(Feature::Plots.missing("drawing charts").into())
}
