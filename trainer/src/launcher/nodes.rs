//! How many machines a job has: `--nnodes N`, or torchrun's elastic `--nnodes MIN:MAX`, and
//! the rendezvous of an elastic job's launchers in pure form — how many nodes it starts with,
//! and what a launcher that took a place in the queue does. The store round trips are
//! [`crate::launcher::node_rendezvous`]'s.
//!
//! ```text
//!   --nnodes 1:3, node 0 hosts the store      node 0   node A   node B        node C
//!   place (arrival order, node 0 first)          0        1        2             3
//!   node 0 closes the rendezvous at 3 nodes   member   member   member   late: joins it
//! ```

use std::fmt;
use std::str::FromStr;

/// `--nnodes`: the fewest and the most machines of the job (equal for a fixed `N`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRange {
    pub min: usize,
    pub max: usize,
}

impl NodeRange {
    /// A job of exactly `n` machines.
    pub fn exactly(n: usize) -> Self {
        Self { min: n, max: n }
    }

    /// Whether the job's size is decided when it starts (`MIN:MAX` with `MIN < MAX`).
    pub fn is_elastic(&self) -> bool {
        self.min < self.max
    }

    /// How many nodes start the job when `arrived` launchers besides node 0's have taken a
    /// place and the rendezvous closes: as many as came, at most `max`. `None` while fewer
    /// than `min` are there.
    pub fn starting_nodes(&self, arrived: usize) -> Option<usize> {
        let nodes = (1 + arrived).min(self.max);
        (nodes >= self.min).then_some(nodes)
    }
}

impl Default for NodeRange {
    fn default() -> Self {
        Self::exactly(1)
    }
}

impl fmt::Display for NodeRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.is_elastic() {
            true => write!(f, "{}:{}", self.min, self.max),
            false => write!(f, "{}", self.max),
        }
    }
}

impl FromStr for NodeRange {
    type Err = String;

    /// `N` or `MIN:MAX` (torchrun's spelling), with `1 <= MIN <= MAX`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let count = |part: &str| {
            part.trim().parse::<usize>().map_err(|_| {
                format!("`{text}` is not a number of machines: give N, or MIN:MAX as torchrun takes it (for example 1:4)")
            })
        };
        let range = match text.split_once(':') {
            Some((min, max)) => Self {
                min: count(min)?,
                max: count(max)?,
            },
            None => Self::exactly(count(text)?),
        };
        if range.min == 0 {
            return Err(format!("`{text}`: a job needs at least 1 machine"));
        }
        if range.min > range.max {
            return Err(format!(
                "`{text}`: MIN ({}) is more than MAX ({})",
                range.min, range.max
            ));
        }
        Ok(range)
    }
}

/// What a launcher that took place `place` (node 0 is 0, the others 1, 2, … in the order they
/// came) does once node 0 closed the rendezvous at `nodes` nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodePlace {
    /// It starts the job as node `node_rank` of `nodes`.
    Member { node_rank: usize, nodes: usize },
    /// It came after the rendezvous closed: its ranks join the job once it trains.
    Late { node_rank: usize },
}

impl NodePlace {
    pub fn of(place: usize, nodes: usize) -> Self {
        match place < nodes {
            true => NodePlace::Member {
                node_rank: place,
                nodes,
            },
            false => NodePlace::Late { node_rank: place },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{NodePlace, NodeRange};

    #[test]
    fn a_node_count_or_a_range_is_read_as_torchrun_writes_it() {
        let parse = |s: &str| s.parse::<NodeRange>();
        assert_eq!(parse("2"), Ok(NodeRange::exactly(2)));
        assert_eq!(parse("1:4"), Ok(NodeRange { min: 1, max: 4 }));
        assert_eq!(parse("3:3"), Ok(NodeRange::exactly(3)));
        assert!(!NodeRange::exactly(3).is_elastic());
        assert_eq!(NodeRange { min: 1, max: 4 }.to_string(), "1:4");
        for bad in ["0", "0:2", "3:2", "a", "1:", ":2", "1:2:3", "-1"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert!(parse("3:2").is_err_and(|e| e.contains("MIN (3) is more than MAX (2)")));
    }

    #[test]
    fn the_job_starts_with_the_nodes_there_between_min_and_max() {
        let range = NodeRange { min: 2, max: 3 };
        // Node 0 alone, then with one more, two, three (the third waits its turn).
        assert_eq!(range.starting_nodes(0), None);
        assert_eq!(range.starting_nodes(1), Some(2));
        assert_eq!(range.starting_nodes(2), Some(3));
        assert_eq!(range.starting_nodes(3), Some(3));
        assert_eq!(NodeRange { min: 1, max: 2 }.starting_nodes(0), Some(1));
    }

    #[test]
    fn a_launcher_that_came_after_the_rendezvous_closed_joins() {
        assert_eq!(
            NodePlace::of(1, 2),
            NodePlace::Member {
                node_rank: 1,
                nodes: 2
            }
        );
        assert_eq!(NodePlace::of(2, 2), NodePlace::Late { node_rank: 2 });
        assert_eq!(NodePlace::of(5, 2), NodePlace::Late { node_rank: 5 });
    }
}
