//! What the charts show, computed from the lines of `metrics.jsonl` (pure: no files, no
//! drawing). [`read_series`] is the whole way from the file's text to the plotted points.

use std::collections::BTreeMap;
use std::path::Path;

use super::error::PlotError;
use super::records::{parse_lines, Line, SpreadLine, StartLine, TrainLine};

/// Points of one curve, `(x, y)` in file order. `y` is NaN where the file has `null` or no
/// value (a gap in the curve); `x` goes back where a resumed run redid steps.
pub type Points = Vec<(f64, f64)>;

/// Every series the charts draw, in the units they are drawn in.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunSeries {
    /// The metric of the loss chart: `"Loss"`, or the first training metric of a run without
    /// one; `None` when the training lines carry no metric at all.
    pub loss_metric: Option<String>,
    /// `(optimizer step, value)` of [`RunSeries::loss_metric`]: one point per `train` line.
    pub train_loss: Points,
    /// `(optimizer step, value)` of [`RunSeries::loss_metric`]: one point per `valid` line
    /// that has it and a step.
    pub valid_loss: Points,
    /// Every validation metric: `(epoch, value)`, one point per `valid` line that has it. The
    /// epoch is 1-based: 1 is the validation during (at the end of) the first epoch.
    pub validation: BTreeMap<String, Points>,
    /// `(optimizer step, learning rate)`: one point per `train` line.
    pub lr: Points,
    /// `(optimizer step, global samples per second)`: one point per `train` line.
    pub throughput: Points,
    /// Milliseconds per optimizer step by phase, from the `train` lines that have a `time`;
    /// `None` when none has (files written before the timing existed).
    pub step_time: Option<StepTimes>,
    /// Where a run started again (resume, restart) or the world size changed.
    pub marks: Vec<Mark>,
}

/// `(optimizer step, milliseconds per step)` by phase, one point per `train` line with a
/// `time`. Medians over the ranks, except `compute_max` (the slowest rank's compute: a
/// straggler shows as the gap between it and `compute`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTimes {
    /// A whole step's wall time.
    pub step: Points,
    pub compute: Points,
    /// Gradient communication: the all-reduces and the wait for the other ranks.
    pub sync: Points,
    pub optimizer: Points,
    /// Waiting for the data loader.
    pub data: Points,
    pub checkpoint: Points,
    pub compute_max: Points,
}

/// A vertical marker: a run started again, or the world size changed.
#[derive(Debug, Clone, PartialEq)]
pub struct Mark {
    /// The optimizer step it happened after.
    pub step: usize,
    /// Epochs complete when it happened (the 0-based epoch then in progress), where known:
    /// its place on the per-epoch charts.
    pub epoch: Option<usize>,
    /// E.g. `resumed at step 40 (world 2→3)`, `restart 1: resumed at step 40`.
    pub label: String,
}

/// The series of the metrics file `path` whose contents are `text` (`path` only names the
/// file in errors).
///
/// Errors: [`PlotError::BadLine`] for a line that cannot be read (with its number),
/// [`PlotError::NoTrainLines`] when no `train` line exists (nothing to plot yet).
pub fn read_series(text: &str, path: &Path) -> Result<RunSeries, PlotError> {
    let lines = parse_lines(text, path)?;
    if !lines.iter().any(|l| matches!(l, Line::Train(_))) {
        return Err(PlotError::NoTrainLines {
            path: path.to_path_buf(),
        });
    }
    Ok(RunSeries::from_lines(&lines))
}

impl RunSeries {
    /// The series of parsed lines, in file order.
    pub fn from_lines(lines: &[Line]) -> Self {
        let train: Vec<&TrainLine> = lines
            .iter()
            .filter_map(|l| match l {
                Line::Train(t) => Some(t),
                _ => None,
            })
            .collect();
        let loss_metric = loss_metric(&train);
        let step = |t: &TrainLine| t.step as f64;
        let value = |v: Option<f64>| v.unwrap_or(f64::NAN);

        let mut series = RunSeries {
            train_loss: match &loss_metric {
                Some(name) => train
                    .iter()
                    .map(|t| (step(t), value(t.metrics.get(name).copied().flatten())))
                    .collect(),
                None => Vec::new(),
            },
            lr: train.iter().map(|t| (step(t), value(t.lr))).collect(),
            throughput: train
                .iter()
                .map(|t| (step(t), value(t.samples_per_sec)))
                .collect(),
            step_time: step_times(&train),
            marks: marks(lines),
            loss_metric,
            ..RunSeries::default()
        };
        for line in lines {
            let Line::Valid(v) = line else { continue };
            let epoch = (v.epoch + 1) as f64;
            for (name, &y) in &v.metrics {
                series
                    .validation
                    .entry(name.clone())
                    .or_default()
                    .push((epoch, value(y)));
            }
            if let (Some(name), Some(at)) = (&series.loss_metric, v.step) {
                if let Some(&y) = v.metrics.get(name) {
                    series.valid_loss.push((at as f64, value(y)));
                }
            }
        }
        series
    }
}

/// `"Loss"` when a training line has it, else the first metric of the first line with one.
fn loss_metric(train: &[&TrainLine]) -> Option<String> {
    const LOSS: &str = "Loss";
    if train.iter().any(|t| t.metrics.contains_key(LOSS)) {
        return Some(LOSS.to_string());
    }
    train.iter().find_map(|t| t.metrics.keys().next()).cloned()
}

fn step_times(train: &[&TrainLine]) -> Option<StepTimes> {
    let timed: Vec<_> = train
        .iter()
        .filter_map(|t| Some((t.step as f64, t.time.as_ref()?)))
        .collect();
    if timed.is_empty() {
        return None;
    }
    let ms = |pick: fn(&super::records::TimeLine) -> Option<SpreadLine>,
              part: fn(SpreadLine) -> Option<f64>| {
        timed
            .iter()
            .map(|(x, time)| {
                let secs = pick(time).and_then(part).unwrap_or(f64::NAN);
                (*x, secs * 1e3)
            })
            .collect::<Points>()
    };
    let median = |s: SpreadLine| s.median;
    Some(StepTimes {
        step: ms(|t| t.step, median),
        compute: ms(|t| t.compute, median),
        sync: ms(|t| t.sync, median),
        optimizer: ms(|t| t.optimizer, median),
        data: ms(|t| t.data, median),
        checkpoint: ms(|t| t.checkpoint, median),
        compute_max: ms(|t| t.compute, |s| s.max),
    })
}

/// A mark for each `start` line after the first, and for each change of world size between
/// consecutive `train` lines that no `start` line explains (files without `start` lines).
fn marks(lines: &[Line]) -> Vec<Mark> {
    let mut marks = Vec::new();
    let mut seen_start = false;
    let mut world: Option<usize> = None;
    let mut last_step: Option<usize> = None;
    for line in lines {
        match line {
            Line::Start(s) => {
                if seen_start {
                    marks.push(Mark {
                        step: s.step,
                        epoch: s.epoch,
                        label: start_label(s, world),
                    });
                }
                seen_start = true;
                world = s.world_size.or(world);
            }
            Line::Train(t) => {
                if let (Some(before), Some(now)) = (world, t.world_size) {
                    if before != now {
                        // The change happened at a checkpoint no later than the last line
                        // of the old world size.
                        let step = last_step.map_or(t.step, |s| s.min(t.step));
                        marks.push(Mark {
                            step,
                            epoch: t.epoch,
                            label: format!("world size {before}→{now}"),
                        });
                    }
                }
                world = t.world_size.or(world);
                last_step = Some(t.step);
            }
            Line::Valid(_) => {}
        }
    }
    marks
}

/// E.g. `restart 1: resumed at step 40 (world 2→3)`.
fn start_label(s: &StartLine, world_before: Option<usize>) -> String {
    let mut label = String::new();
    if s.restart > 0 {
        label.push_str(&format!("restart {}: ", s.restart));
    }
    match s.resumed_from {
        Some(step) => label.push_str(&format!("resumed at step {step}")),
        None => label.push_str(&format!("started again at step {}", s.step)),
    }
    if let (Some(before), Some(now)) = (world_before, s.world_size) {
        if before != now {
            label.push_str(&format!(" (world {before}→{now})"));
        }
    }
    label
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATH: &str = "runs/x/metrics.jsonl";

    fn read(text: &str) -> Result<RunSeries, PlotError> {
        read_series(text, Path::new(PATH))
    }

    fn time(compute: f64, compute_max: f64, step: f64) -> String {
        let spread = |m: f64, x: f64| format!(r#"{{"min":{m},"median":{m},"max":{x}}}"#);
        format!(
            r#"{{"data":{z},"compute":{c},"sync":{z},"optimizer":{z},"checkpoint":{z},"step":{s},"slowest_rank":1}}"#,
            z = spread(0.0, 0.0),
            c = spread(compute, compute_max),
            s = spread(step, step),
        )
    }

    /// A run of 2 ranks to step 20, killed, resumed from its checkpoint of step 10 on 3 ranks
    /// (which redoes step 20) and run to step 30; a launcher restart then resumes at 30.
    fn resumed_run() -> String {
        [
            r#"{"kind":"start","step":0,"epoch":0,"world_size":2,"resumed_from":null,"restart":0,"unix_time":1.7e9}"#.to_string(),
            format!(r#"{{"kind":"train","epoch":0,"step":10,"lr":0.1,"samples_per_sec":1000.0,"world_size":2,"metrics":{{"Accuracy":50.0,"Loss":2.0}},"time":{}}}"#, time(0.004, 0.006, 0.010)),
            format!(r#"{{"kind":"train","epoch":0,"step":20,"lr":0.1,"samples_per_sec":1100.0,"world_size":2,"metrics":{{"Accuracy":60.0,"Loss":null}},"time":{}}}"#, time(0.005, 0.005, 0.011)),
            r#"{"kind":"valid","epoch":0,"step":20,"samples":400,"metrics":{"Accuracy":70.0,"Loss":1.5}}"#.to_string(),
            r#"{"kind":"start","step":10,"epoch":0,"world_size":3,"resumed_from":10,"restart":0,"unix_time":1.7e9}"#.to_string(),
            format!(r#"{{"kind":"train","epoch":0,"step":20,"lr":0.05,"samples_per_sec":1500.0,"world_size":3,"metrics":{{"Accuracy":61.0,"Loss":1.8}},"time":{}}}"#, time(0.003, 0.004, 0.008)),
            r#"{"kind":"train","epoch":1,"step":30,"lr":0.05,"samples_per_sec":1600.0,"world_size":3,"metrics":{"Accuracy":80.0,"Loss":1.2},"time":null}"#.to_string(),
            r#"{"kind":"valid","epoch":1,"step":30,"samples":400,"metrics":{"Accuracy":85.0,"Loss":1.0}}"#.to_string(),
            r#"{"kind":"finish","step":30,"world_size":3,"time":{},"report":"time per step 8.0 ms"}"#.to_string(),
            r#"{"kind":"start","step":30,"epoch":2,"world_size":3,"resumed_from":30,"restart":1,"unix_time":1.7e9}"#.to_string(),
            r#"{"kind":"train","epoch":2,"step":40,"lr":0.01,"samples_per_sec":1700.0,"world_size":3,"metrics":{"Accuracy":90.0,"Loss":0.9}}"#.to_string(),
        ]
        .join("\n")
            + "\n"
    }

    fn ys(points: &Points) -> Vec<f64> {
        points.iter().map(|p| p.1).collect()
    }
    fn xs(points: &Points) -> Vec<f64> {
        points.iter().map(|p| p.0).collect()
    }

    #[test]
    fn a_resumed_run_keeps_every_point_in_file_order_and_is_marked() {
        let s = read(&resumed_run()).unwrap();
        assert_eq!(s.loss_metric.as_deref(), Some("Loss"));
        assert_eq!(xs(&s.train_loss), [10.0, 20.0, 20.0, 30.0, 40.0]);
        let loss = ys(&s.train_loss);
        assert!(loss[1].is_nan(), "a null loss is a gap: {loss:?}");
        assert_eq!([loss[0], loss[2], loss[3], loss[4]], [2.0, 1.8, 1.2, 0.9]);
        assert_eq!(s.valid_loss, [(20.0, 1.5), (30.0, 1.0)]);
        assert_eq!(s.validation["Accuracy"], [(1.0, 70.0), (2.0, 85.0)]);
        assert_eq!(s.validation["Loss"], [(1.0, 1.5), (2.0, 1.0)]);
        assert_eq!(ys(&s.lr), [0.1, 0.1, 0.05, 0.05, 0.01]);
        assert_eq!(ys(&s.throughput), [1000.0, 1100.0, 1500.0, 1600.0, 1700.0]);
        assert_eq!(
            s.marks,
            [
                Mark {
                    step: 10,
                    epoch: Some(0),
                    label: "resumed at step 10 (world 2→3)".into()
                },
                Mark {
                    step: 30,
                    epoch: Some(2),
                    label: "restart 1: resumed at step 30".into()
                },
            ],
            "the world change is told once, by its start line"
        );
    }

    #[test]
    fn step_times_are_milliseconds_from_the_lines_that_have_them() {
        let s = read(&resumed_run()).unwrap();
        let t = s.step_time.expect("three lines have a time");
        assert_eq!(
            xs(&t.step),
            [10.0, 20.0, 20.0],
            "`null` and missing times are skipped"
        );
        let close = |a: &Points, b: [f64; 3]| {
            a.iter().zip(b).all(|(p, q)| (p.1 - q).abs() < 1e-9) && a.len() == 3
        };
        assert!(close(&t.step, [10.0, 11.0, 8.0]), "{:?}", t.step);
        assert!(close(&t.compute, [4.0, 5.0, 3.0]), "{:?}", t.compute);
        assert!(
            close(&t.compute_max, [6.0, 5.0, 4.0]),
            "{:?}",
            t.compute_max
        );
        assert!(close(&t.sync, [0.0, 0.0, 0.0]), "{:?}", t.sync);
    }

    #[test]
    fn old_files_without_start_lines_or_times_still_plot() {
        // Written before `start`, `finish` and `time` existed; the world size changed at a
        // resume that left no line of its own.
        let text = r#"{"kind":"train","epoch":0,"step":5,"lr":0.1,"samples_per_sec":10.0,"world_size":2,"metrics":{"Loss":1.0}}
{"kind":"train","epoch":0,"step":10,"lr":0.1,"samples_per_sec":11.0,"world_size":2,"metrics":{"Loss":0.8}}

{"kind":"train","epoch":1,"step":15,"lr":0.1,"samples_per_sec":14.0,"world_size":3,"metrics":{"Loss":0.7},"extra":"ignored"}
{"kind":"valid","epoch":1,"step":15,"samples":100,"metrics":{"Loss":0.75}}
{"kind":"something-new","step":15}
"#;
        let s = read(text).unwrap();
        assert_eq!(s.train_loss, [(5.0, 1.0), (10.0, 0.8), (15.0, 0.7)]);
        assert_eq!(s.step_time, None);
        assert_eq!(
            s.marks,
            [Mark {
                step: 10,
                epoch: Some(1),
                label: "world size 2→3".into()
            }]
        );
        let files: Vec<String> = s.charts("old").into_iter().map(|c| c.file).collect();
        assert!(!files.contains(&"step-time.png".to_string()), "{files:?}");
    }

    #[test]
    fn a_run_without_a_loss_charts_its_first_metric() {
        let text = r#"{"kind":"train","epoch":0,"step":5,"lr":0.1,"samples_per_sec":10.0,"world_size":1,"metrics":{"Perplexity":30.0,"Accuracy":5.0}}"#;
        let s = read(text).unwrap();
        assert_eq!(s.loss_metric.as_deref(), Some("Accuracy"));
        assert_eq!(s.train_loss, [(5.0, 5.0)]);
    }

    #[test]
    fn a_garbage_line_is_an_error_naming_the_file_and_line() {
        let mut text = resumed_run();
        text.push_str("{\"kind\":\"train\",\"step\":50,\"lr\":0.1\n");
        let err = read(&text).unwrap_err();
        let message = err.to_string();
        assert!(
            matches!(err, PlotError::BadLine { line: 12, .. }),
            "{message}"
        );
        assert!(
            message.starts_with(&format!("line 12 of {PATH}: not JSON")),
            "{message}"
        );
        assert!(!message.contains("line 1 column"), "{message}");
        assert!(err.is_input());

        // The same line last and without its newline is one the run is still writing.
        let mut writing = resumed_run();
        writing.push_str("{\"kind\":\"train\",\"step\":50,\"lr\":0.1");
        let (partial, whole) = (read(&writing).unwrap(), read(&resumed_run()).unwrap());
        assert_eq!(format!("{partial:?}"), format!("{whole:?}"), "NaN-equal");

        let err = read("[1, 2]\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("line 1 of {PATH}: not a JSON object")
        );
        let err = read(r#"{"kind":"train","lr":0.1}"#).unwrap_err();
        assert!(
            err.to_string()
                .contains("a train record: missing field `step`"),
            "{err}"
        );
    }

    #[test]
    fn a_file_without_training_lines_has_nothing_to_plot() {
        for text in [
            "",
            "\n",
            r#"{"kind":"start","step":0,"epoch":0,"world_size":2,"resumed_from":null,"restart":0,"unix_time":1.0}"#,
        ] {
            let err = read(text).unwrap_err();
            assert!(matches!(err, PlotError::NoTrainLines { .. }), "{err}");
            assert!(err.to_string().contains("no training records"), "{err}");
        }
    }
}
