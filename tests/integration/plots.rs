//! `trainer plot`: PNG charts of a run, checked against its `metrics.jsonl` read here
//! independently; and the errors for a missing or broken metrics file.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::common::*;

/// The charts of a digits run with step times: loss, each validation metric, learning rate,
/// throughput, time per step.
const CHARTS: [&str; 6] = [
    "loss.png",
    "validation-accuracy.png",
    "validation-loss.png",
    "learning-rate.png",
    "throughput.png",
    "step-time.png",
];

/// A real run of one epoch on 2 ranks, resumed from its checkpoint for a second epoch on 1
/// rank (a `start` line with `resumed_from` and a world size change), then `trainer plot`.
#[test]
fn plot_draws_every_chart_of_a_resumed_run_from_its_metrics() {
    let dir = scratch("plot-resumed");
    // 1438 training samples: 23 steps of 64 on 2 ranks, a checkpoint at the epoch's end; then
    // 45 steps of 32 on 1 rank.
    let body = digits_config(SGD, 32, "")
        .replace("every_epochs = 0", "every_epochs = 1")
        .replace("\nepochs = 3", "\nepochs = 1");
    train(&write_config(&dir, "run", &body), 2);
    let out = train(
        &write_config(&dir, "run", &body.replace("\nepochs = 1", "\nepochs = 2")),
        1,
    );
    let run_dir = dir.join("run-out");
    // The run itself drew its charts at the end (`output.plots`, on by default).
    assert!(
        run_dir.join("plots/loss.png").is_file(),
        "the run wrote no charts:\n{}",
        out.all()
    );
    std::fs::remove_dir_all(run_dir.join("plots")).unwrap();

    let out = run(trainer().arg("plot").arg(&run_dir));
    assert_eq!(out.code, Some(0), "{}", out.all());
    let printed: Vec<PathBuf> = out.stdout.lines().map(PathBuf::from).collect();
    let expected: Vec<PathBuf> = CHARTS
        .iter()
        .map(|f| run_dir.join("plots").join(f))
        .collect();
    assert_eq!(
        printed,
        expected,
        "the files it says it wrote:\n{}",
        out.all()
    );
    for chart in &expected {
        assert_is_a_chart(chart);
    }

    // What it plotted is what the file says, line by line.
    let path = run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let of_kind =
        |kind: &str| -> Vec<&Value> { lines.iter().filter(|l| l["kind"] == kind).collect() };
    let (train, valid, starts) = (of_kind("train"), of_kind("valid"), of_kind("start"));
    let series = trainer::plot::read_series(&text, &path).unwrap();

    // Training: a line every 5 steps and at each epoch's end.
    let steps: Vec<f64> = train.iter().map(|l| number(&l["step"])).collect();
    assert_eq!(steps.len(), 5 + 10, "{steps:?}");
    assert_eq!(
        (steps[0], steps[4], steps[14]),
        (5.0, 23.0, 68.0),
        "{steps:?}"
    );
    let worlds: Vec<u64> = train
        .iter()
        .map(|l| l["world_size"].as_u64().unwrap())
        .collect();
    assert_eq!(worlds.first(), Some(&2));
    assert_eq!(worlds.last(), Some(&1));
    let from_file = |field: &dyn Fn(&Value) -> &Value| -> Vec<(f64, f64)> {
        train
            .iter()
            .map(|l| (number(&l["step"]), number(field(l))))
            .collect()
    };
    assert_eq!(series.loss_metric.as_deref(), Some("Loss"));
    assert_same(
        &series.train_loss,
        &from_file(&|l| &l["metrics"]["Loss"]),
        "training loss",
    );
    assert_same(&series.lr, &from_file(&|l| &l["lr"]), "learning rate");
    assert_same(
        &series.throughput,
        &from_file(&|l| &l["samples_per_sec"]),
        "throughput",
    );

    // Validation: at the end of each epoch.
    assert_eq!(valid.len(), 2, "{text}");
    let valid_loss: Vec<(f64, f64)> = valid
        .iter()
        .map(|l| (number(&l["step"]), number(&l["metrics"]["Loss"])))
        .collect();
    assert_same(&series.valid_loss, &valid_loss, "validation loss");
    for metric in ["Loss", "Accuracy"] {
        let per_epoch: Vec<(f64, f64)> = valid
            .iter()
            .map(|l| (number(&l["epoch"]) + 1.0, number(&l["metrics"][metric])))
            .collect();
        assert_same(&series.validation[metric], &per_epoch, metric);
    }
    assert_eq!(series.validation.len(), 2);

    // Step times: every line has them, drawn in milliseconds.
    let time = series
        .step_time
        .as_ref()
        .expect("train lines have a `time`");
    let ms = |phase: &'static str, part: &'static str| -> Vec<(f64, f64)> {
        train
            .iter()
            .map(|l| (number(&l["step"]), 1e3 * number(&l["time"][phase][part])))
            .collect()
    };
    assert_same(&time.step, &ms("step", "median"), "whole step");
    assert_same(&time.compute, &ms("compute", "median"), "compute");
    assert_same(&time.sync, &ms("sync", "median"), "sync");
    assert_same(&time.compute_max, &ms("compute", "max"), "slowest compute");

    // The resume is marked where the second start line says, with the world size change.
    assert_eq!(starts.len(), 2, "{text}");
    assert!(starts[0]["resumed_from"].is_null());
    let resumed = starts[1]["resumed_from"].as_u64().expect("resumed_from");
    assert_eq!(resumed, 23);
    assert_eq!(series.marks.len(), 1, "{:?}", series.marks);
    assert_eq!(series.marks[0].step as u64, resumed);
    assert_eq!(series.marks[0].label, "resumed at step 23 (world 2→1)");
}

#[test]
fn plot_refuses_a_missing_or_broken_metrics_file_naming_it() {
    let dir = scratch("plot-errors");
    // A directory without metrics.jsonl, and one that does not exist.
    for run_dir in [dir.clone(), dir.join("nothing-here")] {
        let out = run(trainer().arg("plot").arg(&run_dir));
        assert_eq!(out.code, Some(2), "{}", out.all());
        let file = run_dir.join("metrics.jsonl");
        assert_says(
            &out.stderr,
            &[&file.display().to_string(), "output directory"],
            &out,
        );
        assert!(!out.stderr.contains("panicked"), "{}", out.all());
    }
    assert!(!dir.join("plots").exists(), "nothing written");

    let good = r#"{"kind":"train","epoch":0,"step":5,"lr":0.1,"samples_per_sec":10.0,"world_size":1,"metrics":{"Loss":1.0}}"#;
    let cases = [
        (
            "garbage",
            format!("{good}\n{good}\nnot json at all\n"),
            "line 3 of",
        ),
        (
            "truncated",
            format!("{good}\n{{\"kind\":\"train\",\"st\n"),
            "line 2 of",
        ),
        ("empty", String::new(), "no training records"),
    ];
    for (name, text, needle) in cases {
        let run_dir = dir.join(name);
        std::fs::create_dir_all(&run_dir).unwrap();
        let file = run_dir.join("metrics.jsonl");
        std::fs::write(&file, text).unwrap();
        let out = run(trainer().arg("plot").arg(&run_dir));
        assert_eq!(out.code, Some(2), "{name}: {}", out.all());
        assert_says(&out.stderr, &[needle, &file.display().to_string()], &out);
        assert!(!run_dir.join("plots").exists(), "{name}: nothing written");
    }
}

/// A JSON number, or NaN for `null` (a NaN metric as written).
fn number(v: &Value) -> f64 {
    match v {
        Value::Null => f64::NAN,
        v => v.as_f64().unwrap_or_else(|| panic!("not a number: {v}")),
    }
}

/// Equal point for point (NaN equal to NaN: a gap in both).
fn assert_same(plotted: &[(f64, f64)], file: &[(f64, f64)], what: &str) {
    let same = plotted.len() == file.len()
        && plotted
            .iter()
            .zip(file)
            .all(|(a, b)| a.0 == b.0 && (a.1 == b.1 || (a.1.is_nan() && b.1.is_nan())));
    assert!(same, "{what}: plotted {plotted:?}, file {file:?}");
    assert!(!file.is_empty(), "{what}: no points");
}

/// A PNG of chart size, with something drawn on it: text and axes (dark) and curves (colour).
fn assert_is_a_chart(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        bytes.len() > 5_000,
        "{}: only {} bytes",
        path.display(),
        bytes.len()
    );
    let mut decoder = png::Decoder::new(bytes.as_slice());
    decoder.set_transformations(png::Transformations::EXPAND);
    let mut reader = decoder.read_info().unwrap();
    let (width, height) = (reader.info().width, reader.info().height);
    assert!(
        width >= 400 && height >= 300,
        "{}: {width}x{height}",
        path.display()
    );
    let mut buf = vec![0; reader.output_buffer_size()];
    let frame = reader.next_frame(&mut buf).unwrap();
    assert_eq!(frame.color_type, png::ColorType::Rgb, "{}", path.display());
    let pixels: Vec<&[u8]> = buf[..frame.buffer_size()].chunks_exact(3).collect();
    let dark = pixels.iter().filter(|p| p.iter().all(|&c| c < 100)).count();
    let coloured = pixels
        .iter()
        .filter(|p| p.iter().max().unwrap() - p.iter().min().unwrap() > 80)
        .count();
    let total = pixels.len();
    assert!(
        dark * 200 > total,
        "{}: {dark} dark pixels of {total} (no text?)",
        path.display()
    );
    assert!(
        coloured * 500 > total,
        "{}: {coloured} coloured pixels of {total} (no curve?)",
        path.display()
    );
}
