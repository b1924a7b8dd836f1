//! burn-train users (`burn_ddp::learner`): `trainer/examples/burn_train_user.rs`, a
//! `SupervisedTraining` program written like Burn's guide, changed in its loader-builder and
//! strategy lines, under `trainer launch`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::common::*;

/// The example, built by `cargo test` (examples are compiled with the tests).
fn user_program() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/release/examples/burn_train_user");
    assert!(
        path.exists(),
        "{} is missing: `cargo build --release -p trainer --example burn_train_user`",
        path.display()
    );
    path
}

fn launch(nproc: usize, dir: &Path, args: &[&str]) -> Output {
    let out = run(trainer()
        .args(["launch", "--nproc-per-node", &nproc.to_string(), "--"])
        .arg(user_program())
        .arg("--dir")
        .arg(dir)
        .args(args));
    assert_eq!(out.code, Some(0), "{}", out.all());
    out
}

/// Every file under `dir`, relative to it.
fn files(dir: &Path) -> BTreeSet<String> {
    fn walk(root: &Path, dir: &Path, into: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).unwrap().filter_map(Result::ok) {
            let path = entry.path();
            if path.is_dir() {
                walk(root, &path, into);
            } else {
                into.insert(path.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    let mut all = BTreeSet::new();
    walk(dir, dir, &mut all);
    all
}

/// burn-train's metric log: (value, count) per line; the epoch's aggregate, which burn-train
/// 0.22 appends as `value,final`, has no count.
fn metric_log(path: &Path) -> Vec<(f64, Option<usize>)> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (v, n) = l
                .split_once(',')
                .unwrap_or_else(|| panic!("{}: {l:?}", path.display()));
            let count = (n != "final").then(|| n.parse().unwrap());
            (v.parse().unwrap(), count)
        })
        .collect()
}

/// burn-train's end-of-run summary in a program's output: from its banner on, without the
/// program's own "trained …" lines (another rank's may arrive in between).
fn learner_summary(stdout: &str) -> String {
    let start = stdout
        .find("Learner Summary")
        .unwrap_or_else(|| panic!("no learner summary in:\n{stdout}"));
    stdout[start..]
        .lines()
        .filter(|l| !l.starts_with("trained ") && !l.starts_with("[rank"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn two_processes_end_where_the_unchanged_program_ends_with_the_doubled_batch() {
    let dir = scratch("burn-train-user");
    let (plain, ddp) = (dir.join("plain"), dir.join("ddp"));
    let out = run(std::process::Command::new(user_program())
        .args(["--plain", "--batch", "32", "--dir"])
        .arg(&plain));
    assert_eq!(out.code, Some(0), "{}", out.all());
    let plain_summary = learner_summary(&out.stdout);
    let out = launch(2, &ddp, &["--batch", "16"]);
    assert!(out.stdout.contains("as rank 1"), "{}", out.all());
    assert_rank1_logs_no_info(&out, "[rank 1]");
    // Clean logs from every rank: no warning about burn-train's logger (expected on ranks
    // other than 0), no colour codes in piped output; rank 0's summary is the one-process
    // program's, model block included.
    assert!(!out.all().contains("experiment logger"), "{}", out.all());
    assert!(!out.all().contains('\u{1b}'), "{}", out.all());
    assert!(plain_summary.contains("Model:"), "{plain_summary}");
    assert_eq!(learner_summary(&out.stdout), plain_summary);

    let diff = max_abs_diff(
        &read_weights(&plain.join("model.safetensors")),
        &read_weights(&ddp.join("model.safetensors")),
    );
    assert!(diff < 1e-5, "max |w2 - w1| = {diff:e}");

    // burn-train's directories: the same files as the one-process run (rank 0 wrote them, and
    // only it: a second writer would double the metric lines), and metrics of the global batch
    // with its counts.
    assert_eq!(files(&ddp), files(&plain));
    for log in [
        "train/epoch-2/Loss.log",
        "valid/epoch-2/Accuracy.log",
        "valid/epoch-1/Loss.log",
    ] {
        let (a, b) = (metric_log(&plain.join(log)), metric_log(&ddp.join(log)));
        assert_eq!(a.len(), b.len(), "{log}");
        for ((x, n), (y, m)) in a.iter().zip(&b) {
            assert_eq!(n, m, "{log}: counts");
            assert!((x - y).abs() < 1e-4, "{log}: {x} vs {y}");
        }
    }
}

#[test]
fn shuffled_runs_share_one_global_order_at_any_world_size() {
    let dir = scratch("burn-train-shuffle");
    launch(2, &dir.join("w2"), &["--batch", "16", "--shuffle", "7"]);
    launch(1, &dir.join("w1"), &["--batch", "32", "--shuffle", "7"]);
    let diff = max_abs_diff(
        &read_weights(&dir.join("w1/model.safetensors")),
        &read_weights(&dir.join("w2/model.safetensors")),
    );
    assert!(diff < 1e-5, "max |w2 - w1| = {diff:e}");
}

/// burn-train's own resume (`.checkpoint(epoch)`) at the same world size continues with the
/// resumed epoch's order: 3 ranks (512 samples, so one padded position) with shuffling, resumed
/// after epoch 1, end with the weights of the run never stopped, bit for bit.
#[test]
fn a_resumed_epoch_gets_its_own_order_and_the_uninterrupted_weights() {
    let dir = scratch("burn-train-resume");
    let args = ["--batch", "16", "--shuffle", "7"];
    launch(
        3,
        &dir.join("straight"),
        &[&args[..], &["--epochs", "3"]].concat(),
    );
    let resumed = dir.join("resumed");
    launch(3, &resumed, &[&args[..], &["--epochs", "1"]].concat());
    let out = launch(
        3,
        &resumed,
        &[&args[..], &["--epochs", "3", "--resume", "1"]].concat(),
    );
    assert!(out.stdout.contains("trained 3 epoch(s)"), "{}", out.all());
    let diff = max_abs_diff(
        &read_weights(&dir.join("straight/model.safetensors")),
        &read_weights(&resumed.join("model.safetensors")),
    );
    assert_eq!(diff, 0.0, "max |w_resumed - w_straight|");
}

#[test]
fn a_plain_loader_falls_back_to_contiguous_slices() {
    let dir = scratch("burn-train-fallback");
    launch(2, &dir, &["--batch", "16", "--burn-loader"]);
    // 512 samples, 256 a rank, 16 iterations of 2 x 16 per epoch.
    let lines = metric_log(&dir.join("train/epoch-1/Accuracy.log"));
    let (iterations, aggregate): (Vec<_>, Vec<_>) = lines.iter().partition(|(_, n)| n.is_some());
    assert_eq!(iterations.len(), 16, "{lines:?}");
    assert_eq!(aggregate.len(), 1, "{lines:?}");
    assert!(iterations.iter().all(|&&(_, n)| n == Some(32)), "{lines:?}");
}

/// burn-ddp's options reach the strategy: ZeRO stages 1 and 2 with Adam on 2 ranks (each rank
/// steps, and keeps the Adam state of, the parameters it owns; at stage 2 it keeps only their
/// gradients too) end with the weights of the unchanged one-process program with the doubled
/// batch.
#[test]
fn zero_stages_1_and_2_with_adam_match_the_unchanged_program_with_the_doubled_batch() {
    let dir = scratch("burn-train-zero");
    let plain = dir.join("plain");
    let common = ["--adam", "--no-checkpointer"];
    let out = run(std::process::Command::new(user_program())
        .args(["--plain", "--batch", "32", "--dir"])
        .arg(&plain)
        .args(common));
    assert_eq!(out.code, Some(0), "{}", out.all());
    for stage in ["1", "2"] {
        let ddp = dir.join(format!("stage{stage}"));
        launch(
            2,
            &ddp,
            &[&common[..], &["--batch", "16", "--zero-stage", stage]].concat(),
        );
        let diff = max_abs_diff(
            &read_weights(&plain.join("model.safetensors")),
            &read_weights(&ddp.join("model.safetensors")),
        );
        assert!(diff < 1e-4, "stage {stage}: max |w2 - w1| = {diff:e}");
    }
}

/// Options that cannot work end every rank with exit code 2 and a message naming the fix:
/// ZeRO stage 2 (as 1) with burn-train's checkpointer (whose files would lose the other ranks'
/// optimizer state), ZeRO stage 3 (burn-train's `Learner` cannot hold the shards: refused by
/// `DdpStrategy::from_env_with`, so the program's own error handling reports it), and NCCL in
/// a build without CUDA.
#[test]
fn impossible_strategy_options_exit_2_naming_the_fix() {
    let dir = scratch("burn-train-refused");
    for (args, says) in [
        (
            &["--zero-stage", "2"][..],
            "Remove the checkpointer, use ZeRO stage 0",
        ),
        (
            &["--zero-stage", "3", "--no-checkpointer"][..],
            "burn_train_user: cannot start the strategy: DDP options: ZeRO stage 3 is not available",
        ),
        (&["--nccl"][..], "NCCL needs"),
    ] {
        let out = run(trainer()
            .args(["launch", "--nproc-per-node", "2", "--"])
            .arg(user_program())
            .arg("--dir")
            .arg(dir.join(args.concat().trim_start_matches('-')))
            .args(args));
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.all());
        assert!(out.all().contains(says), "{args:?}: {}", out.all());
    }
}
