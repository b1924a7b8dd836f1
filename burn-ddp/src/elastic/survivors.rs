//! Which ranks carry on after a failure, and from which step: pure.
//!
//! Every survivor announces the number of optimizer steps it has applied; one of them (the
//! first to arrive, see [`super::agreement`]) waits for the others and writes the decision:
//! the announced ranks with their steps. A rank that did not announce in time is left out (it
//! died, or is too late to be trusted). The survivors carry on from the furthest step: a rank
//! died in the last moments of a step, after some survivor finished it and before another
//! did, so the ones behind (one step at most) take the state of one that finished it, which
//! becomes the new group's rank 0 (the members in rank order, those ahead first). Steps that
//! differ by more than one cannot happen in a synchronous job: the decision then refuses to go
//! on, naming the ranks and their steps.

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
    /// Members one step behind `step`: they take the new rank 0's state (module docs).
    pub behind: Vec<usize>,
}

impl Survivors {
    /// The decision from each announced rank's applied steps, in a group of `world` ranks.
    /// Fails when the survivors stand more than one step apart (module docs).
    pub fn decide(world: usize, announced: &BTreeMap<usize, u64>) -> Result<Self, DdpError> {
        let lost = (0..world).filter(|r| !announced.contains_key(r)).collect();
        let (Some(&step), Some(&lowest)) = (announced.values().max(), announced.values().min())
        else {
            return Err(DdpError::Membership(
                "no rank announced itself after the failure".into(),
            ));
        };
        if step - lowest > 1 {
            let each: Vec<String> = announced
                .iter()
                .map(|(r, s)| format!("rank {r} at step {s}"))
                .collect();
            return Err(DdpError::Membership(format!(
                "the surviving ranks stand more than one step apart ({}), which a synchronous job cannot; restart every rank from the newest checkpoint",
                each.join(", ")
            )));
        }
        let ahead = announced
            .iter()
            .filter(|(_, &s)| s == step)
            .map(|(&r, _)| r);
        let behind: Vec<usize> = announced
            .iter()
            .filter(|(_, &s)| s < step)
            .map(|(&r, _)| r)
            .collect();
        Ok(Self {
            members: ahead.chain(behind.iter().copied()).collect(),
            step,
            lost,
            behind,
        })
    }

    /// This decision followed by `next`, agreed among this decision's members (numbered as
    /// in their group, `members`' order) when the group they decided on could not form: the
    /// ranks of the group that failed first that carry on after both, those lost in either,
    /// and those behind.
    pub fn then(&self, next: &Survivors) -> Survivors {
        let original = |ranks: &[usize]| -> Vec<usize> {
            ranks
                .iter()
                .filter_map(|&r| self.members.get(r).copied())
                .collect()
        };
        let mut lost = self.lost.clone();
        lost.extend(original(&next.lost));
        lost.sort_unstable();
        Survivors {
            members: original(&next.members),
            step: next.step,
            lost,
            behind: original(&next.behind),
        }
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
        CollectiveError::PeerSilent { silent, .. } => Some(silent.to_vec()),
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
                behind: vec![],
            })
        );
    }

    /// A rank one step behind carries on after the ranks ahead, the first of which is the
    /// new rank 0 whose state it takes; ranks further apart are refused, each step named.
    #[test]
    fn a_rank_one_step_behind_follows_and_further_apart_is_refused() {
        let announced = BTreeMap::from([(0, 7), (2, 8), (3, 8)]);
        let s = Survivors::decide(4, &announced).map_err(|e| e.to_string());
        assert_eq!(
            s,
            Ok(Survivors {
                members: vec![2, 3, 0],
                step: 8,
                lost: vec![1],
                behind: vec![0],
            })
        );
        let announced = BTreeMap::from([(0, 6), (2, 8)]);
        let e = Survivors::decide(3, &announced)
            .err()
            .map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.contains("rank 0 at step 6, rank 2 at step 8")),
            "{e:?}"
        );
    }

    /// Ranks 0, 2, 3 of 4 decided on; forming their group failed and, among its ranks, 0 and
    /// 2 (ranks 0 and 3 of the first group) carried on, 2 one step behind.
    #[test]
    fn a_second_decision_among_the_first_ones_members_names_the_first_groups_ranks() {
        let first = Survivors {
            members: vec![0, 2, 3],
            step: 7,
            lost: vec![1],
            behind: vec![],
        };
        let second = Survivors {
            members: vec![0, 2],
            step: 7,
            lost: vec![1],
            behind: vec![2],
        };
        assert_eq!(
            first.then(&second),
            Survivors {
                members: vec![0, 3],
                step: 7,
                lost: vec![1, 2],
                behind: vec![3],
            }
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
