//! The order of forward and backward passes on each pipeline stage (pure), and a simulation
//! of a whole pipeline that proves a schedule runs to the end and measures its bubble.
//!
//! Communication is implied by the actions: `Forward(i)` on a stage after the first first
//! receives micro-batch `i`'s activation from the previous stage, and on a stage before the
//! last ends by sending its output on; `Backward(i)` on a stage before the last first
//! receives the gradient of that output, and on a stage after the first ends by sending the
//! gradient of its input back. The transport buffers what it receives (sends never wait for
//! the receiver's program order), so only receives wait — the model [`simulate`] checks.
//!
//! Both schedules run the backward passes in micro-batch order, so each stage accumulates
//! its gradients in the same order under either: GPipe and 1F1B give the same weights.

/// How a stage orders its micro-batches' passes. With feature `serde`: `"gpipe"` or `"1f1b"`
/// (the trainer's `distributed.pipeline_schedule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum PipelineSchedule {
    /// GPipe: every micro-batch forward, then every one backward. Simple; each stage holds
    /// the activations of all `m` micro-batches at once.
    #[default]
    #[cfg_attr(feature = "serde", serde(rename = "gpipe"))]
    GPipe,
    /// One forward, one backward (PipeDream-flush, Megatron's default): after a warm-up of
    /// `stages − 1 − stage` forwards, forwards and backwards alternate. The same bubble as
    /// GPipe, but a stage holds at most `stages − stage` micro-batches' activations.
    #[cfg_attr(feature = "serde", serde(rename = "1f1b"))]
    OneForwardOneBackward,
}

/// One pass of one micro-batch on one stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Forward(usize),
    Backward(usize),
}

/// The passes stage `stage` of `stages` runs, in order, for one pipeline step of
/// `micro_batches` micro-batches. Every micro-batch appears once forward and once backward,
/// its forward first. `stage < stages` is the caller's contract (a [`super::PipelineLayout`]
/// position is).
pub fn stage_actions(
    schedule: PipelineSchedule,
    stages: usize,
    stage: usize,
    micro_batches: usize,
) -> Vec<Action> {
    let forwards = (0..micro_batches).map(Action::Forward);
    let backwards = (0..micro_batches).map(Action::Backward);
    match schedule {
        PipelineSchedule::GPipe => forwards.chain(backwards).collect(),
        PipelineSchedule::OneForwardOneBackward => {
            let warm_up = stages.saturating_sub(stage + 1).min(micro_batches);
            let mut actions: Vec<Action> = (0..warm_up).map(Action::Forward).collect();
            for i in 0..micro_batches - warm_up {
                actions.push(Action::Forward(warm_up + i));
                actions.push(Action::Backward(i));
            }
            actions.extend((micro_batches - warm_up..micro_batches).map(Action::Backward));
            actions
        }
    }
}

/// What a simulated pipeline step did.
#[derive(Debug, Clone, PartialEq)]
pub struct Simulation {
    /// Time from the first forward to the last backward, in the units of the costs.
    pub makespan: f64,
    /// The share of stage time spent waiting: `1 − busy / (stages × makespan)`.
    pub bubble: f64,
    /// Per stage, the most micro-batches whose activations it held at once (forward done,
    /// backward not yet).
    pub peak_in_flight: Vec<usize>,
}

/// A schedule that cannot finish: `stage` waits for `waiting_for`, which never comes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stage {stage} waits forever before {waiting_for:?}")]
pub struct Deadlock {
    pub stage: usize,
    pub waiting_for: Action,
}

/// Runs one pipeline step of `schedule` with `stages` stages and `micro_batches` micro-batches,
/// each forward taking `forward_cost` and each backward `backward_cost` on every stage, with
/// free, buffered transport. Pure: a proof that the plans of [`stage_actions`] fit together
/// (no stage waits forever) and the bubble they leave.
pub fn simulate(
    schedule: PipelineSchedule,
    stages: usize,
    micro_batches: usize,
    forward_cost: f64,
    backward_cost: f64,
) -> Result<Simulation, Deadlock> {
    let plans: Vec<Vec<Action>> = (0..stages)
        .map(|s| stage_actions(schedule, stages, s, micro_batches))
        .collect();
    run_plans(&plans, micro_batches, forward_cost, backward_cost)
}

/// [`simulate`] for any per-stage plans over `micro_batches` micro-batches.
fn run_plans(
    plans: &[Vec<Action>],
    micro_batches: usize,
    forward_cost: f64,
    backward_cost: f64,
) -> Result<Simulation, Deadlock> {
    let stages = plans.len();
    // Finish time of each pass, per stage and micro-batch.
    let mut forward_done = vec![vec![None::<f64>; micro_batches]; stages];
    let mut backward_done = vec![vec![None::<f64>; micro_batches]; stages];
    let mut next = vec![0usize; stages];
    let mut free_at = vec![0.0f64; stages];
    loop {
        let mut progressed = false;
        for s in 0..stages {
            while let Some(&action) = plans[s].get(next[s]) {
                // When the pass's input is there: the previous stage's activation, or the next
                // stage's gradient (and this stage's own forward).
                let ready = match action {
                    Action::Forward(i) if s > 0 => forward_done[s - 1][i],
                    Action::Forward(_) => Some(0.0),
                    Action::Backward(i) if s + 1 < stages => backward_done[s + 1][i]
                        .zip(forward_done[s][i])
                        .map(|(a, b)| a.max(b)),
                    Action::Backward(i) => forward_done[s][i],
                };
                let Some(ready) = ready else { break };
                let start = ready.max(free_at[s]);
                let (cost, done) = match action {
                    Action::Forward(i) => (forward_cost, &mut forward_done[s][i]),
                    Action::Backward(i) => (backward_cost, &mut backward_done[s][i]),
                };
                free_at[s] = start + cost;
                *done = Some(free_at[s]);
                next[s] += 1;
                progressed = true;
            }
        }
        if (0..stages).all(|s| next[s] == plans[s].len()) {
            break;
        }
        if !progressed {
            let stage = (0..stages)
                .find(|&s| next[s] < plans[s].len())
                .unwrap_or_default();
            return Err(Deadlock {
                stage,
                waiting_for: plans[stage][next[stage]],
            });
        }
    }
    let makespan = free_at.iter().copied().fold(0.0, f64::max);
    let busy = (stages * micro_batches) as f64 * (forward_cost + backward_cost);
    let bubble = if makespan > 0.0 {
        1.0 - busy / (stages as f64 * makespan)
    } else {
        0.0
    };
    Ok(Simulation {
        makespan,
        bubble,
        peak_in_flight: plans.iter().map(|plan| peak_in_flight(plan)).collect(),
    })
}

/// The most micro-batches a plan holds activations for at once.
fn peak_in_flight(plan: &[Action]) -> usize {
    let mut held = 0usize;
    let mut peak = 0;
    for action in plan {
        match action {
            Action::Forward(_) => held += 1,
            Action::Backward(_) => held = held.saturating_sub(1),
        }
        peak = peak.max(held);
    }
    peak
}

/// The bubble of a pipeline with uniform stages, in theory: `(P − 1) / (m + P − 1)`.
pub fn theoretical_bubble(stages: usize, micro_batches: usize) -> f64 {
    (stages as f64 - 1.0) / (micro_batches + stages - 1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use Action::{Backward as B, Forward as F};
    use PipelineSchedule::{GPipe, OneForwardOneBackward as OneF1B};

    #[test]
    fn one_f_one_b_warms_up_alternates_and_cools_down() {
        assert_eq!(
            stage_actions(OneF1B, 3, 0, 4),
            vec![F(0), F(1), F(2), B(0), F(3), B(1), B(2), B(3)]
        );
        assert_eq!(
            stage_actions(OneF1B, 3, 2, 4),
            vec![F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)]
        );
        // Fewer micro-batches than the warm-up wants: all forwards, then all backwards.
        assert_eq!(stage_actions(OneF1B, 4, 0, 2), vec![F(0), F(1), B(0), B(1)]);
        assert_eq!(stage_actions(GPipe, 2, 1, 2), vec![F(0), F(1), B(0), B(1)]);
    }

    #[test]
    fn every_micro_batch_runs_once_each_way_forward_first() {
        for schedule in [GPipe, OneF1B] {
            for stages in 1..6 {
                for m in 1..9 {
                    for s in 0..stages {
                        let plan = stage_actions(schedule, stages, s, m);
                        assert_eq!(plan.len(), 2 * m);
                        for i in 0..m {
                            let f = plan.iter().position(|a| *a == F(i));
                            let b = plan.iter().position(|a| *a == B(i));
                            assert!(
                                f.zip(b).is_some_and(|(f, b)| f < b),
                                "{schedule:?} {plan:?}"
                            );
                        }
                        // Backwards in micro-batch order: the same gradient sums under both.
                        let order: Vec<_> = plan.iter().filter(|a| matches!(a, B(_))).collect();
                        assert!(order.windows(2).all(|w| match (w[0], w[1]) {
                            (B(a), B(b)) => a < b,
                            _ => false,
                        }));
                    }
                }
            }
        }
    }

    #[test]
    fn both_schedules_finish_with_the_theoretical_bubble() {
        for schedule in [GPipe, OneF1B] {
            for stages in 1..6 {
                for m in 1..12 {
                    let sim = simulate(schedule, stages, m, 1.0, 2.0).unwrap();
                    let theory = theoretical_bubble(stages, m);
                    assert!(
                        (sim.bubble - theory).abs() < 1e-12,
                        "{schedule:?} P={stages} m={m}: {} vs {theory}",
                        sim.bubble
                    );
                    assert_eq!(sim.makespan, 3.0 * (m + stages - 1) as f64);
                }
            }
        }
    }

    #[test]
    fn one_f_one_b_holds_at_most_stages_minus_stage_micro_batches() {
        let (stages, m) = (4, 16);
        let gpipe = simulate(GPipe, stages, m, 1.0, 2.0).unwrap();
        let one_f1b = simulate(OneF1B, stages, m, 1.0, 2.0).unwrap();
        assert_eq!(gpipe.peak_in_flight, vec![m; stages]);
        assert_eq!(one_f1b.peak_in_flight, vec![4, 3, 2, 1]);
    }

    #[test]
    fn plans_that_wait_for_each_other_are_caught() {
        // The last stage puts a backward before its own forward: stage 0 waits for that
        // gradient, stage 1 for its forward, forever.
        let plans = vec![vec![F(0), B(0)], vec![B(0), F(0)]];
        let deadlock = run_plans(&plans, 1, 1.0, 1.0).unwrap_err();
        assert_eq!(
            deadlock,
            Deadlock {
                stage: 0,
                waiting_for: B(0)
            }
        );
        assert!(deadlock.to_string().contains("stage 0 waits forever"));
        let good = vec![vec![F(0), B(0)], vec![F(0), B(0)]];
        assert!(run_plans(&good, 1, 1.0, 1.0).is_ok());
    }
}
