//! Which waiting processes join the job, and where: pure (the store protocol is
//! [`super::join`]'s).
//!
//! A process that asks to join gets a number (1, 2, … in the order the requests came). At a
//! step boundary rank 0 plans a join: after optimizer step `step`, the requests up to
//! `handled` are dealt with, the ones in `requests` joining (in that order, after the ranks
//! already there) and any other refused (its settings differ). Every member reads the same
//! plan, and each joiner gets its [`Admission`].

/// A join rank 0 planned, the same on every member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedJoin {
    /// The joiners join after this many optimizer steps.
    pub step: u64,
    /// Every request up to this number is dealt with by this plan.
    pub handled: u64,
    /// The requests that join, in the order of their new ranks.
    pub requests: Vec<u64>,
}

/// What admitting a [`PlannedJoin`]'s joiners did (the same on every member).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Admitted {
    /// How many joined: the plan's joiners, or 0 when none did (all refused, or the grown
    /// group could not form).
    pub joined: usize,
    /// Why the grown group could not form (a joiner died on its way in), when it could not:
    /// the members then carried on among themselves.
    pub failure: Option<String>,
    /// Members (their ranks before the admission) that did not carry on after a failed
    /// admission: they died during it too.
    pub lost: Vec<usize>,
}

/// What a joining process is told: its place in the grown job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    /// The generation of the job it joins (its group lives under `gen-{generation}/`).
    pub generation: u64,
    /// Its rank there.
    pub rank: usize,
    /// The grown job's world size.
    pub world: usize,
    /// The optimizer steps the job has applied.
    pub step: u64,
    /// Every request up to this number was dealt with when it joined.
    pub handled: u64,
}

/// A joining process's answer: admitted, or refused with the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Admitted(Admission),
    Refused(String),
}

impl PlannedJoin {
    /// The admissions of this plan's joiners into a job of `world` ranks before it grows, as
    /// generation `generation`: (request, admission) in rank order.
    pub fn admissions(&self, world: usize, generation: u64) -> Vec<(u64, Admission)> {
        let grown = world + self.requests.len();
        self.requests
            .iter()
            .enumerate()
            .map(|(i, &request)| {
                let admission = Admission {
                    generation,
                    rank: world + i,
                    world: grown,
                    step: self.step,
                    handled: self.handled,
                };
                (request, admission)
            })
            .collect()
    }

    /// The plan as the store value every member reads: `step;handled;r,r,…`.
    pub fn encode(&self) -> Vec<u8> {
        let requests: Vec<String> = self.requests.iter().map(u64::to_string).collect();
        format!("{};{};{}", self.step, self.handled, requests.join(",")).into_bytes()
    }

    /// The inverse of [`encode`](Self::encode); `None` for a value it cannot read.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(bytes).ok()?;
        let mut parts = text.split(';');
        let step = parts.next()?.parse().ok()?;
        let handled = parts.next()?.parse().ok()?;
        let list = parts.next()?;
        if parts.next().is_some() {
            return None;
        }
        let requests = match list {
            "" => Vec::new(),
            list => list
                .split(',')
                .map(|r| r.parse().ok())
                .collect::<Option<_>>()?,
        };
        Some(Self {
            step,
            handled,
            requests,
        })
    }
}

impl Reply {
    /// `admitted:generation:rank:world:step:handled`, or `refused:reason`.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Self::Admitted(a) => format!(
                "admitted:{}:{}:{}:{}:{}",
                a.generation, a.rank, a.world, a.step, a.handled
            )
            .into_bytes(),
            Self::Refused(reason) => format!("refused:{reason}").into_bytes(),
        }
    }

    /// The inverse of [`encode`](Self::encode); `None` for a value it cannot read.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let text = std::str::from_utf8(bytes).ok()?;
        if let Some(reason) = text.strip_prefix("refused:") {
            return Some(Self::Refused(reason.to_owned()));
        }
        let fields: Vec<u64> = text
            .strip_prefix("admitted:")?
            .split(':')
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        let [generation, rank, world, step, handled] = fields[..] else {
            return None;
        };
        Some(Self::Admitted(Admission {
            generation,
            rank: usize::try_from(rank).ok()?,
            world: usize::try_from(world).ok()?,
            step,
            handled,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::{Admission, PlannedJoin, Reply};

    #[test]
    fn joiners_take_the_ranks_after_the_members_in_request_order() {
        let plan = PlannedJoin {
            step: 40,
            handled: 5,
            requests: vec![3, 5],
        };
        let admissions = plan.admissions(2, 7);
        assert_eq!(
            admissions,
            vec![
                (
                    3,
                    Admission {
                        generation: 7,
                        rank: 2,
                        world: 4,
                        step: 40,
                        handled: 5
                    }
                ),
                (
                    5,
                    Admission {
                        generation: 7,
                        rank: 3,
                        world: 4,
                        step: 40,
                        handled: 5
                    }
                ),
            ]
        );
    }

    #[test]
    fn plans_and_replies_survive_the_store() {
        let plan = PlannedJoin {
            step: 12,
            handled: 3,
            requests: vec![2, 3],
        };
        assert_eq!(plan.encode(), b"12;3;2,3");
        assert_eq!(PlannedJoin::decode(&plan.encode()), Some(plan));
        let none = PlannedJoin {
            step: 1,
            handled: 1,
            requests: vec![],
        };
        assert_eq!(PlannedJoin::decode(&none.encode()), Some(none));
        assert_eq!(PlannedJoin::decode(b"1;x;2"), None);
        let admitted = Reply::Admitted(Admission {
            generation: 2,
            rank: 1,
            world: 3,
            step: 9,
            handled: 1,
        });
        assert_eq!(Reply::decode(&admitted.encode()), Some(admitted));
        let refused = Reply::Refused("other settings: a:b".into());
        assert_eq!(Reply::decode(&refused.encode()), Some(refused));
        assert_eq!(Reply::decode(b"admitted:1:2"), None);
    }
}
