//! Items read ahead of the training thread: `training.num_workers` threads call
//! `Dataset::get` on this rank's indices, in order, while the training thread computes
//! (PyTorch's `DataLoader(num_workers=N)`). Only the indices given are read.
//!
//! The app's batcher runs on the training thread, which owns the device: on CubeCL devices
//! (wgpu, CUDA) each thread submits to its own stream, and a tensor uploaded by another thread
//! was seen here to be read before its upload finished (wrong weights on wgpu/lavapipe). Reading
//! and decoding items is the part worth doing ahead; the upload then stays in order.

use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::tensor::Device;

/// How many micro-batches of items each worker may have ready before it waits.
const READY_PER_WORKER: usize = 2;

/// The micro-batches of one epoch (or its rest), in order.
pub struct BatchStream<I> {
    source: Source<I>,
    next: usize,
    len: usize,
    /// Joined on drop, so no worker (nor its share of the data set) outlives the stream.
    workers: Vec<std::thread::JoinHandle<()>>,
}

enum Source<I> {
    /// `num_workers = 0`: read on demand on the calling thread.
    Inline {
        dataset: Arc<dyn Dataset<I>>,
        batches: Vec<Vec<usize>>,
    },
    /// Worker `w` reads micro-batches `w, w + N, ...` into `receivers[w]`.
    Workers(Vec<Receiver<Result<Vec<I>, String>>>),
}

/// The items at `indices`; the error gives the reason the data set reported (its `get` error,
/// or [`crate::app::report_item_error`]), or names an index past its `len()`.
fn read<I>(dataset: &dyn Dataset<I>, indices: &[usize]) -> Result<Vec<I>, String> {
    indices
        .iter()
        .map(|&i| crate::app::read_item(dataset, i, "training set"))
        .collect()
}

impl<I: Send + Sync + 'static> BatchStream<I> {
    /// Starts reading `batches` (each a list of data-set indices) with `workers` threads.
    pub fn new(dataset: Arc<dyn Dataset<I>>, batches: Vec<Vec<usize>>, workers: usize) -> Self {
        let len = batches.len();
        if workers == 0 {
            return Self {
                source: Source::Inline { dataset, batches },
                next: 0,
                len,
                workers: Vec::new(),
            };
        }
        let batches = Arc::new(batches);
        let threads = workers.min(len.max(1));
        let mut handles = Vec::new();
        let receivers = (0..threads)
            .map(|w| {
                let (tx, rx) = sync_channel(READY_PER_WORKER);
                let (dataset, batches) = (dataset.clone(), batches.clone());
                handles.push(std::thread::spawn(move || {
                    for k in (w..batches.len()).step_by(threads) {
                        // The training thread stopped early (the run ended mid-epoch, or it
                        // failed): nothing more to read.
                        if tx.send(read(&*dataset, &batches[k])).is_err() {
                            break;
                        }
                    }
                }));
                rx
            })
            .collect();
        Self {
            source: Source::Workers(receivers),
            next: 0,
            len,
            workers: handles,
        }
    }

    /// The next micro-batch in order, batched by `batcher` on `device` on this thread. An
    /// error says which index the data set lacked, or that a worker stopped (a panic in the
    /// data set: its message is on stderr).
    pub fn next_batch<O, Bt>(&mut self, batcher: &Bt, device: &Device) -> anyhow::Result<O>
    where
        Bt: Batcher<I, O>,
    {
        if self.next >= self.len {
            anyhow::bail!("internal: asked for batch {} of {}", self.next, self.len);
        }
        let k = self.next;
        self.next += 1;
        let items = match &mut self.source {
            Source::Inline { dataset, batches } => read(&**dataset, &batches[k]),
            Source::Workers(receivers) => {
                let n = receivers.len();
                receivers[k % n].recv().unwrap_or_else(|_| {
                    Err(format!(
                        "the data worker reading batch {k} stopped (a panic in the data set's `get`; see its message above)"
                    ))
                })
            }
        };
        let items = items.map_err(|e| anyhow::anyhow!(crate::app::AppError(e)))?;
        Ok(batcher.batch(items, device))
    }
}

impl<I> Drop for BatchStream<I> {
    fn drop(&mut self) {
        // Closing the channels first wakes any worker blocked on a full one (it then stops).
        self.source = Source::Workers(Vec::new());
        for worker in self.workers.drain(..) {
            // A worker that panicked has already reported it on stderr.
            let _ = worker.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::data::dataset::InMemDataset;

    struct Sum;
    impl Batcher<u32, u64> for Sum {
        fn batch(&self, items: Vec<u32>, _device: &Device) -> u64 {
            items.iter().map(|&i| u64::from(i)).sum()
        }
    }

    fn stream(workers: usize, batches: Vec<Vec<usize>>) -> BatchStream<u32> {
        let data: Arc<dyn Dataset<u32>> = Arc::new(InMemDataset::new((0..100).collect()));
        BatchStream::new(data, batches, workers)
    }

    fn next(s: &mut BatchStream<u32>) -> anyhow::Result<u64> {
        s.next_batch::<u64, Sum>(&Sum, &Device::flex())
    }

    #[test]
    fn batches_come_in_order_with_any_number_of_workers() {
        let batches: Vec<Vec<usize>> = (0..10).map(|k| vec![k, k + 10]).collect();
        for workers in [0, 1, 3, 16] {
            let mut s = stream(workers, batches.clone());
            let got: Vec<u64> = (0..10).map(|_| next(&mut s).unwrap()).collect();
            let want: Vec<u64> = (0..10).map(|k| 2 * k + 10).collect();
            assert_eq!(got, want, "{workers} workers");
            assert!(next(&mut s).is_err());
        }
    }

    #[test]
    fn a_missing_index_is_named() {
        let mut s = stream(2, vec![vec![1], vec![100]]);
        assert_eq!(next(&mut s).unwrap(), 1);
        let err = next(&mut s).unwrap_err().to_string();
        assert!(err.contains("index 100") && err.contains("100"), "{err}");
    }
}
