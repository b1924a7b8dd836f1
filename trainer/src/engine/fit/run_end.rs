//! The end of a rank's run, after the loop's last step ([`TrainingLoop::finish`]): the step
//! times over the ranks and their report, the final checkpoint and validation when the last
//! step had none, what each rank held at its peak (the `Finished` event), the step kind's own
//! end, and the run's summary.

use super::events::{Event, EventSink, HeldState};
use super::step_kind::StepKind;
use super::summary::Summary;
use super::training_loop::TrainingLoop;
use crate::report::timing::StepTime;

impl<K: StepKind, E: EventSink> TrainingLoop<'_, K, E> {
    /// The end of the run: the step times over the ranks, the final checkpoint and validation
    /// if the last step had none, then what the run held (`Finished`, whose peak memory
    /// counts the final checkpoint and validation), the step kind's own end. Collective.
    pub(super) fn finish(mut self, module: &K::Module) -> anyhow::Result<Summary> {
        self.events.on(Event::StepsDone)?;
        // Taken before the final checkpoint: the report is of the steps' times.
        let times = self.step_times()?;
        let position = self.position;
        if self.last_saved != Some(position.step) {
            self.save_checkpoint(module)?;
        }
        let validation = match self.last_valid.take() {
            Some(v) if v.step == position.step => Some(v),
            _ => {
                // Stopped mid-epoch (max_steps): validate the final model too, and record it.
                let v = self.kind.validate(module, position.step)?;
                if let Some(v) = &v {
                    self.events.on(Event::Validated {
                        epoch: position.epoch,
                        validation: v,
                        epochs: None,
                    })?;
                }
                v
            }
        };
        let time = match times {
            Some((time, report)) => {
                self.finished(time, &report)?;
                Some(report)
            }
            None => None,
        };
        self.kind.finish(position)?;
        self.events.on(Event::Ended)?;
        Ok(Summary {
            validation,
            steps: position.step,
            skipped_steps: self.skipped,
            membership: self.membership.clone(),
            time,
        })
    }

    /// The run's step times over the ranks and the report in words; `None` without steps.
    /// Collective.
    fn step_times(&mut self) -> anyhow::Result<Option<(StepTime, String)>> {
        // The steps since the last log line count in the run's totals.
        let _ = self.clock.take_window();
        if self.clock.run_steps() == 0 {
            return Ok(None);
        }
        let (time, ranks) = self.kind.across_ranks(self.clock.run_means())?;
        let report = time.describe(&ranks);
        Ok(Some((time, report)))
    }

    /// The `Finished` event: the step times, and each rank's peak memory and held training
    /// state, read now, so that the peak includes everything the run did (the final
    /// checkpoint and validation: at ZeRO stage 2 rank 0's merge of the optimizer state for
    /// the checkpoint is often its peak). Collective.
    fn finished(&mut self, time: StepTime, report: &str) -> anyhow::Result<()> {
        let mut ours = vec![crate::engine::memory::peak_resident_bytes().unwrap_or(0) as f64];
        ours.extend(self.kind.held_state()?.to_values());
        let all = self.kind.all_gather(&ours)?;
        let per_rank = all.chunks(ours.len());
        self.events.on(Event::Finished {
            step: self.position.step,
            world_size: self.kind.world_size(),
            time,
            report,
            peak_rss_bytes: per_rank.clone().map(|r| r[0] as u64).collect(),
            held: per_rank.map(|r| HeldState::from_values(&r[1..])).collect(),
        })
    }
}
