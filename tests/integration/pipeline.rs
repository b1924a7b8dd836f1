//! Pipeline parallelism in a user's own loop: `burn-ddp/examples/pipeline.rs` (a perceptron
//! cut into stages with `burn_ddp::pipeline::PipelineParallel`) under `trainer launch`, real
//! processes over loopback, against one process with the whole model and the global batch.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::common::*;

/// The example, built by `cargo test --workspace` (burn-ddp's examples are compiled with its
/// tests; `cargo test -p trainer` alone does not build it).
fn pipeline_example() -> PathBuf {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/examples/pipeline");
    assert!(
        path.exists(),
        "{} is missing: `cargo build --release -p burn-ddp --example pipeline`",
        path.display()
    );
    path
}

/// Runs the example for `steps` steps on `nproc` processes; the whole model's weights from its
/// stage files.
fn train(
    dir: &Path,
    name: &str,
    nproc: usize,
    steps: usize,
    args: &[&str],
) -> BTreeMap<String, Vec<f32>> {
    let out_dir = dir.join(name);
    let out = run(trainer()
        .args(["launch", "--nproc-per-node", &nproc.to_string(), "--"])
        .arg(pipeline_example())
        .args(["--steps", &steps.to_string(), "--out"])
        .arg(&out_dir)
        .args(args));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_says(&out.stdout, &[&format!("pipeline: {steps} steps")], &out);
    let mut weights = BTreeMap::new();
    for entry in std::fs::read_dir(&out_dir).unwrap() {
        let path = entry.unwrap().path();
        for (key, values) in read_weights(&path) {
            assert!(
                weights.insert(key.clone(), values).is_none(),
                "{key} in two stages"
            );
        }
    }
    weights
}

#[test]
fn stages_and_replicas_end_with_the_weights_of_one_process_on_the_whole_batch() {
    let dir = scratch("pipeline");
    let one = train(&dir, "one", 1, 6, &["--stages", "1", "--batch", "16"]);
    assert_eq!(one.len(), 6, "3 layers, weight and bias: {:?}", one.keys());
    let runs = [
        (
            "gpipe-2x1",
            2,
            vec!["--stages", "2", "--batch", "16", "--schedule", "gpipe"],
        ),
        (
            "1f1b-2x1",
            2,
            vec!["--stages", "2", "--batch", "16", "--schedule", "1f1b"],
        ),
        ("1f1b-2x2", 4, vec!["--stages", "2", "--batch", "8"]),
        ("1f1b-3x1", 3, vec!["--stages", "3", "--batch", "16"]),
    ];
    for (name, nproc, args) in runs {
        let weights = train(&dir, name, nproc, 6, &args);
        let diff = max_abs_diff(&weights, &one);
        assert!(diff < 1e-5, "{name}: max |Δw| = {diff:e}");
    }
    let start = train(&dir, "untrained", 1, 0, &["--stages", "1", "--batch", "16"]);
    assert!(
        max_abs_diff(&start, &one) > 1e-3,
        "the steps moved the weights"
    );
}

#[test]
fn a_world_the_stages_do_not_divide_exits_2_naming_both() {
    let out = run(trainer()
        .args(["launch", "--nproc-per-node", "3", "--"])
        .arg(pipeline_example())
        .args(["--stages", "2", "--steps", "1", "--out"])
        .arg(scratch("pipeline-bad").join("out")));
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_says(
        &out.stderr,
        &["world size 3 is not a multiple of pipeline_stages = 2"],
        &out,
    );
}
