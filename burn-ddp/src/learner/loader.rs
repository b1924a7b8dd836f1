//! [`DistributedDataLoaderBuilder`]: burn's `DataLoaderBuilder` with PyTorch's
//! `DistributedSampler` contract — each rank gets its shard of one global per-epoch order.
//!
//! ```text
//!  epoch e:  order = permutation(len, seed + e)   (or 0..len without shuffle), on every rank
//!            rank r of W takes positions r, r+W, r+2W, …  (the tail padded with the first
//!            positions, so every rank takes as many batches)
//! ```
//! The loader counts its own epochs: the `k`-th call to `iter()` iterates epoch `k` (what
//! burn-train's loop does, once per epoch), so no `set_epoch` can be forgotten. A run that
//! burn-train resumes after epoch `e` starts counting at `e` ([`start_at_epoch`], called by
//! `DdpStrategy`), so its epochs see the orders the uninterrupted run's epochs saw.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::data::dataset::{Dataset, DatasetError};
use burn::prelude::*;

use crate::env::DistEnv;
use crate::sampler::DistributedSampler;

/// Builds a data loader that reads only this rank's shard (module docs). Same calls as burn's
/// `DataLoaderBuilder`; the rank and world size come from the launcher's environment
/// (`RANK`, `WORLD_SIZE`: this project's launcher, torchrun, Slurm, Open MPI), or 0 of 1 when
/// there is none.
///
/// Items are `Result`s, as burn's loaders yield them: a data-set item that cannot be read
/// ends its batch as `Err` (the strategy stops the job with it).
pub struct DistributedDataLoaderBuilder<I, O> {
    batcher: Arc<dyn Batcher<I, O>>,
    batch_size: usize,
    shuffle: Option<u64>,
    drop_last: bool,
    device: Option<Device>,
    rank: Option<(usize, usize)>,
}

impl<I, O> DistributedDataLoaderBuilder<I, O>
where
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    pub fn new<Bt: Batcher<I, O> + 'static>(batcher: Bt) -> Self {
        Self {
            batcher: Arc::new(batcher),
            batch_size: 1,
            shuffle: None,
            drop_last: false,
            device: None,
            rank: None,
        }
    }

    /// Items per batch on this rank (the global batch is `world_size` times it).
    pub fn batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// A new global order every epoch, seeded by `seed + epoch` (the same on every rank).
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.shuffle = Some(seed);
        self
    }

    /// Accepted for compatibility with burn's builder; items are read on the training thread.
    pub fn num_workers(self, _num_workers: usize) -> Self {
        self
    }

    /// The device batches are made on (as burn's builder: its default device without one;
    /// `DdpStrategy` moves the loader to the rank's device).
    pub fn set_device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Drops the tail that does not fill a position on every rank, instead of padding it.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// This rank and the world size, instead of the environment's (tests, own launchers).
    pub fn rank(mut self, rank: usize, world_size: usize) -> Self {
        self.rank = Some((rank, world_size));
        self
    }

    pub fn build<D: Dataset<I> + 'static>(self, dataset: D) -> Arc<dyn DataLoader<O>> {
        let (rank, world) = self.rank.unwrap_or_else(rank_from_env);
        let world = world.max(1);
        let sampler = DistributedSampler::new(dataset.len(), world, rank.min(world - 1))
            .with_shuffle(self.shuffle.is_some())
            .with_seed(self.shuffle.unwrap_or(0))
            .with_drop_last(self.drop_last);
        let epoch = Arc::new(AtomicU64::new(0));
        let registration = Arc::new(());
        let loader: Arc<dyn DataLoader<O>> = Arc::new(ShardedDataLoader {
            dataset: Arc::new(dataset),
            batcher: self.batcher,
            batch_size: self.batch_size,
            sampler,
            device: self.device.unwrap_or_default(),
            epoch: epoch.clone(),
            window: None,
            _registration: Some(registration.clone()),
        });
        // So that `DdpStrategy` knows not to slice it again, and can set its epoch on resume.
        if let Ok(mut built) = built_loaders().lock() {
            // Entries of dropped loaders go: their addresses may be reused by other loaders.
            built.retain(|_, entry| entry.alive.strong_count() > 0);
            built.insert(
                address(&loader),
                Registration {
                    alive: Arc::downgrade(&registration),
                    epoch,
                },
            );
        }
        loader
    }
}

/// A loader [`DistributedDataLoaderBuilder`] built: alive while that loader is (an address
/// alone could be reused by another loader after it was dropped), and its epoch counter.
struct Registration {
    alive: Weak<()>,
    epoch: Arc<AtomicU64>,
}

/// The loaders [`DistributedDataLoaderBuilder`] built, by the loader's address: burn-train
/// hands the strategy `Arc<dyn DataLoader>`s, which cannot be downcast.
fn built_loaders() -> &'static Mutex<HashMap<usize, Registration>> {
    static BUILT: OnceLock<Mutex<HashMap<usize, Registration>>> = OnceLock::new();
    BUILT.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The epoch counter of `loader`, if [`DistributedDataLoaderBuilder`] built it and it is alive.
fn registered_epoch<T: ?Sized>(loader: &Arc<T>) -> Option<Arc<AtomicU64>> {
    let built = built_loaders().lock().ok()?;
    let entry = built.get(&address(loader))?;
    (entry.alive.strong_count() > 0).then(|| entry.epoch.clone())
}

fn address<T: ?Sized>(loader: &Arc<T>) -> usize {
    Arc::as_ptr(loader) as *const () as usize
}

/// Whether [`DistributedDataLoaderBuilder`] built `loader` (it is then already sharded).
pub(super) fn is_distributed<T: ?Sized>(loader: &Arc<T>) -> bool {
    registered_epoch(loader).is_some()
}

/// Makes the next `iter()` of `loader` (and of the loaders derived from it) iterate `epoch`
/// (0-based), as it would after `epoch` earlier calls. Returns whether `loader` is one of
/// [`DistributedDataLoaderBuilder`]'s; other loaders are left as they are. Not collective.
pub(super) fn start_at_epoch<T: ?Sized>(loader: &Arc<T>, epoch: u64) -> bool {
    match registered_epoch(loader) {
        Some(counter) => {
            counter.store(epoch, Ordering::SeqCst);
            true
        }
        None => false,
    }
}

/// (rank, world size) of the launcher's environment; 0 of 1 without one (or when it is
/// malformed: forming the process group then reports that, with the variable's name).
fn rank_from_env() -> (usize, usize) {
    DistEnv::from_env()
        .map(|env| (env.rank, env.world_size))
        .unwrap_or((0, 1))
}

/// This rank's shard of the data set, batched. See [`DistributedDataLoaderBuilder`].
pub struct ShardedDataLoader<I, O> {
    dataset: Arc<dyn Dataset<I>>,
    batcher: Arc<dyn Batcher<I, O>>,
    batch_size: usize,
    sampler: DistributedSampler,
    device: Device,
    /// Shared by the loaders `to_device` and `slice` derive, so they count epochs together.
    epoch: Arc<AtomicU64>,
    /// Positions of this rank's shard to keep (`slice`); `None`: all.
    window: Option<(usize, usize)>,
    /// Held by the loader the builder made (not by derived ones): its registration is alive
    /// while it is.
    _registration: Option<Arc<()>>,
}

impl<I, O> ShardedDataLoader<I, O> {
    fn derive(&self, device: Device, window: Option<(usize, usize)>) -> Self {
        Self {
            dataset: self.dataset.clone(),
            batcher: self.batcher.clone(),
            batch_size: self.batch_size,
            sampler: self.sampler.clone(),
            device,
            epoch: self.epoch.clone(),
            window,
            _registration: None,
        }
    }

    fn shard_len(&self) -> usize {
        let all = self.sampler.indices(0, 0).len();
        match self.window {
            Some((start, end)) => end.min(all).saturating_sub(start),
            None => all,
        }
    }
}

impl<I, O> DataLoader<O> for ShardedDataLoader<I, O>
where
    I: Send + Sync + Clone + 'static,
    O: Send + 'static,
{
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<O> + 'a> {
        let epoch = self.epoch.fetch_add(1, Ordering::SeqCst);
        let mut indices = self.sampler.indices(epoch, 0);
        if let Some((start, end)) = self.window {
            let end = end.min(indices.len());
            indices = indices[start.min(end)..end].to_vec();
        }
        Box::new(ShardIter {
            loader: self,
            indices,
            next: 0,
        })
    }

    fn num_items(&self) -> usize {
        self.shard_len()
    }

    fn to_device(&self, device: &Device) -> Arc<dyn DataLoader<O>> {
        Arc::new(self.derive(device.clone(), self.window))
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<O>> {
        let base = self.window.map_or(0, |(s, _)| s);
        Arc::new(self.derive(self.device.clone(), Some((base + start, base + end))))
    }
}

struct ShardIter<'a, I, O> {
    loader: &'a ShardedDataLoader<I, O>,
    indices: Vec<usize>,
    next: usize,
}

impl<I, O> Iterator for ShardIter<'_, I, O> {
    type Item = Result<O, DatasetError>;

    fn next(&mut self) -> Option<Self::Item> {
        let end = (self.next + self.loader.batch_size).min(self.indices.len());
        if end <= self.next {
            return None;
        }
        let items: Result<Vec<I>, DatasetError> = self.indices[self.next..end]
            .iter()
            .map(|&i| self.loader.dataset.get(i))
            .collect();
        self.next = end;
        Some(items.map(|items| self.loader.batcher.batch(items, &self.loader.device)))
    }
}

impl<I, O> DataLoaderIterator<O> for ShardIter<'_, I, O> {
    fn progress(&self) -> Progress {
        Progress::new(self.next, self.indices.len(), Some("items".to_string()))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use burn::data::dataset::InMemDataset;

    use super::*;

    /// Batches of data-set items, as they are.
    #[derive(Clone)]
    struct Items;
    impl Batcher<usize, Vec<usize>> for Items {
        fn batch(&self, items: Vec<usize>, _: &Device) -> Vec<usize> {
            items
        }
    }

    fn epoch_of(rank: usize, world: usize, loader_epochs: usize) -> Vec<Vec<usize>> {
        let loader = DistributedDataLoaderBuilder::<usize, Vec<usize>>::new(Items)
            .batch_size(4)
            .shuffle(9)
            .rank(rank, world)
            .build(InMemDataset::new((0..23).collect::<Vec<usize>>()));
        (0..loader_epochs)
            .map(|_| loader.iter().flat_map(Result::unwrap).collect())
            .collect()
    }

    #[test]
    fn ranks_share_one_permutation_per_epoch_and_take_as_many_batches() {
        let world = 3;
        let ranks: Vec<_> = (0..world).map(|r| epoch_of(r, world, 2)).collect();
        for epoch in 0..2 {
            let seen: BTreeSet<usize> = ranks.iter().flat_map(|r| r[epoch].clone()).collect();
            assert_eq!(seen, (0..23).collect(), "epoch {epoch} covers the data set");
            assert!(ranks.iter().all(|r| r[epoch].len() == 8), "23 padded to 24");
        }
        assert_ne!(ranks[0][0], ranks[0][1], "a new order every epoch");
        // One rank alone sees the same global order, in position order.
        let alone = epoch_of(0, 1, 1).remove(0);
        let interleaved: Vec<usize> = (0..8)
            .flat_map(|k| ranks.iter().map(move |r| r[0][k]))
            .take(23)
            .collect();
        assert_eq!(alone, interleaved);
    }

    #[test]
    fn a_loader_started_at_an_epoch_iterates_what_the_uninterrupted_one_did_then() {
        let build = || {
            DistributedDataLoaderBuilder::<usize, Vec<usize>>::new(Items)
                .batch_size(4)
                .shuffle(9)
                .rank(1, 3)
                .build(InMemDataset::new((0..23).collect::<Vec<usize>>()))
        };
        let straight = epoch_of(1, 3, 4);
        let resumed = build();
        assert!(start_at_epoch(&resumed, 2), "a distributed loader");
        // Loaders derived from it (burn-train moves loaders to devices) share the counter.
        let on_device = resumed.to_device(&Device::flex());
        let epochs: Vec<Vec<usize>> = (0..2)
            .map(|_| on_device.iter().flat_map(Result::unwrap).collect())
            .collect();
        assert_eq!(epochs, straight[2..]);
        assert_ne!(
            straight[2], straight[0],
            "epochs differ, so the test can fail"
        );

        let plain = burn::data::dataloader::DataLoaderBuilder::<usize, Vec<usize>>::new(Items)
            .batch_size(4)
            .build(InMemDataset::new(vec![1, 2]));
        assert!(!start_at_epoch(&plain, 2), "other loaders are left alone");
        assert!(is_distributed(&resumed) && !is_distributed(&plain));
    }

    #[test]
    fn a_dropped_loader_is_forgotten_so_its_address_cannot_vouch_for_another() {
        let loader = DistributedDataLoaderBuilder::<usize, Vec<usize>>::new(Items)
            .rank(0, 2)
            .build(InMemDataset::new(vec![1, 2, 3]));
        let at = address(&loader);
        // A derived loader outliving the one the builder made does not keep it registered.
        let derived = loader.to_device(&Device::flex());
        assert!(is_distributed(&loader));
        drop(loader);
        let entry_alive = built_loaders()
            .lock()
            .map(|built| built.get(&at).is_some_and(|e| e.alive.strong_count() > 0))
            .unwrap_or(true);
        assert!(
            !entry_alive,
            "a loader at this address now would not count as distributed"
        );
        drop(derived);
    }
}
