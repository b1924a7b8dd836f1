//! A failure costs seconds, not the job (`[fault_tolerance] on_rank_failure = "continue"`):
//! when a rank is killed with SIGKILL, in the middle of a step or between two steps, the
//! other ranks drop the step in flight, re-form their group without it and train on, and end
//! with the weights, optimizer state and schedule of a run whose membership was scripted to
//! change at the same step boundary (`TRAINER_LEAVE_AFTER_STEP`: the rank leaves cleanly, no
//! failure), bit for bit. Started again by the launcher (`--max-restarts`), the killed rank
//! joins the others at a step boundary, taking rank 0's weights, optimizer state and position
//! over the collectives, and the run ends bit for bit where a scripted leave and a scripted
//! join at the same boundaries (`TRAINER_JOIN_AFTER_STEP`) end. Below
//! `fault_tolerance.min_world_size` the survivors stop with exit code 2, saying how many are
//! left.

use std::path::Path;

use crate::common::*;
use crate::reference_models::{text_config, NOAM_ADAM};
use crate::resume::assert_same_checkpoints;

/// How the victim dies.
#[derive(Clone, Copy, Debug)]
enum Kill {
    /// In the middle of step `n` (its gradients computed, not summed): the survivors drop
    /// step `n`, so the boundary is after step `n - 1`.
    MidStep(usize),
    /// Right after step `n`: the boundary is after step `n` (the survivors find it gone in
    /// step `n + 1`, which they drop).
    AfterStep(usize),
}

impl Kill {
    fn env(self) -> (&'static str, String) {
        match self {
            Self::MidStep(n) => ("TRAINER_CRASH_IN_STEP", n.to_string()),
            Self::AfterStep(n) => ("TRAINER_CRASH_AFTER_STEP", n.to_string()),
        }
    }

    fn boundary(self) -> usize {
        match self {
            Self::MidStep(n) => n - 1,
            Self::AfterStep(n) => n,
        }
    }
}

fn continuing(body: &str, extra: &str) -> String {
    format!("{body}\n[fault_tolerance]\non_rank_failure = \"continue\"\n{extra}")
}

/// Trains run `name` of `body` (written in `dir`) at `world` ranks with the fault-injection
/// variables `env`, and expects the job to succeed.
fn train_with(dir: &Path, name: &str, body: &str, world: usize, env: &[(&str, String)]) -> Output {
    train_restarting(dir, name, body, world, env, 0)
}

/// [`train_with`], with the launcher's `--max-restarts restarts`.
fn train_restarting(
    dir: &Path,
    name: &str,
    body: &str,
    world: usize,
    env: &[(&str, String)],
    restarts: usize,
) -> Output {
    let config = write_config(dir, name, body);
    let mut cmd = trainer();
    cmd.arg("--config")
        .arg(&config)
        .args(["--nproc-per-node", &world.to_string()])
        .args(["--max-restarts", &restarts.to_string()])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())));
    let out = run(&mut cmd);
    assert_eq!(out.code, Some(0), "{name} ({env:?}):\n{}", out.all());
    out
}

/// Trains run `scripted` of `body` with `leave` (`STEP:R[+R…]`) leaving as scripted, and
/// expects it to end where run `failed` ended, bit for bit.
fn assert_scripted_resize_ends_alike(
    dir: &Path,
    body: &str,
    world: usize,
    leave: &str,
    context: &str,
) {
    let leaving = [("TRAINER_LEAVE_AFTER_STEP", leave.to_string())];
    let out = train_with(dir, "scripted", body, world, &leaving);
    let (step, ranks) = leave.split_once(':').unwrap_or_default();
    for rank in ranks.split('+') {
        assert_says(
            &out.stderr,
            &[&format!("[rank {rank}] left the job after step {step}")],
            &out,
        );
    }
    assert_same_checkpoints(dir, "failed", "scripted", context);
}

/// Trains `body` at `world` ranks twice: rank `victim` killed as `kill` says, and the same
/// rank leaving at the same boundary as scripted; both succeed and end bit for bit alike, and
/// the failed run's metrics record the re-formed job.
fn assert_failure_equals_scripted_resize(
    name: &str,
    body: &str,
    world: usize,
    victim: usize,
    kill: Kill,
) {
    let dir = scratch(&format!("survivors-{name}"));
    let body = continuing(body, "");
    let context = format!("{name}: world {world}, rank {victim} killed {kill:?}");

    let (var, value) = kill.env();
    let killing = [(var, value), ("TRAINER_CRASH_RANK", victim.to_string())];
    let out = train_with(&dir, "failed", &body, world, &killing);
    assert_says(
        &out.stderr,
        &[
            &format!("rank {victim} failed: killed by signal 9"),
            "carry on without it",
        ],
        &out,
    );
    // Killed between steps, it is missed in the next step's gradient all-reduce: the
    // survivors drop that step either way.
    let dropped = 1;
    assert_says(
        &out.stdout,
        &[&format!(
            "the job re-formed 1 time without the ranks it lost ({dropped} step"
        )],
        &out,
    );
    let regroups = records(&dir.join("failed-out/metrics.jsonl"), "regroup");
    assert_eq!(regroups.len(), 1, "{context}: {regroups:?}");
    let r = &regroups[0];
    assert_eq!(
        (
            r["step"].as_u64(),
            r["world_size"].as_u64(),
            r["previous_world_size"].as_u64(),
            r["lost"].clone(),
            r["dropped_steps"].as_u64(),
        ),
        (
            Some(kill.boundary() as u64),
            Some(world as u64 - 1),
            Some(world as u64),
            serde_json::json!([victim]),
            Some(dropped as u64),
        ),
        "{context}: {r}"
    );

    let leave = format!("{}:{victim}", kill.boundary());
    assert_scripted_resize_ends_alike(&dir, &body, world, &leave, &context);
}

/// The records of `kind` in a `metrics.jsonl`.
fn records(path: &Path, kind: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|r| r["kind"] == kind)
        .collect()
}

fn digits(optimizer: &str) -> String {
    // 30 steps of 12 per rank: the job re-forms mid-epoch and finishes the epoch re-sharded.
    digits_config(optimizer, 12, "max_steps = 30").replace("epochs = 3", "epochs = 1")
}

#[test]
fn a_rank_killed_mid_step_leaves_the_others_where_a_scripted_resize_does() {
    assert_failure_equals_scripted_resize("digits-sgd-w3", &digits(SGD), 3, 1, Kill::MidStep(6));
    // Rank 0 (metrics, checkpoints) dies: the new group's rank 0 takes its files over.
    assert_failure_equals_scripted_resize("digits-adam-w4", &digits(ADAM), 4, 0, Kill::MidStep(9));
}

#[test]
fn a_rank_killed_between_steps_leaves_the_others_where_a_scripted_resize_does() {
    assert_failure_equals_scripted_resize(
        "digits-adam-w3",
        &digits(ADAM),
        3,
        2,
        Kill::AfterStep(7),
    );
    assert_failure_equals_scripted_resize("digits-sgd-w4", &digits(SGD), 4, 3, Kill::AfterStep(4));
}

/// A rank that freezes (SIGSTOP, never resumed: a hung driver, a machine that stopped
/// answering) right after step 5 is left out as a dead one is, and its launcher ends it once
/// the survivors decided (fencing): the survivors finish, the job exits 0 instead of waiting
/// for the frozen process forever, and the run ends where a scripted leave at that boundary
/// ends, bit for bit.
#[test]
fn a_frozen_rank_is_left_out_and_ended_so_that_the_job_finishes() {
    let dir = scratch("survivors-frozen");
    let body = continuing(&digits(SGD), "");
    let freezing = [("TRAINER_FREEZE_AFTER_STEP", "5:1".to_string())];
    let out = train_with(&dir, "failed", &body, 3, &freezing);
    assert_says(
        &out.stderr,
        &[
            "[rank 1] TRAINER_FREEZE_AFTER_STEP=5:1: stopping this process (SIGSTOP)",
            "the job left rank 1 out (the survivors of step 5 carry on without it",
            "rank 1 ended, left out by the job: killed by signal 9",
        ],
        &out,
    );
    let regroups = records(&dir.join("failed-out/metrics.jsonl"), "regroup");
    let changes: Vec<_> = regroups
        .iter()
        .map(|r| {
            (
                r["step"].as_u64(),
                r["world_size"].as_u64(),
                r["lost"].clone(),
            )
        })
        .collect();
    assert_eq!(
        changes,
        vec![(Some(5), Some(2), serde_json::json!([1]))],
        "{}",
        out.all()
    );
    assert_scripted_resize_ends_alike(&dir, &body, 3, "5:1", "rank 1 frozen after step 5");
}

#[test]
fn the_transformer_survives_a_rank_killed_mid_step_as_a_scripted_resize_does() {
    let body = text_config(NOAM_ADAM, 5, "max_steps = 12");
    assert_failure_equals_scripted_resize("text-adam-w3", &body, 3, 1, Kill::MidStep(5));
}

/// Ranks 1 and 2 of 4 killed in the same step: the two left re-form once, without both, and
/// end where a scripted resize without both ends.
#[test]
fn two_ranks_killed_at_once_leave_the_other_two_where_a_scripted_resize_does() {
    let dir = scratch("survivors-two-at-once");
    let body = continuing(&digits(ADAM), "");
    let killing = [
        ("TRAINER_CRASH_IN_STEP", "6".to_string()),
        ("TRAINER_CRASH_RANK", "1+2".to_string()),
    ];
    let out = train_with(&dir, "failed", &body, 4, &killing);
    let regroups = records(&dir.join("failed-out/metrics.jsonl"), "regroup");
    assert_eq!(
        regroups
            .iter()
            .map(|r| (r["lost"].clone(), r["world_size"].as_u64()))
            .collect::<Vec<_>>(),
        vec![(serde_json::json!([1, 2]), Some(2))],
        "{}",
        out.all()
    );
    assert_scripted_resize_ends_alike(&dir, &body, 4, "5:1+2", "ranks 1 and 2 killed in step 6");
}

/// Rank 3 of 4 killed in step 6, then rank 1 killed as the survivors form their next group
/// (after they agreed that it carries on): ranks 0 and 2 notice its silence within the
/// detection time, agree again among the ranks of the group that could not form, and carry
/// on as one re-forming without both, ending where a scripted resize without ranks 1 and 3
/// ends.
#[test]
fn a_rank_killed_while_the_survivors_re_form_is_left_out_too() {
    let dir = scratch("survivors-while-re-forming");
    let body = continuing(&digits(ADAM), "");
    let killing = [
        ("TRAINER_CRASH_IN_STEP", "6".to_string()),
        ("TRAINER_CRASH_RANK", "3".to_string()),
        ("TRAINER_CRASH_WHILE_REGROUPING", "1".to_string()),
    ];
    let out = train_with(&dir, "failed", &body, 4, &killing);
    assert_says(
        &out.stderr,
        &[
            "killing this process while the survivors re-form",
            "stopped beating",
            "they agree again",
        ],
        &out,
    );
    let regroups = records(&dir.join("failed-out/metrics.jsonl"), "regroup");
    assert_eq!(
        regroups
            .iter()
            .map(|r| (r["lost"].clone(), r["world_size"].as_u64()))
            .collect::<Vec<_>>(),
        vec![(serde_json::json!([1, 3]), Some(2))],
        "{}",
        out.all()
    );
    assert_scripted_resize_ends_alike(&dir, &body, 4, "5:1+3", "rank 1 killed while re-forming");
}

/// Rank 0 killed while it writes the checkpoint of step 10 (its weights written, the
/// checkpoint not complete): the others know within the detection time (rank 0's heartbeat
/// stops), re-form without it, and the new rank 0 writes the later checkpoints; no damaged
/// checkpoint is taken for a good one, and the run ends where rank 0 leaving after step 10 as
/// scripted ends.
#[test]
fn rank_0_killed_while_writing_a_checkpoint_leaves_the_others_training() {
    let dir = scratch("survivors-in-checkpoint");
    let body = continuing(&digits(SGD), "")
        .replace("every_epochs = 0", "every_epochs = 0\nevery_steps = 10");
    let killing = [("TRAINER_CRASH_IN_CHECKPOINT", "10".to_string())];
    let out = train_with(&dir, "failed", &body, 3, &killing);
    assert_says(&out.stderr, &["rank 0 stopped during"], &out);
    let regroups = records(&dir.join("failed-out/metrics.jsonl"), "regroup");
    assert_eq!(
        regroups
            .iter()
            .map(|r| (
                r["step"].as_u64(),
                r["lost"].clone(),
                r["dropped_steps"].as_u64()
            ))
            .collect::<Vec<_>>(),
        vec![(Some(10), serde_json::json!([0]), Some(0))],
        "{}",
        out.all()
    );
    assert!(
        newest_checkpoint(&dir.join("failed-ckpt")).ends_with("step-00000030"),
        "{}",
        out.all()
    );
    assert_scripted_resize_ends_alike(
        &dir,
        &body,
        3,
        "10:0",
        "rank 0 killed in a checkpoint write",
    );
}

/// When the job admits the restarted rank.
#[derive(Clone, Copy, Debug)]
enum Join {
    /// After step `n`, every rank waiting there for it (`TRAINER_JOIN_AFTER_STEP`).
    After(usize),
    /// As soon as it asks: after the step after the boundary where rank 0 sees its request.
    WhenItAsks,
}

/// Trains `body` at `world` ranks twice: rank `victim` killed as `kill` says and started again
/// by the launcher to join as `join` says; then the same rank leaving at the same boundary
/// and joining again at the same step, as scripted. Both end bit for bit alike, and the
/// failed run's metrics record the lost rank and the joined one. With `dies_joining`
/// (`TRAINER_CRASH_WHILE_JOINING`'s stage) the first restart dies on its way in: the members
/// carry on without it (one more re-formed job in the metrics, which changes nothing else)
/// and the second restart joins.
fn assert_failure_and_rejoin_equal_scripted_resize(
    name: &str,
    body: &str,
    world: usize,
    victim: usize,
    kill: Kill,
    join: Join,
    dies_joining: Option<&str>,
) {
    let dir = scratch(&format!("rejoin-{name}"));
    // Every step's replicas compared: a joiner that took anything else than rank 0's state
    // (its optimizer's, say) drifts from the others at its first step.
    let body = continuing(body, "").replace("[training]", "[training]\ncheck_replicas_every = 1");
    let context = format!("{name}: world {world}, rank {victim} killed {kill:?}, joining {join:?}");

    let (var, value) = kill.env();
    let mut env = vec![(var, value), ("TRAINER_CRASH_RANK", victim.to_string())];
    if let Join::After(step) = join {
        env.push(("TRAINER_JOIN_AFTER_STEP", step.to_string()));
    }
    let restarts = 1 + usize::from(dies_joining.is_some());
    if let Some(stage) = dies_joining {
        env.push(("TRAINER_CRASH_WHILE_JOINING", stage.to_string()));
    }
    let out = train_restarting(&dir, "failed", &body, world, &env, restarts);
    assert_says(
        &out.stderr,
        &[
            &format!("rank {victim} failed: killed by signal 9"),
            &format!("started rank {victim} again to join the others ({restarts} of {restarts} restarts)"),
        ],
        &out,
    );
    assert_says(&out.stdout, &["; ranks joined it 1 time ("], &out);
    let regroups = records(&dir.join("failed-out/metrics.jsonl"), "regroup");
    let changes: Vec<_> = regroups
        .iter()
        .map(|r| {
            (
                r["step"].as_u64().unwrap_or(0) as usize,
                r["world_size"].as_u64(),
                r["lost"].clone(),
                r["joined"].clone(),
            )
        })
        .collect();
    let joined_at = changes.last().map_or(0, |c| c.0);
    if let Join::After(step) = join {
        assert_eq!(joined_at, step, "{context}: {changes:?}");
    }
    let mut expected = vec![(
        kill.boundary(),
        Some(world as u64 - 1),
        serde_json::json!([victim]),
        serde_json::json!([]),
    )];
    if let Some(stage) = dies_joining {
        // Found dead by its silence, not by the set-up's deadline.
        let why = match stage {
            "asked" => "stopped beating",
            _ => "re-form the job",
        };
        assert_says(&out.stderr, &[why], &out);
        // Lost with the rank it was to take in the grown job; the next restart may have
        // asked in time to be planned with it, and is then given up on with it (it asks
        // again).
        let (given_up_at, lost) = changes
            .get(1)
            .map_or((0, serde_json::json!([])), |c| (c.0, c.2.clone()));
        assert!(given_up_at > kill.boundary(), "{context}: {changes:?}");
        let two_joiners = serde_json::json!([world - 1, world]);
        if lost == two_joiners {
            assert_says(&out.stderr, &["asking again"], &out);
        }
        expected.push((
            given_up_at,
            Some(world as u64 - 1),
            match lost == two_joiners {
                true => two_joiners,
                false => serde_json::json!([world - 1]),
            },
            serde_json::json!([]),
        ));
    }
    expected.push((
        joined_at,
        Some(world as u64),
        serde_json::json!([]),
        serde_json::json!([world - 1]),
    ));
    assert_eq!(changes, expected, "{context}: {}", out.all());
    assert!(joined_at > kill.boundary(), "{context}: {changes:?}");

    let scripted = [
        (
            "TRAINER_LEAVE_AFTER_STEP",
            format!("{}:{victim}", kill.boundary()),
        ),
        ("TRAINER_JOIN_AFTER_STEP", joined_at.to_string()),
    ];
    let out = train_with(&dir, "scripted", &body, world, &scripted);
    assert_says(
        &out.stderr,
        &[&format!(
            "[rank {victim}] left the job after step {}",
            kill.boundary()
        )],
        &out,
    );
    assert_says(&out.stdout, &["; ranks joined it 1 time ("], &out);
    assert_same_checkpoints(&dir, "failed", "scripted", &context);
}

#[test]
fn a_rank_killed_and_started_again_joins_where_a_scripted_leave_and_join_do() {
    assert_failure_and_rejoin_equal_scripted_resize(
        "digits-sgd-w3",
        &digits(SGD),
        3,
        1,
        Kill::MidStep(6),
        Join::After(12),
        None,
    );
    // Rank 0 dies: it joins again as the last rank of the grown job.
    assert_failure_and_rejoin_equal_scripted_resize(
        "digits-adam-w4",
        &digits(ADAM),
        4,
        0,
        Kill::MidStep(9),
        Join::After(15),
        None,
    );
    assert_failure_and_rejoin_equal_scripted_resize(
        "digits-adam-w3-between",
        &digits(ADAM),
        3,
        2,
        Kill::AfterStep(7),
        Join::After(14),
        None,
    );
}

/// Without the scripted join the restarted rank is admitted as soon as it asks (the run is
/// long enough for it to start: 240 steps), and the run still ends where a scripted leave and
/// join at the steps it recorded end.
#[test]
fn a_restarted_rank_joins_as_soon_as_it_asks() {
    let body = digits_config(SGD, 4, "max_steps = 240").replace("epochs = 3", "epochs = 2");
    assert_failure_and_rejoin_equal_scripted_resize(
        "digits-sgd-w3-asks",
        &body,
        3,
        2,
        Kill::MidStep(5),
        Join::WhenItAsks,
        None,
    );
}

/// The restarted rank dies on its way in: after it asked (the members form the grown group
/// with a dead process and give up on it once its heartbeat has been silent for the failure
/// detection time, which they say, not at the set-up's deadline) or once in the grown group (the
/// hand-over fails on the members, who carry on as after any failure). Either way the
/// members go on where they stood and the launcher's next restart joins; the run ends where
/// a scripted leave and join end.
#[test]
fn a_rank_killed_while_it_joins_is_given_up_on_and_the_next_restart_joins() {
    let body = digits_config(SGD, 4, "max_steps = 240").replace("epochs = 3", "epochs = 2");
    for stage in ["asked", "admitted"] {
        assert_failure_and_rejoin_equal_scripted_resize(
            &format!("digits-sgd-w3-dies-{stage}"),
            &body,
            3,
            2,
            Kill::MidStep(5),
            Join::WhenItAsks,
            Some(stage),
        );
    }
}

/// Rank 3 of 4 killed in step 5 and started again by the launcher; rank 1 killed as the
/// members are about to admit it (before it forms the grown group with them): the others find
/// rank 1 silent within the detection time, not at the set-up's deadline, and carry on
/// without both; the launcher's restarts of both join later (at one step boundary or at
/// two), every step's replicas equal, and the run ends at 4 ranks.
#[test]
fn a_member_killed_while_a_joiner_is_admitted_is_left_out_and_both_join_again() {
    let dir = scratch("survivors-while-admitting");
    let body = digits_config(SGD, 4, "max_steps = 240").replace("epochs = 3", "epochs = 2");
    let body = continuing(&body, "").replace("[training]", "[training]\ncheck_replicas_every = 1");
    let env = [
        ("TRAINER_CRASH_IN_STEP", "5".to_string()),
        ("TRAINER_CRASH_RANK", "3".to_string()),
        ("TRAINER_CRASH_WHILE_ADMITTING", "1".to_string()),
    ];
    let out = train_restarting(&dir, "failed", &body, 4, &env, 2);
    assert_says(
        &out.stderr,
        &[
            "killing this process while the members admit joiners",
            "of the current group stopped beating",
        ],
        &out,
    );
    let changes: Vec<_> = records(&dir.join("failed-out/metrics.jsonl"), "regroup")
        .iter()
        .map(|r| {
            (
                r["world_size"].as_u64(),
                r["lost"].clone(),
                r["joined"].clone(),
            )
        })
        .collect();
    let json = |ranks: &[usize]| serde_json::json!(ranks);
    // Lost: rank 3; then rank 1 with the joiner it was to admit (rank 3 of the grown job).
    assert_eq!(
        changes.get(..2),
        Some(
            &[
                (Some(3), json(&[3]), json(&[])),
                (Some(2), json(&[1, 3]), json(&[]))
            ][..]
        ),
        "{}",
        out.all()
    );
    let joins = changes.get(2..).unwrap_or_default();
    let mut joined: Vec<u64> = joins
        .iter()
        .filter_map(|(_, _, j)| j.as_array())
        .flatten()
        .filter_map(serde_json::Value::as_u64)
        .collect();
    joined.sort_unstable();
    assert!(
        joins.iter().all(|(_, lost, _)| *lost == json(&[])),
        "{changes:?}"
    );
    assert_eq!(joined, vec![2, 3], "{changes:?}\n{}", out.all());
    assert_eq!(joins.last().map(|c| c.0), Some(Some(4)), "{changes:?}");
}

#[test]
fn the_transformer_rejoins_as_a_scripted_leave_and_join_do() {
    let body = text_config(NOAM_ADAM, 5, "max_steps = 12");
    assert_failure_and_rejoin_equal_scripted_resize(
        "text-adam-w3",
        &body,
        3,
        1,
        Kill::MidStep(5),
        Join::After(8),
        None,
    );
}

#[test]
fn fewer_ranks_than_min_world_size_stop_with_exit_code_2_and_the_numbers() {
    let dir = scratch("survivors-min-world");
    let body = continuing(&digits(SGD), "min_world_size = 3");
    let config = write_config(&dir, "run", &body);
    let out = run(trainer()
        .arg("--config")
        .arg(&config)
        .args(["--nproc-per-node", "3"])
        .env("TRAINER_CRASH_IN_STEP", "4")
        .env("TRAINER_CRASH_RANK", "2"));
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_says(
        &out.stderr,
        &[
            "only 2 of 3 ranks are left after step 3",
            "fewer than fault_tolerance.min_world_size = 3",
        ],
        &out,
    );
}
