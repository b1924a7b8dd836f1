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
        // And the runs really moved away from the initial weights (a run of 0 steps writes
        // them): equal because nothing trained would pass the comparison above too.
        let zero = write_config(&dir, "zero", &digits_config(optimizer, 8, "max_steps = 0"));
        train(&zero, 1);
        let moved = max_abs_diff(&final_weights(&dir, "zero"), &final_weights(&dir, "one"));
        assert!(
            moved > 100.0 * tolerance,
            "{optimizer}: the weights moved only {moved:e} from their initial values"
        );
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

    // What the crashed attempt logged; the second attempt appends to the same files.
    let records_before = records(&dir.join("crashed-out")).len();
    let samples_before = sample_lines(&dir.join("crashed-out"), 0).len();
    let out = train(&crashed, 2);
    assert_resumed_at(&out, 10);
    // It really resumed: it trained steps 11..=30 only (a restart from scratch gives the same
    // weights, but trains steps 1..=30 again).
    let steps: Vec<u64> = records(&dir.join("crashed-out"))[records_before..]
        .iter()
        .filter(|r| r["kind"] == "train")
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(
        steps,
        vec![15, 20, 25, 30],
        "train records after the restart"
    );
    assert_eq!(
        sample_lines(&dir.join("crashed-out"), 0).len() - samples_before,
        20 * 8,
        "rank 0 trained 20 steps of 8 samples after the restart"
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
    assert_says(&out.stderr, &["does not fit this config", "'mlp'"], &out);
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
    assert_says(&out.stdout, &["validation Loss", "Accuracy"], &out);
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

/// Writes the digits with every sample of class 0 and only every 6th of the other classes
/// (about 180 against 30 each) to `path`, as plain CSV.
fn write_imbalanced_digits(path: &Path) {
    use std::io::Read;
    let mut text = String::new();
    flate2::read::GzDecoder::new(
        std::fs::File::open(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../data/digits.csv.gz"
        ))
        .unwrap(),
    )
    .read_to_string(&mut text)
    .unwrap();
    let mut seen = [0usize; 10];
    let kept: Vec<&str> = text
        .lines()
        .filter(|line| {
            let label: usize = line.rsplit(',').next().unwrap().trim().parse().unwrap();
            seen[label] += 1;
            label == 0 || seen[label] % 6 == 0
        })
        .collect();
    std::fs::write(path, kept.join("\n") + "\n").unwrap();
}

/// Class of every training sample of the digits in `path`, split as the trainer splits them.
fn training_labels(path: &Path) -> Vec<usize> {
    use burn::data::dataset::Dataset;
    use trainer::app::App;
    use trainer::builtin::classifier::{ClassifierApp, DataConfig};
    let data = ClassifierApp
        .datasets(&DataConfig {
            path: path.to_owned(),
            ..DataConfig::default()
        })
        .unwrap();
    (0..data.train.len())
        .map(|i| data.train.get(i).unwrap().label)
        .collect()
}

#[test]
fn class_balanced_sampling_draws_every_class_equally_from_imbalanced_data() {
    let dir = scratch("balanced");
    let csv = dir.join("imbalanced-digits.csv");
    write_imbalanced_digits(&csv);
    let labels = training_labels(&csv);
    let mut natural = [0usize; 10];
    for &l in &labels {
        natural[l] += 1;
    }
    let (most, least) = (natural.iter().max().unwrap(), natural.iter().min().unwrap());
    assert!(
        *least > 0 && *most >= 4 * least,
        "the training split must be imbalanced: {natural:?}"
    );

    let body = digits_config(ADAM, 16, "balance_classes = true")
        .replace("{data}", &csv.display().to_string());
    let out = train(&write_config(&dir, "balanced", &body), 2);
    assert!(out.stdout.contains("final validation"), "{}", out.all());
    // Every draw of the three epochs, on both ranks.
    let mut drawn = [0usize; 10];
    for rank in 0..2 {
        for (_, index, _) in sample_lines(&dir.join("balanced-out"), rank) {
            drawn[labels[index]] += 1;
        }
    }
    let total: usize = drawn.iter().sum();
    assert!(total >= 3 * labels.len(), "{total} draws");
    let fair = total as f64 / 10.0;
    for (class, &n) in drawn.iter().enumerate() {
        assert!(
            (n as f64 - fair).abs() <= 0.35 * fair,
            "class {class} drawn {n} times of {total} (fair: {fair:.0}); natural counts {natural:?}, drawn {drawn:?}"
        );
    }
}

/// Every record of `metrics.jsonl` in `out_dir`, in order.
fn records(out_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .collect()
}

/// The newest `valid` record of `metrics.jsonl` in `out_dir`.
fn last_validation(out_dir: &Path) -> serde_json::Value {
    records(out_dir)
        .into_iter()
        .rfind(|r| r["kind"] == "valid")
        .unwrap_or_else(|| panic!("no validation record in {}", out_dir.display()))
}

/// (epoch, index, is padding) of every line of `samples-rank{rank}.txt` in `out_dir`, in order.
fn sample_lines(out_dir: &Path, rank: usize) -> Vec<(usize, usize, bool)> {
    std::fs::read_to_string(out_dir.join(format!("samples-rank{rank}.txt")))
        .unwrap_or_default()
        .lines()
        .map(|line| {
            let f: Vec<usize> = line.split(' ').map(|x| x.parse().unwrap()).collect();
            (f[0], f[1], f[2] == 1)
        })
        .collect()
}

/// Trains `config` on `nproc` local ranks with extra arguments and environment; expects success.
fn train_with(config: &Path, nproc: usize, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = trainer();
    cmd.arg("--config")
        .arg(config)
        .args(["--nproc-per-node", &nproc.to_string()])
        .args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = run(&mut cmd);
    assert_eq!(
        out.code,
        Some(0),
        "training with {nproc} rank(s), {args:?} {env:?} failed:\n{}",
        out.all()
    );
    out
}

/// The initial broadcast: with `TRAINER_SEED_BY_RANK=1` every rank draws other initial weights,
/// and only `prepare` (rank 0's weights to every rank) makes the replicas equal. They are then
/// checked equal after every step, and end exactly where a run whose ranks drew the same
/// weights ends.
#[test]
fn ranks_seeded_differently_start_equal_after_the_broadcast_and_stay_equal() {
    let dir = scratch("broadcast");
    let body = digits_config(SGD, 8, "max_steps = 10\ncheck_replicas_every = 1");
    train(&write_config(&dir, "same-seed", &body), 2);
    let out = train_with(
        &write_config(&dir, "seed-by-rank", &body),
        2,
        &[],
        &[("TRAINER_SEED_BY_RANK", "1")],
    );
    // The hook was on: rank 1 drew its weights with seed 7 + 1.
    assert_says(
        &out.stderr,
        &["TRAINER_SEED_BY_RANK=1: initial weights seeded with 8"],
        &out,
    );
    let diff = max_abs_diff(
        &final_weights(&dir, "same-seed"),
        &final_weights(&dir, "seed-by-rank"),
    );
    assert_eq!(diff, 0.0, "rank 0's initial weights were not everyone's");
}

/// The validation of one checkpoint by 1 and by 2 ranks, and by `trainer eval`: the same loss,
/// accuracy and sample count. The 359 validation samples are odd and no multiple of 2 x the
/// batch (shards of 180 and 179, last batches of 4 and 3), so padding would show.
#[test]
fn one_and_two_rank_validations_of_one_checkpoint_agree() {
    let dir = scratch("eval-ranks");
    let body = digits_config(SGD, 8, "max_steps = 6").replace("epochs = 3", "epochs = 1");
    let source = write_config(&dir, "source", &body);
    train(&source, 2);
    let reference = last_validation(&dir.join("source-out"));
    assert_eq!(reference["samples"], 359, "{reference}");
    assert_eq!(reference["step"], 6, "{reference}");
    let metric = |r: &serde_json::Value, name: &str| r["metrics"][name].as_f64().unwrap();
    let (loss, accuracy) = (metric(&reference, "Loss"), metric(&reference, "Accuracy"));

    // A run resumed at its last step only validates: the checkpoint, by 1 and by 2 ranks.
    for nproc in [1, 2] {
        let name = format!("valid{nproc}");
        copy_newest_checkpoint(&dir.join("source-ckpt"), &dir.join(format!("{name}-ckpt")));
        let out = train(&write_config(&dir, &name, &body), nproc);
        assert!(out.stderr.contains("resumed from"), "{}", out.all());
        let r = last_validation(&dir.join(format!("{name}-out")));
        assert_eq!(r["samples"], 359, "{nproc} rank(s): {r}");
        assert_eq!(r["step"], 6, "{nproc} rank(s): {r}");
        let (l, a) = (metric(&r, "Loss"), metric(&r, "Accuracy"));
        assert!(
            (a - accuracy).abs() <= 1e-9,
            "accuracy {a} with {nproc} rank(s), {accuracy} with 2"
        );
        assert!(
            (l - loss).abs() <= 1e-6 * loss,
            "loss {l} with {nproc} rank(s), {loss} with 2 (a mean of per-batch means, as \
             burn-train's LossMetric counts batches, depends on how the batches fall)"
        );
    }

    // `trainer eval` (one process) of the same checkpoint, to the digits it prints.
    let eval = run(trainer()
        .arg("eval")
        .arg("--config")
        .arg(&source)
        .arg("--checkpoint")
        .arg(dir.join("source-ckpt")));
    assert_eq!(eval.code, Some(0), "{}", eval.all());
    let line = eval
        .stdout
        .lines()
        .find(|l| l.contains("validation"))
        .unwrap_or_else(|| panic!("{}", eval.all()));
    assert!(
        line.contains("(step 6)") && line.ends_with(", 359 samples"),
        "{line}"
    );
    let l = metric_on(line, "Loss").unwrap();
    let a = metric_on(line, "Accuracy").unwrap();
    assert!(
        (l - loss).abs() <= 0.5e-4 + 1e-9,
        "eval: {line}; 2 ranks: loss {loss}"
    );
    assert!(
        (a - accuracy).abs() <= 0.5e-2 + 1e-9,
        "eval: {line}; 2 ranks: {accuracy}%"
    );
}

/// bf16 buckets over real sockets (`BURN_DDP_SHM=0`): half the bytes, and within the
/// tolerance of the shared-memory bf16 test of the f32 run
/// (`compressed_gradients_halve_the_bytes_and_track_the_f32_run`).
#[test]
fn bf16_gradients_over_sockets_track_the_f32_run() {
    let dir = scratch("compression-tcp");
    let with = |compression: &str| {
        digits_config(SGD, 8, "max_steps = 25")
            + &format!("\n[distributed]\ngradient_compression = \"{compression}\"\n")
    };
    let mut logs = BTreeMap::new();
    for (name, compression, shm) in [
        ("f32-shm", "none", "1"),
        ("f32-tcp", "none", "0"),
        ("bf16-tcp", "bf16", "0"),
    ] {
        let out = train_with(
            &write_config(&dir, name, &with(compression)),
            2,
            &[],
            &[("BURN_DDP_SHM", shm)],
        );
        logs.insert(name, out.stderr);
    }
    for name in ["f32-tcp", "bf16-tcp"] {
        assert!(
            logs[name].contains("ring connected") && !logs[name].contains("(shared memory)"),
            "{name}: the ring must use TCP:\n{}",
            logs[name]
        );
    }
    assert!(
        logs["f32-shm"].contains("(shared memory)"),
        "{}",
        logs["f32-shm"]
    );
    assert_eq!(
        2 * bytes_reduced(&dir, "bf16-tcp"),
        bytes_reduced(&dir, "f32-tcp"),
        "bf16 buckets are half the bytes"
    );
    let reference = final_weights(&dir, "f32-shm");
    let diff = max_abs_diff(&final_weights(&dir, "bf16-tcp"), &reference);
    assert!(
        diff > 0.0 && diff < 1e-3,
        "bf16 over TCP: max |w - w_f32| = {diff:e} (want rounding-sized, in (0, 1e-3))"
    );
    let transport = max_abs_diff(&final_weights(&dir, "f32-tcp"), &reference);
    assert_eq!(transport, 0.0, "f32 over TCP and shared memory differ");
}

/// `--no-resume` starts over beside existing checkpoints.
#[test]
fn no_resume_starts_from_scratch_despite_a_checkpoint() {
    let dir = scratch("no-resume");
    let config = write_config(&dir, "run", &digits_config(SGD, 8, "max_steps = 5"));
    train(&config, 2);
    let first = final_weights(&dir, "run");
    let lines = sample_lines(&dir.join("run-out"), 0).len();
    assert_eq!(lines, 5 * 8);
    // Resuming would find the run finished (step 5 of 5) and train nothing.
    let out = train_with(&config, 2, &["--no-resume"], &[]);
    assert!(!out.stderr.contains("resumed from"), "{}", out.all());
    assert_eq!(
        sample_lines(&dir.join("run-out"), 0).len() - lines,
        5 * 8,
        "--no-resume trains the 5 steps again:\n{}",
        out.all()
    );
    assert!(out.stdout.contains("5 optimizer steps"), "{}", out.all());
    assert_eq!(max_abs_diff(&final_weights(&dir, "run"), &first), 0.0);
}

/// Two `trainer` processes started by hand with torchrun's variables (no launcher) train the
/// launcher's run exactly.
#[test]
fn ranks_started_by_hand_with_torchrun_variables_match_the_launcher() {
    let dir = scratch("torchrun-vars");
    let body = digits_config(SGD, 8, "max_steps = 10");
    train(&write_config(&dir, "launched", &body), 2);
    let config = write_config(&dir, "by-hand", &body);
    let port = unused_port().to_string();
    let start = |rank: &str| {
        let mut cmd = trainer();
        cmd.arg("--config")
            .arg(&config)
            .env("RANK", rank)
            .env("WORLD_SIZE", "2")
            .env("LOCAL_RANK", rank)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port);
        spawn(&mut cmd)
    };
    let (r0, r1) = (start("0"), start("1"));
    let (r0, r1) = (finish(r0), finish(r1));
    assert_eq!(r0.code, Some(0), "rank 0:\n{}", r0.all());
    assert_eq!(r1.code, Some(0), "rank 1:\n{}", r1.all());
    assert!(
        r0.stdout.contains("10 optimizer steps, world size 2"),
        "{}",
        r0.all()
    );
    let diff = max_abs_diff(
        &final_weights(&dir, "launched"),
        &final_weights(&dir, "by-hand"),
    );
    assert_eq!(diff, 0.0, "by hand vs launcher");
}

/// `optimizer.name = "adamw"` is AdamW: with weight decay it differs from Adam's L2 penalty.
#[test]
fn adamw_is_not_adam() {
    let dir = scratch("adamw");
    for name in ["adam", "adamw"] {
        let optimizer = format!("name = \"{name}\"\nlearning_rate = 0.003\nweight_decay = 0.5");
        train(
            &write_config(&dir, name, &digits_config(&optimizer, 8, "max_steps = 10")),
            2,
        );
    }
    let diff = max_abs_diff(&final_weights(&dir, "adam"), &final_weights(&dir, "adamw"));
    eprintln!("max |w_adamw - w_adam| = {diff:e}");
    assert!(
        diff > 1e-4,
        "adamw and adam give the same weights ({diff:e})"
    );
}

/// `training.drop_last`: 1409 training samples over 2 ranks of batch 8 are 705 per rank padded
/// (89 steps an epoch) or 704 dropped to (88 steps), with no padding and 1 sample left out.
#[test]
fn drop_last_drops_the_tail_and_a_step() {
    let dir = scratch("drop-last");
    // 1797 digits, 388 held out: 1409 for training.
    let body = |drop_last: bool| {
        digits_config(SGD, 8, &format!("drop_last = {drop_last}"))
            .replace("epochs = 3", "epochs = 1")
            .replace(
                "source = \"digits\"",
                "source = \"digits\"\nvalidation_fraction = 0.2159",
            )
    };
    for (name, drop_last, steps, padding, distinct) in
        [("keep", false, 89, 1, 1409), ("drop", true, 88, 0, 1408)]
    {
        let out = train(&write_config(&dir, name, &body(drop_last)), 2);
        assert!(
            out.stdout.contains(&format!("{steps} optimizer steps")),
            "drop_last = {drop_last}:\n{}",
            out.all()
        );
        let lines: Vec<_> = (0..2)
            .flat_map(|rank| sample_lines(&dir.join(format!("{name}-out")), rank))
            .collect();
        assert_eq!(lines.iter().filter(|s| s.2).count(), padding, "{name}");
        let mut seen = BTreeMap::new();
        visits(&dir.join(format!("{name}-out")), &mut seen);
        assert_eq!(seen.len(), distinct, "drop_last = {drop_last}");
    }
}

/// `training.shuffle = false`: the epoch's order is 0, 1, 2, ... (rank r of 2 takes r, r+2, ...);
/// shuffled by default.
#[test]
fn shuffle_false_keeps_the_data_set_order() {
    let dir = scratch("shuffle");
    for (name, extra) in [("ordered", "shuffle = false"), ("shuffled", "")] {
        let body = digits_config(SGD, 8, &format!("max_steps = 5\n{extra}"));
        train(&write_config(&dir, name, &body), 2);
    }
    for rank in 0..2 {
        let order = |name: &str| -> Vec<usize> {
            sample_lines(&dir.join(format!("{name}-out")), rank)
                .into_iter()
                .map(|s| s.1)
                .collect()
        };
        let want: Vec<usize> = (0..40).map(|k| 2 * k + rank).collect();
        assert_eq!(order("ordered"), want, "rank {rank} with shuffle = false");
        assert_ne!(order("shuffled"), want, "rank {rank} shuffles by default");
    }
}

/// The step-time breakdown finds the straggler: a rank slowed on purpose (an environment hook
/// that sleeps in its compute) is named in every `train` line of `metrics.jsonl`, in the
/// `finish` line and in the final summary — rank 1 when rank 1 is slowed, rank 0 when rank 0
/// is, so the report cannot name a fixed rank by accident.
#[test]
fn the_step_time_report_names_the_slowed_rank() {
    let dir = scratch("straggler");
    let body = digits_config(SGD, 8, "max_steps = 20");
    for slowed in [1usize, 0] {
        let name = format!("slow{slowed}");
        let config = write_config(&dir, &name, &body);
        let out = train_with(
            &config,
            2,
            &[],
            &[("TRAINER_SLOW_STEP", &format!("{slowed}:25"))],
        );
        let summary = out
            .stdout
            .lines()
            .find(|l| l.starts_with("time per step"))
            .unwrap_or_else(|| panic!("no step-time summary:\n{}", out.all()));
        assert!(
            summary.contains(&format!("slowest rank {slowed} ")),
            "rank {slowed} was slowed: {summary}"
        );
        let records = records(&dir.join(format!("{name}-out")));
        let timed: Vec<_> = records
            .iter()
            .filter(|r| r["kind"] == "train" || r["kind"] == "finish")
            .collect();
        assert_eq!(timed.len(), 20 / 5 + 1, "4 train lines and a finish line");
        for r in timed {
            let time = &r["time"];
            assert_eq!(time["slowest_rank"], slowed, "{r}");
            // 25 ms more compute per step on one rank: the max over ranks shows it, the
            // other rank waits for it in the gradient sync.
            assert!(time["compute"]["max"].as_f64().unwrap() >= 0.025, "{r}");
            assert!(time["sync"]["max"].as_f64().unwrap() >= 0.015, "{r}");
            for phase in ["data", "compute", "sync", "optimizer", "checkpoint", "step"] {
                let s = &time[phase];
                let (min, median, max) =
                    (s["min"].as_f64(), s["median"].as_f64(), s["max"].as_f64());
                assert!(
                    matches!((min, median, max), (Some(a), Some(b), Some(c)) if 0.0 <= a && a <= b && b <= c),
                    "{phase}: {r}"
                );
            }
        }
        let start = records.first().expect("a start line");
        assert_eq!(start["kind"], "start");
        assert_eq!(
            (start["step"].as_u64(), start["world_size"].as_u64()),
            (Some(0), Some(2))
        );
        assert!(start["resumed_from"].is_null());
    }
}
