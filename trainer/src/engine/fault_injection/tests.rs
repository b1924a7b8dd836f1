//! The fault plan as the variables ask for it: each fault fires at its point, rank and
//! attempt only, and values that do not parse ask for nothing.

use std::collections::HashMap;

use burn_ddp::fault::JoinStage;

use super::{crash_point, FaultPlan};

fn plan(vars: &[(&str, &str)], attempt: u64) -> FaultPlan {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    FaultPlan::from_lookup(|name| vars.get(name).cloned(), attempt)
}

#[test]
fn no_variable_is_an_empty_plan() {
    assert_eq!(plan(&[], 0), FaultPlan::default());
    assert_eq!(plan(&[("RANK", "2")], 0).leaving_after(4), None);
}

#[test]
fn a_scripted_resize_names_its_step_and_ranks() {
    let resize = plan(&[("TRAINER_LEAVE_AFTER_STEP", "4:1+3")], 0);
    assert_eq!(resize.leaving_after(4), Some(&[1, 3][..]));
    assert_eq!(resize.leaving_after(5), None);
    let unreadable = plan(&[("TRAINER_LEAVE_AFTER_STEP", "4:x")], 0);
    assert_eq!(unreadable.leaving_after(4), None);
}

#[test]
fn the_crashes_in_a_step_and_while_joining_are_for_their_attempt_only() {
    let vars = [
        ("TRAINER_CRASH_IN_STEP", "5"),
        ("TRAINER_CRASH_RANK", "1+3"),
        ("TRAINER_CRASH_WHILE_JOINING", "admitted"),
        ("TRAINER_FREEZE_AFTER_STEP", "7:2"),
    ];
    let first = plan(&vars, 0);
    assert_eq!(first.crash_in_step, Some((5, Some(vec![1, 3]))));
    assert_eq!(first.freeze_after_step, Some((7, 2)));
    assert_eq!(
        first.crash_while_joining, None,
        "only the first restart joins"
    );
    let restarted = plan(&vars, 1);
    assert_eq!(restarted.crash_in_step, None);
    assert_eq!(restarted.freeze_after_step, None);
    assert_eq!(restarted.crash_while_joining, Some(JoinStage::Admitted));
}

#[test]
fn one_step_crashes_the_first_attempt_only() {
    assert_eq!(crash_point("15", None, 0), Some((15, None)));
    assert_eq!(crash_point("15", Some("1"), 0), Some((15, Some(1))));
    assert_eq!(crash_point("15", Some("1"), 1), None);
}

#[test]
fn lists_give_each_attempt_its_step_and_rank() {
    let (steps, ranks) = ("10, 25,40", Some("2,0,1"));
    assert_eq!(crash_point(steps, ranks, 0), Some((10, Some(2))));
    assert_eq!(crash_point(steps, ranks, 1), Some((25, Some(0))));
    assert_eq!(crash_point(steps, ranks, 2), Some((40, Some(1))));
    assert_eq!(
        crash_point(steps, ranks, 3),
        None,
        "the last attempt runs through"
    );
    assert_eq!(crash_point(steps, Some("1"), 2), Some((40, Some(1))));
    assert_eq!(
        crash_point(steps, Some("2,0"), 2),
        None,
        "no rank for attempt 2"
    );
    let attempt_one = plan(
        &[
            ("TRAINER_CRASH_AFTER_STEP", "10,25"),
            ("TRAINER_CRASH_RANK", "2,0"),
        ],
        1,
    );
    assert_eq!(
        attempt_one.crash_after_step,
        Some((25, Some(0), "10,25".to_string()))
    );
}

#[test]
fn values_that_do_not_parse_crash_nothing() {
    assert_eq!(crash_point("x", None, 0), None);
    assert_eq!(crash_point("10,x", None, 1), None);
    assert_eq!(crash_point("10", Some("r"), 0), None);
    let unreadable = plan(
        &[
            ("TRAINER_CRASH_IN_CHECKPOINT", "soon"),
            ("TRAINER_CRASH_WHILE_JOINING", "later"),
            ("TRAINER_FREEZE_AFTER_STEP", "7"),
            ("TRAINER_STALL_AFTER_STEP", "3:long"),
        ],
        0,
    );
    assert_eq!(unreadable, FaultPlan::default());
}
