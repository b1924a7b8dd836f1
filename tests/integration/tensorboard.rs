//! `output.tensorboard = true`: the event files are read by the real TensorBoard (its Python
//! package, which `.ci/run` installs into a cached virtual environment and names with
//! `TENSORBOARD_PYTHON`), and hold the same values as `metrics.jsonl`.

use std::process::Command;

use burn_ddp::testing::{skip, Needs};

use crate::common::*;

/// TensorBoard's own reader, printing `tag step value` for every scalar event.
const READ_SCALARS: &str = r#"
import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
for tag in sorted(acc.Tags()["scalars"]):
    for e in acc.Scalars(tag):
        print(tag, e.step, repr(e.value))
"#;

#[test]
fn tensorboard_reads_the_same_values_as_the_metrics_file() {
    let Ok(python) = std::env::var("TENSORBOARD_PYTHON") else {
        skip(
            Needs::TensorBoard,
            "TENSORBOARD_PYTHON is not set (bash .ci/run sets it)",
        );
        return;
    };
    let dir = scratch("tensorboard");
    let body = digits_config(SGD, 8, "max_steps = 20").replace(
        "log_samples = true",
        "log_samples = true\ntensorboard = true",
    );
    let out_dir = dir.join("run-out");
    train(&write_config(&dir, "run", &body), 2);

    let read = Command::new(&python)
        .arg("-c")
        .arg(READ_SCALARS)
        .arg(out_dir.join("tensorboard"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    let stdout = String::from_utf8_lossy(&read.stdout);
    assert!(
        read.status.success(),
        "TensorBoard's reader failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&read.stderr)
    );
    let events: Vec<(String, u64, f64)> = stdout
        .lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            Some((
                f.next()?.to_string(),
                f.next()?.parse().ok()?,
                f.next()?.parse().ok()?,
            ))
        })
        .collect();
    let of = |tag: &str| -> Vec<(u64, f64)> {
        events
            .iter()
            .filter(|(t, _, _)| t == tag)
            .map(|(_, s, v)| (*s, *v))
            .collect()
    };

    let metrics = std::fs::read_to_string(out_dir.join("metrics.jsonl")).expect("metrics.jsonl");
    let records: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    let expected = |kind: &str, value: &dyn Fn(&serde_json::Value) -> f64| -> Vec<(u64, f64)> {
        records
            .iter()
            .filter(|r| r["kind"] == kind)
            .map(|r| (r["step"].as_u64().unwrap(), value(r)))
            .collect()
    };
    let train_loss = expected("train", &|r| r["metrics"]["Loss"].as_f64().unwrap());
    let valid_accuracy = expected("valid", &|r| r["metrics"]["Accuracy"].as_f64().unwrap());
    let compute_ms = expected("train", &|r| {
        r["time"]["compute"]["median"].as_f64().unwrap() * 1e3
    });
    assert_eq!(train_loss.len(), 4, "20 steps, a line every 5: {metrics}");
    assert!(!valid_accuracy.is_empty(), "{metrics}");
    for (tag, want) in [
        ("train/Loss", &train_loss),
        ("valid/Accuracy", &valid_accuracy),
        ("step_time_ms/compute", &compute_ms),
    ] {
        let got = of(tag);
        assert_eq!(got.len(), want.len(), "{tag}: {got:?} vs {want:?}");
        for ((gs, gv), (ws, wv)) in got.iter().zip(want.iter()) {
            // TensorBoard keeps 32-bit floats.
            assert!(
                gs == ws && (gv - wv).abs() <= 1e-6 * wv.abs().max(1.0),
                "{tag}: {got:?} vs {want:?}"
            );
        }
    }
}
