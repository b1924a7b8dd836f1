//! What the user sees and plots: cross-rank sums, rank 0's progress bar, and `metrics.jsonl`.
//!
//! Only rank 0 draws and writes; every rank takes part in the sums (they are collectives).

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::Context;
use burn_ddp::{CollectiveError, ProcessGroup, ReduceOp};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

/// Adds `values` over all ranks (collective). Metrics are sums of per-sample quantities with
/// their counts, so the result is the exact global value however samples fall on ranks.
pub fn global_sum<const N: usize>(
    group: &mut impl ProcessGroup,
    values: [f64; N],
) -> Result<[f64; N], CollectiveError> {
    let mut v = values;
    group.all_reduce(&mut v, ReduceOp::Sum)?;
    Ok(v)
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Record {
    /// Mean training loss over the steps since the previous record, over all ranks.
    Train {
        epoch: usize,
        step: usize,
        loss: f64,
        lr: f64,
        samples_per_sec: f64,
        world_size: usize,
    },
    /// Validation over every validation sample exactly once.
    Valid {
        epoch: usize,
        step: usize,
        loss: f64,
        accuracy: f64,
        samples: usize,
    },
}

/// Rank 0's outputs; inert on other ranks.
pub struct Reporter {
    file: Option<BufWriter<File>>,
    bar: Option<ProgressBar>,
}

impl Reporter {
    /// On rank 0, creates `dir` and appends to `dir/metrics.jsonl` (a resumed run continues the
    /// same file), and shows a progress bar over `total_steps` when stderr is a terminal.
    pub fn new(rank: usize, dir: &Path, total_steps: u64, done_steps: u64) -> anyhow::Result<Self> {
        if rank != 0 {
            return Ok(Self {
                file: None,
                bar: None,
            });
        }
        fs::create_dir_all(dir)
            .with_context(|| format!("cannot create output directory {}", dir.display()))?;
        let path = dir.join("metrics.jsonl");
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        let bar = ProgressBar::new(total_steps);
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_position(done_steps);
        Ok(Self {
            file: Some(BufWriter::new(file)),
            bar: Some(bar),
        })
    }

    pub fn record(&mut self, record: &Record) {
        if let Some(f) = &mut self.file {
            if let Ok(line) = serde_json::to_string(record) {
                // Metrics must never stop training: a full disk costs lines, not the job.
                let _ = writeln!(f, "{line}").and_then(|_| f.flush());
            }
        }
    }

    pub fn progress(&self, step: u64, message: String) {
        if let Some(bar) = &self.bar {
            bar.set_position(step);
            bar.set_message(message);
        }
    }

    /// Prints a line above the bar (or plainly when there is no terminal).
    pub fn say(&self, line: &str) {
        match &self.bar {
            Some(bar) if !bar.is_hidden() => bar.println(line),
            Some(_) => println!("{line}"),
            None => {}
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
