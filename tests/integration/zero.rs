//! ZeRO stage 1 (`distributed.zero_stage = 1`) end to end: the same model as stage 0 and as one
//! rank with the global batch, each rank holding only its own parameters' optimizer state, and
//! checkpoints that resume at another world size and stage.

use std::path::Path;

use crate::common::*;
use crate::reference_models::{text_config, NOAM_ADAM, NOAM_SGD};

const SGD_MOMENTUM: &str = "name = \"sgd\"\nlearning_rate = 0.05\nmomentum = 0.9";

fn with_stage(body: &str, stage: u8) -> String {
    format!("{body}\n[distributed]\nzero_stage = {stage}\n")
}

/// The `finish` record of a run's `metrics.jsonl`.
fn finish_record(out_dir: &Path) -> serde_json::Value {
    std::fs::read_to_string(out_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .rfind(|v| v["kind"] == "finish")
        .unwrap_or_else(|| panic!("no finish record in {}", out_dir.display()))
}

/// How many parameters each rank held optimizer state for.
fn state_params(out_dir: &Path) -> Vec<u64> {
    finish_record(out_dir)["optimizer_state_params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect()
}

/// Stage 1 at world 2 against stage 0 at world 2 and one rank with the doubled batch.
fn check_stage_1(
    name: &str,
    config: fn(&str, usize, &str) -> String,
    cases: &[(&str, f32)],
    params: u64,
) {
    for (k, (optimizer, tolerance)) in cases.iter().enumerate() {
        let dir = scratch(&format!("{name}-{k}"));
        let steps = "max_steps = 20";
        let runs = [
            ("stage1", 8, 2, 1),
            ("stage0", 8, 2, 0),
            ("one", 16, 1, 0),
            ("zero", 8, 1, 0),
        ];
        for (run, batch, nproc, stage) in runs {
            let steps = if run == "zero" {
                "max_steps = 0"
            } else {
                steps
            };
            let body = with_stage(&config(optimizer, batch, steps), stage);
            train(&write_config(&dir, run, &body), nproc);
        }
        let stage1 = final_weights(&dir, "stage1");
        for other in ["stage0", "one"] {
            let diff = max_abs_diff(&stage1, &final_weights(&dir, other));
            assert!(
                diff < *tolerance,
                "{name} {optimizer}: stage 1 vs {other}: max |dw| = {diff:e} >= {tolerance:e}"
            );
        }
        let moved = max_abs_diff(&final_weights(&dir, "zero"), &stage1);
        assert!(moved > 100.0 * tolerance, "{name}: moved only {moved:e}");

        // Stage 0: every rank holds every parameter's state; stage 1: each its own, all of
        // them between the two, none twice (the state is keyed by parameter, so counts that
        // add up to the total with neither rank holding all mean a partition).
        assert_eq!(state_params(&dir.join("stage0-out")), [params, params]);
        let held = state_params(&dir.join("stage1-out"));
        assert_eq!(held.iter().sum::<u64>(), params, "{name}: {held:?}");
        assert!(held.iter().all(|&n| n > 0 && n < params), "{held:?}");
    }
}

#[test]
fn stage_1_matches_stage_0_and_the_global_batch_on_the_mlp() {
    // hidden = [32]: two weights and two biases.
    check_stage_1(
        "zero-mlp",
        digits_config,
        &[(SGD_MOMENTUM, 1e-5), (ADAM, 1e-4)],
        4,
    );
}

#[test]
fn stage_1_matches_stage_0_and_the_global_batch_on_the_transformer() {
    let params = {
        // Count from a checkpoint of the model: every float tensor is one parameter.
        let dir = scratch("zero-text-count");
        let body = text_config(NOAM_ADAM, 8, "max_steps = 0");
        train(&write_config(&dir, "count", &body), 1);
        final_weights(&dir, "count").len() as u64
    };
    check_stage_1(
        "zero-text",
        text_config,
        &[(NOAM_SGD, 1e-5), (NOAM_ADAM, 1e-4)],
        params,
    );
}

/// A stage-1 checkpoint of world 2 resumes at world 1 with stage 0 and at world 3 with stage
/// 1, and ends where the uninterrupted run ends. The global batch is 24 at every world size
/// (12 x 2, 24 x 1, 8 x 3), so the runs see the same samples in every step.
#[test]
fn a_stage_1_checkpoint_resumes_at_other_world_sizes_and_stages() {
    for (optimizer, tolerance) in [(SGD_MOMENTUM, 1e-5f32), (ADAM, 1e-4)] {
        let dir = scratch(if optimizer == ADAM {
            "zero-resume-adam"
        } else {
            "zero-resume-sgd"
        });
        let body = |batch: usize, steps: usize, stage: u8| {
            let training = format!("max_steps = {steps}");
            with_stage(&digits_config(optimizer, batch, &training), stage)
                .replace("every_epochs = 0", "every_epochs = 0\nevery_steps = 10")
        };
        train(&write_config(&dir, "whole", &body(12, 25, 1)), 2);
        train(&write_config(&dir, "first", &body(12, 10, 1)), 2);
        assert!(newest_checkpoint(&dir.join("first-ckpt")).ends_with("step-00000010"));
        for (name, batch, nproc, stage) in [("w1", 24, 1, 0), ("w3", 8, 3, 1)] {
            copy_newest_checkpoint(&dir.join("first-ckpt"), &dir.join(format!("{name}-ckpt")));
            let out = train(&write_config(&dir, name, &body(batch, 25, stage)), nproc);
            assert_resumed_at(&out, 10);
            let diff = max_abs_diff(&final_weights(&dir, "whole"), &final_weights(&dir, name));
            assert!(
                diff < tolerance,
                "{optimizer}: resumed at world {nproc}, stage {stage}: max |dw| = {diff:e}"
            );
        }
    }
}

#[test]
fn zero_stage_2_is_refused_with_exit_2() {
    let dir = scratch("zero-stage-2");
    let config = write_config(&dir, "bad", &with_stage(&digits_config(SGD, 8, ""), 2));
    let out = run(trainer().arg("--config").arg(&config));
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_says(&out.stderr, &["distributed.zero_stage", "0", "1"], &out);
}
