//! What the loop's membership round (`super::membership_round`) works with when the job's
//! membership changes (`[fault_tolerance] on_rank_failure = "continue"`, or a scripted resize
//! in the tests): why it holds one, what it did, why the step kind re-forms, what the step
//! kind reports back, which errors are the loss of peers, and the loop's state a joining rank
//! takes from rank 0.

use burn_ddp::elastic::{collective_failed_peers, failed_peers};
use burn_ddp::{CollectiveError, DdpError};
use serde::{Deserialize, Serialize};

use crate::engine::checkpoint::TrainPosition;

/// Why the job re-forms its group.
#[derive(Debug, Clone, Copy)]
pub(crate) enum MembershipChange<'a> {
    /// The ranks `leaving` (of the current group) leave after this step, as every rank was
    /// told (the tests' scripted resize, `TRAINER_LEAVE_AFTER_STEP`).
    Planned { leaving: &'a [usize] },
    /// A collective failed because peers died or stopped answering: `known_gone`, as the
    /// group's post-mortem found them; `step`, the optimizer steps this rank has applied;
    /// `in_step`, whether the failure came during a step (dropped: its outputs go too).
    Failure {
        known_gone: &'a [usize],
        step: usize,
        in_step: bool,
    },
}

/// Why the loop holds a membership round (`super::membership_round`).
pub(crate) enum RoundCause {
    /// A step boundary: ranks may leave (the scripted resize) or join.
    Boundary,
    /// A collective failed with `error`; `dropped`: the schedule's state before the step in
    /// flight, when the failure came during it (the step is dropped).
    Failure {
        error: anyhow::Error,
        dropped: Option<Vec<u8>>,
    },
}

/// What a membership round did to this rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Round {
    /// Nothing changed: the next step of the same plan.
    Unchanged,
    /// The job re-formed (ranks lost, left or joined): the rest of the run is planned again.
    Regrouped,
    /// This rank left the job.
    Left,
}

/// The group after a change, as the step kind reports it (the new rank and world size are
/// the step kind's own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Regrouped {
    pub previous_world: usize,
    /// The ranks of the previous group that are not in the new one.
    pub lost: Vec<usize>,
    /// The ranks (of the new group) of the processes that joined.
    pub joined: Vec<usize>,
    /// After a failure in the last moments of a step that some survivors finished and others
    /// did not: every member takes the new rank 0's state (it finished it), which this rank
    /// receives (`Some(true)`: it was behind) or sends along (`Some(false)`).
    pub roll_forward: Option<bool>,
}

/// The loop's part of the training state, as rank 0 hands it to the ranks that join at a step
/// boundary (the step kind hands over the module and its own state): what a checkpoint's
/// manifest and schedule file hold, and the counts the run's summary goes on from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct LoopState {
    pub position: TrainPosition,
    /// The learning-rate schedule's record.
    pub schedule: Vec<u8>,
    pub last_saved: Option<usize>,
    pub skipped: usize,
}

impl LoopState {
    pub(crate) fn to_bytes(&self) -> anyhow::Result<Vec<u8>> {
        Ok(serde_json::to_vec(self)?)
    }

    pub(crate) fn from_bytes(bytes: &[u8]) -> anyhow::Result<Self> {
        serde_json::from_slice(bytes).map_err(|e| {
            anyhow::anyhow!("the training state rank 0 handed over does not read: {e}")
        })
    }
}

/// The ranks found gone when `error` is the loss of peers (burn-ddp's
/// [`failed_peers`]), wherever it sits in the error's chain; `None` for any other error.
pub(crate) fn peer_failure(error: &anyhow::Error) -> Option<Vec<usize>> {
    error.chain().find_map(|cause| {
        if let Some(ddp) = cause.downcast_ref::<DdpError>() {
            return failed_peers(ddp);
        }
        cause
            .downcast_ref::<CollectiveError>()
            .and_then(collective_failed_peers)
    })
}

#[cfg(test)]
mod tests {
    use burn_ddp::{CollectiveError, DdpError};

    use super::{peer_failure, LoopState};
    use crate::engine::checkpoint::TrainPosition;

    #[test]
    fn the_loop_state_survives_the_hand_over() {
        let state = LoopState {
            position: TrainPosition {
                epoch: 2,
                consumed: 96,
                step: 41,
            },
            schedule: vec![0, 7, 255],
            last_saved: Some(40),
            skipped: 1,
        };
        let bytes = state.to_bytes().map_err(|e| e.to_string());
        let back = bytes.and_then(|b| LoopState::from_bytes(&b).map_err(|e| e.to_string()));
        assert_eq!(back, Ok(state));
        assert!(LoopState::from_bytes(b"{").is_err());
    }

    #[test]
    fn a_broken_group_is_a_peer_failure_and_a_mismatch_is_not() {
        let aborted = CollectiveError::Aborted {
            rank: 1,
            first_error: "rank 2 is gone".into(),
        };
        let wrapped = anyhow::Error::from(DdpError::from(aborted)).context("the step");
        assert_eq!(peer_failure(&wrapped), Some(vec![]));
        let setup = CollectiveError::Setup {
            rank: 1,
            message: "bad world".into(),
        };
        assert_eq!(peer_failure(&anyhow::Error::from(setup)), None);
        let mismatch = anyhow::Error::from(DdpError::Mismatch("settings".into()));
        assert_eq!(peer_failure(&mismatch), None);
        assert_eq!(peer_failure(&anyhow::anyhow!("disk full")), None);
    }
}
