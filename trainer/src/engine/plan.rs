//! The step plan: which optimizer steps, epochs, logs, checkpoints and validations a run
//! makes. Pure arithmetic on the configuration and the sampler's shard sizes, so it is the same
//! on every rank and unit-tested here; the loop (`fit`) only follows it.

use crate::engine::checkpoint::TrainPosition;

/// What the plan needs to know about the configuration and the data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanInput {
    /// Training samples in the data set (global).
    pub train_len: usize,
    /// Ranks in the job.
    pub world_size: usize,
    /// Samples per rank per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
    pub accumulation_steps: usize,
    /// Epochs to train in total.
    pub epochs: usize,
    /// Stop after this many optimizer steps in total, if set.
    pub max_steps: Option<usize>,
    /// Log (and sum metrics across ranks) every this many steps.
    pub log_every: usize,
    /// Checkpoint every this many steps (0: never by step count).
    pub checkpoint_every_steps: usize,
    /// Checkpoint at the end of every this many epochs (0: never at epoch ends).
    pub checkpoint_every_epochs: usize,
    /// Compare replicas every this many steps (0: never).
    pub check_replicas_every: usize,
}

/// The plan of a run from a given position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepPlan {
    input: PlanInput,
    /// Samples per rank per optimizer step.
    pub per_step: usize,
    /// The step at which the run ends (counted from the start of the run, not of this attempt).
    pub total_steps: usize,
}

impl StepPlan {
    /// The plan for a run at `position`, where this rank's shard of a full epoch has
    /// `full_epoch_shard` samples and the rest of the current epoch `rest_of_epoch_shard`
    /// (after a resume with another world size the rest of the epoch is re-sharded, so it can
    /// take another number of steps than it would have).
    pub fn new(
        input: PlanInput,
        position: TrainPosition,
        full_epoch_shard: usize,
        rest_of_epoch_shard: usize,
    ) -> Self {
        let per_step = input.batch_size.max(1) * input.accumulation_steps.max(1);
        let steps_per_epoch = full_epoch_shard.div_ceil(per_step);
        let rest = rest_of_epoch_shard.div_ceil(per_step);
        let planned = if position.epoch < input.epochs {
            position.step + rest + (input.epochs - position.epoch - 1) * steps_per_epoch
        } else {
            position.step
        };
        Self {
            input,
            per_step,
            total_steps: input.max_steps.unwrap_or(usize::MAX).min(planned),
        }
    }

    /// The position after the `k`-th (0-based) optimizer step of an epoch that started at
    /// `epoch_start` consumed samples, from `before` (the position before that step).
    pub fn after_step(&self, before: TrainPosition, epoch_start: usize, k: usize) -> TrainPosition {
        let consumed = (epoch_start + (k + 1) * self.per_step * self.input.world_size)
            .min(self.input.train_len);
        TrainPosition {
            epoch: before.epoch,
            consumed,
            step: before.step + 1,
        }
    }

    /// Whether the epoch of `position` is complete (every sample of its order consumed), or
    /// the shard had nothing left to give.
    pub fn epoch_complete(&self, position: TrainPosition, shard_was_empty: bool) -> bool {
        position.consumed >= self.input.train_len || shard_was_empty
    }

    /// Whether to log after `step` (the last step always logs).
    pub fn log_after(&self, step: usize) -> bool {
        step.is_multiple_of(self.input.log_every.max(1)) || step == self.total_steps
    }

    /// Whether to checkpoint after `step` by the step count.
    pub fn checkpoint_after_step(&self, step: usize) -> bool {
        let every = self.input.checkpoint_every_steps;
        every > 0 && step.is_multiple_of(every)
    }

    /// Whether to checkpoint after the epoch that leaves `completed_epochs` epochs done.
    pub fn checkpoint_after_epoch(&self, completed_epochs: usize) -> bool {
        let every = self.input.checkpoint_every_epochs;
        every > 0 && completed_epochs.is_multiple_of(every)
    }

    /// Whether to compare replicas after `step`.
    pub fn check_replicas_after(&self, step: usize) -> bool {
        let every = self.input.check_replicas_every;
        every > 0 && step.is_multiple_of(every)
    }

    /// Whether the run has more to do from `position`.
    pub fn more_after(&self, position: TrainPosition) -> bool {
        position.epoch < self.input.epochs && position.step < self.total_steps
    }

    /// The micro-batches of one optimizer step's samples, and each one's share of the step
    /// (its weight in the step's mean gradient: its samples over the step's samples).
    pub fn micro_batches<'a, T>(&self, step_samples: &'a [T]) -> Vec<(&'a [T], f32)> {
        let total = step_samples.len().max(1) as f32;
        step_samples
            .chunks(self.input.batch_size.max(1))
            .map(|micro| (micro, micro.len() as f32 / total))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input() -> PlanInput {
        PlanInput {
            train_len: 100,
            world_size: 2,
            batch_size: 8,
            accumulation_steps: 2,
            epochs: 3,
            max_steps: None,
            log_every: 10,
            checkpoint_every_steps: 0,
            checkpoint_every_epochs: 1,
            check_replicas_every: 0,
        }
    }

    #[test]
    fn steps_from_the_start() {
        // 50 samples per rank, 16 per step: 4 steps per epoch (the last one short).
        let plan = StepPlan::new(input(), TrainPosition::default(), 50, 50);
        assert_eq!(plan.per_step, 16);
        assert_eq!(plan.total_steps, 12);
        let capped = StepPlan::new(
            PlanInput {
                max_steps: Some(5),
                ..input()
            },
            TrainPosition::default(),
            50,
            50,
        );
        assert_eq!(capped.total_steps, 5);
    }

    #[test]
    fn resumed_mid_epoch_with_another_world_size() {
        // Step 2 of epoch 1 at world 2 consumed 64 samples; at world 1 the rest of the epoch
        // (36 samples) takes 3 steps, then one full epoch of 100 samples takes 7.
        let position = TrainPosition {
            epoch: 1,
            consumed: 64,
            step: 6,
        };
        let plan = StepPlan::new(
            PlanInput {
                world_size: 1,
                ..input()
            },
            position,
            100,
            36,
        );
        assert_eq!(plan.total_steps, 6 + 3 + 7);
        assert!(plan.more_after(position));
    }

    #[test]
    fn positions_advance_by_the_global_batch_and_stop_at_the_epoch_end() {
        let plan = StepPlan::new(input(), TrainPosition::default(), 50, 50);
        let start = TrainPosition::default();
        let p = plan.after_step(start, 0, 0);
        assert_eq!((p.consumed, p.step), (32, 1));
        let p = plan.after_step(p, 0, 3);
        assert_eq!((p.consumed, p.step), (100, 2));
        assert!(plan.epoch_complete(p, false));
        assert!(!plan.epoch_complete(plan.after_step(start, 0, 1), false));
        assert!(plan.epoch_complete(start, true));
    }

    #[test]
    fn logs_checkpoints_and_replica_checks() {
        let plan = StepPlan::new(
            PlanInput {
                checkpoint_every_steps: 4,
                checkpoint_every_epochs: 2,
                check_replicas_every: 3,
                ..input()
            },
            TrainPosition::default(),
            50,
            50,
        );
        assert!(plan.log_after(10) && plan.log_after(12) && !plan.log_after(11));
        assert!(plan.checkpoint_after_step(8) && !plan.checkpoint_after_step(6));
        assert!(plan.checkpoint_after_epoch(2) && !plan.checkpoint_after_epoch(1));
        assert!(plan.check_replicas_after(9) && !plan.check_replicas_after(10));
        let never = StepPlan::new(
            PlanInput {
                checkpoint_every_epochs: 0,
                ..input()
            },
            TrainPosition::default(),
            50,
            50,
        );
        assert!(!never.checkpoint_after_epoch(1) && !never.checkpoint_after_step(4));
    }

    #[test]
    fn micro_batches_weigh_by_their_samples() {
        let plan = StepPlan::new(input(), TrainPosition::default(), 50, 50);
        let samples: Vec<usize> = (0..12).collect();
        let micro = plan.micro_batches(&samples);
        assert_eq!(micro.len(), 2);
        assert_eq!(micro[0].0.len(), 8);
        assert!((micro[0].1 - 8.0 / 12.0).abs() < 1e-6);
        assert!((micro[1].1 - 4.0 / 12.0).abs() < 1e-6);
    }

    #[test]
    fn finished_run_plans_nothing() {
        let done = TrainPosition {
            epoch: 3,
            consumed: 0,
            step: 12,
        };
        let plan = StepPlan::new(input(), done, 50, 50);
        assert_eq!(plan.total_steps, 12);
        assert!(!plan.more_after(done));
    }
}
