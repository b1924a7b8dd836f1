//! Tier 2, "your own loop": `trainer/examples/own_loop.rs` (a plain Burn loop made
//! data-parallel with `DataParallel`) under `trainer launch`, against one process with the
//! global batch.

use std::path::PathBuf;

use crate::common::*;

/// The example, built by `cargo test` (examples are compiled with the tests).
fn own_loop() -> PathBuf {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/examples/own_loop");
    assert!(
        path.exists(),
        "{} is missing: `cargo build --release -p trainer --example own_loop`",
        path.display()
    );
    path
}

#[test]
fn your_own_loop_with_data_parallel_matches_one_process_with_the_global_batch() {
    let dir = scratch("own-loop");
    let mut results = Vec::new();
    for (nproc, batch) in [(2, 8), (1, 16)] {
        let out_dir = dir.join(format!("w{nproc}"));
        let out = run(trainer()
            .args(["launch", "--nproc-per-node", &nproc.to_string(), "--"])
            .arg(own_loop())
            .args(["--batch", &batch.to_string(), "--steps", "20", "--out"])
            .arg(&out_dir));
        assert_eq!(out.code, Some(0), "{}", out.all());
        assert!(
            out.stdout.contains(&format!("20 steps on {nproc} rank(s)")),
            "{}",
            out.all()
        );
        let ckpt = newest_checkpoint(&out_dir.join("checkpoints"));
        results.push(read_weights(&ckpt.join("model.safetensors")));
    }
    let diff = max_abs_diff(&results[0], &results[1]);
    assert!(diff < 1e-5, "max |w2 - w1| = {diff:e}");
}
