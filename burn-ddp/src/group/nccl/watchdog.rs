//! Waiting on NCCL with a deadline, like PyTorch's NCCL watchdog (module docs of [`super`],
//! step 5 of a collective): [`NcclProcessGroup::poll`] spins, then backs off, checks the store
//! for another rank's abort and warns about stalls, until the work is done or the [`Clock`]
//! runs out.

use std::time::{Duration, Instant};

use super::fault::Fault;
use super::group::NcclProcessGroup;
use crate::call::CollectiveDesc;
use crate::group::rendezvous::{self, ABORT_CHECK_EVERY};
use crate::group::stall::{self, StallReporter};
use crate::store::backoff::Backoff;

/// How long polls spin (yield) before they start sleeping: collectives on one node often finish
/// within this, and a sleep would add its whole length to their latency.
const SPIN: Duration = Duration::from_micros(200);
/// Longest sleep between two polls.
pub(super) const MAX_PAUSE: Duration = Duration::from_millis(1);

/// Deadline of one call.
pub(super) struct Clock {
    pub(super) start: Instant,
    pub(super) deadline: Instant,
}

impl Clock {
    pub(super) fn until(deadline: Instant) -> Self {
        Self {
            start: Instant::now(),
            deadline,
        }
    }
}

/// What a wait is waiting for, for stall and timeout messages.
pub(super) enum Waiting<'a> {
    Init,
    Collective {
        desc: &'a CollectiveDesc,
        what: &'a str,
    },
}

impl std::fmt::Display for Waiting<'_> {
    /// The call, as the stall warning names it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Waiting::Init => write!(f, "NCCL set-up"),
            Waiting::Collective { desc, .. } => write!(f, "{desc}"),
        }
    }
}

impl NcclProcessGroup {
    /// Polls `done` until it returns true, fails, or the clock's deadline passes (module docs
    /// of [`super`], step 5). Spins for [`SPIN`], then sleeps with doubling pauses up to
    /// [`MAX_PAUSE`]; checks the store for another rank's abort every [`ABORT_CHECK_EVERY`]
    /// and logs a stall warning every `options.stall_warning`.
    pub(super) fn poll(
        &self,
        clock: &Clock,
        waiting: Waiting<'_>,
        mut done: impl FnMut() -> Result<bool, Fault>,
    ) -> Result<(), Fault> {
        let mut next_store_check = clock.start + ABORT_CHECK_EVERY;
        let mut stall = StallReporter::new(
            &self.store,
            self.member.rank,
            self.member.world_size,
            self.options.stall_warning,
            clock.start,
        );
        let mut backoff = Backoff::new(Duration::from_micros(10), MAX_PAUSE);
        loop {
            if done()? {
                return Ok(());
            }
            let now = Instant::now();
            if now >= clock.deadline {
                return Err(Fault::Timeout {
                    waiting_on: self.waiting_on(&waiting),
                });
            }
            if now >= next_store_check {
                if let Some(why) = rendezvous::published_abort(&self.store) {
                    return Err(Fault::Failed(format!(
                        "another rank aborted the group: {why}"
                    )));
                }
                next_store_check = now + ABORT_CHECK_EVERY;
            }
            stall.warn_if_due(now, &waiting, None, || self.waiting_on(&waiting));
            if now - clock.start < SPIN {
                std::thread::yield_now();
            } else {
                backoff.sleep(clock.deadline);
            }
        }
    }

    /// What a stalled wait is waiting for, with what the store knows about the other ranks.
    fn waiting_on(&self, waiting: &Waiting<'_>) -> String {
        match waiting {
            // The rendezvous saw every rank arrive before NCCL's set-up started.
            Waiting::Init => "every rank joined the rendezvous, but NCCL's own connection set-up has not finished: check that the ranks can reach each other over TCP (set NCCL_SOCKET_IFNAME to the right interface) and rerun with NCCL_DEBUG=INFO".into(),
            Waiting::Collective { desc, what } => format!(
                "NCCL {what} on device {} to complete (every rank must enter this call). {}",
                self.device,
                stall::positions(&self.store, self.member.rank, self.member.world_size, desc.seq)
            ),
        }
    }
}
