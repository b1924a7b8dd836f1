//! [`NcclGroupOptions`]: the settings every rank of an NCCL group shares.

use std::time::Duration;

/// Settings of an [`NcclProcessGroup`](super::NcclProcessGroup). Every rank must use the same
/// values.
#[derive(Debug, Clone)]
pub struct NcclGroupOptions {
    /// Deadline of set-up and of each collective (PyTorch's NCCL default is 10 min; 5 min here,
    /// as for the TCP group).
    pub timeout: Duration,
    /// After this long in one call, log which ranks are stuck in it too (Horovod's stall
    /// warning). Repeats every such interval until the timeout.
    pub stall_warning: Duration,
    /// Before each collective, all-gather every rank's description of it (kind, element type,
    /// length, reduce op, root, sequence number) and fail with
    /// [`CollectiveError::Mismatch`](crate::error::CollectiveError::Mismatch) when two ranks
    /// disagree. Costs one extra NCCL all-gather of `32 × world_size` bytes plus two
    /// small host↔device copies and a stream synchronisation per collective: tens of
    /// microseconds on one node, more across nodes — noticeable for many small buckets, negligible
    /// for a few large ones. Off by default, like PyTorch's `TORCH_DISTRIBUTED_DEBUG=DETAIL`.
    /// Must be the same on every rank (the check is itself a collective).
    pub check_collectives: bool,
    /// The group's namespace in the store ([`PrefixStore`](crate::store::PrefixStore)). A
    /// second NCCL group formed through the same store at the same time needs another prefix.
    pub store_prefix: String,
}

impl Default for NcclGroupOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            stall_warning: Duration::from_secs(60),
            check_collectives: false,
            store_prefix: DEFAULT_STORE_PREFIX.into(),
        }
    }
}

/// The namespace of an NCCL group's keys in the store unless its options name another.
pub const DEFAULT_STORE_PREFIX: &str = "pg/nccl";
