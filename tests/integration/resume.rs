//! A restart is invisible: a run stopped (by `max_steps`, or by `kill -9` and restarted by the
//! launcher) and resumed at the **same** world size ends with the uninterrupted run's
//! checkpoint, byte for byte (weights, optimizer state, scheduler), and logs the same metrics —
//! whether or not the world size divides the data set (padding), from a mid-epoch checkpoint
//! and from one that leaves only the epoch's last, ragged batch, with and without ZeRO stage 1.
//! (Resuming at *another* world size is `training.rs`' and `reference_models.rs`' business:
//! every remaining sample once.)

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::*;
use crate::reference_models::{text_config, NOAM_ADAM};

/// The digits training split (`validation_fraction` 0.2 of 1,797).
const DIGITS_TRAIN: usize = 1438;
/// The transformer test data's training samples (`text_body`).
const TEXT_TRAIN: usize = 382;

/// One workload: its config at a world size and ZeRO stage, and the shape of its epochs.
struct Workload {
    name: &'static str,
    body: fn() -> String,
    train_len: usize,
    batch: usize,
    /// `training.accumulation_steps` and `training.drop_last` of the body.
    accumulation: usize,
    drop_last: bool,
    /// Steps between checkpoints (a multiple of the log interval).
    every_steps: usize,
    /// `training.log_every` of the body.
    log_every: usize,
}

fn digits_body() -> String {
    // Per-rank batch 7 leaves a ragged last batch at every world size tried here.
    digits_config(ADAM, 7, "").replace("epochs = 3", "epochs = 2")
}

fn text_body() -> String {
    // 382 samples: 2 ranks divide them, 3 and 4 pad.
    text_config(NOAM_ADAM, 5, "")
        .replace("epochs = 1", "epochs = 2")
        .replace("\nsamples = 384", "\nsamples = 382")
}

const DIGITS: Workload = Workload {
    name: "digits",
    body: digits_body,
    train_len: DIGITS_TRAIN,
    batch: 7,
    accumulation: 1,
    drop_last: false,
    every_steps: 10,
    log_every: 5,
};

fn digits_accumulated_body() -> String {
    digits_config(
        ADAM,
        7,
        "accumulation_steps = 2\ndrop_last = true\nshuffle = false",
    )
    .replace("epochs = 3", "epochs = 2")
}

/// Two micro-batches per optimizer step, the tail dropped, the data set's own order.
const DIGITS_ACCUMULATED: Workload = Workload {
    name: "digits-accumulated",
    body: digits_accumulated_body,
    train_len: DIGITS_TRAIN,
    batch: 7,
    accumulation: 2,
    drop_last: true,
    every_steps: 10,
    log_every: 5,
};

const TEXT: Workload = Workload {
    name: "text",
    body: text_body,
    train_len: TEXT_TRAIN,
    batch: 5,
    accumulation: 1,
    drop_last: false,
    every_steps: 4,
    log_every: 1,
};

impl Workload {
    /// Optimizer steps of one epoch at `world` ranks (the shard padded to a multiple of the
    /// world size, or cut with `drop_last`; the last step ragged).
    fn steps_per_epoch(&self, world: usize) -> usize {
        let shard = if self.drop_last {
            self.train_len / world
        } else {
            self.train_len.div_ceil(world)
        };
        shard.div_ceil(self.batch * self.accumulation)
    }

    fn config(
        &self,
        dir: &Path,
        run: &str,
        stage: u8,
        max_steps: Option<usize>,
    ) -> std::path::PathBuf {
        let mut body = (self.body)().replace(
            "every_epochs = 0",
            &format!(
                "every_epochs = 0\nevery_steps = {}\nkeep_last = 2",
                self.every_steps
            ),
        );
        if let Some(steps) = max_steps {
            body = body.replace("[training]", &format!("[training]\nmax_steps = {steps}"));
        }
        body.push_str(&format!("\n[distributed]\nzero_stage = {stage}\n"));
        write_config(dir, run, &body)
    }
}

/// Trains `workload` at `world` ranks three ways and compares the final checkpoints byte for
/// byte with the uninterrupted run's:
/// 1. stopped by `max_steps` one step before the end of epoch 0 (so the resumed run starts
///    with the ragged, padded last batch), then resumed;
/// 2. in the resumed run, rank `world - 1` killed with SIGKILL in the middle of epoch 1,
///    between two checkpoints, and restarted by the launcher (`--max-restarts 1`), which
///    resumes from the newest checkpoint and runs to the end.
fn assert_stop_and_kill_are_invisible(workload: &Workload, world: usize, stage: u8) {
    let dir = scratch(&format!("resume-{}-w{world}-z{stage}", workload.name));
    let straight = workload.config(&dir, "straight", stage, None);
    train(&straight, world);

    let per_epoch = workload.steps_per_epoch(world);
    let stop = per_epoch - 1;
    let mut kill = per_epoch + workload.every_steps + 1;
    if kill.is_multiple_of(workload.every_steps) {
        kill += 1; // between two checkpoints: the restart repeats a step
    }
    let stopped = workload.config(&dir, "resumed", stage, Some(stop));
    let out = train(&stopped, world);
    assert!(!out.stderr.contains("resumed from"), "{}", out.all());

    let resumed = workload.config(&dir, "resumed", stage, None);
    let victim = world - 1;
    let out = run(trainer()
        .arg("--config")
        .arg(&resumed)
        .args([
            "--nproc-per-node",
            &world.to_string(),
            "--max-restarts",
            "1",
        ])
        .env("TRAINER_CRASH_AFTER_STEP", kill.to_string())
        .env("TRAINER_CRASH_RANK", victim.to_string()));
    let context = format!("{} at world {world}, ZeRO stage {stage}", workload.name);
    assert_eq!(out.code, Some(0), "{context}:\n{}", out.all());
    assert_resumed_at_step(&out, stop);
    assert_says(
        &out.stderr,
        &[&format!("rank {victim} failed: killed by signal 9")],
        &out,
    );
    let newest_before_kill = kill / workload.every_steps * workload.every_steps;
    assert_resumed_at_step(&out, newest_before_kill);

    assert_same_checkpoints(&dir, "straight", "resumed", &context);
    // The train lines logged after each resume point (windows that start after it) and every
    // validation line are the uninterrupted run's.
    assert_same_metrics(
        &dir,
        ("straight", "resumed"),
        workload.log_every,
        &[stop, newest_before_kill],
        &context,
    );
}

/// The newest checkpoints of runs `a` and `b` are at the same position and hold the same
/// weights, bit for bit, and the same optimizer and scheduler records. (Not the same file
/// bytes: Burn writes the safetensors metadata and the optimizer's state tensors in hash
/// order.)
pub(crate) fn assert_same_checkpoints(dir: &Path, a: &str, b: &str, context: &str) {
    let (ckpt_a, ckpt_b) = (
        newest_checkpoint(&dir.join(format!("{a}-ckpt"))),
        newest_checkpoint(&dir.join(format!("{b}-ckpt"))),
    );
    assert_eq!(
        ckpt_a.file_name(),
        ckpt_b.file_name(),
        "{context}: both runs end at the same step"
    );
    let bits = |ckpt: &Path| -> BTreeMap<String, Vec<u32>> {
        read_weights(&ckpt.join("model.safetensors"))
            .into_iter()
            .map(|(name, values)| (name, values.iter().map(|v| v.to_bits()).collect()))
            .collect()
    };
    let (wa, wb) = (bits(&ckpt_a), bits(&ckpt_b));
    let diff = max_abs_diff(
        &read_weights(&ckpt_a.join("model.safetensors")),
        &read_weights(&ckpt_b.join("model.safetensors")),
    );
    assert!(
        wa == wb,
        "{context}: weights differ from the uninterrupted run's (max |Δw| = {diff:e})"
    );
    for file in ["optimizer.bpk", "scheduler.bpk"] {
        let (ra, rb) = (record(&ckpt_a.join(file)), record(&ckpt_b.join(file)));
        assert!(
            ra == rb,
            "{context}: {file} differs from the uninterrupted run's"
        );
    }
}

/// A burnpack record (Burn's `ModuleOptimizer` / `LrSchedulerRecord` bytes) in a canonical
/// form: its tensors sorted by name, each with its parameter id, dtype, shape and raw bytes,
/// then its scalars and metadata (sorted maps), so that two records with the same entries
/// compare equal whatever order they were written in (the optimizer's state is a hash map).
fn record(path: &Path) -> Vec<String> {
    let reader = burn_pack::Reader::from_file(path)
        .unwrap_or_else(|e| panic!("{}: not a burnpack file: {e}", path.display()));
    let scalars: Vec<String> = reader
        .scalars()
        .iter()
        .map(|(k, v)| format!("scalar {k} = {v:?}"))
        .collect();
    let metadata: Vec<String> = reader
        .metadata()
        .iter()
        .map(|(k, v)| format!("metadata {k} = {v}"))
        .collect();
    let mut tensors: Vec<String> = reader
        .into_tensors()
        .unwrap_or_else(|e| panic!("{}: unreadable tensors: {e}", path.display()))
        .into_iter()
        .map(|t| {
            let bytes = t
                .to_bytes()
                .unwrap_or_else(|e| panic!("{}: tensor {}: {e}", path.display(), t.name));
            format!(
                "tensor {} (param {:?}) {:?} {:?} {:?}",
                t.name,
                t.param_id,
                t.dtype,
                t.shape,
                &bytes[..]
            )
        })
        .collect();
    tensors.sort();
    tensors.into_iter().chain(scalars).chain(metadata).collect()
}

/// The run resumed from the checkpoint of optimizer step `step` (the rank's "resumed from"
/// line names it).
fn assert_resumed_at_step(out: &Output, step: usize) {
    let needle = format!("step {step}; saved with world size");
    assert!(
        out.stderr
            .lines()
            .any(|l| l.contains("resumed from") && l.contains(&needle)),
        "no resume at step {step}:\n{}",
        out.all()
    );
}

/// After the first of `resumed_at`, run `b` logged the validation lines and the train lines
/// of run `a` (metrics, learning rate, epoch), except train lines whose logging window (of
/// `log_every` steps) straddles a resume point: a resumed run logs the rest of that window.
/// For each step the last line counts, since a killed attempt's lines past its checkpoint are
/// logged again by the next one.
fn assert_same_metrics(
    dir: &Path,
    (a, b): (&str, &str),
    log_every: usize,
    resumed_at: &[usize],
    context: &str,
) {
    let lines = |run: &str| -> BTreeMap<(String, u64), serde_json::Value> {
        let text = std::fs::read_to_string(dir.join(format!("{run}-out/metrics.jsonl"))).unwrap();
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|r| r["kind"] == "train" || r["kind"] == "valid")
            .map(|r| {
                let key = (r["kind"].as_str().unwrap_or("").to_string(), r["step"].as_u64().unwrap_or(0));
                let value = serde_json::json!({"epoch": r["epoch"], "metrics": r["metrics"], "lr": r["lr"]});
                (key, value)
            })
            .collect()
    };
    let (la, lb) = (lines(a), lines(b));
    let mut compared = 0;
    for (key, value) in &lb {
        let (kind, step) = (key.0.as_str(), key.1 as usize);
        let straddles = resumed_at
            .iter()
            .any(|&r| step > r && step.saturating_sub(log_every) < r);
        if step <= resumed_at[0] || (kind == "train" && straddles) {
            continue;
        }
        assert_eq!(
            la.get(key),
            Some(value),
            "{context}: {kind} line of step {step}"
        );
        compared += 1;
    }
    assert!(compared >= 4, "{context}: only {compared} lines compared");
}

#[test]
fn digits_resumes_bit_for_bit_at_world_sizes_that_divide_the_data_and_that_do_not() {
    // 1,438 samples: 2 divides them; 3, 4, 5 and 7 pad the last positions.
    for world in [2, 3, 4, 5, 7] {
        assert_stop_and_kill_are_invisible(&DIGITS, world, 0);
    }
}

#[test]
fn digits_resumes_bit_for_bit_with_accumulation_drop_last_and_no_shuffle() {
    assert_stop_and_kill_are_invisible(&DIGITS_ACCUMULATED, 3, 0);
}

#[test]
fn digits_resumes_bit_for_bit_under_zero_stage_1() {
    for world in [2, 3, 4] {
        assert_stop_and_kill_are_invisible(&DIGITS, world, 1);
    }
}

#[test]
fn the_transformer_resumes_bit_for_bit() {
    for (world, stage) in [(2, 0), (3, 0), (4, 0), (2, 1), (3, 1), (4, 1)] {
        assert_stop_and_kill_are_invisible(&TEXT, world, stage);
    }
}

/// Three ranks, killed three times (a different rank each time, at steps between checkpoints),
/// restarted by the launcher each time: the same checkpoint as the run never killed.
#[test]
fn three_kills_of_three_ranks_leave_no_trace() {
    let dir = scratch("resume-three-kills");
    let straight = DIGITS.config(&dir, "straight", 0, None);
    train(&straight, 3);
    let killed = DIGITS.config(&dir, "killed", 0, None);
    // Steps and victims drawn once from a seeded generator, fixed here so a failure reruns.
    let out = run(trainer()
        .arg("--config")
        .arg(&killed)
        .args(["--nproc-per-node", "3", "--max-restarts", "3"])
        .env("TRAINER_CRASH_AFTER_STEP", "23,68,117")
        .env("TRAINER_CRASH_RANK", "2,0,1"));
    assert_eq!(out.code, Some(0), "{}", out.all());
    for (rank, resumed_at) in [(2, 20), (0, 60), (1, 110)] {
        assert_says(
            &out.stderr,
            &[&format!("rank {rank} failed: killed by signal 9")],
            &out,
        );
        assert_resumed_at_step(&out, resumed_at);
    }
    let context = "three kills at world 3";
    assert_same_checkpoints(&dir, "straight", "killed", context);
    assert_same_metrics(
        &dir,
        ("straight", "killed"),
        DIGITS.log_every,
        &[20, 60, 110],
        context,
    );
}
