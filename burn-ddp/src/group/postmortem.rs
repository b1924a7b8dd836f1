//! Post-mortem of a failed collective: which rank died without a word.
//!
//! When a rank dies (`kill -9`, a crash, the OOM killer), only its two ring neighbours see its
//! connections close; they abort and close theirs, so the ranks further along the ring lose a
//! *messenger*, not the cause. To converge on the root cause, every rank whose collective fails
//! publishes a report under `failed/{rank}` in the group's namespace of the store (see
//! [`encode_report`]): its message and, when it lost a connection, the peer it lost and that
//! peer's address. A rank that lost a peer then follows the chain of reports from that peer (who
//! did it lose? who did that one lose?) until either
//! - a rank that reported an error of its own (a mismatch, a timeout, bad arguments): that rank
//!   speaks for itself, and this rank's error stays as it is ([`Verdict::Reported`]); or
//! - a rank that has not reported: alive ranks report at once (a lost connection fails them
//!   immediately), so a rank still silent after the group's failure detection time
//!   ([`DEFAULT_FAILURE_DETECTION`] by default; never past the collective's
//!   deadline) is the one that died ([`Verdict::Gone`], with every silent rank that some report
//!   lost, and the ranks that lost each).
//!
//! The store may be hosted by the rank that died (rank 0 under plain `RANK`/`MASTER_*`
//! variables): every store call here has a deadline, the whole post-mortem runs on a helper
//! thread the caller waits for at most the detection time plus [`STORE_GRACE`] (and the linger), and a store
//! failure is [`Verdict::StoreFailed`] — the caller keeps its own error, never hangs. For the
//! same reason a rank that has its verdict waits (at most [`LINGER`]) until every reporting rank
//! has its own (`judged/{rank}`), so the store's host does not take the store away from them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::error::{GoneRank, StoreError};
use crate::store::{PrefixStore, Store};

/// The failure detection time of the library and of the trainer, by default
/// ([`crate::group::TcpGroupOptions::failure_detection`], [`crate::DdpOptions::failure_detection`],
/// the trainer's `fault_tolerance.detection_secs`): how long a rank that lost a peer waits for
/// the other ranks' reports before it names the silent ones dead; with peer heartbeats, a
/// peer silent for twice this is dead. Live ranks report at once, so a second is enough on a
/// loaded machine and matches torchft's best measured heartbeat.
pub const DEFAULT_FAILURE_DETECTION: Duration = Duration::from_secs(1);
/// How often the wait looks again (it also wakes as soon as the awaited rank reports).
const SLICE: Duration = Duration::from_millis(250);
/// Extra time the caller gives the helper thread for its store round trips.
const STORE_GRACE: Duration = Duration::from_secs(2);
/// How long a rank with a verdict waits for the other reporting ranks to reach theirs.
const LINGER: Duration = Duration::from_secs(1);
/// How long one store read may take.
const READ_TIMEOUT: Duration = Duration::from_secs(1);

/// One rank's failure report, as published under `failed/{rank}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Report {
    /// The peer whose connection this rank lost, and its address; `None` for an error of its own.
    pub lost: Option<(usize, String)>,
    /// The rank's error message.
    pub message: String,
}

/// What the reports say about this rank's failure.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// These ranks were lost by others and never reported: they died.
    Gone(Vec<GoneRank>),
    /// The failure leads to a rank that reported its own error (or to no conclusion): this
    /// rank's error stands as it is.
    Reported,
    /// The store failed (or did not answer in time): nothing is known.
    StoreFailed(StoreError),
}

/// The value of `failed/{rank}`: `lost {peer} {addr}` or `-` on the first line, the message after.
pub(crate) fn encode_report(report: &Report) -> Vec<u8> {
    let head = match &report.lost {
        Some((peer, addr)) => format!("lost {peer} {addr}"),
        None => "-".into(),
    };
    format!("{head}\n{}", report.message).into_bytes()
}

/// The inverse of [`encode_report`]; a value it cannot read counts as an error of the rank's own.
pub(crate) fn decode_report(bytes: &[u8]) -> Report {
    let text = String::from_utf8_lossy(bytes);
    let (head, message) = text.split_once('\n').unwrap_or((&text, ""));
    let lost = head.strip_prefix("lost ").and_then(|rest| {
        let (peer, addr) = rest.split_once(' ')?;
        Some((peer.parse().ok()?, addr.to_string()))
    });
    Report {
        lost,
        message: message.to_string(),
    }
}

fn key(rank: usize) -> String {
    format!("failed/{rank}")
}

/// What the helper thread of [`post_mortem`] says, in order.
enum Step {
    /// The report is published (or publishing failed: then `Done` follows at once).
    Published,
    Done(Result<Verdict, StoreError>),
}

/// Publishes `report` as rank `rank`'s failure and, when it lost a peer, finds the root cause
/// (module docs) among the `world` ranks, waiting at most until `until`. Blocking store calls:
/// run it through [`post_mortem`], which bounds it.
fn investigate(
    store: &dyn Store,
    (rank, world): (usize, usize),
    report: &Report,
    until: Instant,
    tx: &mpsc::Sender<Step>,
) -> Result<Verdict, StoreError> {
    store.set(&key(rank), &encode_report(report))?;
    let _ = tx.send(Step::Published);
    let Some((first, _)) = &report.lost else {
        return Ok(Verdict::Reported);
    };
    let mut known: BTreeMap<usize, Report> = BTreeMap::new();
    known.insert(rank, report.clone());
    loop {
        // Follow the chain of losses from the peer this rank lost.
        let mut seen = BTreeSet::from([rank]);
        let mut at = *first;
        let silent = loop {
            if !seen.insert(at) {
                return Ok(Verdict::Reported); // a cycle: ranks that lost each other
            }
            match read(store, at, &mut known)? {
                None => break at,
                Some(Report {
                    lost: Some((next, _)),
                    ..
                }) => at = next,
                Some(Report { lost: None, .. }) => return Ok(Verdict::Reported),
            }
        };
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return gone(store, world, &mut known).map(Verdict::Gone);
        }
        match store.wait(&[&key(silent)], left.min(SLICE)) {
            Ok(()) | Err(StoreError::Timeout { .. }) => {}
            Err(e) => return Err(e),
        }
    }
}

/// Marks this rank's investigation done (`judged/{rank}`) and waits, at most [`LINGER`], until
/// every rank that reported a failure has marked its own: the rank that hosts the store (rank 0
/// under plain `RANK`/`MASTER_*` variables) must not exit and take the store with it while the
/// others still read it. Store errors end the wait: there is nothing left to wait for.
fn linger(store: &dyn Store, rank: usize, world: usize) {
    if store.set(&format!("judged/{rank}"), b"1").is_err() {
        return;
    }
    let until = Instant::now() + LINGER;
    let reporters: Vec<usize> = (0..world)
        .filter(|&r| r != rank && store.check(&[&key(r)]).unwrap_or(false))
        .collect();
    let keys: Vec<String> = reporters.iter().map(|r| format!("judged/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let left = until.saturating_duration_since(Instant::now());
    if !refs.is_empty() && !left.is_zero() {
        let _ = store.wait(&refs, left);
    }
}

/// Rank `r`'s report, from `known` or the store (`None`: not published).
fn read(
    store: &dyn Store,
    r: usize,
    known: &mut BTreeMap<usize, Report>,
) -> Result<Option<Report>, StoreError> {
    if let Some(report) = known.get(&r) {
        return Ok(Some(report.clone()));
    }
    if !store.check(&[&key(r)])? {
        return Ok(None);
    }
    let report = decode_report(&store.get(&key(r), READ_TIMEOUT)?);
    known.insert(r, report.clone());
    Ok(Some(report))
}

/// Every rank that some report lost and that has not reported itself, with who lost it (all
/// `world` ranks' reports are read once).
fn gone(
    store: &dyn Store,
    world: usize,
    known: &mut BTreeMap<usize, Report>,
) -> Result<Vec<GoneRank>, StoreError> {
    let mut silent = BTreeSet::new();
    for r in 0..world {
        if read(store, r, known)?.is_none() {
            silent.insert(r);
        }
    }
    let lost: BTreeSet<usize> = known
        .values()
        .filter_map(|r| r.lost.as_ref().map(|(p, _)| *p))
        .collect();
    Ok(silent
        .intersection(&lost)
        .copied()
        .map(|r| {
            let losers: Vec<(usize, &str)> = known
                .iter()
                .filter_map(|(&by, rep)| match &rep.lost {
                    Some((p, addr)) if *p == r => Some((by, addr.as_str())),
                    _ => None,
                })
                .collect();
            GoneRank {
                rank: r,
                addr: losers.first().map_or("?", |l| l.1).to_string(),
                lost_by: losers.iter().map(|l| l.0).collect(),
            }
        })
        .collect())
}

/// Publishes rank `rank`'s failure `report` for the group of `world` ranks whose namespace is
/// `store`, then calls `published` (the caller closes its connections there: a neighbour that
/// sees them close then finds the report already there), and, when the rank lost a peer, returns
/// what the reports say (module docs), waiting for them until `deadline` (the collective's) or
/// `window` (the group's failure detection, [`DEFAULT_FAILURE_DETECTION`] by default), whichever comes
/// first.
///
/// Bounded whatever the store does: `published` is called within [`STORE_GRACE`] even if the
/// store does not answer, and the verdict comes by the end of the wait plus [`STORE_GRACE`]. The
/// store work runs on a helper thread, left behind if the store does not answer (its calls have
/// their own deadlines).
pub(crate) fn post_mortem(
    store: &PrefixStore,
    (rank, world): (usize, usize),
    report: Report,
    (deadline, window): (Instant, Duration),
    published: impl FnOnce(),
) -> Verdict {
    let until = deadline.min(Instant::now() + window);
    let (tx, rx) = mpsc::channel();
    let namespace = store.prefix().to_string();
    let store = store.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("post-mortem-{rank}"))
        .spawn(move || {
            let verdict = investigate(&store, (rank, world), &report, until, &tx);
            if verdict.is_ok() {
                linger(&store, rank, world);
            }
            let _ = tx.send(Step::Done(verdict));
        });
    if let Err(e) = spawned {
        published();
        return Verdict::StoreFailed(StoreError::Io {
            addr: format!("(namespace {namespace:?})"),
            operation: "starting the post-mortem thread".into(),
            source: e,
        });
    }
    let timed_out = |bound| {
        Verdict::StoreFailed(StoreError::Timeout {
            addr: format!("(namespace {namespace:?})"),
            operation: "publishing and reading failure reports".into(),
            timeout: bound,
        })
    };
    let first = rx.recv_timeout(STORE_GRACE);
    published();
    match first {
        Ok(Step::Published) => {}
        Ok(Step::Done(Ok(verdict))) => return verdict,
        Ok(Step::Done(Err(e))) => return Verdict::StoreFailed(e),
        Err(_) => return timed_out(STORE_GRACE),
    }
    let bound = until.saturating_duration_since(Instant::now()) + STORE_GRACE + LINGER;
    match rx.recv_timeout(bound) {
        Ok(Step::Done(Ok(verdict))) => verdict,
        Ok(Step::Done(Err(e))) => Verdict::StoreFailed(e),
        Ok(Step::Published) | Err(_) => timed_out(bound),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use std::sync::Arc;

    /// The report window these tests wait with (the default was this long once; the tests
    /// keep it: "at once" means well within it on a loaded machine).
    const REPORT_WINDOW: Duration = Duration::from_millis(2500);

    fn ns() -> PrefixStore {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        PrefixStore::new("pg/test", store)
    }

    fn lost(peer: usize) -> Report {
        Report {
            lost: Some((peer, format!("10.0.0.{peer}:7"))),
            message: format!("lost {peer}"),
        }
    }

    #[test]
    fn reports_round_trip() {
        for r in [
            lost(3),
            Report {
                lost: None,
                message: "mismatch\nsecond line".into(),
            },
        ] {
            assert_eq!(decode_report(&encode_report(&r)), r);
        }
    }

    /// Ring 0 → 1 → 2 → 3 → 0, rank 1 dies: 0 and 2 lose it, 3 loses 2 (a messenger).
    #[test]
    fn the_silent_rank_others_lost_is_named_by_every_survivor() {
        let ns = ns();
        let start = Instant::now();
        let deadline = start + Duration::from_secs(60);
        let handles: Vec<_> = [(0, 1), (2, 1), (3, 2)]
            .into_iter()
            .map(|(rank, peer)| {
                let ns = ns.clone();
                std::thread::spawn(move || {
                    post_mortem(&ns, (rank, 4), lost(peer), (deadline, REPORT_WINDOW), || {})
                })
            })
            .collect();
        for h in handles {
            match h.join().unwrap() {
                Verdict::Gone(gone) => assert_eq!(
                    gone,
                    vec![GoneRank {
                        rank: 1,
                        addr: "10.0.0.1:7".into(),
                        lost_by: vec![0, 2]
                    }]
                ),
                other => panic!("{other:?}"),
            }
        }
        let took = start.elapsed();
        assert!(
            took >= REPORT_WINDOW && took < REPORT_WINDOW * 3,
            "{took:?}"
        );
    }

    #[test]
    fn a_chain_that_ends_in_a_reported_error_keeps_the_rank_s_own_error() {
        let ns = ns();
        let mismatch = Report {
            lost: None,
            message: "mismatch".into(),
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        assert!(matches!(
            post_mortem(&ns, (1, 4), mismatch, (deadline, REPORT_WINDOW), || {}),
            Verdict::Reported
        ));
        let start = Instant::now();
        // 0 lost 2, which lost 1, which reported its own error: at once.
        ns.set("failed/2", &encode_report(&lost(1))).unwrap();
        assert!(matches!(
            post_mortem(&ns, (0, 4), lost(2), (deadline, REPORT_WINDOW), || {}),
            Verdict::Reported
        ));
        assert!(start.elapsed() < REPORT_WINDOW);
    }

    #[test]
    fn the_wait_never_passes_the_collective_s_deadline() {
        let start = Instant::now();
        let deadline = start + Duration::from_millis(300);
        assert!(matches!(
            post_mortem(&ns(), (0, 2), lost(1), (deadline, REPORT_WINDOW), || {}),
            Verdict::Gone(_)
        ));
        assert!(start.elapsed() < REPORT_WINDOW, "{:?}", start.elapsed());
    }

    /// A store whose every call fails, as a store hosted by a dead rank does.
    struct DeadStore;
    impl Store for DeadStore {
        fn set(&self, _: &str, _: &[u8]) -> Result<(), StoreError> {
            Err(dead())
        }
        fn get(&self, _: &str, _: Duration) -> Result<Vec<u8>, StoreError> {
            Err(dead())
        }
        fn add(&self, _: &str, _: i64) -> Result<i64, StoreError> {
            Err(dead())
        }
        fn wait(&self, _: &[&str], _: Duration) -> Result<(), StoreError> {
            Err(dead())
        }
        fn check(&self, _: &[&str]) -> Result<bool, StoreError> {
            Err(dead())
        }
        fn delete_key(&self, _: &str) -> Result<bool, StoreError> {
            Err(dead())
        }
    }
    fn dead() -> StoreError {
        StoreError::Io {
            addr: "127.0.0.1:1".into(),
            operation: "set".into(),
            source: std::io::ErrorKind::ConnectionReset.into(),
        }
    }

    #[test]
    fn a_dead_store_is_a_store_failure_at_once() {
        let ns = PrefixStore::new("pg/test", Arc::new(DeadStore));
        let start = Instant::now();
        let mut closed = false;
        let verdict = post_mortem(
            &ns,
            (2, 4),
            lost(1),
            (start + Duration::from_secs(60), REPORT_WINDOW),
            || closed = true,
        );
        assert!(
            closed,
            "the connections are closed even when the store is dead"
        );
        assert!(matches!(verdict, Verdict::StoreFailed(_)), "{verdict:?}");
        assert!(start.elapsed() < Duration::from_secs(1));
    }
}
