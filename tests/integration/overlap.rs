//! Gradient overlap (`distributed.gradient_overlap`): the buckets of marked blocks go on the
//! wire while backward runs, and the weights are bit-identical to the same buckets summed
//! after backward — for the MLP and the transformer (both mark their layers), at worlds 2 and
//! 3, without and with accumulation and bf16 buckets.

use std::path::Path;

use crate::common::*;

/// A field of rank 0's `reducer-stats.json` of run `name`.
fn stat(dir: &Path, name: &str, field: &str) -> u64 {
    let stats = std::fs::read_to_string(dir.join(format!("{name}-out/reducer-stats.json")))
        .expect("reducer-stats.json");
    stats
        .split(&format!("\"{field}\":"))
        .nth(1)
        .and_then(|rest| rest.split([',', '}']).next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in {stats}"))
}

/// The reference transformer with 3 encoder layers, 6 steps of 8 samples per rank.
fn transformer(extra_training: &str) -> String {
    let extra = format!("max_steps = 6\n{extra_training}");
    crate::reference_models::text_config(ADAM, 8, &extra).replace("layers = 1", "layers = 3")
}

/// Trains `body` with overlap on and off on `world` ranks (`distributed`: more keys of
/// `[distributed]`); asserts bit-identical weights, that the on run sent buckets during
/// backward and the off run none, and that both summed the same buckets.
fn on_and_off_agree(dir: &Path, name: &str, body: &str, world: usize, distributed: &str) {
    let config = |overlap: bool| {
        format!(
            "{body}\n[distributed]\nbucket_cap_mb = 0.004\ntimeout_secs = 120\ngradient_overlap = {overlap}\n{distributed}\n"
        )
    };
    let (on, off) = (format!("{name}-on"), format!("{name}-off"));
    let out = train(&write_config(dir, &on, &config(true)), world);
    assert!(
        out.stdout.contains("gradient overlap: on;"),
        "the summary reports the overlap:\n{}",
        out.all()
    );
    let out = train(&write_config(dir, &off, &config(false)), world);
    assert!(
        out.stdout.contains("gradient overlap: off"),
        "{}",
        out.all()
    );
    let diff = max_abs_diff(&final_weights(dir, &on), &final_weights(dir, &off));
    assert_eq!(diff, 0.0, "{name}: overlap on vs off, max |dw| = {diff:e}");
    assert!(
        stat(dir, &on, "overlap_buckets_during_backward") > 0,
        "{name}: no bucket went on the wire during backward"
    );
    assert_eq!(stat(dir, &off, "overlap_buckets_during_backward"), 0);
    assert!(stat(dir, &off, "overlap_planned_steps") > 0, "{name}");
    assert_eq!(
        stat(dir, &on, "bucket_all_reduces"),
        stat(dir, &off, "bucket_all_reduces"),
        "{name}: the same buckets"
    );
    // The runs trained: the weights moved from the initial ones.
    let zero = format!("{name}-zero");
    let untrained = body.replace("max_steps = ", "max_steps = 0\n# was ");
    train(&write_config(dir, &zero, &untrained), 1);
    let moved = max_abs_diff(&final_weights(dir, &on), &final_weights(dir, &zero));
    assert!(moved > 1e-4, "{name}: the weights did not move ({moved:e})");
}

const BF16: &str = "gradient_compression = \"bf16\"";

#[test]
fn overlap_on_and_off_give_bit_identical_weights_for_the_mlp() {
    let dir = scratch("overlap-mlp");
    let mlp = |extra: &str| digits_config(SGD, 8, &format!("max_steps = 12\n{extra}"));
    on_and_off_agree(&dir, "w2", &mlp(""), 2, "");
    on_and_off_agree(
        &dir,
        "w3-acc2-bf16",
        &mlp("accumulation_steps = 2"),
        3,
        BF16,
    );
}

#[test]
fn overlap_on_and_off_give_bit_identical_weights_for_the_transformer() {
    let dir = scratch("overlap-transformer");
    on_and_off_agree(&dir, "w2", &transformer(""), 2, "");
    let body = transformer("accumulation_steps = 2");
    on_and_off_agree(&dir, "w3-acc2-bf16", &body, 3, BF16);
}
