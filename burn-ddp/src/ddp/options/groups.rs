//! The process groups a rank of a data-parallel job forms, as the options choose them (pure):
//! each group's name, its namespace in the job's store and its shared-memory ring. The one
//! home of those facts: the groups take their options here when they are formed, and
//! `trainer doctor` counts their ring files in `/dev/shm` from
//! [`DdpOptions::process_groups`](crate::ddp::DdpOptions::process_groups).
//!
//! Every group beside the job's is its own ring over the same ranks, with its own sequence of
//! collectives, so two threads never share one (docs/concurrency.md says which thread issues
//! which collective on which group).

use crate::ddp::options::zero_stage::ZeroStage;
use crate::group::{shm, TcpGroupOptions};

/// Bytes of each shared-memory ring of the job's group at ZeRO stages 2 and 3: a quarter of
/// a piece instead of four pieces. Those stages are chosen to save memory, and every rank
/// maps its own ring and its neighbour's, both counted in its resident memory (8 MiB at the
/// default size). Their gradients mostly go through groups of their own (the communication
/// thread's for marked blocks at stage 2, the shards' at stage 3), so the job's group
/// carries little in bulk: stage 2's all-gather of the parameters, and its gradients where no
/// block is marked. Through a ring smaller than a piece those run at about half the speed
/// (`trainer bench-allreduce` on this project's 2-core machine: 1.3 to 2.5 GB/s against 2.2
/// to 4.2 between 1 and 32 MiB).
pub const SHARDED_JOB_RING_BYTES: usize = 256 << 10;

/// Bytes of the side groups' rings (the overlap's, stage 3's two): one 1 MiB piece, not the
/// job group's four. Each rank maps its own ring and its neighbour's, both counted in its
/// resident memory (two stage-3 groups of 4 MiB rings were 16 MiB of a rank's peak RSS);
/// buckets and shards stream through piece by piece, so a smaller ring only costs more
/// wake-ups. The overlap's is never larger than the job's ([`ProcessGroupRole::ring_bytes`]).
pub const SIDE_RING_BYTES: usize = 1 << 20;

/// Bytes of each shared-memory ring of the job's group at ZeRO stage `stage`.
pub fn job_ring_bytes(stage: ZeroStage) -> usize {
    match stage {
        ZeroStage::Off | ZeroStage::OptimizerState => shm::DEFAULT_CAPACITY,
        ZeroStage::Gradients | ZeroStage::Parameters => SHARDED_JOB_RING_BYTES,
    }
}

/// What a process group of the job is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessGroupRole {
    /// The job's own group: set-up, plain DDP's buckets after backward, ZeRO 1/2's exchanges,
    /// metrics, barriers. Issued from the training thread.
    Job,
    /// The gradient overlap's: buckets summed while backward runs, on the communication
    /// thread.
    Overlap,
    /// ZeRO stage 3's shards: the backward's gathers and reduce-scatters, from the training
    /// thread.
    ShardGather,
    /// ZeRO stage 3's forward gathers, run ahead on the prefetch thread.
    ShardPrefetch,
    /// Synchronised BatchNorm's statistics, formed at its first use (only by models that have
    /// the layer).
    SyncBatchNorm,
}

impl ProcessGroupRole {
    /// How the doctor and error messages name it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Job => "the job group",
            Self::Overlap => "the gradient overlap's group",
            Self::ShardGather => "ZeRO stage 3's gather group",
            Self::ShardPrefetch => "ZeRO stage 3's prefetch group",
            Self::SyncBatchNorm => "synchronised BatchNorm's group",
        }
    }

    /// Appended to the job group's store prefix: each group's rendezvous keys apart.
    pub fn store_suffix(self) -> &'static str {
        match self {
            Self::Job => "",
            Self::Overlap => "/overlap",
            Self::ShardGather => "/shard",
            Self::ShardPrefetch => "/shard-prefetch",
            Self::SyncBatchNorm => "/sync_batch_norm",
        }
    }

    /// Its shared-memory ring's bytes, beside a job group of `job_ring` bytes.
    pub fn ring_bytes(self, job_ring: usize) -> usize {
        match self {
            Self::Job | Self::SyncBatchNorm => job_ring,
            Self::Overlap => SIDE_RING_BYTES.min(job_ring),
            Self::ShardGather | Self::ShardPrefetch => SIDE_RING_BYTES,
        }
    }

    /// This group's options, made from the job group's `job` (the same deadlines and ranks; its
    /// own namespace and ring size).
    pub fn options(self, job: &TcpGroupOptions) -> TcpGroupOptions {
        let mut options = job.clone();
        options.store_prefix.push_str(self.store_suffix());
        options.shared_memory_ring_bytes = self.ring_bytes(job.shared_memory_ring_bytes);
        options
    }
}

/// One group a rank forms
/// ([`DdpOptions::process_groups`](crate::ddp::DdpOptions::process_groups)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedGroup {
    pub role: ProcessGroupRole,
    /// Bytes of its shared-memory ring (each rank maps one file of this size plus a header).
    pub ring_bytes: usize,
    /// Formed only by a model that uses it (synchronised BatchNorm), not by every job.
    pub on_first_use: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ddp::DdpOptions;

    #[test]
    fn zero_stages_2_and_3_give_the_job_and_overlap_groups_smaller_rings() {
        let rings = |stage| {
            let job = DdpOptions::default()
                .with_zero_stage(stage)
                .tcp_options()
                .shared_memory_ring_bytes;
            (job, ProcessGroupRole::Overlap.ring_bytes(job))
        };
        assert_eq!(rings(ZeroStage::Off), (4 << 20, 1 << 20));
        assert_eq!(rings(ZeroStage::OptimizerState), (4 << 20, 1 << 20));
        assert_eq!(rings(ZeroStage::Gradients), (256 << 10, 256 << 10));
        assert_eq!(rings(ZeroStage::Parameters), (256 << 10, 256 << 10));
    }

    #[test]
    fn the_groups_a_rank_forms_follow_the_options() {
        let roles = |options: DdpOptions| -> Vec<ProcessGroupRole> {
            options
                .process_groups()
                .iter()
                .filter(|g| !g.on_first_use)
                .map(|g| g.role)
                .collect()
        };
        use ProcessGroupRole::*;
        let off = DdpOptions::default().with_overlap(false);
        assert_eq!(roles(off), vec![Job]);
        assert_eq!(roles(off.with_overlap(true)), vec![Job, Overlap]);
        assert_eq!(
            roles(
                off.with_overlap(true)
                    .with_zero_stage(ZeroStage::Parameters)
            ),
            vec![Job, ShardGather, ShardPrefetch],
            "stage 3's gradients go through its own groups: no overlap group"
        );
        assert_eq!(
            roles(off.with_overlap(true).with_zero_stage(ZeroStage::Gradients)),
            vec![Job, Overlap]
        );
        let stage_3 = DdpOptions::default().with_zero_stage(ZeroStage::Parameters);
        let rings: Vec<usize> = stage_3
            .process_groups()
            .iter()
            .map(|g| g.ring_bytes)
            .collect();
        assert_eq!(rings, vec![256 << 10, 1 << 20, 1 << 20, 256 << 10]);
        let job = stage_3.tcp_options();
        let shard = ShardGather.options(&job);
        assert_eq!(shard.store_prefix, format!("{}/shard", job.store_prefix));
        assert_eq!(shard.shared_memory_ring_bytes, 1 << 20);
        // Each side group's namespace sits beside the others under the job's.
        let prefetch = ShardPrefetch.options(&job);
        assert_eq!(
            prefetch.store_prefix,
            format!("{}/shard-prefetch", job.store_prefix)
        );
        assert_eq!(
            Overlap.options(&job).store_prefix,
            format!("{}/overlap", job.store_prefix)
        );
    }
}
