//! Which charts a run gets, and their layout decisions (pure: series in, chart descriptions
//! out). [`super::draw`] turns a [`Chart`] into pixels without deciding anything.

use std::ops::Range;

use super::series::{Points, RunSeries};

/// One PNG: a title, labelled axes, curves and vertical marks.
#[derive(Debug, Clone, PartialEq)]
pub struct Chart {
    /// The file name inside `plots/`, e.g. `loss.png`.
    pub file: String,
    pub title: String,
    /// With the unit, e.g. `optimizer step`, `time per step (ms)`.
    pub x_label: String,
    pub y_label: String,
    /// The y axis starts at 0 (times, rates), not at the lowest value.
    pub y_from_zero: bool,
    /// Only whole numbers are ticked on the x axis (epochs).
    pub whole_x: bool,
    pub curves: Vec<Curve>,
    /// `(x, label)`: a dashed vertical line where a run started again.
    pub marks: Vec<(f64, String)>,
}

/// One series of a chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Curve {
    /// Its legend entry.
    pub name: String,
    pub points: Points,
    /// An index into the palette: curves about the same quantity share a colour.
    pub color: usize,
    pub dashed: bool,
    /// A dot on every point (validations: few points, each meaningful).
    pub dots: bool,
}

impl Curve {
    fn line(name: &str, points: &Points, color: usize) -> Self {
        Self {
            name: name.to_string(),
            points: points.clone(),
            color,
            dashed: false,
            dots: false,
        }
    }

    fn has_points(&self) -> bool {
        self.points
            .iter()
            .any(|(x, y)| x.is_finite() && y.is_finite())
    }
}

const STEP_AXIS: &str = "optimizer step";
const EPOCH_AXIS: &str = "epoch";

impl RunSeries {
    /// Every chart with something to show, titled with the run's name `run`: the loss (training
    /// and validation), one per validation metric, the learning rate, the throughput and, when
    /// the file has step times, the time per step by phase.
    pub fn charts(&self, run: &str) -> Vec<Chart> {
        let maker = ChartMaker {
            run,
            step_marks: self
                .marks
                .iter()
                .map(|m| (m.step as f64, m.label.clone()))
                .collect(),
            epoch_marks: self
                .marks
                .iter()
                .filter_map(|m| Some((m.epoch? as f64, m.label.clone())))
                .collect(),
        };
        let mut charts = self.loss_and_validation(&maker);
        charts.push(maker.chart(
            "learning-rate.png",
            "Learning rate",
            STEP_AXIS,
            "learning rate".into(),
            false,
            vec![Curve::line("learning rate", &self.lr, 2)],
        ));
        charts.push(maker.chart(
            "throughput.png",
            "Throughput",
            STEP_AXIS,
            "samples / s (all ranks)".into(),
            true,
            vec![Curve::line("samples / s", &self.throughput, 0)],
        ));
        charts.extend(self.step_time(&maker));
        charts.retain(|c| !c.curves.is_empty());
        charts
    }

    /// The loss chart (training and validation) and one chart per validation metric.
    fn loss_and_validation(&self, maker: &ChartMaker<'_>) -> Vec<Chart> {
        let mut charts = Vec::new();
        if let Some(metric) = &self.loss_metric {
            let mut validation = Curve::line("validation", &self.valid_loss, 1);
            validation.dots = true;
            charts.push(maker.chart(
                "loss.png",
                metric,
                STEP_AXIS,
                axis_label(metric),
                false,
                vec![
                    Curve::line(
                        "training (mean since the previous point)",
                        &self.train_loss,
                        0,
                    ),
                    validation,
                ],
            ));
        }
        for (name, points) in &self.validation {
            let mut curve = Curve::line(&format!("validation {name}"), points, 1);
            curve.dots = true;
            charts.push(maker.chart(
                &format!("validation-{}.png", file_slug(name)),
                &format!("Validation {name}"),
                EPOCH_AXIS,
                axis_label(name),
                false,
                vec![curve],
            ));
        }
        charts
    }

    /// The time per step by phase, when the file has step times.
    fn step_time(&self, maker: &ChartMaker<'_>) -> Option<Chart> {
        let t = self.step_time.as_ref()?;
        let mut straggler = Curve::line("compute, slowest rank (max)", &t.compute_max, 0);
        straggler.dashed = true;
        Some(maker.chart(
            "step-time.png",
            "Time per optimizer step (median over ranks)",
            STEP_AXIS,
            "ms per optimizer step".into(),
            true,
            vec![
                Curve::line("whole step", &t.step, 7),
                Curve::line("compute", &t.compute, 0),
                straggler,
                Curve::line("gradient communication", &t.sync, 1),
                Curve::line("optimizer", &t.optimizer, 2),
                Curve::line("data wait", &t.data, 3),
                Curve::line("checkpoint", &t.checkpoint, 4),
            ],
        ))
    }
}

/// Makes the charts of one run: its title and its restart marks on either axis.
struct ChartMaker<'a> {
    run: &'a str,
    step_marks: Vec<(f64, String)>,
    epoch_marks: Vec<(f64, String)>,
}

impl ChartMaker<'_> {
    /// A chart of `curves` (those without points left out) over the step or epoch axis `x`.
    fn chart(
        &self,
        file: &str,
        what: &str,
        x: &str,
        y: String,
        from_zero: bool,
        curves: Vec<Curve>,
    ) -> Chart {
        let marks = if x == EPOCH_AXIS {
            self.epoch_marks.clone()
        } else {
            self.step_marks.clone()
        };
        Chart {
            file: file.to_string(),
            title: format!("{what} — {}", self.run),
            x_label: x.to_string(),
            y_label: y,
            y_from_zero: from_zero,
            whole_x: x == EPOCH_AXIS,
            curves: curves.into_iter().filter(Curve::has_points).collect(),
            marks,
        }
    }
}

/// The y axis label of a metric, with its unit where one is known: accuracies are in %.
pub fn axis_label(metric: &str) -> String {
    if metric.to_lowercase().contains("accuracy") {
        format!("{metric} (%)")
    } else {
        metric.to_string()
    }
}

/// A metric name as part of a file name: lowercase ASCII letters, digits and `-`.
pub fn file_slug(name: &str) -> String {
    let mut slug = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            slug.push(c.to_ascii_lowercase());
        } else if !slug.ends_with('-') {
            slug.push('-');
        }
    }
    let slug = slug.trim_matches('-');
    if slug.is_empty() {
        "metric".to_string()
    } else {
        slug.to_string()
    }
}

/// The pieces of a curve drawn as connected lines: a curve breaks at a missing value and where
/// `x` does not increase (a resumed run redoing steps is drawn over the steps it redid, not
/// joined back to them).
pub fn segments(points: &[(f64, f64)]) -> Vec<Points> {
    let mut pieces: Vec<Points> = Vec::new();
    let mut current: Points = Vec::new();
    for &(x, y) in points {
        if !(x.is_finite() && y.is_finite()) {
            if !current.is_empty() {
                pieces.push(std::mem::take(&mut current));
            }
            continue;
        }
        if current.last().is_some_and(|&(last, _)| x <= last) {
            pieces.push(std::mem::take(&mut current));
        }
        current.push((x, y));
    }
    if !current.is_empty() {
        pieces.push(current);
    }
    pieces
}

/// The axes' ranges of `chart`: every finite point and mark fits, with a margin; `None` when
/// there is no finite point. `headroom` (in [0, 1)) is the fraction of the height left empty
/// at the top for the legend.
pub fn ranges(chart: &Chart, headroom: f64) -> Option<(Range<f64>, Range<f64>)> {
    let finite: Vec<(f64, f64)> = chart
        .curves
        .iter()
        .flat_map(|c| c.points.iter().copied())
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    if finite.is_empty() {
        return None;
    }
    let xs = finite
        .iter()
        .map(|p| p.0)
        .chain(chart.marks.iter().map(|m| m.0));
    let (x_lo, x_hi) = min_max(xs)?;
    let (mut y_lo, y_hi) = min_max(finite.iter().map(|p| p.1))?;
    if chart.y_from_zero {
        y_lo = y_lo.min(0.0);
    }
    let x = padded(x_lo, x_hi, 0.02);
    let y = padded(y_lo, y_hi, 0.05);
    let y_start = if chart.y_from_zero && y_lo >= 0.0 {
        0.0
    } else {
        y.start
    };
    let room = headroom.clamp(0.0, 0.9);
    let y_end = y_start + (y.end - y_start) / (1.0 - room);
    Some((x, y_start..y_end))
}

fn min_max(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

/// `lo..hi` widened by `fraction` of its span on each side; a single value gets a span of its
/// own (10% of its size, or 1 for 0).
fn padded(lo: f64, hi: f64, fraction: f64) -> Range<f64> {
    if hi > lo {
        let pad = (hi - lo) * fraction;
        return (lo - pad)..(hi + pad);
    }
    let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.1 };
    (lo - pad)..(hi + pad)
}

/// A tick value as a person writes it: `40`, `0.5`, `0.003`, `1.5e-5`, `12000`.
pub fn tick_label(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return "0".to_string();
    }
    let magnitude = v.abs();
    if !(1e-3..1e6).contains(&magnitude) {
        let text = format!("{v:.1e}");
        return text.replace(".0e", "e");
    }
    // Four significant digits, trailing zeros dropped.
    let decimals = (3 - magnitude.log10().floor() as i32).max(0) as usize;
    let text = format!("{v:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::plot::series::{Mark, StepTimes};

    #[test]
    fn a_curve_breaks_at_gaps_and_where_steps_go_back() {
        let nan = f64::NAN;
        let points = [
            (10.0, 1.0),
            (20.0, 0.9),
            (30.0, nan),
            (40.0, 0.7),
            (50.0, 0.6),
            // A resume from the checkpoint of step 40 redoes step 50.
            (50.0, 0.61),
            (60.0, 0.5),
        ];
        assert_eq!(
            segments(&points),
            vec![
                vec![(10.0, 1.0), (20.0, 0.9)],
                vec![(40.0, 0.7), (50.0, 0.6)],
                vec![(50.0, 0.61), (60.0, 0.5)],
            ]
        );
        assert!(segments(&[(1.0, nan)]).is_empty());
    }

    #[test]
    fn ticks_read_like_a_person_wrote_them() {
        assert_eq!(tick_label(40.0), "40");
        assert_eq!(tick_label(0.5), "0.5");
        assert_eq!(tick_label(0.1 + 0.2), "0.3");
        assert_eq!(tick_label(0.003), "0.003");
        assert_eq!(tick_label(0.00015), "1.5e-4");
        assert_eq!(tick_label(12000.0), "12000");
        assert_eq!(tick_label(1234.5678), "1235");
        assert_eq!(tick_label(-2.5), "-2.5");
        assert_eq!(tick_label(0.0), "0");
    }

    #[test]
    fn accuracies_are_in_percent_and_names_become_file_names() {
        assert_eq!(axis_label("Accuracy"), "Accuracy (%)");
        assert_eq!(axis_label("Loss"), "Loss");
        assert_eq!(file_slug("Top-K Accuracy@5"), "top-k-accuracy-5");
        assert_eq!(file_slug("///"), "metric");
    }

    fn chart(points: Points, from_zero: bool) -> Chart {
        Chart {
            file: "x.png".into(),
            title: "t".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            y_from_zero: from_zero,
            whole_x: false,
            curves: vec![Curve::line("c", &points, 0)],
            marks: vec![(100.0, "resumed".into())],
        }
    }

    #[test]
    fn ranges_hold_every_point_and_mark_with_room_for_the_legend() {
        let (x, y) = ranges(&chart(vec![(10.0, 2.0), (50.0, 4.0)], false), 0.0).unwrap();
        assert!(x.start < 10.0 && x.end > 100.0, "{x:?}");
        assert!(
            y.start < 2.0 && y.start > 1.8 && y.end > 4.0 && y.end < 4.2,
            "{y:?}"
        );
        let (_, y) = ranges(&chart(vec![(10.0, 2.0), (50.0, 4.0)], true), 0.5).unwrap();
        assert_eq!(y.start, 0.0);
        assert!(y.end > 8.0, "half the height is left for the legend: {y:?}");
        let (_, y) = ranges(&chart(vec![(10.0, 0.05)], false), 0.0).unwrap();
        assert!(
            y.start < 0.05 && y.end > 0.05,
            "one value gets a span: {y:?}"
        );
        assert!(ranges(&chart(vec![(10.0, f64::NAN)], false), 0.0).is_none());
    }

    #[test]
    fn a_run_gets_one_chart_per_concern_and_skips_what_it_lacks() {
        let series = RunSeries {
            loss_metric: Some("Loss".into()),
            train_loss: vec![(10.0, 1.0)],
            valid_loss: vec![(10.0, 0.9)],
            validation: [
                ("Accuracy".to_string(), vec![(1.0, 90.0)]),
                ("Loss".to_string(), vec![(1.0, 0.9)]),
            ]
            .into(),
            lr: vec![(10.0, 0.1)],
            throughput: vec![(10.0, f64::NAN)],
            step_time: None,
            marks: vec![Mark {
                step: 10,
                epoch: None,
                label: "resumed at step 10".into(),
            }],
        };
        let charts = series.charts("run");
        let files: Vec<&str> = charts.iter().map(|c| c.file.as_str()).collect();
        // No throughput (no value) and no step time (no `time` in the file).
        assert_eq!(
            files,
            [
                "loss.png",
                "validation-accuracy.png",
                "validation-loss.png",
                "learning-rate.png"
            ]
        );
        assert_eq!(charts[0].curves.len(), 2);
        assert_eq!(charts[0].marks, [(10.0, "resumed at step 10".to_string())]);
        assert!(charts[1].marks.is_empty(), "a mark without an epoch");
        assert!(
            charts[1].whole_x && !charts[0].whole_x,
            "epochs are ticked whole"
        );
        assert_eq!(charts[1].y_label, "Accuracy (%)");
        assert_eq!(charts[1].title, "Validation Accuracy — run");

        let timed = RunSeries {
            step_time: Some(StepTimes {
                step: vec![(10.0, 5.0)],
                ..StepTimes::default()
            }),
            ..series
        };
        let charts = timed.charts("run");
        let time = charts.iter().find(|c| c.file == "step-time.png").unwrap();
        assert_eq!(time.curves.len(), 1, "phases without values are left out");
        assert_eq!(time.y_label, "ms per optimizer step");
    }
}
