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

use std::sync::{mpsc, Arc};
use std::time::Duration;

use super::handle::DataParallel;
use crate::elastic::fencing::fence;
use crate::elastic::join::{self, Boundary};
use crate::elastic::{agree_on_survivors, Admitted, AgreementOptions, PlannedJoin};
use crate::error::{CollectiveError, DdpError};
use crate::fault::{self, FaultPoint};
use crate::group::{ProcessGroup, TcpProcessGroup};
use crate::init::Distributed;

impl DataParallel {
    /// At the step boundary after `step` optimizer steps: the join due now, if any. Rank 0
    /// reads the job's join requests and plans their join for the next boundary (refusing a
    /// joiner whose fingerprint differs from the one [`check_same`](Self::check_same)
    /// checked, and the ones beyond [`DdpOptions::max_world_size`](crate::DdpOptions)); the
    /// others read the plan (one store round trip each). `wait_for_joiner`
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
            world: self.world_size(),
            max_world: self.options.max_world_size,
            fingerprint: self.fingerprint.as_deref(),
            wait_for_joiner,
        };
        self.joins
            .at_boundary(self.dist.root.as_ref(), self.dist.store.as_ref(), at)
    }

    /// Admits `plan`'s joiners (due now: [`joiners_due`](Self::joiners_due)): rank 0 tells
    /// each its place, and the members form the grown generation with them, keeping their
    /// ranks (the joiners take the ranks after, in request order). Then hand the joiners the
    /// training state (module docs). Collective over the grown job.
    ///
    /// While the grown group forms, every member watches the joiners' heartbeats and, with
    /// peer heartbeats, the other members': one silent for twice the failure detection time
    /// (it died on its way in, or a member died) makes the set-up fail on every rank within a
    /// second. When the grown group cannot form, the members agree through the
    /// store on who carries on (as after a failure, [`crate::elastic::agreement`]) and form
    /// their next generation without the joiners: [`Admitted::failure`] says why, and nothing
    /// else changes unless a member died too ([`Admitted::lost`]).
    ///
    /// # Errors
    /// [`DdpError::Membership`] under ZeRO stages 1 to 3; a store failure; what the members'
    /// agreement or their re-formed group report.
    pub fn admit_joiners(&mut self, plan: &PlannedJoin) -> Result<Admitted, DdpError> {
        let joining = plan.requests.len();
        if joining == 0 {
            return Ok(Admitted::default());
        }
        fault::point(FaultPoint::Admitting);
        let (rank, world) = (self.rank(), self.world_size());
        let generation = self.dist.generation + 1;
        if rank == 0 {
            join::reply_to_joiners(self.dist.root.as_ref(), plan, world, generation)?;
        }
        match self.form_watching_joiners(plan, world + joining, generation) {
            Ok(()) => Ok(Admitted {
                joined: joining,
                ..Admitted::default()
            }),
            Err(DdpError::Collective(e)) => {
                self.carry_on_without_joiners(plan, (world, world + joining), generation, e)
            }
            Err(e) => Err(e),
        }
    }

    /// Forms generation `generation` of `grown` ranks with `plan`'s joiners, aborting its
    /// set-up on every rank when a joiner's or a member's heartbeat stops (see
    /// [`admit_joiners`](Self::admit_joiners)).
    fn form_watching_joiners(
        &mut self,
        plan: &PlannedJoin,
        grown: usize,
        generation: u64,
    ) -> Result<(), DdpError> {
        let rank = self.rank();
        let root = Arc::clone(&self.dist.root);
        let tcp = self.dist.group.options().clone();
        let detection = self.options.failure_detection;
        let (done, until_done) = mpsc::channel::<()>();
        std::thread::scope(|scope| {
            scope.spawn(move || {
                let gone = join::watch_joiners(root.as_ref(), &plan.requests, detection, &until_done);
                if let Some((request, silent)) = gone {
                    let why = format!(
                        "the process of join request {request} stopped beating for {silent:.1?}: it died on its way into the job"
                    );
                    let store = Distributed::generation_store(&root, generation);
                    TcpProcessGroup::abort_forming(store, &tcp, rank, &why);
                }
            });
            // The members are watched too: one that dies now is as silent to the others.
            let members = (0..self.world_size()).filter(|&m| m != rank).collect();
            let formed = self.next_generation_watching(rank, grown, members);
            drop(done);
            formed
        })
    }

    /// After the grown generation `generation` failed to form (`why`): the members agree, in
    /// its namespace, on who carries on at `plan`'s step (a member whose set-up went through
    /// and whose hand-over then failed agrees there too, as after any failure), and form
    /// their next generation. `worlds`: the job's size before and with the joiners.
    fn carry_on_without_joiners(
        &mut self,
        plan: &PlannedJoin,
        (world, grown): (usize, usize),
        generation: u64,
        why: CollectiveError,
    ) -> Result<Admitted, DdpError> {
        let rank = self.rank();
        tracing::warn!(
            "rank {rank}: the joiners of the step boundary after step {} did not join ({why}); the {world} members carry on without them",
            plan.step
        );
        let store = Distributed::generation_store(&self.dist.root, generation);
        let joiners: Vec<usize> = (world..grown).collect();
        let survivors = agree_on_survivors(
            store.as_ref(),
            rank,
            grown,
            plan.step,
            &joiners,
            &AgreementOptions::after_detection(self.options.failure_detection),
        )?;
        // The members this left out (they died while the grown group formed) are fenced
        // as after any failure; the joiners given up on are alive or gone, and ask again.
        let lost: Vec<usize> = survivors
            .lost
            .iter()
            .copied()
            .filter(|&r| r < world)
            .collect();
        if survivors.members.first() == Some(&rank) {
            let why = format!(
                "the members carry on without it after step {} (it fell silent while they admitted joiners)",
                plan.step
            );
            fence(
                self.dist.store.as_ref(),
                self.dist.root.as_ref(),
                &lost,
                &why,
            );
        }
        self.regroup(&survivors.members)?;
        Ok(Admitted {
            joined: 0,
            failure: Some(why.to_string()),
            lost,
        })
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

    /// Rank 0, once training with joiners admitted (at every step boundary,
    /// [`joiners_due`](Self::joiners_due)): a process that comes later, such as a launcher
    /// whose node came back, joins instead of starting the job
    /// ([`crate::elastic::join::job_state`]). The others: nothing.
    pub fn open_to_joiners(&self) -> Result<(), DdpError> {
        match self.rank() {
            0 => join::open(self.dist.root.as_ref()),
            _ => Ok(()),
        }
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
