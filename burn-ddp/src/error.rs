//! Error types, one per layer: environment ([`InitError`]), rendezvous store ([`StoreError`]),
//! collectives ([`CollectiveError`]) and the DDP layer on top of them ([`DdpError`]).
//!
//! Every message says what failed, where (rank, peer address, operation and sequence number) and,
//! when there is one, what to do about it.

use std::time::Duration;

use crate::call::CollectiveDesc;

/// The process could not find out who it is from the environment (see [`crate::env`]).
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    /// A variable that must be present is absent.
    #[error("environment variable {name} is not set ({hint})")]
    Missing {
        name: &'static str,
        hint: &'static str,
    },
    /// A variable is present but does not parse.
    #[error("environment variable {name}={value:?} is not valid: {reason}")]
    Invalid {
        name: &'static str,
        value: String,
        reason: String,
    },
    /// Values that are fine one by one disagree with each other.
    #[error("inconsistent distributed environment: {0}")]
    Inconsistent(String),
}

/// A failure of the rendezvous store (client or server).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The server could not bind its address (port in use, address not local, ...).
    #[error("cannot host the rendezvous store on {addr}: {source} (is another job using this port? choose another MASTER_PORT, or let the launcher pick a free one)")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// The client never reached the server.
    #[error("could not reach the rendezvous store at {addr} within {timeout:?}: {last_error} (is rank 0 running, and are MASTER_ADDR/MASTER_PORT the same on every rank?)")]
    Connect {
        addr: String,
        timeout: Duration,
        last_error: String,
    },
    /// A blocking call ran past its deadline.
    #[error("rendezvous store at {addr}: {operation} timed out after {timeout:?}")]
    Timeout {
        addr: String,
        operation: String,
        timeout: Duration,
    },
    /// The connection broke or the server went away.
    #[error("rendezvous store at {addr}: connection lost during {operation}: {source}")]
    Io {
        addr: String,
        operation: String,
        #[source]
        source: std::io::Error,
    },
    /// Bytes on the wire that do not follow the protocol.
    #[error("rendezvous store at {addr}: protocol error: {source}")]
    Protocol {
        addr: String,
        #[source]
        source: WireError,
    },
    /// The server refused the request (bad token, value too large, ...).
    #[error("rendezvous store at {addr} refused {operation}: {message}")]
    Refused {
        addr: String,
        operation: String,
        message: String,
    },
}

/// A malformed frame; produced by the pure decoders, never by I/O.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("frame truncated: needed {needed} more bytes for {what}")]
    Truncated { what: &'static str, needed: usize },
    #[error("unknown {what} code {code}")]
    UnknownCode { what: &'static str, code: u8 },
    #[error("{what} is not valid UTF-8")]
    BadUtf8 { what: &'static str },
    #[error("{extra} unexpected bytes after the end of the frame")]
    TrailingBytes { extra: usize },
    #[error("bad magic number {found:#010x} (expected {expected:#010x}): the peer does not speak this protocol")]
    BadMagic { found: u32, expected: u32 },
}

/// A collective operation failed. After any such error the group is broken: every later call
/// returns [`CollectiveError::Aborted`] (as an aborted NCCL communicator does), because the ranks
/// no longer agree on where in the stream of collectives they are.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// Forming the group failed (rendezvous, ring connections, inconsistent world sizes).
    #[error("rank {rank}: process group set-up failed: {message}")]
    Setup { rank: usize, message: String },
    /// Setting up through the store failed.
    #[error("rank {rank}: process group set-up failed: {source}")]
    Store {
        rank: usize,
        #[source]
        source: StoreError,
    },
    /// The arguments are wrong on this rank alone (checked before anything is sent).
    #[error("rank {rank}: invalid {desc}: {message}")]
    InvalidArgument {
        rank: usize,
        desc: CollectiveDesc,
        message: String,
    },
    /// Two ranks called different collectives, or the same one with different arguments.
    #[error("rank {rank}: collective mismatch with rank {peer}: this rank called {ours}, rank {peer} called {theirs}. Every rank must call the same collectives in the same order with the same lengths")]
    Mismatch {
        rank: usize,
        peer: usize,
        ours: CollectiveDesc,
        theirs: CollectiveDesc,
    },
    /// No progress before the deadline.
    #[error("rank {rank}: {desc} timed out after {elapsed:?} (timeout {timeout:?}) waiting for {waiting_on}")]
    Timeout {
        rank: usize,
        desc: CollectiveDesc,
        elapsed: Duration,
        timeout: Duration,
        waiting_on: String,
    },
    /// Peers whose heartbeat stood still for longer than the failure detection while this
    /// rank waited on them ([`crate::TcpGroupOptions::peer_heartbeats`]).
    #[error("rank {rank}: {desc}: rank(s) {silent:?} silent for {quiet:?} (no heartbeat in the store): dead, frozen or cut off from the job's network; this rank was waiting for {waiting_on}")]
    PeerSilent {
        rank: usize,
        desc: CollectiveDesc,
        silent: Box<[usize]>,
        quiet: Duration,
        waiting_on: String,
    },
    /// A peer closed its connection or the network failed.
    #[error("rank {rank}: {desc}: connection with rank {peer} ({peer_addr}) failed: {source}. Rank {peer} probably exited or crashed: look at its log")]
    PeerLost {
        rank: usize,
        peer: usize,
        peer_addr: String,
        desc: CollectiveDesc,
        #[source]
        source: std::io::Error,
    },
    /// A peer's connection was lost, and the failure reports of the other ranks (see
    /// `group::postmortem`) show the root cause: the rank(s) in `gone`, which other ranks lost
    /// but which never reported an error themselves, so they died (a crash, `kill -9`, the OOM
    /// killer) or exited outside the group. `peer` is the connection this rank lost: one of
    /// `gone`, or a rank that closed its links after losing one of them (a messenger).
    #[error("rank {rank}: {desc}: {}. {}", gone_list(.gone), lost_here(*.peer, .peer_addr, .source, .gone))]
    PeerGone {
        rank: usize,
        desc: CollectiveDesc,
        gone: Vec<GoneRank>,
        peer: usize,
        peer_addr: String,
        #[source]
        source: std::io::Error,
    },
    /// A peer's connection was lost and the store, through which the ranks tell each other why
    /// they failed, failed too (`store`), so the root cause is unknown. Under plain
    /// `RANK`/`MASTER_*` variables rank 0 hosts the store: it is then probably rank 0 that died.
    #[error("rank {rank}: {desc}: connection with rank {peer} ({peer_addr}) failed: {source}. The rendezvous store cannot tell which rank failed first ({store}): the store's host (rank 0 when the ranks were started with RANK/MASTER_ADDR/MASTER_PORT, else the launcher) is probably gone; otherwise rank {peer} exited or crashed: look at its log")]
    PeerLostStoreGone {
        rank: usize,
        peer: usize,
        peer_addr: String,
        desc: CollectiveDesc,
        #[source]
        source: std::io::Error,
        /// Boxed: it would double the size of every `CollectiveError`.
        store: Box<StoreError>,
    },
    /// A peer sent bytes that are not a frame of this protocol.
    #[error("rank {rank}: {desc}: malformed data from rank {peer}: {source}")]
    Protocol {
        rank: usize,
        peer: usize,
        desc: CollectiveDesc,
        #[source]
        source: WireError,
    },
    /// An earlier collective failed; the group can no longer be used.
    #[error("rank {rank}: the process group was aborted by an earlier error ({first_error}); create a new group")]
    Aborted { rank: usize, first_error: String },
}

/// A rank that died without a word: other ranks lost their connections with it, and it never
/// reported an error of its own (part of [`CollectiveError::PeerGone`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoneRank {
    pub rank: usize,
    /// Its ring address, as the ranks that lost it knew it.
    pub addr: String,
    /// The ranks that lost their connection with it, in order.
    pub lost_by: Vec<usize>,
}

impl std::fmt::Display for GoneRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let by: Vec<String> = self.lost_by.iter().map(usize::to_string).collect();
        let s = if by.len() == 1 { "" } else { "s" };
        write!(
            f,
            "rank {} ({}) is gone: it stopped without reporting an error (lost by rank{s} {})",
            self.rank,
            self.addr,
            by.join(", ")
        )
    }
}

/// The root-cause part of [`CollectiveError::PeerGone`]'s message.
fn gone_list(gone: &[GoneRank]) -> String {
    let each: Vec<String> = gone.iter().map(GoneRank::to_string).collect();
    let (who, whom) = if gone.len() == 1 {
        ("it", "its")
    } else {
        ("they", "their")
    };
    format!(
        "{}; {who} exited or crashed: look at {whom} log",
        each.join("; ")
    )
}

/// This rank's own loss in [`CollectiveError::PeerGone`]'s message.
fn lost_here(peer: usize, addr: &str, source: &std::io::Error, gone: &[GoneRank]) -> String {
    let how = if gone.iter().any(|g| g.rank == peer) {
        "Here"
    } else {
        "This rank lost its neighbour as a consequence"
    };
    format!("{how}: connection with rank {peer} ({addr}) failed: {source}")
}

/// A failure of the DDP layer (parameter broadcast, gradient synchronisation).
#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    #[error(transparent)]
    Init(#[from] InitError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// The model's parameters are not what the DDP layer can handle.
    #[error("DDP: {0}")]
    Unsupported(String),
    /// The device-side gradient path failed outside the collective itself: a buffer's device
    /// address could not be had, or device work before the collective failed.
    #[error("DDP on the device: {0}")]
    Device(String),
    /// Optimizer state could not be serialised or read back (ZeRO's consolidation).
    #[error("optimizer state: {0}")]
    State(String),
    /// The rendezvous store failed (a fingerprint exchange, waiting for rank 0's verdict).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The [`DdpOptions`](crate::ddp::DdpOptions) cannot work with this backend, build or
    /// world: an input to fix (the message says how).
    #[error("DDP options: {0}")]
    Options(String),
    /// The ranks disagree on something that must be the same everywhere (their settings'
    /// fingerprints): an input to fix.
    #[error("{0}")]
    Mismatch(String),
    /// The replicas' parameters are no longer bit-identical.
    #[error("{0}")]
    ReplicaDrift(String),
    /// Gradient overlap failed: the communication thread stopped or missed its deadline, or
    /// the parameters with gradients changed after the bucket plan was learnt.
    #[error("gradient overlap: {0}")]
    Overlap(String),
    /// Rank 0 failed an action the other ranks waited for (writing a checkpoint).
    #[error("rank 0 failed {what}: {message}")]
    RankZeroFailed { what: String, message: String },
    /// Rank 0 stopped beating while the others waited for it (it died during `what`).
    #[error("rank 0 stopped during {what}: no sign of life for {silent:?} (it exited or crashed: look at its log)")]
    RankZeroGone { what: String, silent: Duration },
    /// Synchronised BatchNorm failed in the last forward or backward (recorded there, since
    /// those cannot return errors): the step's statistics were not global.
    #[error(transparent)]
    SyncBatchNorm(#[from] SyncBatchNormError),
    /// The job could not re-form its group after ranks left or died (see
    /// [`crate::elastic`]): the message says why and what to do.
    #[error("elastic membership: {0}")]
    Membership(String),
    /// A process that asked to join found the job ended: there is nothing left to train.
    #[error("the job ended before this process could join it")]
    JobEnded,
}

/// A failure of synchronised BatchNorm's statistics ([`crate::ddp::SyncBatchNorm`]), recorded
/// in the forward or backward pass and returned by the next DDP step.
#[derive(Debug, thiserror::Error)]
pub enum SyncBatchNormError {
    /// The all-reduce of the per-channel statistics (or of their gradients) failed.
    #[error("synchronised BatchNorm: all-reduce of the batch statistics failed: {0}")]
    Collective(#[from] CollectiveError),
    /// The statistics could not be read back from the device, or not as `f32`.
    #[error("synchronised BatchNorm: reading the batch statistics back to the host failed: {0}")]
    Readback(String),
    /// Forming the group failed earlier (its first failure was reported then); every later
    /// use fails too, so no step trains on a mix of local and global statistics.
    #[error("synchronised BatchNorm: its group could not be formed: {0}")]
    Unformed(String),
}

/// A failure of ZeRO stage 3's parameter gather or gradient reduce-scatter
/// ([`crate::ddp::fsdp::shard_gather`]), kept until the step checks.
#[derive(Debug, thiserror::Error)]
pub enum ShardGatherError {
    /// The all-gather of a parameter or the reduce-scatter of its gradient failed.
    #[error("ZeRO stage 3: gathering a parameter or reduce-scattering its gradient failed: {0}")]
    Collective(#[from] CollectiveError),
    /// A shard or a gradient could not be read back from the device, or not as `f32`.
    #[error("ZeRO stage 3: reading a shard or a gradient back to the host failed: {0}")]
    Readback(String),
    /// The blocks gathered ahead of the forward did not come (the prefetch thread's group
    /// failed or missed its deadline).
    #[error("{0}")]
    Prefetch(String),
}

impl DdpError {
    /// Whether the user must fix an input (options, settings, the environment): exit code 2
    /// in a binary, as for `InitError`.
    pub fn is_usage(&self) -> bool {
        matches!(self, Self::Init(_) | Self::Options(_) | Self::Mismatch(_))
    }
}
