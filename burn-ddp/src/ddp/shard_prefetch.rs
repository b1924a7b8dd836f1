//! ZeRO stage 3's forward gathers run ahead of the forward: a thread of its own all-gathers
//! the marked blocks, one collective per block, in the order the forward will use them, and
//! hands each block over when the forward reaches it (a rendezvous, no queue). While block `k`
//! computes, block `k + 1` is on the wire (FSDP's forward prefetch, one block ahead); a rank
//! holds the block computing and the next one whole, the next one twice while it is unpacked
//! from the collective's buffer (measured: [`super::gathered_bytes`]).
//!
//! ```text
//! sharded_forward(model)  every block's shards (tensor handles), one job for the thread
//! thread                  block by block: read and pack the shards, all_gather, unpack each
//!                         parameter whole ─▶ hand-over (waits for the forward: one ahead)
//! mark_block(block k)     takes block k from the queue (gather_shard_prefetched: no
//!                         collective in the forward; backward and recompute as before)
//! ```
//! The thread owns a TCP group of its own (store prefix `…/shard-prefetch`): its collectives
//! run beside the training thread's reduce-scatters and recomputes, each group in the same
//! order on every rank. It always finishes a job's gathers, even when nobody takes them (a
//! forward that marks fewer blocks, a guard dropped early), so the ranks stay in step.

use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use burn::module::ParamId;
use burn::tensor::Tensor;

use super::gathered_bytes::{GatheredBytes, GatheredValues};
use super::mapped::MappedBuffer;
use super::shard_gather::shard_len;
use crate::error::DdpError;
use crate::group::{ProcessGroup, TcpGroupOptions, TcpProcessGroup};
use crate::host_values::host_values;
use crate::store::Store;

/// The suffix of the prefetch group's store prefix.
pub const STORE_SUFFIX: &str = "/shard-prefetch";

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

/// One block gathered whole: each parameter's values, in `ids`' order (counted in the
/// rank's [`GatheredBytes`] while they live).
pub struct GatheredBlock {
    pub ids: Vec<ParamId>,
    pub(crate) full: Vec<GatheredValues>,
}

struct Job {
    blocks: Vec<BlockShards>,
    out: SyncSender<Result<GatheredBlock, String>>,
}

/// The prefetch thread of one rank (module docs).
pub struct Prefetcher {
    jobs: Option<Sender<Job>>,
    handle: Option<JoinHandle<()>>,
    /// How long the forward waits for a block: the group's deadline and a margin.
    deadline: Duration,
}

impl Prefetcher {
    /// Forms the prefetch group and starts the thread, which counts the blocks it gathers in
    /// `gathered`. Collective: every rank calls it at the same point, with the same options
    /// (deadline: `options.timeout`).
    pub fn start(
        store: std::sync::Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        mut options: TcpGroupOptions,
        gathered: Arc<GatheredBytes>,
    ) -> Result<Self, DdpError> {
        options.store_prefix.push_str(STORE_SUFFIX);
        let deadline = options.timeout + Duration::from_secs(30);
        let mut group = TcpProcessGroup::new(store, rank, world_size, options)?;
        let (jobs, inbox) = mpsc::channel::<Job>();
        let handle = std::thread::Builder::new()
            .name(format!("ddp-shard-prefetch-{rank}"))
            .spawn(move || {
                for job in inbox {
                    for block in job.blocks {
                        let gathered = gather_block(&mut group, block, &gathered);
                        // Nobody waiting (the forward moved on): the gathers still run, so
                        // that every rank's group stays in step.
                        let _ = job.out.send(gathered);
                    }
                }
            })
            .map_err(|e| DdpError::Unsupported(format!("cannot start the prefetch thread: {e}")))?;
        Ok(Self {
            jobs: Some(jobs),
            handle: Some(handle),
            deadline,
        })
    }

    /// Queues one forward's blocks; returns the stream the forward takes them from, in order.
    /// Not collective itself; every rank must queue the same blocks (the same model).
    pub fn prefetch(&self, blocks: Vec<BlockShards>) -> Option<PrefetchStream> {
        // A rendezvous: the thread gathers block k + 1 while block k computes, not further
        // ahead (each block further would be held whole too).
        let (out, stream) = mpsc::sync_channel(0);
        self.jobs.as_ref()?.send(Job { blocks, out }).ok()?;
        Some(PrefetchStream {
            blocks: stream,
            deadline: self.deadline,
        })
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// The blocks of one forward, as the thread gathers them.
pub struct PrefetchStream {
    blocks: Receiver<Result<GatheredBlock, String>>,
    deadline: Duration,
}

impl PrefetchStream {
    /// The next block, waiting up to the group's deadline.
    pub fn next(&self) -> Result<GatheredBlock, String> {
        match self.blocks.recv_timeout(self.deadline) {
            Ok(block) => block,
            Err(e) => Err(format!(
                "the prefetched block did not come within {:?}: {e}",
                self.deadline
            )),
        }
    }
}

/// One block: its shards packed, all-gathered in one collective, unpacked.
fn gather_block(
    group: &mut TcpProcessGroup,
    block: BlockShards,
    gathered: &Arc<GatheredBytes>,
) -> Result<GatheredBlock, String> {
    let world = group.world_size();
    let lens: Vec<usize> = block.numels.iter().map(|&n| shard_len(n, world)).collect();
    let per_rank: usize = lens.iter().sum();
    // Mapped from the kernel and given back after the block (module docs of `mapped`): a
    // thread's own malloc heap would keep the largest blocks' buffers for good.
    let buffer = |len| {
        MappedBuffer::<f32>::zeroed(len)
            .map_err(|e| format!("ZeRO stage 3: no memory for a prefetched block: {e}"))
    };
    let mut packed = buffer(per_rank)?;
    let mut unread = None;
    let mut offset = 0;
    for (shard, len) in block.shards.into_iter().zip(&lens) {
        match host_values::<f32>(shard.into_data()) {
            Ok(values) if values.len() == *len => {
                packed[offset..offset + len].copy_from_slice(&values)
            }
            // Zeros: every rank must still enter the collective the others are in.
            other => {
                unread.get_or_insert(format!("{:?}", other.map(|v| v.len())));
            }
        }
        offset += len;
    }
    let mut all = buffer(per_rank * world)?;
    let mut counted = gathered.hold(std::mem::size_of_val(&*all) as u64);
    group
        .all_gather(&packed, &mut all)
        .map_err(|e| format!("ZeRO stage 3: prefetching a block failed: {e}"))?;
    if let Some(why) = unread {
        return Err(format!(
            "ZeRO stage 3: a shard could not be read for the prefetch: {why}"
        ));
    }
    let full = match block.numels[..] {
        // One parameter: the buffer is the parameter, then padding; no copy.
        [numel] => {
            drop(counted);
            vec![GatheredValues::in_buffer(all, numel, gathered)]
        }
        _ => {
            // Parameter by parameter, the buffer's consumed part given back as it goes, so
            // that the block is not held twice (buffer and parameters) while it is unpacked.
            let mut full = Vec::with_capacity(block.numels.len());
            // Bytes given back so far of each rank's part (its consumed prefix).
            let mut released = vec![0; world];
            let mut offset = 0;
            for (&numel, &len) in block.numels.iter().zip(&lens) {
                let values = unpack_parameter(&all, per_rank, offset, len, numel);
                full.push(GatheredValues::new(values, gathered));
                offset += len;
                for (rank, released) in released.iter_mut().enumerate() {
                    let part = rank * per_rank;
                    let now = all.release(part..part + offset);
                    counted.shrink((now - *released) as u64);
                    *released = now;
                }
            }
            full
        }
    };
    Ok(GatheredBlock {
        full,
        ids: block.ids,
    })
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
    let world = gathered.len() / per_rank.max(1);
    let mut full = Vec::with_capacity(len * world);
    for rank in 0..world {
        let start = rank * per_rank + offset;
        full.extend_from_slice(&gathered[start..start + len]);
    }
    full.truncate(numel);
    full
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ddp::shard_gather::shard_of;

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
