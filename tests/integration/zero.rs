//! ZeRO stages 1, 2 and 3 (`distributed.zero_stage`) end to end: the same model as stage 0
//! and as one rank with the global batch, each rank holding only its own parameters'
//! optimizer state (at stage 2 only their gradients, at stage 3 a shard of the marked
//! blocks' weights too), and checkpoints that resume at another world size and stage.

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

/// A per-rank field of the `finish` record.
fn per_rank(out_dir: &Path, field: &str) -> Vec<u64> {
    finish_record(out_dir)[field]
        .as_array()
        .unwrap_or_else(|| panic!("no {field} in the finish record"))
        .iter()
        .map(|n| n.as_u64().unwrap())
        .collect()
}

/// How many parameters each rank held optimizer state for.
fn state_params(out_dir: &Path) -> Vec<u64> {
    per_rank(out_dir, "optimizer_state_params")
}

/// Each rank's counted model state: the gradients its optimizer was given plus its optimizer
/// state, in bytes.
fn model_state_bytes(out_dir: &Path) -> Vec<u64> {
    let grads = per_rank(out_dir, "gradient_bytes");
    let state = per_rank(out_dir, "optimizer_state_bytes");
    grads.iter().zip(&state).map(|(g, s)| g + s).collect()
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

/// A checkpoint of stage `stage` at world 2 resumes at world 1 with stage 0 and at world 3
/// with the same stage, and ends where the uninterrupted run ends. The global batch is 24 at
/// every world size (12 x 2, 24 x 1, 8 x 3), so the runs see the same samples in every step.
fn check_resume(stage: u8, optimizer: &str, tolerance: f32) {
    let dir = scratch(&format!(
        "zero{stage}-resume-{}",
        if optimizer == ADAM { "adam" } else { "sgd" }
    ));
    let body = |batch: usize, steps: usize, stage: u8| {
        let training = format!("max_steps = {steps}");
        with_stage(&digits_config(optimizer, batch, &training), stage)
            .replace("every_epochs = 0", "every_epochs = 0\nevery_steps = 10")
    };
    train(&write_config(&dir, "whole", &body(12, 25, stage)), 2);
    train(&write_config(&dir, "first", &body(12, 10, stage)), 2);
    assert!(newest_checkpoint(&dir.join("first-ckpt")).ends_with("step-00000010"));
    for (name, batch, nproc, stage) in [("w1", 24, 1, 0), ("w3", 8, 3, stage)] {
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

#[test]
fn a_stage_1_checkpoint_resumes_at_other_world_sizes_and_stages() {
    check_resume(1, SGD_MOMENTUM, 1e-5);
    check_resume(1, ADAM, 1e-4);
}

#[test]
fn a_stage_2_checkpoint_resumes_at_other_world_sizes_and_stages() {
    check_resume(2, ADAM, 1e-4);
}

/// The reference transformer with 3 encoder layers (each a marked block), Adam, 8 steps of 8
/// samples per rank, buckets of 0.004 MiB (about 1,000 values: many buckets, most with
/// gradients of several owners).
fn transformer(steps: usize, stage: u8) -> String {
    let training = format!("max_steps = {steps}");
    let body = text_config(ADAM, 8, &training).replace("layers = 1", "layers = 3");
    format!(
        "{body}\n[distributed]\nzero_stage = {stage}\nbucket_cap_mb = 0.004\ntimeout_secs = 120\n"
    )
}

/// Stage 2 against stage 0 on the transformer with Adam at worlds 2 and 4: the same weights
/// (to the ring's rounding), the buckets reduce-scattered while backward runs, and each rank's
/// counted gradients + optimizer state a share of stage 0's: together exactly stage 0's (a
/// partition), each about 1/N of it (a parameter is never split, so a share is within the
/// largest parameter of the even one).
#[test]
fn stage_2_matches_stage_0_on_the_transformer_holding_a_share_of_gradients_and_state() {
    let dir = scratch("zero2-text");
    for world in [2, 4] {
        let (stage0, stage2) = (format!("w{world}-stage0"), format!("w{world}-stage2"));
        train(&write_config(&dir, &stage0, &transformer(8, 0)), world);
        let out = train(&write_config(&dir, &stage2, &transformer(8, 2)), world);
        assert!(
            out.stdout.contains("gradient overlap: on;"),
            "{}",
            out.all()
        );
        let diff = max_abs_diff(&final_weights(&dir, &stage0), &final_weights(&dir, &stage2));
        assert!(
            diff < 1e-5,
            "world {world}: stage 2 vs stage 0: max |dw| = {diff:e}"
        );
        let stats =
            std::fs::read_to_string(dir.join(format!("{stage2}-out/reducer-stats.json"))).unwrap();
        assert!(
            !stats.contains("\"overlap_buckets_during_backward\":0"),
            "world {world}: no bucket was reduce-scattered during backward: {stats}"
        );

        let whole = model_state_bytes(&dir.join(format!("{stage0}-out")));
        let shares = model_state_bytes(&dir.join(format!("{stage2}-out")));
        assert_eq!(whole.len(), world);
        assert!(whole.iter().all(|&b| b == whole[0] && b > 0), "{whole:?}");
        assert_eq!(
            shares.iter().sum::<u64>(),
            whole[0],
            "world {world}: the shares {shares:?} do not partition stage 0's {}",
            whole[0]
        );
        // Largest parameter: the 32 x 16 feed-forward weights, 12 bytes a value with Adam.
        let even = whole[0] / world as u64;
        assert!(
            shares.iter().all(|&b| b > 0 && b <= even + 32 * 16 * 12),
            "world {world}: shares {shares:?} against an even share of {even}"
        );
    }
}

/// `trainer consolidate` of the checkpoint root of run `name` (a stage-3 run): its newest
/// checkpoint written whole, where `final_weights` reads it.
pub(crate) fn consolidate(dir: &Path, name: &str) {
    let out = run(trainer()
        .arg("consolidate")
        .arg(dir.join(format!("{name}-ckpt"))));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_says(&out.stdout, &["consolidated checkpoint:"], &out);
}

/// Each rank's counted model state: its parameters, the gradients its optimizer was given
/// and its optimizer state, in bytes.
fn held_bytes(out_dir: &Path) -> Vec<u64> {
    let params = per_rank(out_dir, "parameter_bytes");
    model_state_bytes(out_dir)
        .iter()
        .zip(&params)
        .map(|(s, p)| s + p)
        .collect()
}

/// Stage 3 against stage 0 on the transformer with Adam at worlds 2 and 4: the same weights
/// (the consolidated shards against the whole model), and each rank holding a share of the
/// marked blocks' weights, gradients and optimizer state, the rest (embeddings, the output
/// layer) whole.
#[test]
fn stage_3_matches_stage_0_on_the_transformer_holding_a_shard_of_the_model() {
    let dir = scratch("zero3-text");
    let mut held = Vec::new();
    for world in [2, 4] {
        let (stage0, stage3) = (format!("w{world}-stage0"), format!("w{world}-stage3"));
        train(&write_config(&dir, &stage0, &transformer(8, 0)), world);
        let out = train(&write_config(&dir, &stage3, &transformer(8, 3)), world);
        // 8 steps of 6 marked blocks (2 embeddings, 3 layers, the output layer): every
        // forward's blocks taken gathered ahead.
        assert!(
            out.stdout
                .contains("ZeRO stage 3 on rank 0: 48 blocks gathered ahead of their forward"),
            "{}",
            out.all()
        );
        // Each layer's weights are given back after its forward and gathered again when its
        // backward reads them (on the CPU, no recompute): at least the 3 layers of 8 steps.
        let again: u64 = out
            .stdout
            .split("of their forward, ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        assert!(again >= 24, "{again} blocks gathered again: {}", out.all());
        assert!(
            dir.join(format!(
                "{stage3}-ckpt/zero3-world-{world}/rank-{}",
                world - 1
            ))
            .is_dir(),
            "every rank writes its part"
        );
        consolidate(&dir, &stage3);
        let diff = max_abs_diff(&final_weights(&dir, &stage0), &final_weights(&dir, &stage3));
        assert!(
            diff < 1e-5,
            "world {world}: stage 3 vs stage 0: max |dw| = {diff:e}"
        );
        // The whole parameters held at once in a step (measured while tensors use them): at
        // least a layer (each is gathered whole for its forward), and less than the whole
        // model (each is dropped after its forward; gathered at most one block ahead).
        let weights = final_weights(&dir, &stage0);
        let bytes_of = |prefix: &str| -> u64 {
            let values: usize = weights
                .iter()
                .filter(|(name, _)| name.starts_with(prefix))
                .map(|(_, v)| v.len())
                .sum();
            4 * values as u64
        };
        let (layer, model) = (bytes_of("encoder.layers.0."), bytes_of(""));
        let gathered = per_rank(&dir.join(format!("{stage3}-out")), "gathered_peak_bytes");
        assert!(
            layer > 0 && gathered.iter().all(|&g| g >= layer && g < model),
            "world {world}: whole parameters held at once {gathered:?}, a layer {layer}, the \
             model {model} bytes"
        );
        let whole = held_bytes(&dir.join(format!("{stage0}-out")));
        let shard = held_bytes(&dir.join(format!("{stage3}-out")));
        assert!(whole.iter().all(|&b| b == whole[0]), "{whole:?}");
        assert!(
            shard.iter().all(|&b| b == shard[0] && b < whole[0]),
            "world {world}: {shard:?} against stage 0's {}",
            whole[0]
        );
        held.push((whole[0] as f64, shard[0] as f64));
    }
    // Stage 0 holds R + S (R: the parameters held whole, S: the sharded ones, 16 bytes a
    // value with Adam), stage 3 at world N holds R + S / N (and under N values of padding a
    // parameter). From worlds 2 and 4: S = 4 (p2 - p4), R = p2 - S / 2, and R + S is stage
    // 0's.
    let [(whole, p2), (_, p4)] = [held[0], held[1]];
    let sharded = 4.0 * (p2 - p4);
    let replicated = p2 - sharded / 2.0;
    assert!(
        sharded > replicated && ((replicated + sharded) / whole - 1.0).abs() < 0.05,
        "stage 0 {whole}, stage 3 at world 2 {p2}, at world 4 {p4}: not R + S / N"
    );
}

/// Stage 3 with bf16 gradients (`gradient_compression`): the shards' gradients are
/// reduce-scattered in 16 bits (scaled by 1/world before rounding), as the whole parameters'
/// buckets are, so the run ends where stage 0 with bf16 ends (measured: bit-identical at
/// world 2, where each sum is rounded once either way), away from stage 3 in f32 (2e-3), and
/// moves fewer bytes than stage 3 in f32 (the parameters are still gathered in f32).
#[test]
fn stage_3_reduce_scatters_compressed_gradients_and_ends_where_stage_0_with_them_ends() {
    let dir = scratch("zero3-bf16");
    let bf16 = |stage| format!("{}gradient_compression = \"bf16\"\n", transformer(8, stage));
    train(&write_config(&dir, "stage0-bf16", &bf16(0)), 2);
    for (name, config) in [("stage3-bf16", bf16(3)), ("stage3-f32", transformer(8, 3))] {
        train(&write_config(&dir, name, &config), 2);
        consolidate(&dir, name);
    }
    let diff = max_abs_diff(
        &final_weights(&dir, "stage0-bf16"),
        &final_weights(&dir, "stage3-bf16"),
    );
    assert!(
        diff < 1e-5,
        "stage 3 vs stage 0, both bf16: max |dw| = {diff:e}"
    );
    let rounded = max_abs_diff(
        &final_weights(&dir, "stage3-f32"),
        &final_weights(&dir, "stage3-bf16"),
    );
    assert!(
        rounded > 1e-4,
        "bf16 gradients left no trace: max |dw| = {rounded:e}"
    );
    let bytes = |name: &str| -> u64 {
        let stats =
            std::fs::read_to_string(dir.join(format!("{name}-out/reducer-stats.json"))).unwrap();
        let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
        stats["bytes_reduced"].as_u64().unwrap()
    };
    let (compressed, f32_bytes) = (bytes("stage3-bf16"), bytes("stage3-f32"));
    assert!(
        compressed < f32_bytes,
        "stage 3 moved {compressed} bytes with bf16 gradients, {f32_bytes} in f32"
    );
}

/// Copies the directory tree `from` into `to`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().filter_map(Result::ok) {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// `trainer eval` of a stage-3 run's checkpoint root `root`, and of one rank's part (its
/// directory, and its newest step's), before `trainer consolidate`: each one message, exit
/// code 2, that names the commands to run and no flag `eval` does not have.
fn eval_needs_consolidate_first(config: &Path, root: &Path) {
    let set = root.join("zero3-world-4");
    let rank_1 = set.join("rank-1");
    let part = newest_checkpoint(&rank_1);
    for (given, found) in [
        (
            root.to_path_buf(),
            "its newest checkpoint (step 25) is a ZeRO stage-3 one",
        ),
        (rank_1, "is in a ZeRO stage-3 checkpoint's per-rank parts"),
        (part, "is in a ZeRO stage-3 checkpoint's per-rank parts"),
        (set, "is in a ZeRO stage-3 checkpoint's per-rank parts"),
    ] {
        let out = run(trainer()
            .arg("eval")
            .arg("--config")
            .arg(config)
            .arg("--checkpoint")
            .arg(&given));
        assert_eq!(out.code, Some(2), "{}: {}", given.display(), out.all());
        let consolidate = format!("trainer consolidate {}", root.display());
        let eval = format!(
            "trainer eval --config {} --checkpoint {}",
            config.display(),
            root.display()
        );
        assert_says(&out.stderr, &[found, &consolidate, &eval], &out);
        assert_eq!(out.stderr.matches("error:").count(), 1, "{}", out.all());
        assert!(
            !out.stderr.contains("--no-resume") && !out.stderr.contains("shape"),
            "{}",
            out.all()
        );
    }
}

/// A stage-3 checkpoint written at world 4 resumes at worlds 2 and 3 (stage 3, the shards
/// re-cut) and at world 1 (stage 0, joined), and a stage-0 one at world 2 and stage 3, and
/// each ends where the uninterrupted run ends. The
/// global batch is 24 at every world size (6 x 4, 12 x 2, 8 x 3, 24 x 1). `trainer eval`
/// refuses the per-rank parts, naming `trainer consolidate`, and reads the consolidated
/// checkpoint, which also loads with Burn's own loader into a model defined here, without
/// this project.
#[test]
fn a_stage_3_checkpoint_resumes_at_other_world_sizes_and_consolidates_for_burn() {
    let dir = scratch("zero3-resume");
    let body = |batch: usize, steps: usize, stage: u8| {
        let training = format!("max_steps = {steps}");
        with_stage(&digits_config(ADAM, batch, &training), stage)
            .replace("every_epochs = 0", "every_epochs = 0\nevery_steps = 10")
    };
    let whole_config = write_config(&dir, "whole", &body(6, 25, 3));
    train(&whole_config, 4);
    train(&write_config(&dir, "first", &body(6, 10, 3)), 4);
    eval_needs_consolidate_first(&whole_config, &dir.join("whole-ckpt"));
    consolidate(&dir, "whole");
    let out = run(trainer()
        .arg("eval")
        .arg("--config")
        .arg(&whole_config)
        .arg("--checkpoint")
        .arg(dir.join("whole-ckpt")));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_says(&out.stdout, &["(step 25): validation"], &out);
    let whole = final_weights(&dir, "whole");
    // A whole checkpoint (stage 0, world 4) resumed at stage 3 too: the state cut per rank.
    train(&write_config(&dir, "whole0", &body(6, 10, 0)), 4);
    for (name, batch, nproc, stage) in [
        ("w2", 12, 2, 3),
        ("w3", 8, 3, 3),
        ("w1", 24, 1, 0),
        ("from0", 12, 2, 3),
    ] {
        let first = if name == "from0" { "whole0" } else { "first" };
        copy_tree(
            &dir.join(format!("{first}-ckpt")),
            &dir.join(format!("{name}-ckpt")),
        );
        let out = train(&write_config(&dir, name, &body(batch, 25, stage)), nproc);
        assert_resumed_at(&out, 10);
        if stage == 3 {
            consolidate(&dir, name);
        }
        let diff = max_abs_diff(&whole, &final_weights(&dir, name));
        assert!(
            diff < 1e-4,
            "{name}: resumed at world {nproc}, stage {stage}: max |dw| = {diff:e}"
        );
    }

    // A Burn program's own definition of the digits MLP (hidden = [32]): the names are the
    // model's (under the engine's model kind, `Mlp.`), nothing else is shared.
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn_store::{ModuleSnapshot, SafetensorsStore};
    #[derive(Module, Debug)]
    struct Mlp {
        hidden: Vec<Linear>,
        output: Linear,
    }
    let device = burn::tensor::Device::flex();
    let mut mlp = Mlp {
        hidden: vec![LinearConfig::new(64, 32).init(&device)],
        output: LinearConfig::new(32, 10).init(&device),
    };
    let file = newest_checkpoint(&dir.join("whole-ckpt")).join("model.safetensors");
    let loaded = mlp
        .load_from(&mut SafetensorsStore::from_file(&file).with_key_remapping(r"^Mlp\.", ""))
        .unwrap();
    assert!(
        loaded.is_success() && loaded.missing.is_empty() && loaded.unused.is_empty(),
        "{loaded:?}"
    );
    let w: Vec<f32> = mlp.output.weight.val().into_data().try_to_vec().unwrap();
    assert_eq!(w, whole["Mlp.output.weight"]);
}

/// kill -9 of a rank mid-run at stage 3 with `--max-restarts 1`: every rank restarts from
/// the newest checkpoint all ranks wrote, and the run ends on the uninterrupted run's bits.
#[test]
fn at_stage_3_a_killed_rank_costs_nothing_but_time() {
    let dir = scratch("zero3-restart");
    let body = with_stage(&digits_config(ADAM, 8, "max_steps = 30"), 3).replace(
        "every_epochs = 0",
        "every_epochs = 0\nevery_steps = 10\nkeep_last = 3",
    );
    let straight = write_config(&dir, "straight", &body);
    let restarted = write_config(&dir, "restarted", &body);
    train(&straight, 2);
    let out = run(trainer()
        .arg("--config")
        .arg(&restarted)
        .args(["--nproc-per-node", "2", "--max-restarts", "1"])
        .env("TRAINER_CRASH_AFTER_STEP", "15")
        .env("TRAINER_CRASH_RANK", "1"));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_says(&out.stderr, &["rank 1 failed: killed by signal 9"], &out);
    assert_resumed_at(&out, 10);
    consolidate(&dir, "straight");
    consolidate(&dir, "restarted");
    assert_same_weights(&dir, "straight", "restarted", 0.0);
}

/// A model the memory pre-flight refuses for one rank, and at world 4 under stages 0 to 2,
/// trains under stage 3 at world 4, to the weights of a stage-0 run given the memory.
#[test]
fn a_model_too_big_for_stages_0_to_2_trains_under_stage_3() {
    let dir = scratch("zero3-memory");
    // The 3-layer transformer: 7,218 parameters, with Adam 20 bytes each on one rank at
    // stage 0 (144 kB), 7 bytes a rank at stage 2 on 4 ranks (4 x 50.5 kB), 4 at stage 3
    // (4 x 28.9 kB). The pre-flight is told that 130 kB are available.
    let room = ("TRAINER_MEMORY_AVAILABLE", "130000");
    let config = |name: &str, stage: u8| write_config(&dir, name, &transformer(8, stage));
    let alone = run(trainer()
        .arg("--config")
        .arg(config("alone", 0))
        .env(room.0, room.1));
    assert_eq!(alone.code, Some(2), "{}", alone.all());
    assert_says(
        &alone.stderr,
        &["does not fit in memory", "zero_stage = 3"],
        &alone,
    );
    for stage in [0, 1, 2] {
        let out = run(trainer()
            .arg("--config")
            .arg(config(&format!("stage{stage}"), stage))
            .args(["--nproc-per-node", "4"])
            .env(room.0, room.1));
        assert_eq!(out.code, Some(2), "stage {stage}: {}", out.all());
        assert_says(
            &out.stderr,
            &["does not fit in memory", "zero_stage = 3"],
            &out,
        );
    }
    let out = run(trainer()
        .arg("--config")
        .arg(config("stage3", 3))
        .args(["--nproc-per-node", "4"])
        .env(room.0, room.1));
    assert_eq!(out.code, Some(0), "{}", out.all());
    train(&config("roomy", 0), 4);
    consolidate(&dir, "stage3");
    assert_same_weights(&dir, "roomy", "stage3", 1e-5);
}

/// Stage 3 with pipeline stages is bad input (exit 2, naming both), and so is consolidating
/// a directory that holds no stage-3 checkpoint.
#[test]
fn stage_3_refuses_pipeline_stages_and_consolidate_needs_a_stage_3_checkpoint() {
    let dir = scratch("zero3-refusals");
    let body = with_stage(&digits_config(SGD, 8, ""), 3) + "pipeline_stages = 2\n";
    let out = run(trainer()
        .arg("--config")
        .arg(write_config(&dir, "piped", &body)));
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_says(
        &out.stderr,
        &["distributed.zero_stage", "pipeline_stages = 2"],
        &out,
    );
    let out = run(trainer().arg("consolidate").arg(dir.join("nothing-here")));
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_says(
        &out.stderr,
        &["no ZeRO stage-3 checkpoint", "zero3-world-"],
        &out,
    );
}
