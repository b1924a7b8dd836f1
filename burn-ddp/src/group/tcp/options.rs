//! The settings of a TCP group: [`TcpGroupOptions`].

use std::net::IpAddr;
use std::time::Duration;

use crate::group::shm;

/// The namespace of a TCP group's keys in the store unless its options name another.
pub const DEFAULT_STORE_PREFIX: &str = "pg/default";

/// Settings of a [`TcpProcessGroup`]. Every rank of a group must use the same values.
#[derive(Debug, Clone)]
pub struct TcpGroupOptions {
    /// Deadline of set-up and of each collective (PyTorch's default is 30 min for NCCL; 5 min
    /// here: a collective on a CPU ring that takes longer than that has a dead peer).
    pub timeout: Duration,
    /// After this long without finishing a collective, log who has not arrived (Horovod's stall
    /// warning, 60 s). Repeats every such interval until the timeout.
    pub stall_warning: Duration,
    /// Bytes per pipelined piece; smaller pieces overlap more, larger ones cost fewer syscalls.
    pub piece_bytes: usize,
    /// The job's shared secret; ring connections without it are refused.
    pub token: String,
    /// The address to listen on and publish for ring connections. `None`: loopback.
    pub advertise_ip: Option<IpAddr>,
    /// Move data to neighbours on the same host through shared memory (module docs).
    /// `Some(true)`: yes, where the neighbour shares the host; `Some(false)`: sockets only;
    /// `None` (the default): not decided by the caller, which the group takes as sockets only,
    /// and [`crate::init::Distributed::init`] resolves from `BURN_DDP_SHM` (on unless `0`).
    pub shared_memory: Option<bool>,
    /// Bytes of each shared-memory ring this rank receives through (its `/dev/shm` file is this
    /// plus a page). Default [`shm::DEFAULT_CAPACITY`], four pieces; a group that carries less
    /// at a time (the overlap's buckets) can take less, since every rank maps both its own ring
    /// and its neighbour's and both count in its resident memory. Need not match across ranks.
    pub shared_memory_ring_bytes: usize,
    /// The group's namespace in the store ([`PrefixStore`]): two groups formed through one store
    /// at the same time need different prefixes. Default [`DEFAULT_STORE_PREFIX`].
    pub store_prefix: String,
    /// How long a rank that lost a peer waits for the other ranks' failure reports before it
    /// names the silent ones dead (the group's post-mortem): live ranks report at once, so
    /// this bounds how long a rank's death takes to be known. Default
    /// [`DEFAULT_FAILURE_DETECTION`](crate::group::DEFAULT_FAILURE_DETECTION), 1 s. Need not match
    /// across ranks.
    pub failure_detection: Duration,
    /// Each rank beats a counter in the store, and a collective that has waited
    /// `failure_detection` reads its peers' (`group/liveness.rs`): a peer whose counter stood
    /// still for twice that (dead, frozen, or cut off from the job's network) fails the call,
    /// naming it ([`CollectiveError::PeerSilent`](crate::CollectiveError::PeerSilent)), instead of
    /// the wait going on to `timeout`. Costs a store round trip per rank every quarter of
    /// `failure_detection`. Default off; must match across ranks.
    pub peer_heartbeats: bool,
}

impl Default for TcpGroupOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            stall_warning: Duration::from_secs(60),
            piece_bytes: 1 << 20,
            token: String::new(),
            advertise_ip: None,
            shared_memory: None,
            shared_memory_ring_bytes: shm::DEFAULT_CAPACITY,
            store_prefix: DEFAULT_STORE_PREFIX.into(),
            failure_detection: crate::group::postmortem::DEFAULT_FAILURE_DETECTION,
            peer_heartbeats: false,
        }
    }
}

impl TcpGroupOptions {
    /// Whether links to same-host neighbours use shared memory (`shared_memory == Some(true)`).
    pub fn uses_shared_memory(&self) -> bool {
        self.shared_memory == Some(true)
    }
}
