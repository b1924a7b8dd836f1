//! A process joining a job that is training (a rank restarted by its launcher, or a new one):
//! the joiner's side of [`crate::elastic::join`]. [`Distributed::join`] asks and waits in one
//! call; [`Distributed::ask_to_join`] and [`PendingJoin::admitted`] are the same in two, for
//! a caller with work to do while the job gets to its next step boundary.
//!
//! From its request on, the joiner beats a heartbeat in the job's store for as long as it is
//! in the job; the members that admit it watch it while they form the grown group, so a
//! joiner that dies on its way in costs them about twice the failure detection time, not the
//! set-up's deadline. When forming the grown group fails (the members gave up on a joiner,
//! maybe this one, too slow to be told from a dead one), the joiner asks again, until its
//! deadline.

use std::time::Instant;

use crate::elastic::join::{ask_to_join, JoinRequest};
use crate::elastic::Admission;
use crate::env::DistEnv;
use crate::error::DdpError;
use crate::fault::{self, FaultPoint, JoinStage};
use crate::group::TcpGroupOptions;
use crate::init::{Connected, Distributed};
use crate::store::heartbeat::beat_period;

/// A process that asked to join and has not been admitted yet ([`Distributed::ask_to_join`]).
pub struct PendingJoin {
    env: DistEnv,
    connected: Connected,
    fingerprint: String,
    request: JoinRequest,
    deadline: Instant,
}

impl Distributed {
    /// Joins a job that is already training: [`ask_to_join`](Self::ask_to_join), then
    /// [`PendingJoin::admitted`].
    ///
    /// # Errors
    /// As those two.
    pub fn join(
        env: DistEnv,
        options: TcpGroupOptions,
        fingerprint: &str,
    ) -> Result<(Self, Admission), DdpError> {
        Self::ask_to_join(env, options, fingerprint)?.admitted()
    }

    /// Connects to the job's store as [`init`](Self::init) does (hosting nothing) and asks to
    /// join with this process's settings `fingerprint`; the request's heartbeat beats every
    /// quarter of `options.failure_detection` from now on. The whole join, admission
    /// included, has `options.timeout` (the job may be validating or writing a checkpoint).
    /// Not collective.
    ///
    /// # Errors
    /// [`DdpError::Collective`] when the store cannot be reached; [`DdpError::Store`] when it
    /// fails.
    pub fn ask_to_join(
        env: DistEnv,
        options: TcpGroupOptions,
        fingerprint: &str,
    ) -> Result<PendingJoin, DdpError> {
        let deadline = Instant::now() + options.timeout;
        let connected = Self::connect(&env, options, false)?;
        let request = ask(&connected, fingerprint)?;
        fault::point(FaultPoint::Joining(JoinStage::Asked));
        Ok(PendingJoin {
            env,
            connected,
            fingerprint: fingerprint.to_owned(),
            request,
            deadline,
        })
    }
}

/// Asks the job behind `connected` to admit this process.
fn ask(connected: &Connected, fingerprint: &str) -> Result<JoinRequest, DdpError> {
    let beat_every = beat_period(connected.options.failure_detection);
    ask_to_join(&connected.store, fingerprint, beat_every)
}

impl PendingJoin {
    /// Waits until the job admits this process at a step boundary and forms the grown
    /// generation with the ranks already there. Returns the job, in which this process has
    /// the rank the admission gave, and the admission. Collective with the job's ranks at
    /// their admission.
    ///
    /// # Errors
    /// [`DdpError::Mismatch`] when the job refuses this process (other settings);
    /// [`DdpError::JobEnded`] when it ended before this process could join;
    /// [`DdpError::Membership`] when it did not admit it in time; [`DdpError::Store`] on a
    /// deadline or a lost store; what forming the group reports at the deadline.
    pub fn admitted(self) -> Result<(Distributed, Admission), DdpError> {
        let PendingJoin {
            env,
            connected,
            fingerprint,
            mut request,
            deadline,
        } = self;
        loop {
            let admission = request.answer(connected.store.as_ref(), deadline)?;
            let env = DistEnv {
                rank: admission.rank,
                world_size: admission.world,
                ..env.clone()
            };
            let formed = Distributed::form_generation(
                env,
                connected.store.clone(),
                connected.options.clone(),
                admission.generation,
            );
            match formed {
                Ok(mut dist) => {
                    dist.joins_handled = admission.handled;
                    dist.fingerprint = Some(fingerprint);
                    dist._join_request = Some(request);
                    return Ok((dist, admission));
                }
                Err(e) if Instant::now() < deadline => {
                    tracing::warn!(
                        "joining after step {} as rank {} failed ({e}); asking again",
                        admission.step,
                        admission.rank
                    );
                    request = ask(&connected, &fingerprint)?;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}
