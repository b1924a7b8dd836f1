//! `trainer plot` and `output.plots` (cargo feature `plots`): a [`Chart`] drawn into a PNG
//! with plotters, in the embedded DejaVu Sans font (no system
//! fonts are needed, or used, at run time).

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::types::RangedCoordf64;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::report::plot::charts::{ranges, segments, tick_label, Chart};
use crate::report::plot::error::PlotError;

/// Pixels of every chart: wide enough for a legend beside a long run.
pub const SIZE: (u32, u32) = (900, 500);

/// The font family every text is drawn in (registered by [`ensure_font`]).
const FONT: &str = "sans-serif";

/// Colours of the curves (the first of matplotlib's `tab10`, then a dark grey).
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(64, 64, 64),
];
const MARK_COLOR: RGBColor = RGBColor(110, 110, 110);

/// Height of one legend entry, in pixels, and of the plotting area (about: the image less the
/// caption and the x axis labels).
const LEGEND_ENTRY_PX: f64 = 21.0;
const PLOT_HEIGHT_PX: f64 = 380.0;

/// Marks listed one by one in the legend; more are summed up in one entry.
const MARKS_IN_LEGEND: usize = 4;

/// Registers the embedded DejaVu Sans as [`FONT`], once per process.
fn ensure_font() -> Result<(), PlotError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED
        .get_or_init(|| register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok());
    if ok {
        Ok(())
    } else {
        Err(PlotError::Font)
    }
}

/// Draws `chart` into the PNG file `path` (replaced if it exists).
pub fn draw(chart: &Chart, path: &Path) -> Result<(), PlotError> {
    ensure_font()?;
    let failed = |e: &dyn std::fmt::Display| PlotError::Draw {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };

    // The legend: curves, then marks (capped).
    let legend_entries = chart.curves.len() + chart.marks.len().min(MARKS_IN_LEGEND + 1);
    let with_legend = legend_entries > 1 || !chart.marks.is_empty();
    let headroom = if with_legend {
        (legend_entries as f64 * LEGEND_ENTRY_PX + 16.0) / PLOT_HEIGHT_PX
    } else {
        0.0
    };
    let Some((x_range, y_range)) = ranges(chart, headroom) else {
        return Err(failed(&"no finite value to plot"));
    };
    let (y_lo, y_hi) = (y_range.start, y_range.end);
    // Whole epochs: a tick per epoch where they fit, none between.
    let x_ticks = if chart.whole_x {
        ((x_range.end - x_range.start).ceil() as usize + 1).clamp(2, 12)
    } else {
        10
    };
    let whole = chart.whole_x;
    let x_tick = move |v: &f64| {
        if whole && (v - v.round()).abs() > 1e-9 {
            String::new()
        } else {
            tick_label(*v)
        }
    };

    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| failed(&e))?;
    let mut ctx = ChartBuilder::on(&root)
        .caption(&chart.title, (FONT, 22))
        .margin(14)
        .x_label_area_size(48)
        .y_label_area_size(78)
        .build_cartesian_2d(x_range, y_range)
        .map_err(|e| failed(&e))?;
    ctx.configure_mesh()
        .x_desc(chart.x_label.as_str())
        .y_desc(chart.y_label.as_str())
        .x_labels(x_ticks)
        .y_labels(8)
        .x_label_formatter(&x_tick)
        .y_label_formatter(&|v| tick_label(*v))
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .light_line_style(TRANSPARENT)
        .bold_line_style(RGBColor(225, 225, 225))
        .draw()
        .map_err(|e| failed(&e))?;

    draw_curves(&mut ctx, chart).map_err(|e| failed(&e))?;
    draw_marks(&mut ctx, chart, y_lo, y_hi).map_err(|e| failed(&e))?;

    if with_legend {
        ctx.configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .label_font((FONT, 14))
            .background_style(WHITE.mix(0.9))
            .border_style(RGBColor(190, 190, 190))
            .draw()
            .map_err(|e| failed(&e))?;
    }
    root.present().map_err(|e| failed(&e))?;
    Ok(())
}

/// The chart area of [`draw`]: f64 on both axes.
type Area<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Every curve (solid or dashed, with dots where asked or where a curve has a single point)
/// and its legend entry.
fn draw_curves(ctx: &mut Area<'_, '_>, chart: &Chart) -> Result<(), String> {
    for curve in &chart.curves {
        let color = PALETTE[curve.color % PALETTE.len()];
        let style = color.stroke_width(2);
        let pieces = segments(&curve.points);
        let anno = if curve.dashed {
            ctx.draw_series(
                pieces
                    .into_iter()
                    .flat_map(|piece| DashedLineSeries::new(piece, 7, 5, style)),
            )
        } else {
            ctx.draw_series(
                pieces
                    .into_iter()
                    .flat_map(|piece| LineSeries::new(piece, style)),
            )
        }
        .map_err(|e| e.to_string())?;
        anno.label(curve.name.as_str());
        if curve.dashed {
            anno.legend(move |(x, y)| {
                DashedPathElement::new(vec![(x, y), (x + 20, y)], 5, 3, style)
            });
        } else {
            anno.legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        }
        let lonely = curve.points.len() <= 1;
        if curve.dots || lonely {
            ctx.draw_series(
                curve
                    .points
                    .iter()
                    .filter(|(x, y)| x.is_finite() && y.is_finite())
                    .map(|&p| Circle::new(p, 4, color.filled())),
            )
            .map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

/// The restart marks: vertical dashed lines over `y_lo..y_hi`, the first few in the legend.
fn draw_marks(ctx: &mut Area<'_, '_>, chart: &Chart, y_lo: f64, y_hi: f64) -> Result<(), String> {
    let mark_style = MARK_COLOR.stroke_width(2);
    for (i, (x, label)) in chart.marks.iter().enumerate() {
        let line = DashedLineSeries::new(vec![(*x, y_lo), (*x, y_hi)], 8, 6, mark_style);
        let anno = ctx.draw_series(line).map_err(|e| e.to_string())?;
        let legend = match i {
            i if i < MARKS_IN_LEGEND => Some(label.clone()),
            i if i == MARKS_IN_LEGEND => Some(format!(
                "{} more restarts (dashed)",
                chart.marks.len() - MARKS_IN_LEGEND
            )),
            _ => None,
        };
        if let Some(text) = legend {
            anno.label(text).legend(move |(x, y)| {
                DashedPathElement::new(vec![(x, y), (x + 20, y)], 5, 3, mark_style)
            });
        }
    }
    Ok(())
}
