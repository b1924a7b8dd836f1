//! Slurm's host-list syntax (`SLURM_JOB_NODELIST`, `SLURM_STEP_NODELIST`), expanded: what
//! `scontrol show hostnames` prints, without needing `scontrol`.
//!
//! A list is comma-separated; each entry is literal text and bracketed ranges, e.g.
//! `node[01-04,07]` → `node01 node02 node03 node04 node07` (the width of a range's first bound
//! is kept: `01` pads to two digits), `rack[1-2]-n[1-2]` → the product `rack1-n1 rack1-n2
//! rack2-n1 rack2-n2`, `a,b[3-4]` → `a b3 b4`. Pure.

/// A host list that does not follow Slurm's syntax.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("host list {list:?}: {reason}")]
pub struct HostListError {
    pub list: String,
    pub reason: String,
}

/// At most this many hosts are expanded (a typo such as `n[1-99999999]` must not allocate
/// without bound).
pub const MAX_HOSTS: usize = 1 << 16;

/// Every host of `list`, in Slurm's order.
pub fn expand(list: &str) -> Result<Vec<String>, HostListError> {
    let fail = |reason: String| HostListError {
        list: list.to_string(),
        reason,
    };
    let mut hosts = Vec::new();
    for entry in split_top_level(list).map_err(fail)? {
        let entry = entry.trim();
        if entry.is_empty() {
            continue;
        }
        let mut names = vec![String::new()];
        let mut rest = entry;
        while !rest.is_empty() {
            match rest.find('[') {
                None => {
                    names.iter_mut().for_each(|n| n.push_str(rest));
                    rest = "";
                }
                Some(open) => {
                    let literal = &rest[..open];
                    let close = rest[open..]
                        .find(']')
                        .map(|c| open + c)
                        .ok_or_else(|| fail(format!("unclosed '[' in {entry:?}")))?;
                    let values = expand_ranges(&rest[open + 1..close]).map_err(&fail)?;
                    if names.len().saturating_mul(values.len()) > MAX_HOSTS {
                        return Err(fail(format!("more than {MAX_HOSTS} hosts")));
                    }
                    names = names
                        .iter()
                        .flat_map(|n| values.iter().map(move |v| format!("{n}{literal}{v}")))
                        .collect();
                    rest = &rest[close + 1..];
                }
            }
        }
        hosts.extend(names);
        if hosts.len() > MAX_HOSTS {
            return Err(fail(format!("more than {MAX_HOSTS} hosts")));
        }
    }
    if hosts.is_empty() {
        return Err(fail("no host in it".into()));
    }
    Ok(hosts)
}

/// The first host of `list` (rank 0's, for the block distribution Slurm uses by default).
pub fn first_host(list: &str) -> Result<String, HostListError> {
    expand(list).map(|mut hosts| hosts.swap_remove(0))
}

/// Splits at commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0usize, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err("nested '['".into()),
            ']' if depth == 1 => depth = 0,
            ']' => return Err("']' without '['".into()),
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("unclosed '['".into());
    }
    parts.push(&list[start..]);
    Ok(parts)
}

/// `01-04,07` → `01 02 03 04 07`, zero-padded to the width of each range's first bound.
fn expand_ranges(inner: &str) -> Result<Vec<String>, String> {
    let mut values = Vec::new();
    for part in inner.split(',') {
        let part = part.trim();
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let number = |s: &str| {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("{part:?} is not a number or a range of numbers"));
            }
            s.parse::<u64>()
                .map_err(|_| format!("{s:?} is too large a number"))
        };
        let (from, to) = (number(lo)?, number(hi)?);
        if to < from {
            return Err(format!("range {part:?} goes backwards"));
        }
        if (to - from) as usize >= MAX_HOSTS {
            return Err(format!("range {part:?} has more than {MAX_HOSTS} hosts"));
        }
        let width = lo.len();
        values.extend((from..=to).map(|v| format!("{v:0width$}")));
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(list: &str) -> Vec<String> {
        expand(list).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn plain_names_and_lists() {
        assert_eq!(hosts("node1"), ["node1"]);
        assert_eq!(hosts("a,b,c"), ["a", "b", "c"]);
        assert_eq!(hosts("vm"), ["vm"]);
    }

    #[test]
    fn ranges_keep_their_zero_padding() {
        assert_eq!(
            hosts("node[01-04,07]"),
            ["node01", "node02", "node03", "node04", "node07"]
        );
        assert_eq!(hosts("n[8-11]"), ["n8", "n9", "n10", "n11"]);
        assert_eq!(hosts("n[098-101]"), ["n098", "n099", "n100", "n101"]);
    }

    #[test]
    fn several_brackets_give_the_product_and_entries_mix() {
        assert_eq!(
            hosts("rack[1-2]-n[1-2]"),
            ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
        );
        assert_eq!(
            hosts("gpu[1-2],cpu7,big[10,12]x"),
            ["gpu1", "gpu2", "cpu7", "big10x", "big12x"]
        );
        assert_eq!(first_host("node[07-09],a").unwrap(), "node07");
    }

    #[test]
    fn bad_lists_say_what_is_wrong() {
        for (list, says) in [
            ("node[1-", "unclosed"),
            ("node[2-1]", "backwards"),
            ("node[a-b]", "not a number"),
            ("node[[1]]", "nested"),
            ("node]", "without '['"),
            ("", "no host"),
            ("n[0-99999999]", "more than"),
        ] {
            let err = expand(list).unwrap_err().to_string();
            assert!(err.contains(says), "{list:?}: {err}");
        }
    }
}
