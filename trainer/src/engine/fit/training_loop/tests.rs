//! The loop against a fake step kind: a "module" that counts its applied steps, a data set
//! of the numbers 0..20, and a recorder of every event. Each test fails when the loop
//! skips a planned checkpoint, logs a window twice, resumes at the wrong step, or decides
//! a non-finite step otherwise than `training.on_nonfinite` says.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, InMemDataset};
use burn::tensor::Device;
use burn_ddp::StepOutcome;

use super::*;
use crate::engine::checkpoint::Manifest;
use crate::engine::fit::events::HeldState;
use crate::report::metrics::MetricValue;
use crate::report::timing::{RankTimes, StepTime};

const SAMPLES: usize = 20;

/// The batch of a micro-batch: its sample indices.
struct Ids;
impl Batcher<usize, Vec<usize>> for Ids {
    fn batch(&self, items: Vec<usize>, _device: &Device) -> Vec<usize> {
        items
    }
}

/// A step kind on one rank that records what the loop asked of it.
struct Fake {
    data: Arc<dyn Dataset<usize>>,
    /// Returned by `restore`.
    checkpoint: Option<Checkpoint>,
    /// Steps (1-based) whose gradients are not finite.
    nonfinite: Vec<usize>,
    /// The step the next `step` call takes (1-based).
    next_step: usize,
    /// Each step's samples (epoch of the position before it, indices read).
    trained: Vec<Vec<usize>>,
    saved: Vec<usize>,
    validated: Vec<usize>,
    /// What had been saved and validated when the held state (and the peak memory
    /// beside it) was read for the `Finished` event.
    held_read_after: Option<(Vec<usize>, Vec<usize>)>,
}

impl Fake {
    fn new() -> Self {
        Self {
            data: Arc::new(InMemDataset::new((0..SAMPLES).collect())),
            checkpoint: None,
            nonfinite: Vec::new(),
            next_step: 1,
            trained: Vec::new(),
            saved: Vec::new(),
            validated: Vec::new(),
            held_read_after: None,
        }
    }
}

impl StepKind for Fake {
    type Item = usize;
    /// The number of applied steps.
    type Module = usize;

    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn data_parallel_size(&self) -> usize {
        1
    }
    fn train_set(&self) -> Arc<dyn Dataset<usize>> {
        self.data.clone()
    }
    fn restore(&mut self, module: usize) -> anyhow::Result<(usize, Option<Checkpoint>)> {
        let ckpt = self.checkpoint.take();
        if let Some(c) = &ckpt {
            self.next_step = c.manifest.position.step + 1;
        }
        Ok((module, ckpt))
    }
    fn step(
        &mut self,
        module: usize,
        batches: &mut BatchStream<usize>,
        step: &StepInput<'_>,
        _clock: &mut PhaseClock,
    ) -> anyhow::Result<(usize, StepOutcome)> {
        let mut read = Vec::new();
        for (micro, _) in &step.micro_batches {
            let batch: Vec<usize> = batches.next_batch(&Ids, &Device::flex())?;
            assert_eq!(batch.len(), micro.len());
            read.extend(batch);
        }
        self.trained.push(read);
        let this = self.next_step;
        self.next_step += 1;
        Ok(if self.nonfinite.contains(&this) {
            (module, StepOutcome::Skipped { ranks: vec![0] })
        } else {
            (module + 1, StepOutcome::Applied)
        })
    }
    fn train_metrics(&mut self, _: TrainPosition, _: f64) -> anyhow::Result<Vec<MetricValue>> {
        Ok(Vec::new())
    }
    fn across_ranks(&mut self, ours: RankTimes) -> anyhow::Result<(StepTime, Vec<RankTimes>)> {
        Ok((StepTime::across_ranks(&[ours]), vec![ours]))
    }
    fn all_gather(&mut self, ours: &[f64]) -> anyhow::Result<Vec<f64>> {
        Ok(ours.to_vec())
    }
    fn held_state(&mut self) -> anyhow::Result<HeldState> {
        self.held_read_after = Some((self.saved.clone(), self.validated.clone()));
        Ok(HeldState::default())
    }
    fn check_replicas(&mut self, _: &usize, _: usize) -> anyhow::Result<()> {
        Ok(())
    }
    fn save(&mut self, position: TrainPosition, _: &usize, _: &Schedule) -> anyhow::Result<()> {
        self.saved.push(position.step);
        Ok(())
    }
    fn validate(&mut self, _: &usize, step: usize) -> anyhow::Result<Option<Validation>> {
        self.validated.push(step);
        Ok(Some(Validation {
            metrics: Vec::new(),
            samples: 4,
            step,
        }))
    }
}

/// The events, by kind, with the step each was at.
#[derive(Default)]
struct Recorder {
    lines: Vec<String>,
}

impl EventSink for Recorder {
    fn on(&mut self, event: Event<'_>) -> anyhow::Result<()> {
        self.lines.push(match event {
            Event::Started { position, .. } => format!("started {}", position.step),
            Event::Stepped { epoch, .. } => format!("stepped {epoch}"),
            Event::Trained { position, .. } => format!("trained {}", position.step),
            Event::Validated {
                epoch, validation, ..
            } => format!("validated {epoch} {}", validation.step),
            Event::Regrouped { position, .. } => format!("regrouped {}", position.step),
            Event::StepsDone => "steps done".into(),
            Event::Finished { step, .. } => format!("finished {step}"),
            Event::Ended => "ended".into(),
        });
        Ok(())
    }
}

impl Recorder {
    /// The steps of the events whose line starts with `kind`.
    fn steps(&self, kind: &str) -> Vec<String> {
        self.lines
            .iter()
            .filter_map(|l| l.strip_prefix(kind).map(|rest| rest.trim().to_string()))
            .collect()
    }
}

/// 20 samples in steps of 2 (10 per epoch), 2 epochs; a `train` line every 4 steps, a
/// checkpoint every 3 steps and at every epoch's end.
fn settings() -> LoopSettings {
    LoopSettings {
        training: TrainingConfig {
            epochs: 2,
            batch_size: 2,
            log_every: 4,
            num_workers: 0,
            ..TrainingConfig::default()
        },
        checkpoint: CheckpointConfig {
            every_steps: 3,
            every_epochs: 1,
            ..CheckpointConfig::default()
        },
        optimizer: OptimizerConfig::default(),
        ..LoopSettings::default()
    }
}

fn sampler(settings: &LoopSettings) -> EpochSampler {
    EpochSampler::new(SAMPLES, &settings.training, 1, 0, None).unwrap()
}

fn run(fake: &mut Fake, settings: &LoopSettings) -> (anyhow::Result<Summary>, Recorder) {
    let mut events = Recorder::default();
    let result = fit(fake, 0, sampler(settings), settings, &mut events)
        .and_then(|f| f.done())
        .map(|(_, s)| s);
    (result, events)
}

fn steps(list: &[usize]) -> Vec<String> {
    list.iter().map(usize::to_string).collect()
}

#[test]
fn a_run_saves_every_planned_checkpoint_once_and_logs_each_window_once() {
    let settings = settings();
    let mut fake = Fake::new();
    let (summary, events) = run(&mut fake, &settings);
    let summary = summary.unwrap();
    assert_eq!(summary.steps, 20);
    assert_eq!(summary.skipped_steps, 0);
    assert_eq!(fake.saved, [3, 6, 9, 10, 12, 15, 18, 20]);
    assert_eq!(events.steps("trained"), steps(&[4, 8, 12, 16, 20]));
    assert_eq!(events.steps("validated"), ["0 10", "1 20"]);
    assert_eq!(fake.validated, [10, 20], "no second validation of step 20");
    // Every sample once per epoch, in the sampler's order.
    let order = sampler(&settings);
    for epoch in 0..2 {
        let got: Vec<usize> = fake.trained[epoch * 10..(epoch + 1) * 10].concat();
        let want: Vec<usize> = order
            .samples(epoch as u64, 0)
            .iter()
            .map(|s| s.index)
            .collect();
        assert_eq!(got, want, "epoch {epoch}");
    }
    let first_and_last = (events.lines.first(), events.lines.last());
    assert_eq!(
        first_and_last,
        (Some(&"started 0".to_string()), Some(&"ended".to_string()))
    );
    let done = events.lines.iter().position(|l| l == "steps done");
    let finished = events.lines.iter().position(|l| l == "finished 20");
    assert!(done.is_some() && done < finished, "{:?}", events.lines);
}

/// A run stopped mid-epoch by `max_steps` saves and validates its last step in `finish`;
/// the `Finished` event's peak memory and held state are read after both (a final
/// checkpoint can be a rank's peak: at ZeRO stage 2 rank 0 merges the optimizer state).
#[test]
fn the_finish_record_is_measured_after_the_final_checkpoint_and_validation() {
    let mut settings = settings();
    settings.training.max_steps = Some(17);
    let mut fake = Fake::new();
    let (summary, events) = run(&mut fake, &settings);
    assert_eq!(summary.unwrap().steps, 17);
    assert_eq!(fake.saved.last(), Some(&17), "the final checkpoint");
    assert_eq!(fake.validated, [10, 17], "the final validation");
    assert_eq!(
        fake.held_read_after,
        Some((fake.saved.clone(), fake.validated.clone())),
        "read after the final checkpoint and validation"
    );
    let at = |line: &str| events.lines.iter().position(|l| l == line);
    let (validated, finished) = (at("validated 1 17"), at("finished 17"));
    assert!(
        validated.is_some() && validated < finished && finished < at("ended"),
        "{:?}",
        events.lines
    );
}

/// A checkpoint of step 6 (12 samples into epoch 0) with a schedule of its own.
fn checkpoint_of_step_6(dir: &std::path::Path, settings: &LoopSettings) -> Checkpoint {
    std::fs::create_dir_all(dir).unwrap();
    let mut schedule = Schedule::new(&settings.optimizer, 1, 20).unwrap();
    for _ in 0..6 {
        schedule.next_lr();
    }
    std::fs::write(
        dir.join(crate::engine::checkpoint::SCHEDULER_FILE),
        schedule.to_bytes().unwrap(),
    )
    .unwrap();
    Checkpoint {
        dir: dir.to_path_buf(),
        manifest: Manifest {
            shards: None,
            format_version: 3,
            model: "fake".into(),
            model_fingerprint: String::new(),
            config_fingerprint: String::new(),
            seed: 0,
            world_size: 1,
            position: TrainPosition {
                epoch: 0,
                consumed: 12,
                step: 6,
            },
            checksums: BTreeMap::new(),
            burn_version: None,
        },
    }
}

#[test]
fn a_resumed_run_starts_after_the_restored_step_and_sample() {
    let settings = settings();
    let dir = std::env::temp_dir().join(format!("fit-loop-resume-{}", std::process::id()));
    let mut fake = Fake::new();
    fake.checkpoint = Some(checkpoint_of_step_6(&dir, &settings));
    let (summary, events) = run(&mut fake, &settings);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(summary.unwrap().steps, 20);
    assert_eq!(events.lines.first().map(String::as_str), Some("started 6"));
    assert_eq!(fake.trained.len(), 14, "steps 7 to 20");
    // The rest of epoch 0 is the sampler's order after its first 12 samples.
    let rest: Vec<usize> = sampler(&settings)
        .samples(0, 12)
        .iter()
        .map(|s| s.index)
        .collect();
    assert_eq!(fake.trained[..4].concat(), rest);
    assert_eq!(
        fake.saved,
        [9, 10, 12, 15, 18, 20],
        "step 6 is not saved again"
    );
    assert_eq!(events.steps("trained"), steps(&[8, 12, 16, 20]));
}

#[test]
fn a_nonfinite_step_is_skipped_or_stops_the_run_as_configured() {
    let mut settings = settings();
    settings.training.on_nonfinite = OnNonFinite::Skip;
    let mut fake = Fake::new();
    fake.nonfinite = vec![5];
    let mut events = Recorder::default();
    let (applied, summary) = fit(&mut fake, 0, sampler(&settings), &settings, &mut events)
        .and_then(|f| f.done())
        .expect("skipping trains on");
    assert_eq!((applied, summary.steps, summary.skipped_steps), (19, 20, 1));

    settings.training.on_nonfinite = OnNonFinite::Stop;
    let mut fake = Fake::new();
    fake.nonfinite = vec![5];
    let (result, _) = run(&mut fake, &settings);
    let error = result.expect_err("stop fails the run");
    let failed = error
        .downcast_ref::<NonFiniteGradients>()
        .expect("the non-finite error");
    assert_eq!((failed.step, failed.last_checkpoint), (5, Some(3)));
    assert_eq!(fake.saved, [3], "no checkpoint after the failed step");
}
