//! ZeRO stage 3's gathers off the training thread: a thread of its own all-gathers the marked
//! blocks, one collective per block, in the order the forward uses them, one block ahead of
//! it; and gathers again the blocks given back after their forward when the backward reads
//! them ([`super::block_storage`]). While block `k` computes, block `k + 1` is on the wire
//! (FSDP's forward prefetch, one block ahead, never further: each block further ahead would
//! be held whole too); a rank holds the block computing and the next one whole, the next
//! one's unpacked part and the rest of its collective's buffer meanwhile (measured:
//! [`super::gathered_bytes`]).
//!
//! ```text
//! micro_batch(model)      every block's shards (tensor handles); block 0 asked for
//! thread                  per request, in order: read and pack the shards, all_gather,
//!                         unpack each parameter into a slot of its own
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
use crate::ddp::fsdp::gathered_bytes::{GatheredBytes, Held};
use crate::ddp::fsdp::shard_gather::shard_len;
use crate::ddp::options::groups::ProcessGroupRole;
use crate::error::DdpError;
use crate::group::{ProcessGroup, TcpGroupOptions, TcpProcessGroup};
use crate::host_values::copy_host_values;
use crate::store::Store;

/// One marked block's shards, as the forward will use them.
#[derive(Debug, Clone)]
pub struct BlockShards {
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
pub struct GatheredBlock {
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
pub struct Prefetcher {
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
                        Command::Restore(storage) => restore_block(&mut group, &storage, &links),
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
    pub fn prefetch(&self, blocks: Vec<BlockShards>) -> Option<PrefetchStream> {
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
pub struct PrefetchStream {
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
    pub fn take_next(&mut self) -> Result<GatheredBlock, String> {
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

/// The block's shards read and packed (this rank's part), all-gathered in one collective
/// into a buffer counted while it lives: the ranks' parts in rank order.
fn gather_packed(
    group: &mut TcpProcessGroup,
    shards: &[Tensor<1>],
    numels: &[usize],
    gathered: &Arc<GatheredBytes>,
) -> Result<(MappedBuffer<f32>, Held), String> {
    let world = group.world_size();
    let lens: Vec<usize> = numels.iter().map(|&n| shard_len(n, world)).collect();
    let per_rank: usize = lens.iter().sum();
    let mut packed = buffer(per_rank)?;
    let mut unread = None;
    let mut offset = 0;
    for (shard, len) in shards.iter().zip(&lens) {
        // On failure zeros: every rank must still enter the collective the others are in.
        if let Err(e) = copy_host_values(shard, &mut packed[offset..offset + len]) {
            unread.get_or_insert(e);
        }
        offset += len;
    }
    let mut all = buffer(per_rank * world)?;
    let counted = gathered.hold(std::mem::size_of_val(&*all) as u64);
    group
        .all_gather(&packed, &mut all)
        .map_err(|e| format!("ZeRO stage 3: gathering a block failed: {e}"))?;
    match unread {
        Some(why) => Err(format!(
            "ZeRO stage 3: a shard could not be read for its gather: {why}"
        )),
        None => Ok((all, counted)),
    }
}

/// Mapped from the kernel and given back after use (module docs of `mapped`): a thread's own
/// malloc heap would keep the largest blocks' buffers for good.
fn buffer(len: usize) -> Result<MappedBuffer<f32>, String> {
    MappedBuffer::<f32>::zeroed(len)
        .map_err(|e| format!("ZeRO stage 3: no memory for a gathered block: {e}"))
}

/// One block for the forward: gathered, then each parameter in a slot of its own.
fn gather_block(
    group: &mut TcpProcessGroup,
    block: BlockShards,
    links: &StorageLinks,
) -> Result<GatheredBlock, String> {
    let world = group.world_size();
    let (all, counted) = gather_packed(group, &block.shards, &block.numels, &links.gauge)?;
    let buffers = match block.numels[..] {
        // One parameter: the buffer is the parameter, then padding; no copy (its slot counts
        // it from here).
        [_] => {
            drop(counted);
            vec![all]
        }
        _ => {
            let mut unpacked = Unpacking::new(all, counted, &block.numels, world);
            let mut buffers = Vec::with_capacity(block.numels.len());
            for (i, &numel) in block.numels.iter().enumerate() {
                let mut values = buffer(numel)?;
                unpacked.parameter(i, &mut values);
                buffers.push(values);
            }
            buffers
        }
    };
    // The slots count their buffers from here (the collective's buffer went, or is theirs).
    let (storage, slots) = BlockStorage::new(block.shards, block.numels, buffers, links.clone());
    Ok(GatheredBlock {
        ids: block.ids,
        slots,
        storage,
    })
}

/// An evicted block gathered again, into the slots its tensors still use.
fn restore_block(group: &mut TcpProcessGroup, storage: &BlockStorage, links: &StorageLinks) {
    let world = group.world_size();
    match gather_packed(group, &storage.shards, &storage.numels, &links.gauge) {
        Ok((all, counted)) => {
            let bytes = std::mem::size_of_val(&*all) as u64;
            let mut unpacked = Unpacking::new(all, counted, &storage.numels, world);
            storage.finish(Ok((bytes, &mut |i, values: &mut [f32]| {
                unpacked.parameter(i, values)
            })));
        }
        Err(e) => storage.finish(Err(e)),
    }
}

/// A gathered block's buffer unpacked parameter by parameter, in order, its consumed part
/// given back to the kernel as it goes, so that the block is not held twice (buffer and
/// parameters) while it is unpacked.
struct Unpacking {
    all: MappedBuffer<f32>,
    counted: Held,
    lens: Vec<usize>,
    offsets: Vec<usize>,
    per_rank: usize,
    /// Bytes given back so far of each rank's part (its consumed prefix).
    released: Vec<usize>,
}

impl Unpacking {
    fn new(all: MappedBuffer<f32>, counted: Held, numels: &[usize], world: usize) -> Self {
        let lens: Vec<usize> = numels.iter().map(|&n| shard_len(n, world)).collect();
        let offsets: Vec<usize> = lens
            .iter()
            .scan(0, |at, len| {
                let start = *at;
                *at += len;
                Some(start)
            })
            .collect();
        Self {
            all,
            counted,
            per_rank: lens.iter().sum(),
            lens,
            offsets,
            released: vec![0; world],
        }
    }

    /// Parameter `i`'s whole values into `full`; the parts of the buffer up to its end given
    /// back (parameters skipped before it included).
    fn parameter(&mut self, i: usize, full: &mut [f32]) {
        let (offset, len) = (self.offsets[i], self.lens[i]);
        unpack_parameter_into(&self.all, self.per_rank, offset, len, full);
        for (rank, released) in self.released.iter_mut().enumerate() {
            let part = rank * self.per_rank;
            let now = self.all.release(part..part + offset + len);
            self.counted.shrink((now - *released) as u64);
            *released = now;
        }
    }
}

/// The whole parameters from `gathered`, the ranks' packed shards in rank order (each rank's
/// block: the parameters' shards one after the other, [`shard_len`]`(numel, world)` values
/// each). Pure.
pub fn unpack_block(gathered: &[f32], numels: &[usize], world: usize) -> Vec<Vec<f32>> {
    let lens: Vec<usize> = numels.iter().map(|&n| shard_len(n, world)).collect();
    let per_rank: usize = lens.iter().sum();
    let mut offset = 0;
    numels
        .iter()
        .zip(&lens)
        .map(|(&numel, &len)| {
            let full = unpack_parameter(gathered, per_rank, offset, len, numel);
            offset += len;
            full
        })
        .collect()
}

/// One parameter of [`unpack_block`]: `numel` values whose shards (`len` values each) start at
/// `offset` in every rank's part of `per_rank` values. Pure.
fn unpack_parameter(
    gathered: &[f32],
    per_rank: usize,
    offset: usize,
    len: usize,
    numel: usize,
) -> Vec<f32> {
    let mut full = vec![0.0; numel];
    unpack_parameter_into(gathered, per_rank, offset, len, &mut full);
    full
}

/// [`unpack_parameter`] into `full` (the parameter's `numel` values). Pure.
fn unpack_parameter_into(
    gathered: &[f32],
    per_rank: usize,
    offset: usize,
    len: usize,
    full: &mut [f32],
) {
    let world = gathered.len() / per_rank.max(1);
    for rank in 0..world {
        let at = rank * len;
        if at >= full.len() {
            break;
        }
        let start = rank * per_rank + offset;
        let take = len.min(full.len() - at);
        full[at..at + take].copy_from_slice(&gathered[start..start + take]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ddp::fsdp::shard_gather::shard_of;

    #[test]
    fn a_packed_block_unpacks_into_its_whole_parameters() {
        let params: Vec<Vec<f32>> = vec![
            (0..10).map(|i| i as f32).collect(),
            vec![100.0],
            (0..7).map(|i| -(i as f32)).collect(),
        ];
        let numels: Vec<usize> = params.iter().map(Vec::len).collect();
        for world in [1, 2, 3, 4, 11] {
            let gathered: Vec<f32> = (0..world)
                .flat_map(|rank| {
                    params
                        .iter()
                        .flat_map(move |p| shard_of(p, rank, world))
                        .collect::<Vec<_>>()
                })
                .collect();
            assert_eq!(
                unpack_block(&gathered, &numels, world),
                params,
                "world {world}"
            );
        }
    }
}
