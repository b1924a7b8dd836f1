//! Fault points: the one seam through which a test reaches production code to inject a fault
//! (kill a rank, stall it, freeze it) at a named moment of the membership protocol or the
//! step, as TiKV's `fail` crate does with `fail_point!`.
//!
//! Production code names the moment with [`point`]; a program that wants faults installs one
//! [`FaultHandler`], once, at its start ([`install`]), and decides there what each point does
//! (the trainer's handler reads its fault plan from the environment, once). Without a
//! handler a point is one atomic load and a branch: nothing else of a test reaches the step
//! path, and no public signature carries a test's parameter.
//!
//! The points are few on purpose; each says where it stands and what the rank has done by
//! then, so that a kill there is a precise failure scenario:
//!
//! | point | where |
//! |---|---|
//! | [`FaultPoint::InStep`] | a step's gradients are computed, not yet summed |
//! | [`FaultPoint::AfterStep`] | a step, its checkpoint and its log are done; before the step boundary's membership round |
//! | [`FaultPoint::InCheckpoint`] | rank 0 wrote a checkpoint's weights, not yet its manifest |
//! | [`FaultPoint::Regrouping`] | the survivors of a failure agreed; this rank is about to form their group |
//! | [`FaultPoint::Admitting`] | a member is about to form the grown group with joiners |
//! | [`FaultPoint::Joining`] | a joiner asked to join, or was admitted and is about to take the state |

use std::sync::OnceLock;

/// A named moment at which a fault may be injected (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultPoint {
    /// In optimizer step `step` (counted from 1) of rank `rank` of the current group: its
    /// gradients computed, not yet summed across the ranks.
    InStep { rank: usize, step: usize },
    /// Right after optimizer step `step` of rank `rank` (its checkpoint, if due, written),
    /// before the step boundary's membership round.
    AfterStep { rank: usize, step: usize },
    /// Rank 0 wrote the weights of the checkpoint of step `step`, not yet its manifest.
    InCheckpoint { step: usize },
    /// The survivors of a failure agreed on who carries on; this rank is about to form their
    /// group.
    Regrouping,
    /// A member is about to form the grown group with the joiners due.
    Admitting,
    /// A joining process at `stage` of its way in.
    Joining(JoinStage),
}

/// Where a joining process stands ([`FaultPoint::Joining`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinStage {
    /// It asked the job to admit it and waits for the answer.
    Asked,
    /// It is in the grown group and about to take the training state from rank 0.
    Admitted,
}

impl JoinStage {
    /// The stage's name, as a fault plan spells it: `asked`, `admitted`.
    pub fn name(self) -> &'static str {
        match self {
            JoinStage::Asked => "asked",
            JoinStage::Admitted => "admitted",
        }
    }
}

/// What a program does at each fault point: kill the process, sleep, stop it, or nothing.
/// Called on the thread that reached the point; it must not call into burn-ddp.
pub type FaultHandler = Box<dyn Fn(FaultPoint) + Send + Sync>;

static HANDLER: OnceLock<FaultHandler> = OnceLock::new();

/// Installs this process's fault handler. Once per process: a second call returns `false`
/// and leaves the first handler in place.
pub fn install(handler: FaultHandler) -> bool {
    HANDLER.set(handler).is_ok()
}

/// The fault point `at`: runs the installed handler, if any; without one, nothing.
pub fn point(at: FaultPoint) {
    if let Some(handler) = HANDLER.get() {
        handler(at);
    }
}
