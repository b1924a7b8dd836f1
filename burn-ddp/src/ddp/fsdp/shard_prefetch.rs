//! ZeRO stage 3's gathers off the training thread: a thread of its own all-gathers the marked
//! blocks, in the order the forward uses them, one block ahead of it; and gathers again the
//! blocks given back after their forward when the backward reads them
//! ([`super::block_storage`]). While block `k` computes, block `k + 1` is on the wire (FSDP's
//! forward prefetch, one block ahead, never further: each block further ahead would be held
//! whole too); a rank holds the block computing and the next one whole (measured:
//! [`super::gathered_bytes`]).
//!
//! Each parameter is gathered in place, in the mapping that becomes its tensor's storage: the
//! rank's shard is copied into its part and an all-gather fills the others' parts. One
//! collective per parameter rather than per block, because a block's parameters packed into
//! one buffer would need that buffer and an unpacking copy besides the parameters, and on a
//! CPU the fresh pages of those buffers cost more than the collectives' calls (measured: a
//! rank of the reference transformer faulted in about 12,000 pages a step fewer).
//!
//! ```text
//! micro_batch(model)      every block's shards (tensor handles); block 0 asked for
//! thread                  per request, in order, each parameter: its shard copied into a
//!                         slot of its own, all-gathered there in place
//! mark_block(block k)     takes block k (no collective in the forward), asks for block k + 1
//! a read of an evicted    asks for that block again (and the one the forward ran before
//!   block (backward)      it), waits for it
//! ```
//! The thread owns a TCP group of its own (store prefix `…/shard-prefetch`): its collectives
//! run beside the training thread's reduce-scatters, each group in the same order on every
//! rank, since the training thread asks for every gather in the model's order. A block
//! asked for and not taken (a forward that marks fewer blocks) is still gathered, on every
//! rank alike.

use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use burn::module::ParamId;
use burn::tensor::Tensor;

use crate::ddp::buckets::mapped::MappedBuffer;
use crate::ddp::fsdp::block_storage::{
    BlockStorage, ParamSlot, RestoreReport, Restorer, StorageLinks,
};
use crate::ddp::fsdp::gathered_bytes::GatheredBytes;
use crate::ddp::fsdp::shard_gather::shard_len;
use crate::ddp::options::groups::ProcessGroupRole;
use crate::error::DdpError;
use crate::group::{ProcessGroup, TcpGroupOptions, TcpProcessGroup};
use crate::host_values::copy_host_values;
use crate::store::Store;

/// One marked block's shards, as the forward will use them.
#[derive(Debug, Clone)]
pub(crate) struct BlockShards {
    /// Its sharded parameters, in the block's visit order.
    pub ids: Vec<ParamId>,
    /// This rank's shard of each ([`shard_len`] values; read when the block's turn comes).
    pub shards: Vec<Tensor<1>>,
    /// The whole parameters' sizes.
    pub numels: Vec<usize>,
}

/// One block gathered whole: each parameter's values in its slot, in `ids`' order (counted
/// in the rank's [`GatheredBytes`] while they are in memory), and the block's storage
/// (evicted once the forward has moved on, [`super::block_storage`]).
pub(crate) struct GatheredBlock {
    pub ids: Vec<ParamId>,
    pub(crate) slots: Vec<Arc<ParamSlot>>,
    pub(crate) storage: Arc<BlockStorage>,
}

/// What the thread does, in the order asked (the same on every rank).
enum Command {
    /// Gather a block for the forward; the result to `out`.
    Gather {
        block: BlockShards,
        out: SyncSender<Result<GatheredBlock, String>>,
    },
    /// Gather an evicted block again, into its slots.
    Restore(Arc<BlockStorage>),
}

/// The way to the thread, closed when the [`Prefetcher`] is dropped (slots that outlive it
/// then fail their restore instead of keeping the thread alive).
type Commands = Arc<Mutex<Option<Sender<Command>>>>;

fn send(commands: &Commands, command: Command) -> Result<(), String> {
    let commands = commands.lock().unwrap_or_else(PoisonError::into_inner);
    match commands.as_ref().map(|c| c.send(command)) {
        Some(Ok(())) => Ok(()),
        _ => Err("ZeRO stage 3: the prefetch thread has stopped".into()),
    }
}

/// The prefetch thread of one rank (module docs).
pub(crate) struct Prefetcher {
    commands: Commands,
    handle: Option<JoinHandle<()>>,
    /// How long the forward waits for a block: the group's deadline and a margin.
    deadline: Duration,
}

impl Prefetcher {
    /// Forms the prefetch group and starts the thread, which counts the blocks it gathers in
    /// `gathered` and reports each restore (its bytes, or its failure) to `report`. Collective: every rank calls it at
    /// the same point, with the job group's options `job` (deadline: its timeout; namespace
    /// and ring: [`ProcessGroupRole::ShardPrefetch`]).
    pub(crate) fn start(
        store: std::sync::Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        job: &TcpGroupOptions,
        gathered: Arc<GatheredBytes>,
        report: RestoreReport,
    ) -> Result<Self, DdpError> {
        let options = ProcessGroupRole::ShardPrefetch.options(job);
        let deadline = options.timeout + Duration::from_secs(30);
        let mut group = TcpProcessGroup::new(store, rank, world_size, options)?;
        let (sender, inbox) = mpsc::channel::<Command>();
        let commands: Commands = Arc::new(Mutex::new(Some(sender)));
        let restorer: Restorer = {
            let commands = commands.clone();
            Arc::new(move |block| send(&commands, Command::Restore(block)))
        };
        // What the thread gives each block's storage it makes.
        let links = StorageLinks {
            restorer,
            report,
            gauge: gathered,
            deadline,
        };
        let handle = std::thread::Builder::new()
            .name(format!("ddp-shard-prefetch-{rank}"))
            .spawn(move || {
                for command in inbox {
                    match command {
                        Command::Gather { block, out } => {
                            // Nobody waiting (a forward that marked fewer blocks): the gather
                            // still ran, on every rank alike.
                            let _ = out.send(gather_block(&mut group, block, &links));
                        }
                        Command::Restore(storage) => restore_block(&mut group, &storage),
                    }
                }
            })
            .map_err(|e| DdpError::Unsupported(format!("cannot start the prefetch thread: {e}")))?;
        Ok(Self {
            commands,
            handle: Some(handle),
            deadline,
        })
    }

    /// Queues one forward's blocks; returns the stream the forward takes them from, in order
    /// (the first one asked for now, each next one when the forward takes the one before).
    /// Not collective itself; every rank must queue the same blocks (the same model).
    pub(crate) fn prefetch(&self, blocks: Vec<BlockShards>) -> Option<PrefetchStream> {
        let mut stream = PrefetchStream {
            queued: blocks.into_iter(),
            pending: None,
            commands: self.commands.clone(),
            deadline: self.deadline,
        };
        stream.ask_next().ok()?;
        Some(stream)
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        drop(
            self.commands
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// The blocks of one forward, as the thread gathers them: one block ahead of the forward
/// (asked for when the forward takes the one before), not further (each block further would
/// be held whole too).
pub(crate) struct PrefetchStream {
    queued: std::vec::IntoIter<BlockShards>,
    pending: Option<Receiver<Result<GatheredBlock, String>>>,
    commands: Commands,
    deadline: Duration,
}

impl PrefetchStream {
    fn ask_next(&mut self) -> Result<(), String> {
        self.pending = None;
        if let Some(block) = self.queued.next() {
            let (out, pending) = mpsc::sync_channel(1);
            send(&self.commands, Command::Gather { block, out })?;
            self.pending = Some(pending);
        }
        Ok(())
    }

    /// The next block, waiting up to the group's deadline; the one after it is asked for.
    pub(crate) fn take_next(&mut self) -> Result<GatheredBlock, String> {
        let pending = self
            .pending
            .take()
            .ok_or("the forward marked more blocks than were prefetched")?;
        let block = match pending.recv_timeout(self.deadline) {
            Ok(block) => block,
            Err(e) => Err(format!(
                "the prefetched block did not come within {:?}: {e}",
                self.deadline
            )),
        };
        self.ask_next()?;
        block
    }
}

/// One parameter gathered whole, in place, into `full` (its values, then padding:
/// [`shard_len`]` × world` values): this rank's shard copied into its own part, then the
/// ranks' parts all-gathered (one collective per parameter, with no buffer but the
/// parameter's own). Returns the bytes of the collective's buffer.
fn gather_parameter(
    group: &mut TcpProcessGroup,
    shard: &Tensor<1>,
    full: &mut [f32],
) -> Result<u64, String> {
    let (rank, world) = (group.rank(), group.world_size());
    let len = full.len() / world.max(1);
    // On failure zeros: every rank must still enter the collective the others are in.
    let unread = copy_host_values(shard, &mut full[rank * len..(rank + 1) * len]).err();
    let counts = vec![len; world];
    group
        .all_gather_v(full, &counts)
        .map_err(|e| format!("ZeRO stage 3: gathering a block failed: {e}"))?;
    match unread {
        Some(why) => Err(format!(
            "ZeRO stage 3: a shard could not be read for its gather: {why}"
        )),
        None => Ok(std::mem::size_of_val(full) as u64),
    }
}

/// A buffer for one whole parameter of `numel` values and its padding (module docs of
/// `mapped`: mapped from the kernel and given back after use, since a thread's own malloc
/// heap would keep the largest blocks' memory for good).
fn parameter_buffer(numel: usize, world: usize) -> Result<MappedBuffer<f32>, String> {
    MappedBuffer::<f32>::zeroed(shard_len(numel, world) * world)
        .map_err(|e| format!("ZeRO stage 3: no memory for a gathered block: {e}"))
}

/// One block for the forward: each parameter gathered into a slot of its own. After a
/// failure the block's other gathers still run (as on the ranks that did not fail); the
/// first failure is returned.
fn gather_block(
    group: &mut TcpProcessGroup,
    block: BlockShards,
    links: &StorageLinks,
) -> Result<GatheredBlock, String> {
    let world = group.world_size();
    let mut buffers = Vec::with_capacity(block.numels.len());
    // Counted as they are gathered; the slots count them from `BlockStorage::new` on.
    let mut counted = Vec::with_capacity(block.numels.len());
    let mut failed = None;
    for (shard, &numel) in block.shards.iter().zip(&block.numels) {
        let mut full = parameter_buffer(numel, world)?;
        counted.push(links.gauge.hold(std::mem::size_of_val(&*full) as u64));
        if let Err(e) = gather_parameter(group, shard, &mut full) {
            failed.get_or_insert(e);
        }
        buffers.push(full);
    }
    if let Some(why) = failed {
        return Err(why);
    }
    drop(counted);
    let (storage, slots) = BlockStorage::new(block.shards, block.numels, buffers, links.clone());
    Ok(GatheredBlock {
        ids: block.ids,
        slots,
        storage,
    })
}

/// An evicted block gathered again, in place, into the slots its tensors still use.
fn restore_block(group: &mut TcpProcessGroup, storage: &BlockStorage) {
    let world = group.world_size();
    storage.restore(&mut |i, slot: Option<&mut [f32]>| {
        let shard = &storage.shards[i];
        match slot {
            Some(full) => gather_parameter(group, shard, full),
            None => {
                let mut full = parameter_buffer(storage.numels[i], world)?;
                gather_parameter(group, shard, &mut full)
            }
        }
    });
}
