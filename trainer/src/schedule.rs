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

use burn::optim::lr_scheduler::noam::{NoamLrScheduler, NoamLrSchedulerConfig};
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::LearningRate;
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use burn::tensor::backend::Backend;

use crate::config::{LrSchedule, OptimizerConfig};
use crate::error::UsageError;

/// [`OptimizerConfig::learning_rate`] as a Burn scheduler whose record is the step count.
#[derive(Debug, Clone)]
pub struct PlannedSchedule {
    config: OptimizerConfig,
    total_steps: usize,
    step: usize,
}

impl LrScheduler for PlannedSchedule {
    type Record<B: Backend> = usize;

    fn step(&mut self) -> LearningRate {
        // Unscaled: `Schedule` applies `lr_scaling` to every scheduler alike.
        let lr = self.config.learning_rate(1, self.step, self.total_steps);
        self.step += 1;
        lr
    }

    fn to_record<B: Backend>(&self) -> usize {
        self.step
    }

    fn load_record<B: Backend>(mut self, record: usize) -> Self {
        self.step = record;
        self
    }
}

/// The configured scheduler and the world-size scale.
#[derive(Debug, Clone)]
pub struct Schedule {
    kind: Kind,
    scale: f64,
}

#[derive(Debug, Clone)]
enum Kind {
    Planned(PlannedSchedule),
    Noam(NoamLrScheduler),
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
            Kind::Noam(s) => s.step(),
        };
        lr * self.scale
    }

    /// The scheduler's record, serialised with Burn's recorder (for checkpoints).
    pub fn to_bytes<B: Backend>(&self) -> Result<Vec<u8>, String> {
        match &self.kind {
            Kind::Planned(s) => record_bytes::<B, _>(s),
            Kind::Noam(s) => record_bytes::<B, _>(s),
        }
    }

    /// Restores the scheduler from [`to_bytes`](Self::to_bytes)' output.
    pub fn load_bytes<B: Backend>(
        self,
        bytes: Vec<u8>,
        device: &B::Device,
    ) -> Result<Self, String> {
        let kind = match self.kind {
            Kind::Planned(s) => Kind::Planned(load_record::<B, _>(s, bytes, device)?),
            Kind::Noam(s) => Kind::Noam(load_record::<B, _>(s, bytes, device)?),
        };
        Ok(Self { kind, ..self })
    }
}

/// Any Burn scheduler's record as bytes.
fn record_bytes<B: Backend, S: LrScheduler>(s: &S) -> Result<Vec<u8>, String> {
    Recorder::<B>::record(
        &NamedMpkBytesRecorder::<FullPrecisionSettings>::new(),
        s.to_record::<B>(),
        (),
    )
    .map_err(|e| format!("cannot serialise the learning-rate scheduler: {e}"))
}

/// Any Burn scheduler restored from [`record_bytes`].
fn load_record<B: Backend, S: LrScheduler>(
    s: S,
    bytes: Vec<u8>,
    device: &B::Device,
) -> Result<S, String> {
    let record = Recorder::<B>::load(
        &NamedMpkBytesRecorder::<FullPrecisionSettings>::new(),
        bytes,
        device,
    )
    .map_err(|e| format!("its learning-rate scheduler state does not load: {e}"))?;
    Ok(s.load_record::<B>(record))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LrScaling;
    use burn::backend::Flex;

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
            let bytes = first.to_bytes::<Flex>().unwrap();
            let resumed = Schedule::new(&config, 2, 40).unwrap();
            let mut resumed = resumed
                .load_bytes::<Flex>(bytes, &Default::default())
                .unwrap();
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
