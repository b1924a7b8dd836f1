//! Batches built ahead of the training thread: `training.num_workers` threads call
//! `Dataset::get` on this rank's indices and the app's batcher, in order, while the training
//! thread computes (PyTorch's `DataLoader(num_workers=N)`). Only the indices given are read.

use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::tensor::backend::Backend;

/// How many batches each worker may have ready before it waits for the training thread.
const READY_PER_WORKER: usize = 2;

/// The batches of one epoch (or its rest), in order.
pub struct BatchStream<O> {
    source: Source<O>,
    next: usize,
    len: usize,
    /// Joined on drop, so no worker (nor its share of the data set) outlives the stream.
    workers: Vec<std::thread::JoinHandle<()>>,
}

enum Source<O> {
    /// `num_workers = 0`: built on demand on the calling thread.
    Inline(Box<dyn FnMut(usize) -> Result<O, String>>),
    /// Worker `w` builds batches `w, w + N, ...` into `receivers[w]`.
    Workers(Vec<Receiver<Result<O, String>>>),
}

/// Reads `indices[k]` from `dataset` and batches them, for every `k`; the error names the index
/// the data set did not have.
fn build<B, I, O, Bt>(
    dataset: &dyn Dataset<I>,
    batcher: &Bt,
    device: &B::Device,
    indices: &[usize],
) -> Result<O, String>
where
    B: Backend,
    Bt: Batcher<B, I, O> + ?Sized,
{
    let items = indices
        .iter()
        .map(|&i| {
            dataset.get(i).ok_or_else(|| {
                format!(
                    "the data set returned no item for index {i} (its len() is {}): `get` must return Some for every index below `len`",
                    dataset.len()
                )
            })
        })
        .collect::<Result<Vec<I>, String>>()?;
    Ok(batcher.batch(items, device))
}

impl<O: Send + 'static> BatchStream<O> {
    /// Starts building `batches` (each a list of data-set indices) with `workers` threads.
    pub fn new<B, I, Bt>(
        dataset: Arc<dyn Dataset<I>>,
        batcher: Arc<Bt>,
        device: B::Device,
        batches: Vec<Vec<usize>>,
        workers: usize,
    ) -> Self
    where
        B: Backend,
        I: Send + Sync + 'static,
        Bt: Batcher<B, I, O> + 'static,
    {
        let len = batches.len();
        if workers == 0 {
            let build_one =
                move |k: usize| build::<B, I, O, Bt>(&*dataset, &*batcher, &device, &batches[k]);
            return Self {
                source: Source::Inline(Box::new(build_one)),
                next: 0,
                len,
                workers: Vec::new(),
            };
        }
        let batches = Arc::new(batches);
        let mut handles = Vec::new();
        let receivers = (0..workers.min(len.max(1)))
            .map(|w| {
                let (tx, rx) = sync_channel(READY_PER_WORKER);
                let (dataset, batcher, device, batches) = (
                    dataset.clone(),
                    batcher.clone(),
                    device.clone(),
                    batches.clone(),
                );
                let step = workers.min(len.max(1));
                handles.push(std::thread::spawn(move || {
                    for k in (w..batches.len()).step_by(step) {
                        let batch =
                            build::<B, I, O, Bt>(&*dataset, &*batcher, &device, &batches[k]);
                        // The training thread stopped early (the run ended mid-epoch, or it
                        // failed): nothing more to build.
                        if tx.send(batch).is_err() {
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

    /// The next batch in order. An error says which index the data set lacked, or that a worker
    /// stopped (a panic in the data set or the batcher: its message is on stderr).
    pub fn next_batch(&mut self) -> anyhow::Result<O> {
        if self.next >= self.len {
            anyhow::bail!("internal: asked for batch {} of {}", self.next, self.len);
        }
        let k = self.next;
        self.next += 1;
        let batch = match &mut self.source {
            Source::Inline(build_one) => build_one(k),
            Source::Workers(receivers) => {
                let n = receivers.len();
                receivers[k % n].recv().unwrap_or_else(|_| {
                    Err(format!(
                        "the batch worker building batch {k} stopped (a panic in the data set's `get` or in the batcher; see its message above)"
                    ))
                })
            }
        };
        batch.map_err(|e| anyhow::anyhow!(crate::app::AppError(e)))
    }
}

impl<O> Drop for BatchStream<O> {
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
    use burn::backend::Flex;
    use burn::data::dataset::InMemDataset;

    struct Sum;
    impl Batcher<Flex, u32, u64> for Sum {
        fn batch(&self, items: Vec<u32>, _device: &burn::backend::flex::FlexDevice) -> u64 {
            items.iter().map(|&i| u64::from(i)).sum()
        }
    }

    fn stream(workers: usize, batches: Vec<Vec<usize>>) -> BatchStream<u64> {
        let data: Arc<dyn Dataset<u32>> = Arc::new(InMemDataset::new((0..100).collect()));
        BatchStream::new::<Flex, u32, Sum>(
            data,
            Arc::new(Sum),
            Default::default(),
            batches,
            workers,
        )
    }

    #[test]
    fn batches_come_in_order_with_any_number_of_workers() {
        let batches: Vec<Vec<usize>> = (0..10).map(|k| vec![k, k + 10]).collect();
        for workers in [0, 1, 3, 16] {
            let mut s = stream(workers, batches.clone());
            let got: Vec<u64> = (0..10).map(|_| s.next_batch().unwrap()).collect();
            let want: Vec<u64> = (0..10).map(|k| 2 * k + 10).collect();
            assert_eq!(got, want, "{workers} workers");
            assert!(s.next_batch().is_err());
        }
    }

    #[test]
    fn a_missing_index_is_named() {
        let mut s = stream(2, vec![vec![1], vec![100]]);
        assert_eq!(s.next_batch().unwrap(), 1);
        let err = s.next_batch().unwrap_err().to_string();
        assert!(err.contains("index 100") && err.contains("100"), "{err}");
    }
}
