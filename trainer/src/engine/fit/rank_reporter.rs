//! The rank's reporter: it consumes the training loop's [`Event`]s into rank 0's
//! `metrics.jsonl` (and TensorBoard files), the progress bar and its lines, every rank's
//! sample log (`output.log_samples`, for the tests) and, at the end, the charts
//! (`output.plots`).

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::Path;

use burn_ddp::sampler::Sample;

use crate::config::OutputConfig;
use crate::engine::checkpoint::TrainPosition;
use crate::engine::fit::events::{Event, EventSink};
use crate::engine::fit::summary::Validation;
use crate::report::metrics::{self, Record, Reporter};

/// One rank's consumer of the loop's events; inert until `Started` opens its files.
pub(crate) struct RankReporter {
    rank: usize,
    output: OutputConfig,
    reporter: Option<Reporter>,
}

impl RankReporter {
    pub(crate) fn new(rank: usize, output: &OutputConfig) -> Self {
        Self {
            rank,
            output: output.clone(),
            reporter: None,
        }
    }

    fn record(&mut self, record: &Record) {
        if let Some(reporter) = &mut self.reporter {
            reporter.record(record);
        }
    }

    /// A `train` record and the progress bar's position and message.
    fn trained(&mut self, position: TrainPosition, record: &Record, message: String) {
        if let Some(reporter) = &mut self.reporter {
            reporter.record(record);
            reporter.progress(position.step as u64, message);
        }
    }

    /// The job re-formed with this rank as `rank`: a rank that becomes rank 0 opens rank 0's
    /// files (appending), and rank 0 writes the `regroup` record and says so.
    fn regrouped(
        &mut self,
        rank: usize,
        total_steps: usize,
        position: TrainPosition,
        record: &Record,
    ) -> anyhow::Result<()> {
        let was = std::mem::replace(&mut self.rank, rank);
        if rank == 0 && was != 0 && self.reporter.is_some() {
            self.reporter = Some(Reporter::new(
                0,
                &self.output.dir,
                total_steps as u64,
                position.step as u64,
            )?);
        }
        if rank == 0 {
            if let (
                Some(reporter),
                Record::Regroup {
                    world_size,
                    previous_world_size,
                    lost,
                    joined,
                    recovery_secs,
                    ..
                },
            ) = (&mut self.reporter, record)
            {
                let change = match (lost.is_empty(), joined.is_empty()) {
                    (_, true) => format!(
                        "lost rank(s) {lost:?} of {previous_world_size}; training on with {world_size} ranks ({recovery_secs:.2} s from the failed step's start)"
                    ),
                    (true, false) => format!(
                        "rank(s) {joined:?} joined the {previous_world_size}; training on with {world_size} ranks ({recovery_secs:.2} s to hand them the training state)"
                    ),
                    (false, false) => format!(
                        "lost rank(s) {lost:?} of {previous_world_size}, rank(s) {joined:?} joined; training on with {world_size} ranks ({recovery_secs:.2} s)"
                    ),
                };
                reporter.say(&format!("after step {}: {change}", position.step));
            }
            self.record(record);
        }
        Ok(())
    }

    /// A `valid` record, and the end of an epoch's line (of `epochs`).
    fn validated(&mut self, epoch: usize, v: &Validation, epochs: Option<usize>) {
        let Some(reporter) = &mut self.reporter else {
            return;
        };
        record_validation(reporter, epoch, v);
        if let Some(epochs) = epochs {
            reporter.say(&format!(
                "epoch {}/{epochs}: validation {} ({} samples)",
                epoch + 1,
                metrics::describe(&v.metrics),
                v.samples
            ));
        }
    }
}

impl EventSink for RankReporter {
    fn on(&mut self, event: Event<'_>) -> anyhow::Result<()> {
        match event {
            Event::Started {
                position,
                total_steps,
                world_size,
                resumed_from,
            } => {
                self.reporter = Some(open_reporter(
                    self.rank,
                    world_size,
                    &self.output,
                    total_steps,
                    position,
                    resumed_from,
                )?);
            }
            Event::Stepped { epoch, samples } => {
                if self.output.log_samples {
                    log_samples(&self.output.dir, self.rank, epoch, samples)?;
                }
            }
            Event::Trained {
                position,
                lr,
                samples_per_sec,
                world_size,
                metrics,
                time,
            } => {
                let message = format!(
                    "epoch {} {} {samples_per_sec:.0} samples/s",
                    position.epoch + 1,
                    metrics::describe(metrics),
                );
                let record = Record::Train {
                    epoch: position.epoch,
                    step: position.step,
                    lr,
                    samples_per_sec,
                    world_size,
                    metrics: metrics::as_map(metrics),
                    time,
                };
                self.trained(position, &record, message);
            }
            Event::Regrouped {
                position,
                rank,
                world_size,
                previous_world_size,
                lost,
                joined,
                dropped_steps,
                recovery_secs,
                total_steps,
            } => self.regrouped(
                rank,
                total_steps,
                position,
                &Record::Regroup {
                    epoch: position.epoch,
                    step: position.step,
                    world_size,
                    previous_world_size,
                    lost: lost.to_vec(),
                    joined: joined.to_vec(),
                    dropped_steps,
                    recovery_secs,
                },
            )?,
            Event::Validated {
                epoch,
                validation,
                epochs,
            } => self.validated(epoch, validation, epochs),
            Event::StepsDone => {
                if let Some(reporter) = &self.reporter {
                    reporter.finish();
                }
            }
            Event::Finished {
                step,
                world_size,
                time,
                report,
                peak_rss_bytes,
                held,
            } => self.record(&Record::Finish {
                step,
                world_size,
                time,
                report: report.to_string(),
                peak_rss_bytes,
                optimizer_state_params: held.iter().map(|h| h.optimizer_state_params).collect(),
                optimizer_state_bytes: held.iter().map(|h| h.optimizer_state_bytes).collect(),
                gradient_bytes: held.iter().map(|h| h.gradient_bytes).collect(),
                parameter_bytes: held.iter().map(|h| h.parameter_bytes).collect(),
                gathered_peak_bytes: held.iter().map(|h| h.gathered_peak_bytes).collect(),
            }),
            Event::Ended => {
                if self.rank == 0 && self.output.plots {
                    write_plots(&self.output.dir);
                }
            }
        }
        Ok(())
    }
}

/// The `valid` line of `metrics.jsonl` for a validation during `epoch`.
fn record_validation(reporter: &mut Reporter, epoch: usize, v: &Validation) {
    reporter.record(&Record::Valid {
        epoch,
        step: v.step,
        samples: v.samples,
        metrics: metrics::as_map(&v.metrics),
    });
}

/// Rank 0's progress bar and metrics file (and TensorBoard files), with the run's `start`
/// line.
fn open_reporter(
    rank: usize,
    world_size: usize,
    output: &OutputConfig,
    total_steps: usize,
    position: TrainPosition,
    resumed_from: Option<usize>,
) -> anyhow::Result<Reporter> {
    let mut reporter = Reporter::new(rank, &output.dir, total_steps as u64, position.step as u64)?;
    if output.tensorboard {
        reporter = reporter.with_tensorboard(&output.dir.join("tensorboard"))?;
    }
    reporter.record(&Record::Start {
        step: position.step,
        epoch: position.epoch,
        world_size,
        resumed_from,
        restart: crate::launcher::worker_env::restart_count(),
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
    });
    Ok(reporter)
}

/// Rank 0, at the end of a run (`output.plots`): charts must never fail a finished run.
fn write_plots(dir: &Path) {
    match crate::report::plot::write_plots(dir) {
        Ok(files) => tracing::info!(
            "wrote {} charts to {}",
            files.len(),
            dir.join("plots").display()
        ),
        Err(e) => tracing::warn!("could not write the charts of {}: {e:#}", dir.display()),
    }
}

/// Appends `epoch index is_padding` lines for the samples of one step (for tests).
fn log_samples(dir: &Path, rank: usize, epoch: usize, chunk: &[Sample]) -> anyhow::Result<()> {
    fs::create_dir_all(dir)?;
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("samples-rank{rank}.txt")))?;
    for s in chunk {
        writeln!(f, "{epoch} {} {}", s.index, u8::from(s.is_padding))?;
    }
    Ok(())
}
