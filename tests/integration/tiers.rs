//! Tier 2, "your own loop": `burn-ddp/examples/own_loop.rs` (a plain Burn loop made
//! data-parallel with `burn_ddp::DataParallel`, in a program that needs `burn` and `burn-ddp`
//! only) under `trainer launch`, against one process with the global batch.

use std::path::PathBuf;

use crate::common::*;

/// The example, built by `cargo test` (examples are compiled with the tests).
fn own_loop() -> PathBuf {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/examples/own_loop");
    assert!(
        path.exists(),
        "{} is missing: `cargo build --release -p burn-ddp --example own_loop`",
        path.display()
    );
    path
}

/// Runs the example on `nproc` ranks with per-rank `batch` and the extra `args`; the final
/// weights rank 0 wrote.
fn train(
    dir: &std::path::Path,
    nproc: usize,
    batch: usize,
    args: &[&str],
) -> (std::collections::BTreeMap<String, Vec<f32>>, String) {
    let out_dir = dir.join(format!("w{nproc}"));
    let out = run(trainer()
        .args(["launch", "--nproc-per-node", &nproc.to_string(), "--"])
        .arg(own_loop())
        .args(["--batch", &batch.to_string(), "--steps", "20", "--out"])
        .arg(&out_dir)
        .args(args));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(
        out.stdout.contains(&format!("20 steps on {nproc} rank(s)")),
        "{}",
        out.all()
    );
    (read_weights(&out_dir.join("model.safetensors")), out.stdout)
}

#[test]
fn your_own_loop_with_data_parallel_matches_one_process_with_the_global_batch() {
    let dir = scratch("own-loop");
    let (two, _) = train(&dir, 2, 8, &[]);
    let (one, _) = train(&dir, 1, 16, &[]);
    let diff = max_abs_diff(&two, &one);
    assert!(diff < 1e-5, "max |w2 - w1| = {diff:e}");
}

/// ZeRO stages 1, 2 and 3 with Adam (each rank steps and keeps the state of the parameters it
/// owns; at stage 2 only their gradients too; at stage 3 a shard of every layer, gathered for
/// each forward) on 2 ranks, against plain Adam in one process with the doubled batch.
#[test]
fn your_own_loop_with_zero_stages_1_to_3_and_adam_matches_one_process() {
    let dir = scratch("own-loop-zero");
    let (one, _) = train(&dir, 1, 16, &["--adam"]);
    for stage in ["1", "2", "3"] {
        let dir = dir.join(format!("stage{stage}"));
        let (two, stdout) = train(&dir, 2, 8, &["--adam", "--zero-stage", stage]);
        assert!(stdout.contains(&format!("ZeRO stage {stage}")), "{stdout}");
        let diff = max_abs_diff(&two, &one);
        assert!(diff < 1e-4, "stage {stage}: max |w2 - w1| = {diff:e}");
    }
}

/// The own loop's recipe for fault tolerance (`--survivors`, under `trainer launch
/// --survivors-continue`): rank 1 of 3 is killed with SIGKILL from outside while the job
/// trains; the two others drop the step in flight, re-form, take the rest of the epoch over
/// themselves and finish every step, with equal replicas (the example checks them), and the
/// job exits 0.
#[test]
fn your_own_loop_survives_a_rank_killed_from_outside() {
    let dir = scratch("own-loop-survivors");
    let mut launcher = spawn(
        trainer()
            .args([
                "launch",
                "--nproc-per-node",
                "3",
                "--survivors-continue",
                "--",
            ])
            .arg(own_loop())
            .args(["--survivors", "--batch", "8", "--steps", "3000", "--out"])
            .arg(dir.join("out")),
    );
    // Past the first steps, whose set-up (the overlap's group) a death would fail.
    launcher.wait_for_line("own loop: step 500 of 3000");
    let victim = tree_of(launcher.id())
        .into_iter()
        .find(|&pid| rank_of(pid) == Some(1));
    let Some(victim) = victim else {
        launcher.fail("no process of rank 1 under the launcher");
    };
    signal(victim, libc::SIGKILL);
    let out = finish(launcher);
    assert_eq!(out.code, Some(0), "{}", out.all());
    for said in [
        "rank 1 failed: killed by signal 9",
        "the survivors re-form the job",
        "own loop: lost rank(s) [1] after step",
        "own loop: 3000 steps on 2 rank(s)",
    ] {
        assert!(out.all().contains(said), "missing {said:?}:\n{}", out.all());
    }
}
