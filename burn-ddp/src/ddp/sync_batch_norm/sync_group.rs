//! The process group of synchronised BatchNorm ([`crate::ddp::SyncBatchNorm`]), installed
//! process-wide.
//!
//! A model's `forward` cannot reach the [`DataParallel`](crate::DataParallel) handle (the
//! training loop holds it, and its group, by `&mut`), and a Burn backward pass cannot take
//! arguments at all. So the statistics travel on a group of their own: a second TCP ring of the
//! same job, formed through the same store under its own namespace (the handle's group's prefix
//! followed by
//! [`ProcessGroupRole::SyncBatchNorm`](crate::ddp::options::groups::ProcessGroupRole)'s suffix). `DataParallel::new` installs its recipe here when the world has
//! more than one rank, and the [`SyncGroupGuard`] it keeps takes it out again when it is
//! dropped. The ring itself is formed at the first synchronised statistic (the first training
//! forward of a `SyncBatchNorm`, which every rank reaches in step), so a job without
//! synchronised BatchNorm opens no second ring.
//!
//! Why a second group and not the job's: its collectives happen inside `forward` and
//! `backward`, interleaved with nothing the DDP step does, so a group of their own keeps the
//! two streams of collectives (and their sequence numbers, which every rank checks) apart.
//!
//! ## The contract
//! - **Collective, in the same order on every rank**: every rank runs the same model, and every
//!   forward in training mode and every backward over it, in step. Each synchronised BatchNorm
//!   layer does two all-reduces in its forward and two in its backward.
//! - **Deadline**: forming the group and each all-reduce have the timeout of the
//!   `DataParallel`'s group (the job's [`DdpOptions::timeout`](crate::DdpOptions::timeout) when
//!   it joined through `DataParallel::from_env`).
//! - **One per process**: the slot is process-wide, as a process is one rank. Ranks run as
//!   threads of one process (tests) must not use synchronised BatchNorm at the same time; the
//!   crate's tests that install a group serialise on [`TEST_LOCK`].
//! - **Failure**: neither a Burn `forward` nor a backward pass can return an error, so a failed
//!   all-reduce is recorded here; the layer then goes on with this rank's local values (the
//!   group is aborted: later calls fail at once, without waiting), and the error is returned by
//!   the next [`DataParallel::step`](crate::DataParallel::step) (or pipeline step)
//!   ([`DdpError::SyncBatchNorm`](crate::DdpError::SyncBatchNorm)), or by
//!   [`take_error`] in a loop of your own. A step taken after such a failure would mix local
//!   and global statistics, so the DDP step refuses it.
//! - **One build of burn-ddp**: the slot is a static of this build. A program with two builds
//!   of burn-ddp (a user's crate depending on a second `burn-ddp` beside the engine's) has two
//!   slots, and a layer of one build finds no group where the other build's `DataParallel`
//!   installed it. So every live `DataParallel` of this build is counted (of any world size: a
//!   world of one installs nothing, but rightly uses local statistics), and a layer about to
//!   train on local statistics while none is alive, in a process the launcher's variables make
//!   a rank of a job of several, stops with an error that says so ([`check_local_statistics`])
//!   instead of training silently on this rank's samples alone.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use std::sync::Arc;

use crate::env::DistEnv;
use crate::error::SyncBatchNormError;
use crate::group::{ProcessGroup, ReduceOp, TcpGroupOptions, TcpProcessGroup};
use crate::store::Store;

/// The installed group, if any, and the first error since [`take_error`] last looked.
///
/// A `Mutex` because Burn may run a model's forward and backward on any thread; the lock is
/// held for one all-reduce of a few per-channel values.
static SLOT: Mutex<Slot> = Mutex::new(Slot {
    installed: None,
    error: None,
});

/// Tells installations apart, so that dropping an old guard never takes out a newer group.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Live [`SyncGroupGuard`]s, one per live `DataParallel` of this build, of any world size
/// (module docs: one build of burn-ddp).
static LIVE_GUARDS: AtomicUsize = AtomicUsize::new(0);

struct Slot {
    installed: Option<(u64, Group)>,
    error: Option<SyncBatchNormError>,
}

/// What is needed to form the group, until its first use; then the group; `Failed` once
/// forming it failed (later calls fail at once, as an aborted group does).
enum Group {
    Recipe(Recipe),
    Formed(Box<TcpProcessGroup>),
    /// Why forming it failed.
    Failed(String),
}

/// The arguments of [`TcpProcessGroup::new`] for the group.
pub struct Recipe {
    pub store: Arc<dyn Store>,
    pub rank: usize,
    pub world_size: usize,
    pub options: TcpGroupOptions,
}

/// Takes the group out of the slot when dropped (if it is still the one installed), and
/// counts as a live `DataParallel` of this build until then. Held by
/// [`DataParallel`](crate::DataParallel).
#[derive(Debug)]
pub struct SyncGroupGuard {
    /// `None` for a world of one, which installs nothing.
    id: Option<u64>,
}

impl SyncGroupGuard {
    fn counted(id: Option<u64>) -> Self {
        LIVE_GUARDS.fetch_add(1, Ordering::Relaxed);
        Self { id }
    }
}

impl Drop for SyncGroupGuard {
    fn drop(&mut self) {
        LIVE_GUARDS.fetch_sub(1, Ordering::Relaxed);
        let Some(own) = self.id else {
            return;
        };
        let mut slot = lock();
        if slot.installed.as_ref().is_some_and(|(id, _)| *id == own) {
            slot.installed = None;
        }
    }
}

/// Installs `recipe` as the process's synchronised-BatchNorm group, replacing any other (and
/// clearing a recorded error). Not collective: the group is formed at its first use.
#[must_use = "the group is taken out again when the guard is dropped"]
pub fn install(recipe: Recipe) -> SyncGroupGuard {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let mut slot = lock();
    if slot.installed.is_some() {
        // One group per process: a second live `DataParallel` (ranks as threads of one
        // process) would send its SyncBatchNorm statistics over the newest handle's group.
        tracing::warn!(
            "a second DataParallel in this process replaces the first one's synchronised-BatchNorm group"
        );
    }
    slot.installed = Some((id, Group::Recipe(recipe)));
    slot.error = None;
    SyncGroupGuard::counted(Some(id))
}

/// The guard of a `DataParallel` of one rank: nothing to install (its layers use local
/// statistics, which are the global ones), but it counts as a live `DataParallel` of this
/// build for [`check_local_statistics`].
pub(crate) fn install_none() -> SyncGroupGuard {
    SyncGroupGuard::counted(None)
}

/// For a synchronised BatchNorm about to train on local statistics (no group of more than one
/// rank installed, [`is_active`] false). That is right in a world of one, and wrong in a rank
/// of a job of several whose `DataParallel` lives in another build of burn-ddp (module docs):
/// this panics then, with [`missing_group`]'s message, since a `forward` cannot return an
/// error. Reads the process environment only while no `DataParallel` of this build is alive.
///
/// # Panics
/// When no `DataParallel` of this build is alive and the launcher's variables make this
/// process a rank of a job of more than one rank.
pub(crate) fn check_local_statistics() {
    let live = LIVE_GUARDS.load(Ordering::Relaxed);
    if let Some(message) = missing_group(live, |name| std::env::var(name).ok()) {
        panic!("{message}");
    }
}

/// Why local statistics would be wrong, if they would: `live_guards` is 0 (no `DataParallel`
/// of this build is alive) while `lookup`'s launcher variables make this process a rank of a
/// job of more than one rank ([`DistEnv::from_lookup`]). Pure.
fn missing_group(live_guards: usize, lookup: impl Fn(&str) -> Option<String>) -> Option<String> {
    if live_guards > 0 {
        return None;
    }
    let job = DistEnv::from_lookup(lookup)
        .ok()
        .filter(|env| env.world_size > 1)?;
    Some(format!(
        "synchronised BatchNorm of burn-ddp {} ({}) is training on rank {} of a job of {} ranks, but no DataParallel of this build of burn-ddp is alive: it has no group to sum the batch statistics over and would normalise with this rank's samples alone. Most likely the program holds two builds of burn-ddp (a `burn-ddp` dependency of your crate beside the engine's; `cargo tree --duplicates` lists them) and the DataParallel of the other one runs the job: take SyncBatchNorm from the engine's build (`trainer::burn_ddp::SyncBatchNorm`) and drop the second dependency, or make them one version and source. A training loop of your own must create its DataParallel before the first training forward; for per-rank statistics on purpose, use `burn::nn::BatchNorm`",
        env!("CARGO_PKG_VERSION"),
        env!("CARGO_MANIFEST_DIR"),
        job.rank,
        job.world_size,
    ))
}

/// Whether a group of more than one rank is installed: synchronised BatchNorm then uses
/// global statistics, else local ones (exactly Burn's `BatchNorm`).
pub fn is_active() -> bool {
    lock()
        .installed
        .as_ref()
        .is_some_and(|(_, group)| match group {
            Group::Recipe(recipe) => recipe.world_size > 1,
            Group::Formed(group) => group.world_size() > 1,
            Group::Failed(_) => true,
        })
}

/// Sums `values` across the ranks in place (every rank gets the same sums). Collective over the
/// installed group, with its deadline; without one (or with one of one rank) the values are
/// left as they are. On failure the error is recorded (see the module docs), the values are
/// left as this rank's own, and `false` is returned.
pub fn sum_in_place(values: &mut [f32]) -> bool {
    let mut slot = lock();
    let Slot { installed, error } = &mut *slot;
    let Some((_, group)) = installed else {
        return true;
    };
    if let Group::Recipe(recipe) = group {
        // The first use: collective, every rank reaches it in the same forward.
        let formed = TcpProcessGroup::new(
            Arc::clone(&recipe.store),
            recipe.rank,
            recipe.world_size,
            recipe.options.clone(),
        );
        *group = match formed {
            Ok(formed) => Group::Formed(Box::new(formed)),
            Err(e) => {
                tracing::error!("synchronised BatchNorm: forming its group failed: {e}");
                let why = e.to_string();
                error.get_or_insert(SyncBatchNormError::Collective(e));
                Group::Failed(why)
            }
        };
        if matches!(group, Group::Failed(_)) {
            return false;
        }
    }
    let group = match group {
        Group::Formed(group) => group,
        Group::Failed(why) => {
            error.get_or_insert(SyncBatchNormError::Unformed(why.clone()));
            return false;
        }
        Group::Recipe(_) => return false,
    };
    if group.world_size() == 1 {
        return true;
    }
    let before = values.to_vec();
    match group.all_reduce(values, ReduceOp::Sum) {
        Ok(()) => true,
        Err(e) => {
            tracing::error!(
                rank = group.rank(),
                "synchronised BatchNorm: all-reduce of statistics failed: {e}"
            );
            // A failed ring may have left partial sums in the buffer.
            values.copy_from_slice(&before);
            error.get_or_insert(SyncBatchNormError::Collective(e));
            false
        }
    }
}

/// The first failure of the group since the last call (and forgets it).
pub fn take_error() -> Option<SyncBatchNormError> {
    lock().error.take()
}

/// Records a failure that happened around the collective (reading a tensor back, say), so it
/// surfaces like a failed all-reduce.
pub(crate) fn record_error(e: SyncBatchNormError) {
    lock().error.get_or_insert(e);
}

/// Held by this crate's tests that install a group or rely on there being none, so they do
/// not run at the same time (cargo runs tests on threads of one process).
#[cfg(test)]
pub(crate) static TEST_LOCK: Mutex<()> = Mutex::new(());

/// The slot, even after a panic elsewhere while it was held: its contents stay consistent (every
/// write is a single assignment), and a poisoned lock must not turn one failure into many.
fn lock() -> MutexGuard<'static, Slot> {
    SLOT.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::{Arc, PoisonError};
    use std::time::Duration;

    use super::*;
    use crate::store::MemoryStore;

    /// A group whose other rank never comes: the first use fails at the deadline, and every
    /// later one fails at once, each recording an error (no step trains on local statistics
    /// unnoticed).
    #[test]
    fn a_group_that_cannot_form_fails_every_use_not_only_the_first() {
        let _alone = TEST_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
        let options = TcpGroupOptions {
            timeout: Duration::from_secs(1),
            ..TcpGroupOptions::default()
        };
        let guard = install(Recipe {
            store: Arc::new(MemoryStore::new()),
            rank: 0,
            world_size: 2,
            options,
        });
        assert!(is_active());
        let mut values = [1.0f32, 2.0];
        assert!(!sum_in_place(&mut values));
        assert_eq!(values, [1.0, 2.0], "this rank's own values are kept");
        assert!(matches!(
            take_error(),
            Some(SyncBatchNormError::Collective(_))
        ));
        assert!(!sum_in_place(&mut values));
        let again = take_error().map(|e| e.to_string()).unwrap_or_default();
        assert!(again.contains("could not be formed"), "{again}");
        drop(guard);
        assert!(!is_active(), "the guard takes the group out");
    }

    /// Local statistics are wrong in a rank of a job of several with no `DataParallel` of this
    /// build alive, and the message says what, where and how to fix it; with one alive (of any
    /// world size), in a job of one, or without launcher variables they are right.
    #[test]
    fn local_statistics_in_a_job_of_several_need_a_data_parallel_of_this_build() {
        let job = |rank: &'static str, world: &'static str| {
            let vars = HashMap::from([
                ("RANK", rank),
                ("WORLD_SIZE", world),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", "29500"),
            ]);
            move |name: &str| vars.get(name).map(|v| v.to_string())
        };
        let message = missing_group(0, job("1", "2")).expect("a rank of two without a group");
        for part in [
            "training on rank 1 of a job of 2 ranks",
            "no DataParallel of this build of burn-ddp is alive",
            env!("CARGO_MANIFEST_DIR"),
            "cargo tree --duplicates",
            "trainer::burn_ddp::SyncBatchNorm",
            "burn::nn::BatchNorm",
        ] {
            assert!(message.contains(part), "{part:?} in {message}");
        }
        assert_eq!(
            missing_group(1, job("1", "2")),
            None,
            "a DataParallel is alive"
        );
        assert_eq!(missing_group(0, job("0", "1")), None, "a job of one");
        assert_eq!(missing_group(0, |_| None), None, "no launcher");
    }
}
