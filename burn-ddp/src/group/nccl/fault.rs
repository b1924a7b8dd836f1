//! [`Fault`]: why an NCCL call failed, before it becomes a
//! [`CollectiveError`](crate::error::CollectiveError) with its context.

use crate::call::CollectiveDesc;
use crate::error::WireError;

/// Why a collective failed, before it is turned into a
/// [`CollectiveError`](crate::error::CollectiveError) with its context.
#[derive(Debug)]
pub(super) enum Fault {
    Timeout {
        waiting_on: String,
    },
    /// An NCCL or CUDA error, or another rank's published abort.
    Failed(String),
    Mismatch {
        peer: usize,
        theirs: CollectiveDesc,
    },
    Protocol {
        peer: usize,
        source: WireError,
    },
}

impl Fault {
    /// The fault in words, for a set-up error or a log line.
    pub(super) fn describe(&self) -> String {
        match self {
            Fault::Timeout { waiting_on } => format!("timed out waiting for {waiting_on}"),
            Fault::Failed(message) => message.clone(),
            Fault::Mismatch { peer, theirs } => format!("rank {peer} called {theirs}"),
            Fault::Protocol { peer, source } => {
                format!("malformed data from rank {peer}: {source}")
            }
        }
    }
}
