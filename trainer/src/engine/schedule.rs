//! The learning-rate schedule of a run (`[optimizer] schedule`), as a Burn [`LrScheduler`]
//! stepped once per optimizer step, whose record is saved in every checkpoint and restored on
//! resume, so the rate continues exactly where it stopped (at any world size).
//!
//! | `schedule` | scheduler |
//! |---|---|
//! | `"constant"`, `"cosine"` | [`PlannedSchedule`]: linear warm-up, then constant or cosine decay over the run |
//! | `"noam"` | Burn's [`NoamLrScheduler`] (`learning_rate` is its factor; `warmup_steps`, `model_size`) |
//!
//! `lr_scaling` multiplies whichever rate the scheduler gives.

use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::optim::lr_scheduler::noam::NoamLrSchedulerConfig;
use burn::optim::lr_scheduler::{LrScheduler, LrSchedulerRecord};
use burn::optim::LearningRate;
use burn::tensor::Bytes;

use crate::config::{LrSchedule, OptimizerConfig};
use crate::error::UsageError;

/// The key of [`PlannedSchedule`]'s one scalar in its record.
const STEP_KEY: &str = "step";

/// [`OptimizerConfig::learning_rate`] as a Burn scheduler whose record is the step count.
#[derive(Debug, Clone)]
pub struct PlannedSchedule {
    config: OptimizerConfig,
    total_steps: usize,
    step: usize,
}

impl LrScheduler for PlannedSchedule {
    fn step(&mut self) -> LearningRate {
        // Unscaled: `Schedule` applies `lr_scaling` to every scheduler alike.
        let lr = self.config.learning_rate(1, self.step, self.total_steps);
        self.step += 1;
        lr
    }

    fn to_record(&self) -> LrSchedulerRecord {
        LrSchedulerRecord::new().with_scalar(STEP_KEY, self.step)
    }

    fn load_record(&mut self, record: LrSchedulerRecord) {
        if let Some(step) = record.scalar::<usize>(STEP_KEY) {
            self.step = step;
        }
    }
}

/// The configured scheduler and the world-size scale.
#[derive(Clone)]
pub struct Schedule {
    kind: Kind,
    scale: f64,
}

impl std::fmt::Debug for Schedule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            Kind::Planned(s) => format!("{s:?}"),
            Kind::Noam(_) => "Noam".to_string(),
        };
        f.debug_struct("Schedule")
            .field("kind", &kind)
            .field("scale", &self.scale)
            .finish()
    }
}

#[derive(Clone)]
enum Kind {
    Planned(PlannedSchedule),
    /// Burn builds its Noam scheduler only wrapped, as a (one-group) module scheduler.
    Noam(ModuleLrScheduler),
}

impl Schedule {
    /// The schedule of `[optimizer]` for a run of `total_steps` optimizer steps on
    /// `world_size` ranks, at its first step.
    pub fn new(
        o: &OptimizerConfig,
        world_size: usize,
        total_steps: usize,
    ) -> Result<Self, UsageError> {
        let kind = match o.schedule {
            LrSchedule::Constant | LrSchedule::Cosine => Kind::Planned(PlannedSchedule {
                config: o.clone(),
                total_steps,
                step: 0,
            }),
            LrSchedule::Noam => Kind::Noam(
                NoamLrSchedulerConfig::new(o.learning_rate)
                    .with_warmup_steps(o.warmup_steps)
                    .with_model_size(o.model_size)
                    .init()
                    .map_err(|e| {
                        UsageError(format!(
                            "optimizer.schedule = \"noam\": {e} (set optimizer.warmup_steps and optimizer.model_size)"
                        ))
                    })?,
            ),
        };
        Ok(Self {
            kind,
            scale: o.lr_scaling.factor(world_size),
        })
    }

    /// The rate of the next optimizer step (advances the scheduler).
    pub fn next_lr(&mut self) -> f64 {
        let lr = match &mut self.kind {
            Kind::Planned(s) => s.step(),
            Kind::Noam(s) => s.step().base(),
        };
        lr * self.scale
    }

    /// The scheduler's record ([`LrSchedulerRecord`], burnpack bytes), for checkpoints.
    pub fn to_bytes(&self) -> Result<Vec<u8>, String> {
        let record = match &self.kind {
            Kind::Planned(s) => s.to_record(),
            Kind::Noam(s) => s.to_record(),
        };
        record
            .into_bytes()
            .map(|bytes| bytes.to_vec())
            .map_err(|e| format!("cannot serialise the learning-rate scheduler: {e}"))
    }

    /// Restores the scheduler from [`to_bytes`](Self::to_bytes)' output.
    pub fn load_bytes(self, bytes: Vec<u8>) -> Result<Self, String> {
        let record = LrSchedulerRecord::from_bytes(Bytes::from_bytes_vec(bytes))
            .map_err(|e| format!("its learning-rate scheduler state does not load: {e}"))?;
        if record.is_empty() {
            return Err("its learning-rate scheduler state is empty".into());
        }
        // Each schedule ignores keys it does not know: a record of the other kind would start
        // the schedule over without a word. Only the planned schedule writes `STEP_KEY`.
        let planned_record = record.scalar::<usize>(STEP_KEY).is_some();
        if planned_record != matches!(self.kind, Kind::Planned(_)) {
            return Err(
                "its learning-rate scheduler state is of another schedule than the \
                 config's [training] schedule: resume with the schedule that wrote it"
                    .into(),
            );
        }
        let kind = match self.kind {
            Kind::Planned(mut s) => {
                s.load_record(record);
                Kind::Planned(s)
            }
            Kind::Noam(s) => Kind::Noam(s.load_record(record)),
        };
        Ok(Self { kind, ..self })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LrScaling;

    fn noam() -> OptimizerConfig {
        OptimizerConfig {
            learning_rate: 2.0,
            schedule: LrSchedule::Noam,
            warmup_steps: 10,
            model_size: 64,
            ..Default::default()
        }
    }

    #[test]
    fn a_restored_schedule_continues_exactly() {
        for config in [
            noam(),
            OptimizerConfig {
                schedule: LrSchedule::Cosine,
                warmup_steps: 3,
                ..Default::default()
            },
        ] {
            let mut whole = Schedule::new(&config, 2, 40).unwrap();
            let expected: Vec<f64> = (0..40).map(|_| whole.next_lr()).collect();
            let mut first = Schedule::new(&config, 2, 40).unwrap();
            for lr in &expected[..17] {
                assert_eq!(first.next_lr(), *lr);
            }
            let bytes = first.to_bytes().unwrap();
            let resumed = Schedule::new(&config, 2, 40).unwrap();
            let mut resumed = resumed.load_bytes(bytes).unwrap();
            for lr in &expected[17..] {
                assert_eq!(resumed.next_lr(), *lr, "{:?}", config.schedule);
            }
        }
    }

    #[test]
    fn noam_warms_up_then_decays_and_scales_with_the_world() {
        let mut s = Schedule::new(&noam(), 1, 100).unwrap();
        let lrs: Vec<f64> = (0..30).map(|_| s.next_lr()).collect();
        assert!(lrs[0] < lrs[9] && lrs[9] > lrs[29]);
        let scaled = OptimizerConfig {
            lr_scaling: LrScaling::Linear,
            ..noam()
        };
        let mut s4 = Schedule::new(&scaled, 4, 100).unwrap();
        assert!((s4.next_lr() - 4.0 * lrs[0]).abs() < 1e-15);
        let bad = OptimizerConfig {
            warmup_steps: 0,
            ..noam()
        };
        let err = Schedule::new(&bad, 1, 10).unwrap_err().to_string();
        assert!(
            err.contains("noam") && err.contains("warmup_steps"),
            "{err}"
        );
    }
}
