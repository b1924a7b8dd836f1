//! The reference models of other kinds (regression, transformer text classifier) through the
//! same generic engine a user's crate uses: the DDP property, resume at another world size with
//! a stateful Burn scheduler, and validation metrics weighted by their counts across ranks.

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::*;

/// A regression run (MSE, synthetic data generated per index).
fn regression_config(optimizer: &str, batch: usize, extra_training: &str) -> String {
    format!(
        r#"
[model]
name = "regression"
hidden = [16]

[data]
samples = 512
validation_samples = 128
features = 6
targets = 2
seed = 3

[optimizer]
{optimizer}

[training]
epochs = 2
batch_size = {batch}
seed = 11
log_every = 5
{extra_training}

[checkpoint]
dir = "{{ckpt}}"
every_epochs = 0

[output]
dir = "{{out}}"
log_samples = true
"#
    )
}

/// A transformer text-classification run (token ids, padding masks, Noam schedule).
pub(crate) fn text_config(optimizer: &str, batch: usize, extra_training: &str) -> String {
    format!(
        r#"
[model]
name = "text_transformer"
vocab_size = 16
max_len = 16
d_model = 16
heads = 2
layers = 1
d_ff = 32

[data]
vocab_size = 16
samples = 384
validation_samples = 96
min_len = 3
max_len = 16
seed = 5

[optimizer]
{optimizer}

[training]
epochs = 1
batch_size = {batch}
seed = 13
log_every = 1
{extra_training}

[checkpoint]
dir = "{{ckpt}}"
every_epochs = 0

[output]
dir = "{{out}}"
log_samples = true
"#
    )
}

pub(crate) const NOAM_SGD: &str =
    "name = \"sgd\"\nlearning_rate = 2.0\nschedule = \"noam\"\nwarmup_steps = 8\nmodel_size = 16";
pub(crate) const NOAM_ADAM: &str =
    "name = \"adam\"\nlearning_rate = 0.5\nschedule = \"noam\"\nwarmup_steps = 8\nmodel_size = 16";

/// 2 ranks with per-rank batch b end where 1 rank with batch 2b ends, for `config(opt, b, _)`.
fn check_ddp_property(
    name: &str,
    config: fn(&str, usize, &str) -> String,
    cases: &[(&str, f32)],
    batch: usize,
) {
    for (k, (optimizer, tolerance)) in cases.iter().enumerate() {
        let dir = scratch(&format!("{name}-{k}"));
        let two = write_config(&dir, "two", &config(optimizer, batch, "max_steps = 20"));
        let one = write_config(&dir, "one", &config(optimizer, 2 * batch, "max_steps = 20"));
        let out2 = train(&two, 2);
        let out1 = train(&one, 1);
        let (w2, w1) = (final_weights(&dir, "two"), final_weights(&dir, "one"));
        let diff = max_abs_diff(&w2, &w1);
        assert!(
            diff < *tolerance,
            "{name} {optimizer}: max |w2 - w1| = {diff:e} >= {tolerance:e}\n{}\n{}",
            out2.all(),
            out1.all()
        );
        // The runs moved: 20 steps of real training, not a no-op.
        let zero = write_config(&dir, "zero", &config(optimizer, batch, "max_steps = 0"));
        train(&zero, 1);
        let moved = max_abs_diff(&final_weights(&dir, "zero"), &w1);
        assert!(
            moved > 100.0 * tolerance,
            "{name}: weights moved only {moved:e}"
        );
        eprintln!("{name} {optimizer}: max |w2 - w1| = {diff:e} (moved {moved:e})");
    }
}

#[test]
fn regression_two_ranks_match_one_rank_with_the_global_batch() {
    check_ddp_property(
        "ddp-regression",
        regression_config,
        &[(SGD, 1e-5), (ADAM, 1e-4)],
        8,
    );
}

#[test]
fn transformer_two_ranks_match_one_rank_with_the_global_batch() {
    // Each rank pads its batch to its own longest sequence, the single rank to the longest of
    // all: equal only if padding is really masked everywhere.
    check_ddp_property(
        "ddp-text",
        text_config,
        &[(NOAM_SGD, 1e-5), (NOAM_ADAM, 1e-4)],
        8,
    );
}

/// (step → lr) of the training records in `metrics.jsonl`.
fn learning_rates(out_dir: &Path) -> BTreeMap<u64, f64> {
    std::fs::read_to_string(out_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "train")
        .map(|v| (v["step"].as_u64().unwrap(), v["lr"].as_f64().unwrap()))
        .collect()
}

#[test]
fn transformer_resumes_at_another_world_size_with_its_noam_schedule() {
    let dir = scratch("text-reshard");
    // The uninterrupted reference: the learning rate of every step.
    let whole = write_config(&dir, "whole", &text_config(NOAM_ADAM, 8, ""));
    train(&whole, 2);
    let reference = learning_rates(&dir.join("whole-out"));
    // Stopped after 7 steps at world 2 (112 of 384 samples).
    let first = write_config(&dir, "first", &text_config(NOAM_ADAM, 8, "max_steps = 7"));
    train(&first, 2);
    let mut before = BTreeMap::new();
    visits(&dir.join("first-out"), &mut before);
    assert_eq!(before.values().sum::<usize>(), 7 * 8 * 2);

    for nproc in [1, 3] {
        let name = format!("resume{nproc}");
        let body = text_config(NOAM_ADAM, 8, "");
        resume_visits_every_sample_once(&dir, nproc, &body, &before, 384);
        // The schedule continues where it stopped: step 8 onwards has the rates of the
        // uninterrupted run (Noam depends on the step only, not on the world size).
        let resumed = learning_rates(&dir.join(format!("{name}-out")));
        assert_eq!(resumed.keys().next(), Some(&8), "{resumed:?}");
        for (step, lr) in &resumed {
            if let Some(want) = reference.get(step) {
                assert_eq!(lr, want, "lr at step {step} with {nproc} rank(s)");
            }
        }
        assert!(resumed.len() >= 5, "{resumed:?}");
    }
}

#[test]
fn validation_metrics_are_summed_with_their_counts_across_unequal_shards() {
    // 359 validation samples over 3 ranks: shards of 120, 120 and 119. A count-weighted
    // accuracy is hits / 359; a mean of per-rank means is not a multiple of 1/359.
    let dir = scratch("valid-counts");
    let config = write_config(
        &dir,
        "three",
        &digits_config(SGD, 8, "max_steps = 6").replace("epochs = 3", "epochs = 1"),
    );
    let out = train(&config, 3);
    let accuracy = final_accuracy(&out);
    let record = std::fs::read_to_string(dir.join("three-out/metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .rfind(|v| v["kind"] == "valid")
        .unwrap_or_else(|| panic!("no validation record\n{}", out.all()));
    assert_eq!(record["samples"], 359, "{record}");
    let exact = record["metrics"]["Accuracy"].as_f64().unwrap();
    assert!((exact - accuracy).abs() < 0.006, "{exact} vs {accuracy}");
    let hits = exact / 100.0 * 359.0;
    assert!(
        (hits - hits.round()).abs() < 1e-6,
        "accuracy {exact}% is not hits/359 ({hits} hits): per-rank means were averaged"
    );
    // The same checkpoint evaluated by one process gives the same accuracy.
    let eval = run(trainer()
        .arg("eval")
        .arg("--config")
        .arg(&config)
        .arg("--checkpoint")
        .arg(dir.join("three-ckpt")));
    assert_eq!(eval.code, Some(0), "{}", eval.all());
    let line = eval
        .stdout
        .lines()
        .find(|l| l.contains("validation"))
        .unwrap();
    let single = metric_on(line, "Accuracy").unwrap();
    assert!(
        (single - exact).abs() < 0.006,
        "1 process: {single}, 3 ranks: {exact}"
    );
}
