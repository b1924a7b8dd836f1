//! Which ranks carry on after a failure, and from which step: pure.
//!
//! Every survivor announces the number of optimizer steps it has applied; one of them (the
//! first to arrive, see [`super::agreement`]) waits for the others and writes the decision:
//! the announced ranks, in their old rank order, with their steps. A rank that did not announce
//! in time is left out (it died, or is too late to be trusted). The survivors carry on only when
//! they all stand at the same step: a step that some survivor applied and another did not
//! (a rank died in the last moments of the gradient all-reduce) cannot be dropped on one and
//! kept on another, so the decision then refuses to go on, naming the ranks and their steps.

use std::collections::BTreeMap;

use crate::error::{CollectiveError, DdpError};

/// The survivors of a failure as their agreement decided (the same on every survivor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Survivors {
    /// The ranks (of the group that failed) that carry on, in rank order: the new group's rank
    /// `i` is `members[i]`.
    pub members: Vec<usize>,
    /// The optimizer steps every member has applied.
    pub step: u64,
    /// The ranks of the group that failed that are not members.
    pub lost: Vec<usize>,
}

impl Survivors {
    /// The decision from each announced rank's applied steps, in a group of `world` ranks.
    /// Fails when the survivors stand at different steps (module docs).
    pub fn decide(world: usize, announced: &BTreeMap<usize, u64>) -> Result<Self, DdpError> {
        let members: Vec<usize> = announced.keys().copied().collect();
        let lost = (0..world).filter(|r| !announced.contains_key(r)).collect();
        let mut steps = announced.values().copied();
        let Some(step) = steps.next() else {
            return Err(DdpError::Membership(
                "no rank announced itself after the failure".into(),
            ));
        };
        if steps.any(|s| s != step) {
            let each: Vec<String> = announced
                .iter()
                .map(|(r, s)| format!("rank {r} at step {s}"))
                .collect();
            return Err(DdpError::Membership(format!(
                "the surviving ranks stand at different steps ({}): a rank died as the last gradient all-reduce ended, so some ranks applied that step and others did not; restart every rank from the newest checkpoint",
                each.join(", ")
            )));
        }
        Ok(Self {
            members,
            step,
            lost,
        })
    }

    /// The decision as the store value every survivor reads: `rank:step` pairs, comma-separated.
    pub(crate) fn encode(announced: &BTreeMap<usize, u64>) -> Vec<u8> {
        let pairs: Vec<String> = announced.iter().map(|(r, s)| format!("{r}:{s}")).collect();
        pairs.join(",").into_bytes()
    }

    /// The inverse of [`encode`](Self::encode); `None` for a value it cannot read.
    pub(crate) fn decode(bytes: &[u8]) -> Option<BTreeMap<usize, u64>> {
        let text = std::str::from_utf8(bytes).ok()?;
        if text.is_empty() {
            return Some(BTreeMap::new());
        }
        text.split(',')
            .map(|pair| {
                let (r, s) = pair.split_once(':')?;
                Some((r.parse().ok()?, s.parse().ok()?))
            })
            .collect()
    }
}

/// Whether `error` is the loss of peers (a rank died, exited, stopped answering or lost its
/// link) rather than a fault of this rank or of the job's input: `Some` with the ranks the
/// group's post-mortem found gone (possibly none named), `None` for any other error. Only such
/// a failure lets the survivors re-form their group; a mismatch, bad arguments or a lost
/// rendezvous store do not.
pub fn failed_peers(error: &DdpError) -> Option<Vec<usize>> {
    match error {
        DdpError::Collective(c) => collective_failed_peers(c),
        DdpError::SyncBatchNorm(crate::error::SyncBatchNormError::Collective(c)) => {
            collective_failed_peers(c)
        }
        DdpError::Overlap(_) => Some(Vec::new()),
        DdpError::RankZeroGone { .. } => Some(vec![0]),
        _ => None,
    }
}

/// [`failed_peers`] of a collective's own error.
pub fn collective_failed_peers(error: &CollectiveError) -> Option<Vec<usize>> {
    match error {
        CollectiveError::PeerGone { gone, .. } => Some(gone.iter().map(|g| g.rank).collect()),
        CollectiveError::PeerLost { .. }
        | CollectiveError::Timeout { .. }
        | CollectiveError::Aborted { .. } => Some(Vec::new()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::Survivors;

    #[test]
    fn the_announced_ranks_carry_on_in_rank_order() {
        let announced = BTreeMap::from([(3, 7), (0, 7), (2, 7)]);
        let s = Survivors::decide(4, &announced).map_err(|e| e.to_string());
        assert_eq!(
            s,
            Ok(Survivors {
                members: vec![0, 2, 3],
                step: 7,
                lost: vec![1],
            })
        );
    }

    #[test]
    fn survivors_at_different_steps_are_refused_with_each_step_named() {
        let announced = BTreeMap::from([(0, 7), (2, 8)]);
        let e = Survivors::decide(3, &announced)
            .err()
            .map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.contains("rank 0 at step 7, rank 2 at step 8")),
            "{e:?}"
        );
    }

    #[test]
    fn the_decision_survives_the_store() {
        let announced = BTreeMap::from([(1, 12), (4, 12)]);
        let bytes = Survivors::encode(&announced);
        assert_eq!(bytes, b"1:12,4:12");
        assert_eq!(Survivors::decode(&bytes), Some(announced));
        assert_eq!(Survivors::decode(b"1:x"), None);
        assert_eq!(Survivors::decode(b""), Some(BTreeMap::new()));
    }
}
