//! The bookkeeping every group shares: [`CallLog`].

use crate::call::{CollectiveDesc, CollectiveKind, DataType};
use crate::error::CollectiveError;

/// The bookkeeping every backend shares: the sequence number of the next call and whether an
/// earlier error aborted the group.
#[derive(Debug)]
pub(crate) struct CallLog {
    rank: usize,
    seq: u64,
    aborted: Option<String>,
}

impl CallLog {
    pub fn new(rank: usize) -> Self {
        Self {
            rank,
            seq: 0,
            aborted: None,
        }
    }

    /// Numbers the next call. Fails with [`CollectiveError::Aborted`] after an abort, and with
    /// [`CollectiveError::InvalidArgument`] when `precheck` found a problem (the caller must
    /// then abort: the other ranks are entering the collective and would wait for this one).
    pub fn begin(
        &mut self,
        kind: CollectiveKind,
        dtype: DataType,
        len: usize,
        precheck: Option<String>,
    ) -> Result<CollectiveDesc, CollectiveError> {
        let desc = CollectiveDesc {
            seq: self.seq,
            kind,
            dtype,
            len: len as u64,
        };
        self.seq += 1;
        if let Some(first_error) = &self.aborted {
            let err = CollectiveError::Aborted {
                rank: self.rank,
                first_error: first_error.clone(),
            };
            return Err(err);
        }
        match precheck {
            Some(message) => Err(CollectiveError::InvalidArgument {
                rank: self.rank,
                desc,
                message,
            }),
            None => Ok(desc),
        }
    }

    /// Records the error that aborts the group (the first one is kept).
    pub fn abort(&mut self, why: &CollectiveError) {
        if self.aborted.is_none() {
            self.aborted = Some(why.to_string());
        }
    }
}
