//! A user's own crate (`examples/custom-model/`: its own model, batch type, data set and config
//! tables, Burn with its default features) trained by the engine, launched by
//! `trainer launch`, killed and resumed. `.ci/run` builds the example before the tests.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use crate::common::*;

/// The example's binary: `$CUSTOM_MODEL_BIN`, or where `.ci/run` builds it.
fn custom_model() -> PathBuf {
    let path = std::env::var_os("CUSTOM_MODEL_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/custom-model"),
        PathBuf::from,
    );
    assert!(
        path.exists(),
        "{} is missing: build the example first with \
         `(cd examples/custom-model && CARGO_TARGET_DIR=../../target cargo build --release)` \
         (bash .ci/run does), or point CUSTOM_MODEL_BIN at it",
        path.display()
    );
    path
}

/// The example's config with the test's directories, `epochs` epochs and extra `[training]` keys.
fn circles_config(epochs: usize, extra_training: &str) -> String {
    format!(
        r#"
[model]
hidden = 16

[data]
train_points = 512
valid_points = 128
noise = 0.05
seed = 7

[optimizer]
name = "adam"
learning_rate = 0.01

[training]
epochs = {epochs}
batch_size = 16
seed = 1
log_every = 4
{extra_training}

[checkpoint]
dir = "{{ckpt}}"
every_steps = 6
every_epochs = 0

[output]
dir = "{{out}}"
"#
    )
}

/// `trainer launch --nproc-per-node 2 [launch_args] -- custom-model --config CONFIG`.
fn launch_example(config: &std::path::Path, launch_args: &[&str], env: &[(&str, &str)]) -> Output {
    launch_example_on(2, config, launch_args, env)
}

/// [`launch_example`] on `nproc` local ranks.
fn launch_example_on(
    nproc: usize,
    config: &std::path::Path,
    launch_args: &[&str],
    env: &[(&str, &str)],
) -> Output {
    let mut cmd = trainer();
    cmd.args(["launch", "--nproc-per-node", &nproc.to_string()])
        .args(launch_args)
        .arg("--")
        .arg(custom_model())
        .arg("--config")
        .arg(config);
    for (k, v) in env {
        cmd.env(k, v);
    }
    run(&mut cmd)
}

#[test]
fn a_user_crate_resumes_after_sigkill_to_the_weights_of_an_uninterrupted_run() {
    // 2 ranks: SIGKILL rank 1 right after step 15 (the last checkpoint is step 12); the
    // launcher restarts both ranks, which resume from step 12 and finish.
    resume_after_sigkill(2, 2, 15, 12);
    // 3 ranks (512 points: one padded position per epoch; 3 epochs of 11 steps, about the
    // training of 2 ranks' 32 steps): killed after step 8, resumed from step 6, the restarted
    // ranks train epoch 0's ragged, padded last batch.
    resume_after_sigkill(3, 3, 8, 6);
}

/// The user's own model cut into 2 pipeline stages by its own `StageSplit` (its own
/// `PipelineStage`, batch type and loss): 4 micro-batches of 8 on 2 processes end with the
/// weights of one process with the batch of 32 (Adam), each layer on exactly one stage, and
/// report the app's own metrics (its accuracy) as one process does.
#[test]
fn the_users_model_in_two_pipeline_stages_trains_to_the_weights_of_one_process() {
    let dir = scratch("user-crate-pipeline");
    let one = circles_config(1, "").replace("batch_size = 16", "batch_size = 32");
    let staged = circles_config(1, "accumulation_steps = 4")
        .replace("batch_size = 16", "batch_size = 8")
        + "\n[distributed]\npipeline_stages = 2\npipeline_schedule = \"1f1b\"\n";
    let mut accuracy = Vec::new();
    for (name, body, nproc) in [("one", one, 1), ("staged", staged, 2)] {
        let out = launch_example_on(nproc, &write_config(&dir, name, &body), &[], &[]);
        assert_eq!(out.code, Some(0), "{name}: {}", out.all());
        accuracy.push(final_accuracy(&out));
    }
    // 128 validation points: within one point a near-tie could flip.
    assert!(
        (accuracy[0] - accuracy[1]).abs() <= 100.0 / 128.0 + 1e-9,
        "final validation accuracy: {accuracy:?} (one process, stages)"
    );
    let whole = crate::pipeline::stage_weights(&dir, "one", 1);
    let staged = crate::pipeline::stage_weights(&dir, "staged", 2);
    assert_eq!(whole.len(), 4, "{:?}", whole.keys());
    let diff = max_abs_diff(&staged, &whole);
    assert!(diff < 1e-4, "max |Δw| = {diff:e}");
}

/// The user's own model marks its two layers (`trainer::burn_ddp::mark_block`): with
/// `distributed.gradient_overlap` on, their buckets go on the wire during backward, and the
/// weights are bit-identical to overlap off (the same buckets, summed after backward), at
/// world 2 and at world 3 with accumulation and bf16 buckets.
#[test]
fn the_users_marked_layers_overlap_backward_bit_identical_to_no_overlap() {
    let dir = scratch("user-crate-overlap");
    for (world, training, distributed) in [
        (2, "", ""),
        (
            3,
            "accumulation_steps = 2",
            "gradient_compression = \"bf16\"",
        ),
    ] {
        let mut weights = Vec::new();
        for overlap in [true, false] {
            let name = format!("w{world}-{overlap}");
            let body = circles_config(1, training)
                + &format!(
                    "\n[distributed]\nbucket_cap_mb = 0.0002\ngradient_overlap = {overlap}\n{distributed}\n"
                );
            let out = launch_example_on(world, &write_config(&dir, &name, &body), &[], &[]);
            assert_eq!(out.code, Some(0), "{name}: {}", out.all());
            let line = if overlap {
                "gradient overlap: on;"
            } else {
                "gradient overlap: off"
            };
            assert!(out.stdout.contains(line), "{name}: {}", out.all());
            weights.push(final_weights(&dir, &name));
        }
        let diff = max_abs_diff(&weights[0], &weights[1]);
        assert_eq!(
            diff, 0.0,
            "world {world}: overlap on vs off, max |dw| = {diff:e}"
        );
    }
}

/// ZeRO stage 3 on the user's model (its two marked layers cut into shards, gathered for each
/// forward and again for the backward): the weights of stage 0, at world 2, and at world 3
/// with accumulation (each micro-batch's backward reduce-scatters into the shards).
#[test]
fn the_users_model_at_zero_stage_3_trains_to_the_weights_of_stage_0() {
    let dir = scratch("user-crate-zero3");
    for (world, training) in [(2, ""), (3, "accumulation_steps = 2")] {
        for stage in [0, 3] {
            let name = format!("w{world}-stage{stage}");
            let body =
                circles_config(1, training) + &format!("\n[distributed]\nzero_stage = {stage}\n");
            let out = launch_example_on(world, &write_config(&dir, &name, &body), &[], &[]);
            assert_eq!(out.code, Some(0), "{name}: {}", out.all());
        }
        crate::zero::consolidate(&dir, &format!("w{world}-stage3"));
        let diff = max_abs_diff(
            &final_weights(&dir, &format!("w{world}-stage0")),
            &final_weights(&dir, &format!("w{world}-stage3")),
        );
        assert!(
            diff < 1e-5,
            "world {world}: stage 3 vs 0: max |dw| = {diff:e}"
        );
    }
}

/// The user's model with a `SyncBatchNorm` (taken through `trainer::burn_ddp`, the engine's own
/// build of burn-ddp) on 2 ranks with batches of 16 ends with the weights and running statistics
/// of one process with batches of 32: its statistics are the global batch's. Per-rank
/// statistics (plain BatchNorm, or a SyncBatchNorm of a second burn-ddp build that finds no
/// process group) would normalise each rank's half by its own mean and variance.
#[test]
fn the_users_sync_batch_norm_on_two_ranks_matches_one_process_with_the_whole_batch() {
    let dir = scratch("user-crate-sync-batch-norm");
    let config = |batch: &str| {
        circles_config(1, "")
            .replace("hidden = 16", "hidden = 16\nsync_batch_norm = true")
            .replace("batch_size = 16", batch)
            // SGD: Adam's step divides by the gradient's own size, so where a gradient is near
            // zero it turns rounding differences of the two reductions into visible ones.
            .replace(
                "name = \"adam\"\nlearning_rate = 0.01",
                "name = \"sgd\"\nlearning_rate = 0.1",
            )
    };
    for (name, batch, nproc) in [("one", "batch_size = 32", 1), ("two", "batch_size = 16", 2)] {
        let out = launch_example_on(nproc, &write_config(&dir, name, &config(batch)), &[], &[]);
        assert_eq!(out.code, Some(0), "{name}: {}", out.all());
    }
    let (one, two) = (final_weights(&dir, "one"), final_weights(&dir, "two"));
    assert!(
        one.keys().any(|k| k.contains("norm.running_var")),
        "the norm's statistics are in the checkpoint: {:?}",
        one.keys()
    );
    let diff = max_abs_diff(&two, &one);
    assert!(diff < 1e-5, "max |Δw| = {diff:e}");
}

/// The user's model on `nproc` ranks for `epochs` epochs, rank 1 killed after step
/// `crash_after` and restarted by the launcher from the checkpoint of step `resumed_at`, ends
/// with the uninterrupted run's weights, bit for bit.
fn resume_after_sigkill(nproc: usize, epochs: usize, crash_after: usize, resumed_at: usize) {
    let dir = scratch(&format!("user-crate-resume-{nproc}"));
    let whole = write_config(&dir, "whole", &circles_config(epochs, ""));
    let out = launch_example_on(nproc, &whole, &[], &[]);
    assert_eq!(out.code, Some(0), "uninterrupted run:\n{}", out.all());
    assert!(
        final_accuracy(&out) > 80.0,
        "the user's model learns:\n{}",
        out.all()
    );

    let crashed = write_config(&dir, "crashed", &circles_config(epochs, ""));
    let out = launch_example_on(
        nproc,
        &crashed,
        &["--max-restarts", "1"],
        &[
            ("TRAINER_CRASH_AFTER_STEP", &crash_after.to_string()),
            ("TRAINER_CRASH_RANK", "1"),
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(
        out.stderr.contains("killing this process") && out.stderr.contains("restarting every rank"),
        "the crash and the restart happened:\n{}",
        out.all()
    );
    let checkpoint = format!("step-{resumed_at:08}");
    assert!(
        out.stderr.contains("resumed from") && out.stderr.contains(&checkpoint),
        "resumed from the checkpoint of step {resumed_at}:\n{}",
        out.all()
    );
    let diff = max_abs_diff(
        &final_weights(&dir, "crashed"),
        &final_weights(&dir, "whole"),
    );
    assert_eq!(
        diff, 0.0,
        "{nproc} ranks: max |w_resumed - w_whole| against the uninterrupted run"
    );
}

#[test]
fn ranks_read_only_their_shard_and_the_launcher_reads_nothing() {
    let dir = scratch("user-crate-reads");
    let config = write_config(&dir, "reads", &circles_config(1, ""));
    let log = dir.join("data.log");
    // The example launches itself (`--nproc-per-node`): its launcher process runs the
    // pre-flight check, then starts the ranks.
    let out = run(Command::new(custom_model())
        .current_dir(&dir)
        .arg("--config")
        .arg(&config)
        .args(["--nproc-per-node", "2"])
        .env("CIRCLES_DATA_LOG", &log)
        .env_remove("RANK")
        .env_remove("TRAINER_WORKER"));
    assert_eq!(out.code, Some(0), "{}", out.all());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        !text.contains("rank=none"),
        "the launcher / pre-flight opened or read the data:\n{text}"
    );
    // rank → (train reads, validation reads)
    let mut reads: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut opened = 0;
    for line in text.lines() {
        let field = |key: &str| {
            line.split(' ')
                .find_map(|f| f.strip_prefix(key))
                .unwrap_or_else(|| panic!("no {key} in {line}"))
                .to_string()
        };
        if line.contains("opened") {
            opened += 1;
            continue;
        }
        let entry = reads.entry(field("rank=")).or_default();
        let n: usize = field("reads=").parse().unwrap();
        if field("first=") == "0" {
            entry.0 += n;
        } else {
            entry.1 += n;
        }
    }
    assert_eq!(opened, 2, "each rank opens the data once:\n{text}");
    // One epoch of 512 training points over 2 ranks, and one validation pass of 128.
    assert_eq!(
        reads.get("0"),
        Some(&(256, 64)),
        "rank 0 reads its shard only:\n{text}"
    );
    assert_eq!(reads.get("1"), Some(&(256, 64)), "{text}");
}

#[test]
fn a_misspelt_key_in_the_users_own_table_is_bad_input_naming_it() {
    let dir = scratch("user-crate-bad");
    let config = write_config(
        &dir,
        "bad",
        &circles_config(1, "").replace("hidden = 16", "hiden = 16"),
    );
    let out = launch_example(&config, &[], &[]);
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert!(out.stderr.contains("hiden"), "{}", out.all());
    assert!(!out.stderr.contains("panicked"), "{}", out.all());
}

#[test]
fn the_users_parameter_count_lets_the_preflight_refuse_a_model_too_big() {
    let dir = scratch("user-crate-too-big");
    let config = write_config(
        &dir,
        "big",
        &circles_config(1, "").replace("hidden = 16", "hidden = 4000000000"),
    );
    refused_before_any_rank(&config, &["20,000,000,002 parameters need at least"]);
}

/// The user's binary as its own launcher (`run::main`) on 2 ranks with `config`: the pre-flight
/// refuses it with exit code 2, saying each of `says`, before any rank is started.
fn refused_before_any_rank(config: &std::path::Path, says: &[&str]) {
    let mut cmd = Command::new(custom_model());
    cmd.arg("--config")
        .arg(config)
        .args(["--nproc-per-node", "2"]);
    let out = run(&mut cmd);
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_says(&out.stderr, says, &out);
    assert_no_rank_started(&out);
}

/// The user's binary names itself (`trainer::program_info!()`): `--version` and `--help` say
/// `custom-model` and its crate's version, not `trainer`.
#[test]
fn the_users_binary_names_itself_in_help_and_version() {
    let out = run(Command::new(custom_model()).arg("--version"));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_eq!(out.stdout.trim(), "custom-model 0.1.0", "{}", out.all());
    let out = run(Command::new(custom_model()).arg("--help"));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(out.stdout.contains("Usage: custom-model"), "{}", out.all());
    assert!(!out.stdout.contains("trainer "), "{}", out.all());
}

/// A device the user's build lacks: the advice is for the user's crate (a feature of its own
/// forwarding trainer's and Burn's), not the workspace's `-p trainer`. CI builds the example
/// with `--features cuda` only, so `wgpu` is the device it lacks.
#[test]
fn a_device_the_users_build_lacks_is_refused_with_advice_for_the_users_crate() {
    let dir = scratch("user-crate-no-wgpu");
    let config = write_config(
        &dir,
        "wgpu",
        &(circles_config(1, "") + "device = \"wgpu\"\n"),
    );
    let out = run(Command::new(custom_model()).arg("--config").arg(&config));
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_says(
        &out.stderr,
        &[
            "output.device = \"wgpu\" is not available in this build",
            "rebuild custom-model with `--features wgpu`",
            "\"trainer/wgpu\"",
            "\"burn/wgpu\"",
        ],
        &out,
    );
    assert!(!out.stderr.contains("-p trainer"), "{}", out.all());
}

/// An optional part the user's build lacks (examples/custom-model depends on trainer with
/// `default-features = false`): asking for it is refused before any rank starts, naming
/// trainer's cargo feature and how the user's crate turns it on.
#[test]
fn an_output_the_users_build_lacks_is_refused_naming_trainers_feature() {
    let dir = scratch("user-crate-no-tensorboard");
    let config = write_config(
        &dir,
        "tensorboard",
        &(circles_config(1, "") + "tensorboard = true\n"),
    );
    refused_before_any_rank(
        &config,
        &[
            "output.tensorboard = true needs trainer's cargo feature `tensorboard`",
            "the Cargo.toml of custom-model's crate",
            "features = [\"tensorboard\"]",
        ],
    );
}

/// The user's own model under `[fault_tolerance] on_rank_failure = "continue"`: rank 1 of 3
/// killed in the middle of step 5 and started again by `trainer launch --survivors-continue
/// --max-restarts 1` joins after step 10, taking rank 0's weights, optimizer state and
/// position; the run ends bit for bit where a scripted leave after step 4 and join after step
/// 10 end, every step's replicas compared.
#[test]
fn the_users_model_survives_a_killed_rank_that_rejoins_as_a_scripted_leave_and_join_do() {
    let dir = scratch("user-crate-rejoin");
    let body = circles_config(3, "check_replicas_every = 1")
        + "\n[fault_tolerance]\non_rank_failure = \"continue\"\n";
    let failed = write_config(&dir, "failed", &body);
    let out = launch_example_on(
        3,
        &failed,
        &["--survivors-continue", "--max-restarts", "1"],
        &[
            ("TRAINER_CRASH_IN_STEP", "5"),
            ("TRAINER_CRASH_RANK", "1"),
            ("TRAINER_JOIN_AFTER_STEP", "10"),
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_says(
        &out.stderr,
        &["started rank 1 again to join the others (1 of 1 restarts)"],
        &out,
    );
    assert_says(&out.stdout, &["; ranks joined it 1 time ("], &out);
    let scripted = write_config(&dir, "scripted", &body);
    let out = launch_example_on(
        3,
        &scripted,
        &["--survivors-continue"],
        &[
            ("TRAINER_LEAVE_AFTER_STEP", "4:1"),
            ("TRAINER_JOIN_AFTER_STEP", "10"),
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_says(&out.stderr, &["[rank 1] left the job after step 4"], &out);
    crate::resume::assert_same_checkpoints(&dir, "failed", "scripted", "the user's model");
}
