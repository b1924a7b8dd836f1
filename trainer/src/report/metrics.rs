//! What the user sees and plots: burn-train metrics summed across ranks with their counts,
//! rank 0's progress bar, and `metrics.jsonl`.
//!
//! Only rank 0 draws and writes; every rank takes part in the sums (they are collectives).

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::Context;
use burn::data::dataloader::Progress;
use burn::tensor::TensorReadError;
use burn::train::metric::{
    Adaptor, Metric, MetricAttributes, MetricMetadata, Numeric, NumericEntry,
};
use burn::train::ItemLazy;
use burn_ddp::{CollectiveError, ProcessGroup, ReduceOp};
use indicatif::{ProgressBar, ProgressStyle};

pub use crate::report::record::Record;
use crate::report::tensorboard::EventWriter;

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

/// One numeric burn-train metric fed with items of type `I`, type-erased so that a set can hold
/// metrics of different input types.
trait NumericSlot<I>: Send {
    fn name(&self) -> String;
    fn unit(&self) -> Option<String>;
    /// Feeds one batch of `samples` samples; an error is a failed read of the item's tensors.
    fn update(
        &mut self,
        item: &I,
        samples: usize,
        metadata: &MetricMetadata,
    ) -> Result<(), TensorReadError>;
    /// (value x count, count) since the last clear.
    fn weighted(&self) -> (f64, f64);
    fn clear(&mut self);
}

/// A metric and its own sums since the last clear: each batch's value times its weight.
struct Slot<Me> {
    metric: Me,
    weighted_sum: f64,
    weight: f64,
}

impl<I, Me> NumericSlot<I> for Slot<Me>
where
    Me: Metric + Numeric + 'static,
    I: Adaptor<Me::Input>,
{
    fn name(&self) -> String {
        self.metric.name().to_string()
    }
    fn unit(&self) -> Option<String> {
        match self.metric.attributes() {
            MetricAttributes::Numeric(a) => a.unit,
            MetricAttributes::None => None,
        }
    }
    fn update(
        &mut self,
        item: &I,
        samples: usize,
        metadata: &MetricMetadata,
    ) -> Result<(), TensorReadError> {
        self.metric.update(&item.adapt(), metadata)?;
        if let Some(NumericEntry::Aggregated {
            aggregated_value,
            count,
        }) = self.metric.value()
        {
            // A metric that counts a batch once gave the batch's mean (burn-train's
            // `LossMetric` gets the mean loss as a one-element tensor): weigh it by the batch's
            // samples, so the result is the mean over samples whatever the batches — and the
            // same on any number of ranks. Other counts (samples, tokens) are the metric's own.
            let weight = if count == 1 { samples.max(1) } else { count };
            if weight > 0 {
                self.weighted_sum += aggregated_value * weight as f64;
                self.weight += weight as f64;
            }
        }
        Ok(())
    }
    fn weighted(&self) -> (f64, f64) {
        match self.metric.running_value() {
            // No value yet (a metric computed only at the end of an epoch): nothing counted.
            None => (0.0, 0.0),
            // A metric without counts (e.g. a learning rate) counts once per rank.
            Some(NumericEntry::Value(v) | NumericEntry::Final(v)) if v.is_nan() => (0.0, 0.0),
            Some(NumericEntry::Value(v) | NumericEntry::Final(v)) => (v, 1.0),
            Some(NumericEntry::Aggregated { .. }) => (self.weighted_sum, self.weight),
        }
    }
    fn clear(&mut self) {
        self.metric.clear();
        self.weighted_sum = 0.0;
        self.weight = 0.0;
    }
}

/// A set of burn-train numeric metrics (`LossMetric`, `AccuracyMetric`, any type implementing
/// `Metric + Numeric`) computed on outputs of type `I` (the synced output of a `TrainStep` or
/// `InferenceStep`, which must implement `Adaptor` to each metric's input, as burn-train's
/// `ClassificationOutput` and `RegressionOutput` do; a metric the output cannot feed is a
/// compile error at [`Metrics::with`]).
///
/// Across ranks, each metric is combined as `sum(value x count) / sum(count)`, never a mean of
/// per-rank means, so unequal shards weigh by their samples.
///
/// ```
/// use burn::train::metric::LossMetric;
/// use burn::train::RegressionOutput;
/// use trainer::metrics::Metrics;
/// let metrics = Metrics::<RegressionOutput>::new().with(LossMetric::new());
/// assert_eq!(metrics.names(), ["Loss"]);
/// ```
///
/// A metric the output cannot feed does not compile (a regression output has no class scores
/// for an accuracy):
///
/// ```compile_fail
/// use burn::train::metric::AccuracyMetric;
/// use burn::train::RegressionOutput;
/// use trainer::metrics::Metrics;
/// let _ = Metrics::<RegressionOutput>::new().with(AccuracyMetric::new());
/// ```
pub struct Metrics<I> {
    slots: Vec<Box<dyn NumericSlot<I>>>,
}

impl<I> Default for Metrics<I> {
    fn default() -> Self {
        Self { slots: Vec::new() }
    }
}

/// A metric's global value over the samples it covers.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricValue {
    pub name: String,
    /// The metric's unit, e.g. `%`.
    pub unit: Option<String>,
    pub value: f64,
    pub count: f64,
}

impl<I> Metrics<I> {
    /// No metrics.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a numeric metric.
    #[must_use]
    pub fn with<Me>(mut self, metric: Me) -> Self
    where
        Me: Metric + Numeric + 'static,
        I: Adaptor<Me::Input>,
    {
        self.slots.push(Box::new(Slot {
            metric,
            weighted_sum: 0.0,
            weight: 0.0,
        }));
        self
    }

    /// The metrics' names, in the order they were added.
    pub fn names(&self) -> Vec<String> {
        self.slots.iter().map(|s| s.name()).collect()
    }

    /// Feeds one synced output, of a batch of `samples` samples, to every metric (local, no
    /// communication). A metric that reports one value per batch (burn-train's `LossMetric`:
    /// the batch's mean loss) is weighted by `samples`, so every result is a mean over samples.
    ///
    /// # Errors
    ///
    /// A metric could not read the item's tensors from the device (Burn's
    /// [`TensorReadError`]); the metrics may then hold part of this update.
    pub fn update(
        &mut self,
        item: &I,
        samples: usize,
        progress: Progress,
        iteration: usize,
        lr: Option<f64>,
    ) -> Result<(), TensorReadError> {
        let metadata = MetricMetadata {
            progress,
            iteration: Some(iteration),
            lr: lr.map(Into::into),
        };
        for slot in &mut self.slots {
            slot.update(item, samples, &metadata)?;
        }
        Ok(())
    }

    /// Every metric's global value since the last call, then clears them. Collective: every
    /// rank calls it at the same point with the same metric set (one all-reduce).
    pub fn global(
        &mut self,
        group: &mut impl ProcessGroup,
    ) -> Result<Vec<MetricValue>, CollectiveError> {
        let mut sums: Vec<f64> = self
            .slots
            .iter()
            .flat_map(|s| {
                let (weighted, count) = s.weighted();
                [weighted, count]
            })
            .collect();
        if !sums.is_empty() {
            group.all_reduce(&mut sums, ReduceOp::Sum)?;
        }
        let values = self
            .slots
            .iter_mut()
            .zip(sums.chunks_exact(2))
            .map(|(slot, pair)| {
                slot.clear();
                MetricValue {
                    name: slot.name(),
                    unit: slot.unit(),
                    value: if pair[1] > 0.0 {
                        pair[0] / pair[1]
                    } else {
                        f64::NAN
                    },
                    count: pair[1],
                }
            })
            .collect();
        Ok(values)
    }
}

impl<I: ItemLazy> Metrics<I> {
    /// Syncs `output` (its device work finishes here: at a log line, not every micro-batch)
    /// and feeds it, of a batch of `samples` samples, to every metric ([`update`](Self::update));
    /// local. `phase` ("training", "validation") starts the error's message.
    pub(crate) fn update_lazy(
        &mut self,
        output: I,
        samples: usize,
        progress: Progress,
        iteration: usize,
        lr: Option<f64>,
        phase: &str,
    ) -> anyhow::Result<()> {
        let output = output
            .sync()
            .with_context(|| format!("{phase}: the device failed to compute a batch"))?;
        self.update(&output, samples, progress, iteration, lr)
            .with_context(|| format!("{phase}: cannot read a metric's values from the device"))
    }
}

/// `name value` pairs for a log line, e.g. `Loss 0.1234, Accuracy 97.50%`.
pub fn describe(values: &[MetricValue]) -> String {
    values
        .iter()
        .map(|v| match &v.unit {
            Some(unit) => format!("{} {:.2}{unit}", v.name, v.value),
            None => format!("{} {:.4}", v.name, v.value),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The values as a name → value map (for [`Record`]).
pub fn as_map(values: &[MetricValue]) -> BTreeMap<String, f64> {
    values.iter().map(|v| (v.name.clone(), v.value)).collect()
}

/// Rank 0's outputs; inert on other ranks.
pub struct Reporter {
    file: Option<BufWriter<File>>,
    bar: Option<ProgressBar>,
    /// `output.tensorboard`: the same records as TensorBoard scalars.
    tensorboard: Option<EventWriter>,
}

impl Reporter {
    /// On rank 0, creates `dir` and appends to `dir/metrics.jsonl` (a resumed run continues the
    /// same file), and shows a progress bar over `total_steps` when stderr is a terminal.
    pub fn new(rank: usize, dir: &Path, total_steps: u64, done_steps: u64) -> anyhow::Result<Self> {
        if rank != 0 {
            return Ok(Self {
                file: None,
                bar: None,
                tensorboard: None,
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
            tensorboard: None,
        })
    }

    /// Also writes every record as TensorBoard scalars to a new event file in `dir` (rank 0;
    /// inert on other ranks).
    pub fn with_tensorboard(mut self, dir: &Path) -> anyhow::Result<Self> {
        if self.file.is_some() {
            let writer = EventWriter::create(dir).with_context(|| {
                format!(
                    "cannot create a TensorBoard event file in {}",
                    dir.display()
                )
            })?;
            tracing::info!("TensorBoard events: {}", writer.path().display());
            self.tensorboard = Some(writer);
        }
        Ok(self)
    }

    pub fn record(&mut self, record: &Record) {
        if let Some(f) = &mut self.file {
            if let Ok(line) = serde_json::to_string(record) {
                // Metrics must never stop training: a full disk costs lines, not the job.
                let _ = writeln!(f, "{line}").and_then(|_| f.flush());
            }
        }
        if let Some(events) = &mut self.tensorboard {
            if let Err(e) = events.record(record) {
                tracing::warn!(
                    "cannot write TensorBoard events to {}: {e}; no more will be written",
                    events.path().display()
                );
                self.tensorboard = None;
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

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, Int, Tensor};
    use burn::train::metric::{AccuracyMetric, LossMetric};
    use burn::train::ClassificationOutput;
    use burn_ddp::store::{MemoryStore, Store};
    use burn_ddp::{TcpGroupOptions, TcpProcessGroup};
    use std::sync::Arc;

    /// `hits` correct predictions out of `n` (class 0 predicted, targets 0 for hits).
    fn output(hits: usize, n: usize) -> ClassificationOutput {
        let device = Device::flex();
        let scores = Tensor::<2>::from_floats([[1.0, 0.0]], &device).repeat_dim(0, n);
        let targets: Vec<i64> = (0..n).map(|i| i64::from(i >= hits)).collect();
        let targets = Tensor::<1, Int>::from_ints(targets.as_slice(), &device);
        let loss = Tensor::<1>::from_floats([0.0], &device);
        ClassificationOutput::new(loss, scores, targets)
    }

    #[test]
    fn ranks_combine_with_their_counts_not_as_a_mean_of_means() {
        // Rank 0: 1 of 1 correct; rank 1: 0 of 3. Global: 1 of 4 = 25% (a mean of the
        // per-rank means would say 50%).
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let shards = [(1, 1), (0, 3)];
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mut group =
                        TcpProcessGroup::new(store, rank, 2, TcpGroupOptions::default()).unwrap();
                    let mut metrics =
                        Metrics::<ClassificationOutput>::new().with(AccuracyMetric::new());
                    let (hits, n) = shards[rank];
                    let progress = Progress {
                        items_processed: n,
                        items_total: n,
                        unit: None,
                    };
                    metrics
                        .update(&output(hits, n), n, progress, 0, None)
                        .unwrap();
                    metrics.global(&mut group).unwrap()
                })
            })
            .collect();
        for handle in handles {
            let values = handle.join().unwrap();
            assert_eq!(values.len(), 1);
            assert_eq!(values[0].name, "Accuracy");
            assert!((values[0].value - 25.0).abs() < 1e-9, "{values:?}");
            assert_eq!(values[0].count, 4.0);
        }
    }

    #[test]
    fn a_loss_given_per_batch_is_a_mean_over_samples_whatever_the_batches() {
        // burn-train's LossMetric sees one mean per batch. Batches of 7 (mean loss 1.0) and
        // 1 (mean 9.0): the mean over the 8 samples is 2.0 (a mean of the batch means: 5.0).
        let mut group = burn_ddp::Distributed::standalone().group;
        let device = Device::flex();
        let with_loss = |loss: f32, n: usize| {
            let mut o = output(n, n);
            o.loss = Tensor::<1>::from_floats([loss], &device);
            o
        };
        let mut metrics = Metrics::<ClassificationOutput>::new()
            .with(LossMetric::new())
            .with(AccuracyMetric::new());
        let progress = || Progress {
            items_processed: 0,
            items_total: 8,
            unit: None,
        };
        metrics
            .update(&with_loss(1.0, 7), 7, progress(), 0, None)
            .unwrap();
        metrics
            .update(&with_loss(9.0, 1), 1, progress(), 1, None)
            .unwrap();
        let values = metrics.global(&mut group).unwrap();
        assert_eq!(values[0].name, "Loss");
        assert!((values[0].value - 2.0).abs() < 1e-9, "{values:?}");
        assert_eq!(values[0].count, 8.0);
        assert_eq!(values[1].count, 8.0, "accuracy counts its own samples");
    }

    #[test]
    fn a_metric_with_nothing_counted_is_nan_not_zero() {
        let mut group = burn_ddp::Distributed::standalone().group;
        let mut metrics = Metrics::<ClassificationOutput>::new().with(AccuracyMetric::new());
        let values = metrics.global(&mut group).unwrap();
        assert!(values[0].value.is_nan() && values[0].count == 0.0);
    }
}
