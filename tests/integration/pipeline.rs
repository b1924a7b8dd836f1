//! Pipeline parallelism in a user's own loop: `burn-ddp/examples/pipeline.rs` (a perceptron
//! cut into stages with `burn_ddp::pipeline::PipelineParallel`) under `trainer launch`, real
//! processes over loopback, against one process with the whole model and the global batch.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;

/// The example, built by `cargo test --workspace` (burn-ddp's examples are compiled with its
/// tests; `cargo test -p trainer` alone does not build it).
fn pipeline_example() -> PathBuf {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/examples/pipeline");
    assert!(
        path.exists(),
        "{} is missing: `cargo build --release -p burn-ddp --example pipeline`",
        path.display()
    );
    path
}

/// Runs the example for `steps` steps on `nproc` processes; the whole model's weights from its
/// stage files.
fn train(
    dir: &Path,
    name: &str,
    nproc: usize,
    steps: usize,
    args: &[&str],
) -> BTreeMap<String, Vec<f32>> {
    let out_dir = dir.join(name);
    let out = run(trainer()
        .args(["launch", "--nproc-per-node", &nproc.to_string(), "--"])
        .arg(pipeline_example())
        .args(["--steps", &steps.to_string(), "--out"])
        .arg(&out_dir)
        .args(args));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_says(&out.stdout, &[&format!("pipeline: {steps} steps")], &out);
    let mut weights = BTreeMap::new();
    for entry in std::fs::read_dir(&out_dir).unwrap() {
        let path = entry.unwrap().path();
        for (key, values) in read_weights(&path) {
            assert!(
                weights.insert(key.clone(), values).is_none(),
                "{key} in two stages"
            );
        }
    }
    weights
}

#[test]
fn stages_and_replicas_end_with_the_weights_of_one_process_on_the_whole_batch() {
    let dir = scratch("pipeline");
    let one = train(&dir, "one", 1, 6, &["--stages", "1", "--batch", "16"]);
    assert_eq!(one.len(), 6, "3 layers, weight and bias: {:?}", one.keys());
    let runs = [
        (
            "gpipe-2x1",
            2,
            vec!["--stages", "2", "--batch", "16", "--schedule", "gpipe"],
        ),
        (
            "1f1b-2x1",
            2,
            vec!["--stages", "2", "--batch", "16", "--schedule", "1f1b"],
        ),
        ("1f1b-2x2", 4, vec!["--stages", "2", "--batch", "8"]),
        ("1f1b-3x1", 3, vec!["--stages", "3", "--batch", "16"]),
    ];
    for (name, nproc, args) in runs {
        let weights = train(&dir, name, nproc, 6, &args);
        let diff = max_abs_diff(&weights, &one);
        assert!(diff < 1e-5, "{name}: max |Δw| = {diff:e}");
    }
    let start = train(&dir, "untrained", 1, 0, &["--stages", "1", "--batch", "16"]);
    assert!(
        max_abs_diff(&start, &one) > 1e-3,
        "the steps moved the weights"
    );
}

#[test]
fn a_world_the_stages_do_not_divide_exits_2_naming_both() {
    let out = run(trainer()
        .args(["launch", "--nproc-per-node", "3", "--"])
        .arg(pipeline_example())
        .args(["--stages", "2", "--steps", "1", "--out"])
        .arg(scratch("pipeline-bad").join("out")));
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_says(
        &out.stderr,
        &["world size 3 is not a multiple of pipeline_stages = 2"],
        &out,
    );
}

// ---- The engine: `[distributed] pipeline_stages` with the text transformer ----

/// A text-transformer config (3 encoder layers, dropout 0) of `[optimizer]` `optimizer`:
/// 8 steps of a global batch of 32, as `batch_size` × `micro_batches` per replica and
/// `stages` pipeline stages (`stages = 1`: plain training).
fn transformer(
    dir: &Path,
    name: &str,
    optimizer: &str,
    (stages, schedule): (usize, &str),
    (batch_size, micro_batches): (usize, usize),
    extra_checkpoint: &str,
) -> PathBuf {
    let body = format!(
        r#"
[model]
name = "text_transformer"
layers = 3

[data]
samples = 256
validation_samples = 64
seed = 5

[optimizer]
{optimizer}

[training]
epochs = 1
batch_size = {batch_size}
accumulation_steps = {micro_batches}
seed = 42
log_every = 2

[distributed]
pipeline_stages = {stages}
pipeline_schedule = "{schedule}"
timeout_secs = 120

[checkpoint]
dir = "{{ckpt}}"
{extra_checkpoint}

[output]
dir = "{{out}}"
plots = false
"#
    );
    write_config(dir, name, &body)
}

/// The whole model's weights at the end of run `name`: its newest checkpoint, or the union of
/// its stages' newest checkpoints (each key on exactly one stage).
pub(crate) fn stage_weights(dir: &Path, name: &str, stages: usize) -> BTreeMap<String, Vec<f32>> {
    let root = dir.join(format!("{name}-ckpt"));
    if stages == 1 {
        return read_weights(&newest_checkpoint(&root).join("model.safetensors"));
    }
    let mut whole = BTreeMap::new();
    for stage in 0..stages {
        let stage_root = root.join(format!("pipeline-{stages}/stage-{stage}"));
        let part = read_weights(&newest_checkpoint(&stage_root).join("model.safetensors"));
        assert!(!part.is_empty(), "{name}: stage {stage} holds no parameter");
        for (key, values) in part {
            assert!(
                whole.insert(key.clone(), values).is_none(),
                "{name}: {key} on two stages"
            );
        }
    }
    whole
}

/// The last validation loss of the one-process run `name` (its metrics file).
fn final_validation_loss(dir: &Path, name: &str) -> f64 {
    let metrics = std::fs::read_to_string(dir.join(format!("{name}-out/metrics.jsonl"))).unwrap();
    let line = metrics
        .lines()
        .rfind(|l| l.contains(r#""kind":"valid""#))
        .unwrap_or_else(|| panic!("{name}: no validation record"));
    let value: serde_json::Value = serde_json::from_str(line).unwrap();
    value["metrics"]["Loss"].as_f64().unwrap()
}

/// The metrics of each record of `kind` (`train`, `valid`) of run `name` (its metrics file),
/// `None` where `null`.
fn records(dir: &Path, name: &str, kind: &str) -> Vec<BTreeMap<String, Option<f64>>> {
    let metrics = std::fs::read_to_string(dir.join(format!("{name}-out/metrics.jsonl"))).unwrap();
    let tag = format!(r#""kind":"{kind}""#);
    metrics
        .lines()
        .filter(|l| l.contains(&tag))
        .map(|line| {
            let value: serde_json::Value = serde_json::from_str(line).unwrap();
            let metrics = value["metrics"].as_object().unwrap();
            metrics
                .iter()
                .map(|(k, v)| (k.clone(), v.as_f64()))
                .collect()
        })
        .collect()
}

/// Run `name`'s records of `kind` report the metrics of run `one`'s (one process, the whole
/// model): the same names, losses within rounding, accuracies (in %, over 64 samples a
/// record) within one sample a near-tie could flip.
fn same_records(dir: &Path, name: &str, one: &str, kind: &str) {
    let (got, expected) = (records(dir, name, kind), records(dir, one, kind));
    assert!(!expected.is_empty(), "{one}: no {kind} record");
    assert_eq!(got.len(), expected.len(), "{name}: {kind} records");
    for (k, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(
            g.keys().collect::<Vec<_>>(),
            ["Accuracy", "Loss"],
            "{name}: the app's metrics in {kind} record {k}"
        );
        let tolerance = |metric: &str, b: f64| {
            if metric == "Accuracy" {
                100.0 / 64.0 + 1e-9
            } else {
                1e-5 * b.abs().max(1.0)
            }
        };
        for (metric, value) in e {
            let close = match (g[metric], *value) {
                (Some(a), Some(b)) => (a - b).abs() <= tolerance(metric, b),
                (a, b) => a.is_none() && b.is_none(),
            };
            assert!(
                close,
                "{name}: {kind} record {k}: {g:?}, one process: {e:?}"
            );
        }
    }
}

/// What `trainer eval` says of run `name`'s newest checkpoint (stages put together), from
/// "validation" on.
fn evaluated(dir: &Path, name: &str) -> String {
    let out = run(trainer()
        .arg("eval")
        .arg("--config")
        .arg(dir.join(format!("{name}.toml")))
        .arg("--checkpoint")
        .arg(dir.join(format!("{name}-ckpt"))));
    assert_eq!(out.code, Some(0), "{}", out.all());
    let line = out
        .stdout
        .lines()
        .find(|l| l.contains("validation"))
        .unwrap_or_default();
    line.split("validation")
        .nth(1)
        .unwrap_or_else(|| panic!("{}", out.all()))
        .to_string()
}

/// The validation loss of a pipeline run's closing line.
fn said_validation_loss(out: &Output) -> f64 {
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("pipeline:"))
        .unwrap_or_else(|| panic!("no closing line:\n{}", out.all()));
    let value = line
        .split("validation loss ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .unwrap_or_else(|| panic!("no validation loss in {line:?}"));
    value.trim().parse().unwrap()
}

#[test]
fn the_transformer_in_stages_trains_to_the_weights_of_one_process() {
    let dir = scratch("engine-pipeline");
    for (optimizer, tolerance) in [(SGD, 1e-5), (ADAM, 1e-4)] {
        let tag = if optimizer == SGD { "sgd" } else { "adam" };
        let one = format!("{tag}-one");
        crate::common::train(
            &transformer(&dir, &one, optimizer, (1, "gpipe"), (32, 1), ""),
            1,
        );
        let one_loss = final_validation_loss(&dir, &one);
        let one = stage_weights(&dir, &one, 1);
        assert_eq!(
            one.len(),
            2 + 3 * 16 + 2,
            "embeddings, 3 layers, head: {:?}",
            one.keys()
        );
        let runs = [
            ("gpipe-2x1", 2, (2, "gpipe"), (8, 4)),
            ("1f1b-2x1", 2, (2, "1f1b"), (8, 4)),
            ("1f1b-2x2", 4, (2, "1f1b"), (8, 2)),
            ("gpipe-2x2", 4, (2, "gpipe"), (8, 2)),
            ("gpipe-3x1", 3, (3, "gpipe"), (16, 2)),
        ];
        for (name, nproc, stages, batch) in runs {
            let name = format!("{tag}-{name}");
            let config = transformer(&dir, &name, optimizer, stages, batch, "");
            let out = crate::common::train(&config, nproc);
            assert_says(&out.stdout, &["8 steps, ", "peak RSS per rank"], &out);
            let diff = max_abs_diff(&stage_weights(&dir, &name, stages.0), &one);
            assert!(diff < tolerance, "{name}: max |Δw| = {diff:e}");
            let loss = said_validation_loss(&out);
            assert!(
                (loss - one_loss).abs() < 1e-5,
                "{name}: validation loss {loss} through the stages, {one_loss} in one process"
            );
            // The app's own metrics (loss and accuracy) on the last stage's outputs, over
            // every replica's samples: those of one process.
            same_records(&dir, &name, &format!("{tag}-one"), "train");
            same_records(&dir, &name, &format!("{tag}-one"), "valid");
            // `trainer eval` puts the stages' checkpoints together into the whole model.
            assert_eq!(
                evaluated(&dir, &name),
                evaluated(&dir, &format!("{tag}-one")),
                "{name}"
            );
        }
    }
}

#[test]
fn a_killed_middle_stage_resumes_from_the_stage_checkpoints_to_the_same_weights() {
    let dir = scratch("engine-pipeline-kill");
    let every = "every_steps = 2";
    let straight = transformer(&dir, "straight", ADAM, (3, "1f1b"), (16, 2), every);
    crate::common::train(&straight, 3);
    let killed = transformer(&dir, "killed", ADAM, (3, "1f1b"), (16, 2), every);
    let out = run(trainer()
        .arg("--config")
        .arg(&killed)
        .args(["--nproc-per-node", "3", "--max-restarts", "1"])
        .env("TRAINER_CRASH_AFTER_STEP", "5")
        .env("TRAINER_CRASH_RANK", "1"));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_says(
        &out.stderr,
        &[
            "rank 1 failed: killed by signal 9",
            "restarting every rank (1 of 1",
            "stage 0: resumed from",
            "step 4; saved with 1 replicas, now 1",
        ],
        &out,
    );
    let diff = max_abs_diff(
        &stage_weights(&dir, "killed", 3),
        &stage_weights(&dir, "straight", 3),
    );
    assert!(diff < 1e-6, "max |Δw| = {diff:e}");
}

/// Rewrites config `path` with `from` replaced by `to`.
fn edit_config(path: &Path, from: &str, to: &str) {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.contains(from), "no {from} in {text}");
    std::fs::write(path, text.replace(from, to)).unwrap();
}

/// Also: every rank logs its samples (`output.log_samples`), and the stage's replicas are
/// compared after every step (`training.check_replicas_every`).
#[test]
fn stage_checkpoints_resume_at_another_number_of_replicas() {
    let dir = scratch("engine-pipeline-replicas");
    let checked = |config: &Path| {
        edit_config(config, "plots = false", "plots = false\nlog_samples = true");
        edit_config(
            config,
            "log_every = 2",
            "log_every = 2\ncheck_replicas_every = 1",
        );
    };
    let first = transformer(&dir, "first", SGD, (2, "gpipe"), (8, 4), "");
    checked(&first);
    edit_config(&first, "log_every = 2", "log_every = 2\nmax_steps = 4");
    crate::common::train(&first, 2);
    let second = transformer(&dir, "first", SGD, (2, "gpipe"), (8, 2), "");
    checked(&second);
    let out = crate::common::train(&second, 4);
    assert_says(
        &out.stderr,
        &[
            "stage 0: resumed from",
            "step 4; saved with 1 replicas, now 2",
        ],
        &out,
    );
    assert_says(&out.stdout, &["2 stages × 2 replicas", "8 steps"], &out);
    // Rank 0's metrics file: both runs' starts, the app's metrics of the last stages,
    // validation.
    let metrics = std::fs::read_to_string(dir.join("first-out/metrics.jsonl")).unwrap();
    for needle in [
        r#""resumed_from":4"#,
        r#""kind":"train","epoch":0,"step":8"#,
        r#""world_size":4,"metrics":{"Accuracy":"#,
        r#""kind":"valid","epoch":0,"step":8,"samples":64"#,
    ] {
        assert!(metrics.contains(needle), "no {needle} in\n{metrics}");
    }
    // Ranks 0 and 1 are replica 0's stages in both runs (4 steps × 32, then 4 × 16 samples),
    // ranks 2 and 3 replica 1's in the second: the stages of a replica read the same samples,
    // and the two runs together read the epoch's 256 samples once each.
    let logged = |rank: usize| {
        let path = dir.join(format!("first-out/samples-rank{rank}.txt"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    assert_eq!(logged(0), logged(1), "replica 0's two stages");
    assert_eq!(logged(2), logged(3), "replica 1's two stages");
    let mut indices: Vec<usize> = logged(0)
        .lines()
        .chain(logged(2).lines())
        .map(|line| match line.split(' ').collect::<Vec<_>>()[..] {
            ["0", index, "0"] => index.parse().unwrap(),
            _ => panic!("not a sample of epoch 0 without padding: {line}"),
        })
        .collect();
    assert_eq!(indices.len(), 128 + 64 + 64);
    indices.sort_unstable();
    indices.dedup();
    assert_eq!(indices.len(), 256, "a sample read twice");
}

/// Runs `config` on `nproc` local ranks, expects exit code 2 and `says` on stderr.
fn refused(config: &Path, nproc: usize, says: &str) {
    let out = run(trainer()
        .arg("--config")
        .arg(config)
        .args(["--nproc-per-node", &nproc.to_string()]));
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_says(&out.stderr, &[says], &out);
}

#[test]
fn the_engine_refuses_stages_it_cannot_run_with_exit_2() {
    let dir = scratch("engine-pipeline-bad");
    // A world the stages do not divide: refused before any rank starts.
    let config = transformer(&dir, "odd", SGD, (2, "gpipe"), (8, 4), "");
    refused(
        &config,
        3,
        "pipeline_stages = 2 does not divide the world size 3",
    );
    // More stages than the model has layers.
    let config = transformer(&dir, "thin", SGD, (4, "gpipe"), (8, 4), "");
    refused(&config, 4, "model.layers: 3 encoder layers cannot be cut");
    // An app whose model does not split.
    let text = std::fs::read_to_string(&config).unwrap();
    let mlp = text
        .replace("name = \"text_transformer\"\nlayers = 3", "name = \"mlp\"")
        .replace(
            "samples = 256\nvalidation_samples = 64\nseed = 5",
            "source = \"digits\"",
        );
    let config = dir.join("mlp.toml");
    std::fs::write(&config, mlp).unwrap();
    refused(
        &config,
        4,
        "cannot be cut into stages (this program gives no StageSplit)",
    );
}

/// `trainer --config <config> --nproc-per-node 1 --nnodes 2 --node-rank <rank>` on loopback,
/// with the environment `env`.
fn node(config: &Path, rank: usize, port: u16, env: &[(&str, &str)]) -> Command {
    let mut cmd = trainer();
    // `trainer()` clears the launcher variables, the job token among them: both machines'
    // launchers must share one.
    cmd.env("BURN_DDP_TOKEN", format!("pipeline-nodes-{port}"));
    cmd.envs(env.iter().copied());
    cmd.arg("--config").arg(config).args([
        "--nproc-per-node",
        "1",
        "--nnodes",
        "2",
        "--node-rank",
        &rank.to_string(),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port.to_string(),
    ]);
    cmd
}

#[test]
fn ranks_started_with_other_stage_counts_fail_at_once_naming_both() {
    let dir = scratch("engine-pipeline-mismatch");
    let staged = transformer(&dir, "staged", SGD, (2, "gpipe"), (8, 4), "");
    let plain = transformer(&dir, "plain", SGD, (1, "gpipe"), (8, 4), "");
    let (nodes, _) =
        start_by_hand(|port| vec![node(&staged, 0, port, &[]), node(&plain, 1, port, &[])]);
    let outs: Vec<Output> = nodes.into_iter().map(Proc::finish).collect();
    let all = format!("{}\n{}", outs[0].all(), outs[1].all());
    assert!(outs.iter().all(|o| o.code != Some(0)), "{all}");
    assert!(
        all.contains("rank 1's config differs from rank 0's"),
        "the ranks must compare their settings first:\n{all}"
    );
}

#[test]
fn a_model_the_preflight_refuses_for_one_process_trains_in_two_stages_on_two_nodes() {
    let dir = scratch("engine-pipeline-memory");
    // 27 746 parameters with Adam: at least 20 bytes each on one rank (555 kB); a stage holds
    // about half. The pre-flight is told that 400 kB are available on each machine.
    let room = ("TRAINER_MEMORY_AVAILABLE", "400000");
    let whole = transformer(&dir, "whole", ADAM, (1, "gpipe"), (32, 1), "");
    let out = run(trainer().arg("--config").arg(&whole).env(room.0, room.1));
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_says(&out.stderr, &["the model does not fit in memory"], &out);
    // Two "machines" of one rank each (nodes 0 and 1 on loopback), one stage each.
    let staged = transformer(&dir, "staged", ADAM, (2, "1f1b"), (8, 4), "");
    let (nodes, _) = start_by_hand(|port| {
        vec![
            node(&staged, 0, port, &[room]),
            node(&staged, 1, port, &[room]),
        ]
    });
    let outs: Vec<Output> = nodes.into_iter().map(Proc::finish).collect();
    for (i, out) in outs.iter().enumerate() {
        assert_eq!(
            out.code,
            Some(0),
            "node {i}:\n{}\nthe other node:\n{}",
            out.all(),
            outs[1 - i].all()
        );
    }
    stage_weights(&dir, "staged", 2);
}

#[test]
fn torchrun_and_mpirun_start_pipeline_stages_like_the_trainers_launcher() {
    let dir = scratch("engine-pipeline-launchers");
    let config = |name: &str| transformer(&dir, name, ADAM, (2, "1f1b"), (8, 4), "");
    crate::common::train(&config("reference"), 2);
    let reference = stage_weights(&dir, "reference", 2);
    let mut launched = Vec::new();
    if let Some(torchrun) = crate::torchrun::torchrun_path() {
        let out = run(&mut crate::torchrun::torchrun(
            &torchrun,
            &[],
            &config("torchrun"),
        ));
        launched.push(("torchrun", out));
    }
    if let Some(mut mpirun) = crate::launchers::mpirun() {
        let out = run(mpirun
            .arg(env!("CARGO_BIN_EXE_trainer"))
            .arg("--config")
            .arg(config("mpirun")));
        launched.push(("mpirun", out));
    }
    for (name, out) in launched {
        assert_eq!(out.code, Some(0), "{name}:\n{}", out.all());
        let diff = max_abs_diff(&stage_weights(&dir, name, 2), &reference);
        assert!(diff < 1e-6, "{name}: max |Δw| = {diff:e}");
    }
}

#[test]
fn a_stage_one_checkpoint_ahead_goes_back_with_the_others() {
    let dir = scratch("engine-pipeline-ahead");
    let every = "every_steps = 2";
    crate::common::train(
        &transformer(&dir, "run", SGD, (2, "gpipe"), (8, 4), every),
        2,
    );
    // As if the job died between the two stages' writes of step 8.
    let stages = dir.join("run-ckpt/pipeline-2");
    std::fs::remove_dir_all(stages.join("stage-1/step-00000008")).unwrap();
    // Resumed with 2 replicas: stage 0's step 8 of the first run must not stand in for the
    // step 8 this run trains.
    let again = transformer(&dir, "run", SGD, (2, "gpipe"), (8, 2), every);
    let out = crate::common::train(&again, 4);
    assert_says(
        &out.stderr,
        &[
            "removed 1 checkpoint(s) after step 6",
            "step 6; saved with 1 replicas, now 2",
        ],
        &out,
    );
    for stage in 0..2 {
        let manifest = stages.join(format!("stage-{stage}/step-00000008/manifest.json"));
        let manifest: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
        assert_eq!(
            manifest["world_size"], 2,
            "stage {stage}'s step 8: {manifest}"
        );
    }
}

/// `training.on_nonfinite = "skip"` with a learning rate of 1e30: the first step blows the
/// weights up and later steps' gradients are not finite. Every rank skips those steps
/// together, and the pipeline skips exactly the steps one process training the whole model
/// skips, ending with its weights.
#[test]
fn on_nonfinite_skip_skips_the_steps_one_process_skips_on_every_stage() {
    let dir = scratch("engine-pipeline-skip");
    let diverging = "name = \"sgd\"\nlearning_rate = 1e30";
    let skipped = |name: &str, stages: (usize, &'static str), batch, nproc| {
        let config = transformer(&dir, name, diverging, stages, batch, "");
        edit_config(
            &config,
            "log_every = 2",
            "log_every = 2\non_nonfinite = \"skip\"",
        );
        let out = crate::common::train(&config, nproc);
        (skipped_steps(&out), out)
    };
    let (one, _) = skipped("one", (1, "gpipe"), (32, 1), 1);
    assert!(
        (1..8).contains(&one),
        "one process skipped {one} of 8 steps"
    );
    let (pipeline, out) = skipped("stages", (2, "1f1b"), (8, 4), 2);
    assert_eq!(
        pipeline, one,
        "steps skipped by the pipeline and by one process"
    );
    assert_says(&out.stderr, &["skipped on every rank"], &out);
    // The metrics of the skipped steps' forward passes count, as in one process (whose loss
    // is not finite there: `null`).
    assert_eq!(records(&dir, "stages", "train").len(), 4);
    same_records(&dir, "stages", "one", "train");
    // Differences relative to the largest weight, of the order of the learning rate (a weight
    // whose true gradient is 0, as the attention's key bias, holds rounding noise × 1e30).
    let stages = stage_weights(&dir, "stages", 2);
    let one = stage_weights(&dir, "one", 1);
    assert_eq!(stages.len(), one.len());
    let scale = one.values().flatten().fold(1.0f32, |m, w| m.max(w.abs()));
    for (key, values) in &one {
        for (a, b) in values.iter().zip(&stages[key]) {
            assert!(a.is_finite() && b.is_finite(), "{key}: {a} vs {b}");
            assert!(
                (a - b).abs() / scale < 1e-5,
                "{key}: {a} vs {b} (scale {scale:e})"
            );
        }
    }
}
