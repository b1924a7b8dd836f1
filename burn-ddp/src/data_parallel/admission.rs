//! Processes joining a job that is training: at a step boundary the members admit them and
//! form the grown generation with them (the plan through the store is
//! [`crate::elastic::join`]'s); what a joiner needs to train then comes from rank 0 over the
//! grown group: the weights ([`DataParallel::prepare`]) and any state as bytes
//! ([`DataParallel::broadcast_bytes`]: the optimizer's, the loop's position).
//!
//! The joiner's side: [`Distributed::join`](crate::Distributed::join) (ask, wait for the
//! admission, form the grown group), [`DataParallel::new`] over it, then the same
//! [`prepare`](DataParallel::prepare) and [`broadcast_bytes`](DataParallel::broadcast_bytes)
//! calls as the members, in the same order.

use std::time::Duration;

use super::handle::DataParallel;
use crate::elastic::join::{self, Boundary};
use crate::elastic::PlannedJoin;
use crate::error::DdpError;
use crate::group::ProcessGroup;

impl DataParallel {
    /// At the step boundary after `step` optimizer steps: the join due now, if any. Rank 0
    /// reads the job's join requests and plans their join for the next boundary (refusing a
    /// joiner whose fingerprint differs from the one [`check_same`](Self::check_same)
    /// checked); the others read the plan (one store round trip each). `wait_for_joiner`
    /// (the tests' scripted join, the same on every rank): admit a joiner at this very
    /// boundary, waiting up to that long for one to ask. Not a collective, but every member
    /// must call it at every step boundary with the same `step`.
    ///
    /// # Errors
    /// A store failure or deadline; [`DdpError::Membership`] when a plan cannot be read or no
    /// joiner came within `wait_for_joiner`.
    pub fn joiners_due(
        &mut self,
        step: u64,
        wait_for_joiner: Option<Duration>,
    ) -> Result<Option<PlannedJoin>, DdpError> {
        let at = Boundary {
            rank: self.rank(),
            step,
            fingerprint: self.fingerprint.as_deref(),
            wait_for_joiner,
        };
        self.joins
            .at_boundary(self.dist.root.as_ref(), self.dist.store.as_ref(), at)
    }

    /// Admits `plan`'s joiners (due now: [`joiners_due`](Self::joiners_due)): rank 0 tells
    /// each its place, and the members form the grown generation with them, keeping their
    /// ranks (the joiners take the ranks after, in request order). Returns how many joined (0
    /// when rank 0 refused them all: nothing changes). Then hand the joiners the training
    /// state (module docs). Collective over the grown job.
    ///
    /// # Errors
    /// [`DdpError::Membership`] under ZeRO stages 1 to 3; a store failure; what forming the
    /// group reports (a joiner that died before it: the group's deadline).
    pub fn admit_joiners(&mut self, plan: &PlannedJoin) -> Result<usize, DdpError> {
        let joining = plan.requests.len();
        if joining == 0 {
            return Ok(0);
        }
        let (rank, world) = (self.rank(), self.world_size());
        if rank == 0 {
            join::reply_to_joiners(
                self.dist.root.as_ref(),
                plan,
                world,
                self.dist.generation + 1,
            )?;
        }
        self.next_generation(rank, world + joining)?;
        Ok(joining)
    }

    /// Rank 0's `bytes` on every rank (the others' `bytes` are not read): training state that
    /// a joiner needs. Collective.
    pub fn broadcast_bytes(&mut self, bytes: Vec<u8>) -> Result<Vec<u8>, DdpError> {
        let len = self.broadcast_from_rank_zero(i64::try_from(bytes.len()).unwrap_or(i64::MAX))?;
        let len = usize::try_from(len)
            .map_err(|_| DdpError::Membership(format!("rank 0 announced {len} bytes of state")))?;
        let mut buffer = match self.rank() {
            0 => bytes,
            _ => vec![0u8; len],
        };
        if self.world_size() > 1 {
            self.dist.group.broadcast(&mut buffer, 0)?;
        }
        Ok(buffer)
    }

    /// Rank 0, when the run is over: a process that asks to join from now on is told that the
    /// job has ended ([`DdpError::JobEnded`]) instead of waiting. The others: nothing.
    pub fn close_to_joiners(&self) -> Result<(), DdpError> {
        match self.rank() {
            0 => join::close(self.dist.root.as_ref()),
            _ => Ok(()),
        }
    }
}
