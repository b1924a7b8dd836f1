//! `trainer plot RUN_DIR`: PNG charts of a run from its `metrics.jsonl`, into `RUN_DIR/plots/`.
//!
//! | file | owns |
//! |---|---|
//! | `records.rs` | the lines of `metrics.jsonl`, read leniently (pure) |
//! | `series.rs` | the points of every chart and the resume marks, from those lines (pure) |
//! | `charts.rs` | which charts a run gets, their titles, axes, ranges and ticks (pure) |
//! | `error.rs` | why no charts could be written |
//! | `draw.rs` | a chart drawn into a PNG (plotters, embedded DejaVu Sans font; cargo feature `plots`) |
//! | `draw_stand_in.rs` | the same name, refusing, in a build without `plots` |
//! | `mod.rs` | the command: find the file, read it, write the charts |
//!
//! A chart is drawn into a PNG by `draw.rs` (plotters, embedded DejaVu Sans font), in
//! builds with the cargo feature `plots` (the `trainer` binary's default); without it the
//! command is refused, naming the feature, with exit code 2.
//!
//! The charts, one concern each: `loss.png` (training and validation loss per optimizer
//! step), `validation-<metric>.png` (each validation metric per epoch), `learning-rate.png`,
//! `throughput.png` (global samples per second) and, for files with step times,
//! `step-time.png` (milliseconds per step by phase, and the slowest rank's compute). A run
//! that started again (resume, launcher restart) or changed world size is marked with a
//! dashed vertical line on every chart.

pub(crate) mod charts;
pub(crate) mod error;
mod records;
mod series;

// An optional part (`crate::features`): the real module with its cargo feature, the stand-in
// with the same names without it.
#[cfg(feature = "plots")]
mod draw;
#[cfg(not(feature = "plots"))]
#[path = "draw_stand_in.rs"]
mod draw;

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;

// Public in every build, so a program without the `plots` feature can draw the same charts
// with a library of its own: their curves, the axes' ranges and the tick labels.
pub use charts::{ranges, segments, tick_label, Chart, Curve};
pub use error::PlotError;
pub use records::{Line, SpreadLine, StartLine, TimeLine, TrainLine, ValidLine};
pub use series::{read_series, Mark, Points, RunSeries, StepTimes};

use crate::error::UsageError;
use crate::features::Feature;

/// The metrics file inside a run's output directory.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// The charts' directory inside a run's output directory.
pub const PLOTS_DIR: &str = "plots";

#[derive(Args, Debug, Clone)]
pub struct PlotArgs {
    /// The run's output directory (`output.dir`), holding `metrics.jsonl`.
    pub run_dir: PathBuf,
}

/// `trainer plot RUN_DIR`: writes the charts and prints each file written, one per line.
/// Exit code 0; a missing or unreadable metrics file is an error with exit code 2.
pub fn plot_command(args: &PlotArgs) -> anyhow::Result<ExitCode> {
    for file in write_plots(&args.run_dir)? {
        println!("{}", file.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes the charts of the run whose output directory is `run_dir` (or whose metrics file
/// is `run_dir`) into its `plots/` directory, replacing charts of the same names, and returns
/// the files written. Reads the file once; safe while a run appends to it (a last line still
/// being written is left out).
///
/// Errors: [`PlotError`]; those about the input ([`PlotError::is_input`]) as a
/// [`UsageError`] (exit code 2).
pub fn write_plots(run_dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    plots(run_dir).map_err(|e| {
        if e.is_input() {
            UsageError(e.to_string()).into()
        } else {
            e.into()
        }
    })
}

/// [`write_plots`] with its typed error.
pub fn plots(run_dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    Feature::Plots.require("drawing charts (`trainer plot`, output.plots)")?;
    let (metrics, dir) = if run_dir.is_file() {
        let dir = run_dir.parent().unwrap_or(Path::new(".")).to_path_buf();
        (run_dir.to_path_buf(), dir)
    } else {
        (run_dir.join(METRICS_FILE), run_dir.to_path_buf())
    };
    let text = fs::read_to_string(&metrics).map_err(|source| match source.kind() {
        ErrorKind::NotFound => PlotError::NoMetrics {
            path: metrics.clone(),
        },
        _ => PlotError::Read {
            path: metrics.clone(),
            source,
        },
    })?;
    let series = read_series(&text, &metrics)?;

    let out = dir.join(PLOTS_DIR);
    fs::create_dir_all(&out).map_err(|source| PlotError::CreateDir {
        path: out.clone(),
        source,
    })?;
    let mut written = Vec::new();
    for chart in series.charts(&run_name(&dir)) {
        let path = out.join(&chart.file);
        // Drawn beside, then renamed: a viewer never sees half a chart. (The encoder goes by
        // the extension, so the temporary name ends in .png too.)
        let partial = out.join(format!(".partial-{}", chart.file));
        let drawn = draw::draw(&chart, &partial).and_then(|()| {
            fs::rename(&partial, &path).map_err(|e| PlotError::Draw {
                path: path.clone(),
                reason: e.to_string(),
            })
        });
        if drawn.is_err() {
            let _ = fs::remove_file(&partial);
        }
        drawn?;
        written.push(path);
    }
    Ok(written)
}

/// The run's name in chart titles: its directory's name.
fn run_name(dir: &Path) -> String {
    let absolute = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    absolute
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string())
}
