//! Training end to end: the DDP property, accumulation, crash and resume (also with another
//! world size), bad input, and the main job's accuracy.

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::*;

/// The central DDP property: N ranks with batch b end where 1 rank with batch N·b ends.
#[test]
fn two_ranks_match_one_rank_with_the_global_batch() {
    for (optimizer, tolerance) in [(SGD, 1e-5f32), (ADAM, 1e-4)] {
        let dir = scratch(if optimizer == SGD {
            "ddp-sgd"
        } else {
            "ddp-adam"
        });
        let two = write_config(&dir, "two", &digits_config(optimizer, 8, "max_steps = 25"));
        let one = write_config(&dir, "one", &digits_config(optimizer, 16, "max_steps = 25"));
        train(&two, 2);
        train(&one, 1);
        let diff = max_abs_diff(&final_weights(&dir, "two"), &final_weights(&dir, "one"));
        assert!(
            diff < tolerance,
            "{optimizer}: max |w2 - w1| = {diff:e} >= {tolerance:e}"
        );
        // And the run really moved away from its initial weights.
        assert!(std::fs::read_to_string(dir.join("two-out/metrics.jsonl"))
            .unwrap()
            .contains("\"step\":25"));
    }
}

#[test]
fn accumulation_communicates_once_per_step_and_keeps_the_property() {
    let dir = scratch("ddp-accumulation");
    let two = write_config(
        &dir,
        "two",
        &digits_config(SGD, 4, "max_steps = 20\naccumulation_steps = 2"),
    );
    let one = write_config(&dir, "one", &digits_config(SGD, 16, "max_steps = 20"));
    train(&two, 2);
    train(&one, 1);
    let diff = max_abs_diff(&final_weights(&dir, "two"), &final_weights(&dir, "one"));
    assert!(diff < 1e-5, "max |w2 - w1| = {diff:e}");
    let stats = std::fs::read_to_string(dir.join("two-out/reducer-stats.json")).unwrap();
    assert!(
        stats.contains("\"syncs\":20") && stats.contains("\"steps\":20"),
        "{stats}"
    );
    assert!(
        stats.contains("\"bucket_all_reduces\":20"),
        "one bucket per sync for this model: {stats}"
    );
}

/// `distributed.gradient_compression`: bf16 / fp16 buckets are half the bytes, the run stays
/// within rounding of the f32 run, and a full run learns as well.
#[test]
fn compressed_gradients_halve_the_bytes_and_track_the_f32_run() {
    let dir = scratch("compression");
    let with = |compression: &str, extra: &str| {
        digits_config(SGD, 8, extra)
            + &format!("\n[distributed]\ngradient_compression = \"{compression}\"\n")
    };
    train(
        &write_config(&dir, "none", &with("none", "max_steps = 25")),
        2,
    );
    let reference = final_weights(&dir, "none");
    let full = final_accuracy(&train(
        &write_config(&dir, "none-full", &with("none", "")),
        2,
    ));
    for (format, tolerance) in [("bf16", 1e-3f32), ("fp16", 2e-4)] {
        train(
            &write_config(&dir, format, &with(format, "max_steps = 25")),
            2,
        );
        assert_eq!(
            2 * bytes_reduced(&dir, format),
            bytes_reduced(&dir, "none"),
            "{format} buckets are half the bytes"
        );
        let diff = max_abs_diff(&final_weights(&dir, format), &reference);
        assert!(
            diff > 0.0 && diff < tolerance,
            "{format}: max |w - w_f32| = {diff:e} (want rounding-sized, in (0, {tolerance:e}))"
        );
        let name = format!("{format}-full");
        let accuracy = final_accuracy(&train(&write_config(&dir, &name, &with(format, "")), 2));
        eprintln!(
            "{format}: max |w - w_f32| = {diff:e} after 25 steps; {accuracy}% (f32: {full}%)"
        );
        assert!(
            full >= 85.0 && (accuracy - full).abs() <= 3.0,
            "{format}: {accuracy}% against {full}% with f32 gradients"
        );
    }
}

#[test]
fn a_killed_rank_loses_only_the_work_since_the_checkpoint() {
    let dir = scratch("crash-resume");
    let body = digits_config(ADAM, 8, "max_steps = 30")
        .replace("every_epochs = 0", "every_epochs = 0\nevery_steps = 10");
    let straight = write_config(&dir, "straight", &body);
    let crashed = write_config(&dir, "crashed", &body);
    train(&straight, 2);

    let out = run(trainer()
        .arg("--config")
        .arg(&crashed)
        .args(["--nproc-per-node", "2"])
        .env("TRAINER_CRASH_AFTER_STEP", "15")
        .env("TRAINER_CRASH_RANK", "1"));
    assert_ne!(out.code, Some(0), "{}", out.all());
    assert!(
        out.stderr.contains("rank 1 failed: killed by signal 9"),
        "the launcher names the rank and the signal:\n{}",
        out.all()
    );
    assert!(newest_checkpoint(&dir.join("crashed-ckpt")).ends_with("step-00000010"));

    let out = train(&crashed, 2);
    assert!(
        out.stderr.contains("resumed from") && out.stderr.contains("step 10"),
        "{}",
        out.all()
    );
    let diff = max_abs_diff(
        &final_weights(&dir, "straight"),
        &final_weights(&dir, "crashed"),
    );
    assert!(
        diff <= 1e-6,
        "resumed run differs from the uninterrupted one by {diff:e}"
    );
}

#[test]
fn resuming_with_another_world_size_visits_every_sample_once() {
    let dir = scratch("reshard");
    let first = write_config(
        &dir,
        "first",
        &digits_config(SGD, 8, "max_steps = 5").replace("epochs = 3", "epochs = 1"),
    );
    train(&first, 2);
    let mut before = BTreeMap::new();
    visits(&dir.join("first-out"), &mut before);
    assert_eq!(before.values().sum::<usize>(), 5 * 8 * 2);

    let body = digits_config(SGD, 8, "").replace("epochs = 3", "epochs = 1");
    for nproc in [1, 3] {
        resume_visits_every_sample_once(&dir, nproc, &body, &before, 1438);
    }
}

#[test]
fn bad_configs_exit_2_naming_the_field_or_file() {
    let dir = scratch("bad-input");
    let good = digits_config(SGD, 8, "max_steps = 2");
    let cases = [
        (
            "unknown-key",
            good.replace("seed = 7", "seed = 7\nepochz = 3"),
            "epochz",
        ),
        (
            "wrong-type",
            good.replace("batch_size = 8", "batch_size = \"big\""),
            "batch_size",
        ),
        (
            "zero-batch",
            good.replace("batch_size = 8", "batch_size = 0"),
            "training.batch_size",
        ),
        (
            "missing-data",
            good.replace("{data}", "/nonexistent/digits.csv.gz"),
            "/nonexistent/digits.csv.gz",
        ),
        (
            "unknown-model",
            good.replace("name = \"mlp\"", "name = \"rnn\""),
            "\"rnn\" is not a known model",
        ),
        (
            "checkpoint-dir-is-a-file",
            good.replace("{ckpt}", "{data}"),
            "checkpoint.dir",
        ),
        (
            "unknown-model-key",
            good.replace("hidden = [32]", "hiden = [32]"),
            "hiden",
        ),
    ];
    for (name, body, needle) in cases {
        let config = write_config(&dir, name, &body);
        for nproc in ["1", "2"] {
            let out = run(trainer()
                .arg("--config")
                .arg(&config)
                .args(["--nproc-per-node", nproc]));
            assert_eq!(out.code, Some(2), "{name}:\n{}", out.all());
            assert!(
                out.stderr.contains(needle),
                "{name}: message should name {needle:?}:\n{}",
                out.all()
            );
            assert!(!out.stderr.contains("panicked"), "{}", out.all());
        }
        assert!(
            !dir.join(format!("{name}-ckpt")).exists(),
            "{name}: nothing written"
        );
    }
}

#[test]
fn a_checkpoint_of_another_model_is_refused_and_left_intact() {
    let dir = scratch("other-model");
    let mlp = write_config(&dir, "mlp", &digits_config(SGD, 8, "max_steps = 3"));
    train(&mlp, 1);
    let ckpt = dir.join("mlp-ckpt");
    let snapshot = |p: &Path| -> Vec<(String, Vec<u8>)> {
        let d = newest_checkpoint(p);
        let mut files: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .filter_map(Result::ok)
            .map(|f| {
                (
                    f.file_name().to_string_lossy().to_string(),
                    std::fs::read(f.path()).unwrap(),
                )
            })
            .collect();
        files.sort();
        files
    };
    let before = snapshot(&ckpt);
    let cnn_body = digits_config(SGD, 8, "max_steps = 3")
        .replace("name = \"mlp\"\nhidden = [32]", "name = \"cnn\"")
        .replace("{ckpt}", &ckpt.display().to_string());
    let cnn = write_config(&dir, "cnn", &cnn_body);
    let out = run(trainer()
        .arg("--config")
        .arg(&cnn)
        .args(["--nproc-per-node", "2"]));
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert!(
        out.stderr.contains("does not fit this config") && out.stderr.contains("'mlp'"),
        "{}",
        out.all()
    );
    assert_eq!(
        snapshot(&ckpt),
        before,
        "the checkpoint must be left as it was"
    );

    // The eval command reads the mlp checkpoint back into the plain model.
    let out = run(trainer()
        .arg("eval")
        .arg("--config")
        .arg(&mlp)
        .arg("--checkpoint")
        .arg(&ckpt));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(
        out.stdout.contains("validation Loss") && out.stdout.contains("Accuracy"),
        "{}",
        out.all()
    );
}

#[test]
fn the_main_job_reaches_95_percent_with_two_processes() {
    let dir = scratch("main-job");
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../configs/digits-mlp.toml"
    ))
    .unwrap();
    let body = text
        .replace("runs/digits-mlp/checkpoints", "{ckpt}")
        .replace("\"runs/digits-mlp\"", "\"{out}\"")
        .replace("data/digits.csv.gz", "{data}");
    let config = write_config(&dir, "main", &body);
    let out = train(&config, 2);
    let accuracy = final_accuracy(&out);
    assert!(accuracy >= 95.0, "{accuracy}%");
    assert!(newest_checkpoint(&dir.join("main-ckpt"))
        .join("model.safetensors")
        .exists());
}

#[test]
fn class_balanced_sampling_trains_on_two_ranks() {
    let dir = scratch("balanced");
    let config = write_config(
        &dir,
        "balanced",
        &digits_config(ADAM, 16, "balance_classes = true"),
    );
    let out = train(&config, 2);
    let accuracy = final_accuracy(&out);
    assert!(accuracy >= 90.0, "{accuracy}%");
}
