//! One contract suite for every [`ProcessGroup`] implementation (PyTorch's `StoreTestBase`
//! pattern): the same cases run against the TCP group over sockets, the TCP group over shared
//! memory and, on a machine with GPUs, the NCCL group.
//!
//! Ranks are threads of this process, each with its own client of a real [`TcpStoreServer`] on
//! `127.0.0.1` port 0. Each group is formed once per (implementation, world size) and runs the
//! whole table of cases — every collective (and the staged all-reduce) × every [`Element`] type × lengths 0, 1, 7 (odd, not a
//! multiple of 2, 3 or 4) and 2^20 + 3 (large, pipelined, not a multiple either) — so the suite
//! forms a handful of groups, not thousands. Every result is checked against a closed form
//! computed here in `i64`/`f64` from the inputs' formula, never with the group's own reduction
//! code. Failure cases (mismatches, timeouts, missing ranks) get a group each: they abort it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::{Element, PieceStaging, ProcessGroup, ReduceOp};
use crate::error::CollectiveError;
use crate::store::{Store, TcpStore, TcpStoreServer};

/// Forms rank `rank` of a group of `world` ranks through `store`, with deadline `timeout`.
pub(crate) trait Form: Sync {
    type Group: ProcessGroup;
    fn form(
        &self,
        store: Arc<dyn Store>,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self::Group, CollectiveError>;
}

impl<G: ProcessGroup, F> Form for F
where
    F: Fn(Arc<dyn Store>, usize, usize, Duration) -> Result<G, CollectiveError> + Sync,
{
    type Group = G;
    fn form(
        &self,
        store: Arc<dyn Store>,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<G, CollectiveError> {
        self(store, rank, world, timeout)
    }
}

const TOKEN: &str = "conformance";
const LENGTHS: [usize; 4] = [0, 1, 7, (1 << 20) + 3];
const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
/// Deadline of the groups that are expected to succeed: long enough for a loaded machine,
/// short enough that a hang fails the test instead of the CI job.
const GENEROUS: Duration = Duration::from_secs(60);

/// A fresh store server on an OS-chosen port.
pub(crate) fn store_server() -> TcpStoreServer {
    TcpStoreServer::bind("127.0.0.1:0", TOKEN).expect("bind a store on 127.0.0.1:0")
}

/// A client of `server`, as each rank has its own.
pub(crate) fn client(server: &TcpStoreServer) -> Arc<dyn Store> {
    let addr = server.local_addr().to_string();
    Arc::new(TcpStore::connect(&addr, TOKEN, Duration::from_secs(10)).expect("reach the store"))
}

/// Runs `body(rank, formed group)` on `world` threads, each forming its group through its own
/// client of a fresh store; returns the results in rank order. Ranks listed in `absent` never
/// form a group (`body` gets `None` for them).
pub(crate) fn on_ranks<F: Form, R: Send>(
    form: &F,
    world: usize,
    timeout: Duration,
    absent: &[usize],
    body: impl Fn(usize, Option<Result<F::Group, CollectiveError>>) -> R + Sync,
) -> Vec<R> {
    let server = store_server();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let store = client(&server);
                let body = &body;
                s.spawn(move || {
                    let group =
                        (!absent.contains(&rank)).then(|| form.form(store, rank, world, timeout));
                    body(rank, group)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

// ---------------------------------------------------------------------------------------------
// Closed forms

/// A test element: built from small integers, read back as `f64`. Every value and every partial
/// sum of the suite is a small integer (|x| <= 120), exact in every type, bf16 included.
pub(crate) trait Sample: Element {
    /// The name in failure messages.
    const NAME: &'static str;
    /// Relative tolerance of `Avg` (a division rounded in this type); `None` for integers,
    /// whose `Avg` truncates and is exact.
    const AVG_TOLERANCE: Option<f64>;
    const SIGNED: bool;
    fn from_i64(v: i64) -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! sample {
    ($t:ty, $name:literal, $tol:expr, $signed:expr, |$v:ident| $from:expr, |$x:ident| $to:expr) => {
        impl Sample for $t {
            const NAME: &'static str = $name;
            const AVG_TOLERANCE: Option<f64> = $tol;
            const SIGNED: bool = $signed;
            fn from_i64($v: i64) -> Self {
                $from
            }
            fn to_f64(self) -> f64 {
                let $x = self;
                $to
            }
        }
    };
}
sample!(f32, "f32", Some(1e-6), true, |v| v as f32, |x| x as f64);
sample!(f64, "f64", Some(1e-14), true, |v| v as f64, |x| x);
sample!(i32, "i32", None, true, |v| v as i32, |x| x as f64);
sample!(i64, "i64", None, true, |v| v, |x| x as f64);
sample!(u8, "u8", None, false, |v| v as u8, |x| x as f64);
sample!(
    half::bf16,
    "bf16",
    Some(1.0 / 128.0),
    true,
    |v| half::bf16::from_f64(v as f64),
    |x| x.to_f64()
);
sample!(
    half::f16,
    "f16",
    Some(1.0 / 1024.0),
    true,
    |v| half::f16::from_f64(v as f64),
    |x| x.to_f64()
);

/// Element `i` of rank `rank`'s input: small integers that differ across ranks and positions
/// (in -15..=15 for signed types, 0..=30 for unsigned ones).
fn value(rank: usize, i: usize, signed: bool) -> i64 {
    let v = ((i * 7 + rank * 13) % 31) as i64;
    if signed {
        v - 15
    } else {
        v
    }
}

fn input<T: Sample>(rank: usize, len: usize) -> Vec<T> {
    (0..len)
        .map(|i| T::from_i64(value(rank, i, T::SIGNED)))
        .collect()
}

/// `op` over every rank's element `i`, in exact arithmetic (integer `Avg` truncates, as the
/// contract says).
fn reduced<T: Sample>(op: ReduceOp, world: usize, i: usize) -> f64 {
    let values = (0..world).map(|r| value(r, i, T::SIGNED));
    let sum: i64 = values.clone().sum();
    match op {
        ReduceOp::Sum => sum as f64,
        ReduceOp::Avg if T::AVG_TOLERANCE.is_none() => (sum / world as i64) as f64,
        ReduceOp::Avg => sum as f64 / world as f64,
        ReduceOp::Max => values.max().unwrap_or(0) as f64,
        ReduceOp::Min => values.min().unwrap_or(0) as f64,
    }
}

/// The first element of `actual` that differs from `expected(i)`, as a message. Only a float
/// `Avg` is compared with a tolerance (its division rounds); everything else must be exact.
fn first_difference<T: Sample>(
    actual: &[T],
    inexact: bool,
    expected: impl Fn(usize) -> f64,
) -> Option<String> {
    let tolerance = if inexact { T::AVG_TOLERANCE } else { None };
    actual.iter().enumerate().find_map(|(i, &a)| {
        let (a, e) = (a.to_f64(), expected(i));
        let ok = match tolerance {
            Some(t) => (a - e).abs() <= t * e.abs().max(1.0),
            None => a == e,
        };
        (!ok).then(|| format!("element {i} is {a}, expected {e}"))
    })
}

/// A [`PieceStaging`] that fills from `input`, drains into `output`, and records whether each
/// element was filled once and drained once, after its fill.
struct Recorder<T> {
    input: Vec<T>,
    output: Vec<T>,
    fills: Vec<u8>,
    drains: Vec<u8>,
    drained_unfilled: bool,
}

impl<T: Sample> Recorder<T> {
    fn new(input: Vec<T>) -> Self {
        let len = input.len();
        Self {
            input,
            output: vec![T::from_i64(77); len],
            fills: vec![0; len],
            drains: vec![0; len],
            drained_unfilled: false,
        }
    }

    /// What the group did wrong with the staging, if anything.
    fn misuse(&self) -> Option<String> {
        if self.drained_unfilled {
            return Some("a piece was drained before it was filled".into());
        }
        let once = |counts: &[u8]| counts.iter().position(|&c| c != 1);
        if let Some(i) = once(&self.fills) {
            return Some(format!("element {i} filled {} times", self.fills[i]));
        }
        once(&self.drains).map(|i| format!("element {i} drained {} times", self.drains[i]))
    }
}

impl<T: Sample> PieceStaging<T> for Recorder<T> {
    fn fill(&mut self, range: std::ops::Range<usize>, piece: &mut [T]) {
        piece.copy_from_slice(&self.input[range.clone()]);
        self.fills[range].iter_mut().for_each(|c| *c += 1);
    }

    fn drain(&mut self, range: std::ops::Range<usize>, piece: &[T]) {
        self.output[range.clone()].copy_from_slice(piece);
        self.drained_unfilled |= self.fills[range.clone()].contains(&0);
        self.drains[range].iter_mut().for_each(|c| *c += 1);
    }
}

// ---------------------------------------------------------------------------------------------
// The table of cases

/// Runs every case of the table through `g` and returns what went wrong, one line each. Stops
/// at the first error of the group (it is aborted after one).
fn run_table<G: ProcessGroup>(g: &mut G, arrivals: &AtomicUsize) -> Vec<String> {
    let mut failures = Vec::new();
    let mut barriers = 0;
    let result = (|| {
        cases::<f32, G>(g, &mut failures, arrivals, &mut barriers)?;
        cases::<f64, G>(g, &mut failures, arrivals, &mut barriers)?;
        cases::<i32, G>(g, &mut failures, arrivals, &mut barriers)?;
        cases::<i64, G>(g, &mut failures, arrivals, &mut barriers)?;
        cases::<u8, G>(g, &mut failures, arrivals, &mut barriers)?;
        cases::<half::bf16, G>(g, &mut failures, arrivals, &mut barriers)?;
        cases::<half::f16, G>(g, &mut failures, arrivals, &mut barriers)
    })();
    if let Err(e) = result {
        failures.push(format!("rank {}: {e}", g.rank()));
    }
    failures
}

/// Every collective of the table for element type `T` and every length.
fn cases<T: Sample, G: ProcessGroup>(
    g: &mut G,
    failures: &mut Vec<String>,
    arrivals: &AtomicUsize,
    barriers: &mut usize,
) -> Result<(), CollectiveError> {
    let (rank, world) = (g.rank(), g.world_size());
    let mut check = |what: String, found: Option<String>| {
        if let Some(found) = found {
            failures.push(format!(
                "{} {what}, world {world}, rank {rank}: {found}",
                T::NAME
            ));
        }
    };
    for len in LENGTHS {
        for op in OPS {
            let mut buf = input::<T>(rank, len);
            g.all_reduce(&mut buf, op)?;
            let found = first_difference(&buf, op == ReduceOp::Avg, |i| reduced::<T>(op, world, i));
            check(format!("all_reduce({op:?}) of {len}"), found);
        }
        for op in OPS {
            let mut staging = Recorder::new(input::<T>(rank, len));
            let mut ring = vec![T::from_i64(99); len];
            g.all_reduce_staged(&mut ring, op, &mut staging)?;
            let found = staging.misuse().or_else(|| {
                first_difference(&staging.output, op == ReduceOp::Avg, |i| {
                    reduced::<T>(op, world, i)
                })
            });
            check(format!("all_reduce_staged({op:?}) of {len}"), found);
        }
        for root in 0..world {
            let mut buf = input::<T>(rank, len);
            g.broadcast(&mut buf, root)?;
            let found = first_difference(&buf, false, |i| value(root, i, T::SIGNED) as f64);
            check(format!("broadcast(root {root}) of {len}"), found);
        }
        let mut out = vec![T::from_i64(99); world * len];
        g.all_gather(&input::<T>(rank, len), &mut out)?;
        let found = first_difference(&out, false, |j| {
            value(j / len.max(1), j % len.max(1), T::SIGNED) as f64
        });
        check(format!("all_gather of {len} per rank"), found);
        for op in OPS {
            // Block b of the input is the block rank b keeps: element j of the whole input is
            // element j of the formula.
            let mut out = vec![T::from_i64(99); len];
            g.reduce_scatter(&input::<T>(rank, world * len), &mut out, op)?;
            let found = first_difference(&out, op == ReduceOp::Avg, |i| {
                reduced::<T>(op, world, rank * len + i)
            });
            check(format!("reduce_scatter({op:?}) of {len} per rank"), found);
        }
    }
    // A barrier returns only once every rank has arrived at it.
    *barriers += 1;
    arrivals.fetch_add(1, Ordering::SeqCst);
    g.barrier()?;
    let seen = arrivals.load(Ordering::SeqCst);
    if seen < world * *barriers {
        failures.push(format!(
            "barrier #{barriers} on rank {rank} returned after {seen} of {} arrivals",
            world * *barriers
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The suite

/// Every collective × element type × length through one group per world size in
/// `1..=max_world`, checked against the closed forms.
pub(crate) fn collectives_match_closed_forms<F: Form>(form: &F, max_world: usize) {
    for world in 1..=max_world {
        let arrivals = AtomicUsize::new(0);
        let failures = on_ranks(form, world, GENEROUS, &[], |rank, group| {
            match group.expect("every rank forms") {
                Ok(mut g) => run_table(&mut g, &arrivals),
                Err(e) => vec![format!("rank {rank} could not form the group: {e}")],
            }
        });
        let failures: Vec<String> = failures.into_iter().flatten().collect();
        assert!(
            failures.is_empty(),
            "world size {world}:\n{}",
            failures.join("\n")
        );
    }
}

/// Ranks that call different collectives fail on every rank, at once (no timeout), and the
/// ranks next to the odd one name both calls.
pub(crate) fn mismatched_calls_fail_on_every_rank<F: Form>(form: &F) {
    let world = 3;
    // What rank 1 does differently from ranks 0 and 2.
    for case in ["length", "kind", "root"] {
        let start = Instant::now();
        let results = on_ranks(form, world, GENEROUS, &[], |rank, group| {
            let mut g = group.expect("every rank forms").expect("the group forms");
            let odd = rank == 1;
            let mut buf = vec![1.0f32; if odd && case == "length" { 8 } else { 7 }];
            let first = match case {
                "kind" if odd => g.broadcast(&mut buf, 0),
                "root" => g.broadcast(&mut buf, if odd { 2 } else { 0 }),
                _ => g.all_reduce(&mut buf, ReduceOp::Sum),
            };
            // The group is aborted after the error: the next call fails at once.
            let next = g.barrier();
            (first, next)
        });
        assert!(
            start.elapsed() < GENEROUS / 2,
            "{case}: a mismatch must not wait for the timeout"
        );
        for (rank, (first, next)) in results.iter().enumerate() {
            let first = first
                .as_ref()
                .err()
                .unwrap_or_else(|| panic!("{case}: rank {rank} finished a mismatched collective"));
            assert!(
                matches!(next, Err(CollectiveError::Aborted { .. })),
                "{case}: rank {rank} after the error: {next:?}"
            );
            // Ranks next to the odd one see its header; the others may first see a neighbour
            // that has already aborted.
            assert!(
                matches!(
                    first,
                    CollectiveError::Mismatch { .. }
                        | CollectiveError::PeerLost { .. }
                        | CollectiveError::Aborted { .. }
                ),
                "{case}: rank {rank}: {first}"
            );
        }
        let both_named = results.iter().any(|(first, _)| {
            let msg = first
                .as_ref()
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            match case {
                "length" => msg.contains("7 elements") && msg.contains("8 elements"),
                "kind" => msg.contains("all_reduce(Sum") && msg.contains("broadcast(root 0"),
                _ => msg.contains("broadcast(root 0") && msg.contains("broadcast(root 2"),
            }
        });
        assert!(both_named, "{case}: no rank named both calls: {results:?}");
    }
}

/// A call whose arguments are wrong on one rank (a root that is not a rank, sizes that do not fit
/// the world size) fails there with `InvalidArgument`, and the other ranks, already inside the
/// collective, fail too, at once (no timeout); the group is aborted on every rank.
pub(crate) fn invalid_arguments_fail_on_every_rank<F: Form>(form: &F) {
    let world = 3;
    // What rank 1 gets wrong, and the message it must give.
    for (case, expected) in [
        ("root", "root 3 is not a rank of this group"),
        (
            "all_gather",
            "output has 8 elements, expected world size x input = 6",
        ),
        (
            "reduce_scatter",
            "input has 8 elements, expected world size x output = 6",
        ),
    ] {
        let start = Instant::now();
        let results = on_ranks(form, world, GENEROUS, &[], |rank, group| {
            let mut g = group.expect("every rank forms").expect("the group forms");
            let odd = rank == 1;
            let wrong = if odd { 8 } else { 6 };
            let first = match case {
                "root" => g.broadcast(&mut [1.0f32; 2], if odd { world } else { 0 }),
                "all_gather" => g.all_gather(&[1.0f32; 2], &mut vec![0.0; wrong]),
                _ => g.reduce_scatter(&vec![1.0f32; wrong], &mut [0.0; 2], ReduceOp::Sum),
            };
            (first, g.barrier())
        });
        assert!(
            start.elapsed() < GENEROUS / 2,
            "{case}: an invalid argument must not wait for the timeout"
        );
        for (rank, (first, next)) in results.iter().enumerate() {
            match first {
                Err(CollectiveError::InvalidArgument { message, .. }) if rank == 1 => {
                    assert!(message.contains(expected), "{case}: {message}")
                }
                Err(e) => assert!(rank != 1, "{case}: rank 1: {e}"),
                Ok(()) => panic!("{case}: rank {rank} finished a call with a wrong argument"),
            }
            assert!(
                matches!(next, Err(CollectiveError::Aborted { .. })),
                "{case}: rank {rank} after the error: {next:?}"
            );
        }
    }
}

/// A rank that formed the group but never enters a collective makes the others time out
/// within the deadline, naming it; the group is aborted afterwards.
pub(crate) fn a_rank_that_never_calls_is_named_at_the_timeout<F: Form>(form: &F) {
    let (world, timeout) = (3, Duration::from_millis(1500));
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let done_rx = std::sync::Mutex::new(done_rx);
    let results = on_ranks(form, world, timeout, &[], |rank, group| {
        let mut g = group.expect("every rank forms").expect("the group forms");
        if rank == 2 {
            // Stays in the group without calling, until the others have given up.
            let rx = done_rx.lock().unwrap_or_else(|p| p.into_inner());
            for _ in 0..2 {
                let _ = rx.recv_timeout(Duration::from_secs(30));
            }
            return None;
        }
        let start = Instant::now();
        let mut buf = vec![1i64; 5];
        let err = g.all_reduce(&mut buf, ReduceOp::Sum).err();
        let elapsed = start.elapsed();
        let next = g.barrier().err();
        let _ = done_tx.send(());
        Some((err, elapsed, next))
    });
    let mut named = false;
    for (rank, result) in results.into_iter().enumerate().take(2) {
        let (err, elapsed, next) = result.expect("ranks 0 and 1 report");
        let err = err.unwrap_or_else(|| panic!("rank {rank} finished without rank 2"));
        let msg = err.to_string();
        // TCP names the neighbour it waits for; NCCL lists the ranks not seen in the call.
        let not_seen = msg.split("not seen in it: [").nth(1).unwrap_or("");
        let not_seen = not_seen.split(']').next().unwrap_or("");
        let names_rank_2 = msg.contains("rank 2 (") || not_seen.split(", ").any(|r| r == "2");
        named |= matches!(err, CollectiveError::Timeout { .. }) && names_rank_2;
        // The first rank to time out aborts, and a neighbour may see that before its own
        // deadline: a lost peer is the other acceptable answer, never a hang.
        assert!(
            matches!(
                err,
                CollectiveError::Timeout { .. } | CollectiveError::PeerLost { .. }
            ),
            "rank {rank}: {msg}"
        );
        assert!(
            elapsed < timeout + Duration::from_secs(5),
            "rank {rank} gave up after {elapsed:?} (timeout {timeout:?})"
        );
        assert!(
            matches!(next, Some(CollectiveError::Aborted { .. })),
            "rank {rank} after the timeout: {next:?}"
        );
    }
    assert!(named, "no rank timed out naming rank 2");
}

/// A rank that never joins is named by the others within the set-up deadline.
pub(crate) fn a_rank_that_never_joins_is_named<F: Form>(form: &F) {
    let (world, timeout) = (3, Duration::from_millis(1500));
    let start = Instant::now();
    let results = on_ranks(form, world, timeout, &[2], |_, group| {
        group.map(|g| g.err().map(|e| e.to_string()))
    });
    assert!(start.elapsed() < timeout + Duration::from_secs(5));
    for (rank, msg) in results.into_iter().enumerate().take(2) {
        let msg = msg
            .flatten()
            .unwrap_or_else(|| panic!("rank {rank} formed a group without rank 2"));
        assert!(msg.contains("rank(s) 2 never joined"), "rank {rank}: {msg}");
    }
}

/// A rank whose set-up fails (here: another world size) makes every rank fail at once, all
/// naming the first cause.
pub(crate) fn a_failed_set_up_aborts_every_rank<F: Form>(form: &F) {
    let server = store_server();
    let start = Instant::now();
    let results: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = [(0, 2), (1, 3)]
            .into_iter()
            .map(|(rank, world)| {
                let store = client(&server);
                s.spawn(move || match form.form(store, rank, world, GENEROUS) {
                    Ok(_) => panic!("rank {rank} formed a group with another world size"),
                    Err(e) => e.to_string(),
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank"))
            .collect()
    });
    assert!(start.elapsed() < GENEROUS / 2, "{results:?}");
    for msg in results {
        assert!(
            msg.contains("WORLD_SIZE=2") && msg.contains("WORLD_SIZE=3"),
            "{msg}"
        );
    }
}

/// Instantiates the whole suite for one implementation: `$form` is a [`Form`], `$max_world` the
/// largest group it can form here.
macro_rules! conformance_suite {
    ($name:ident, $form:expr, $max_world:expr) => {
        mod $name {
            use super::*;

            #[test]
            fn collectives_match_closed_forms() {
                super::collectives_match_closed_forms(&$form, $max_world);
            }

            #[test]
            fn mismatched_calls_fail_on_every_rank() {
                super::mismatched_calls_fail_on_every_rank(&$form);
            }

            #[test]
            fn invalid_arguments_fail_on_every_rank() {
                super::invalid_arguments_fail_on_every_rank(&$form);
            }

            #[test]
            fn a_rank_that_never_calls_is_named_at_the_timeout() {
                super::a_rank_that_never_calls_is_named_at_the_timeout(&$form);
            }

            #[test]
            fn a_rank_that_never_joins_is_named() {
                super::a_rank_that_never_joins_is_named(&$form);
            }

            #[test]
            fn a_failed_set_up_aborts_every_rank() {
                super::a_failed_set_up_aborts_every_rank(&$form);
            }
        }
    };
}

// ---------------------------------------------------------------------------------------------
// Implementations

mod tcp {
    use super::*;
    use crate::group::tcp::{TcpGroupOptions, TcpProcessGroup};

    /// The TCP group with its transport chosen explicitly (never from the environment). 64 KiB
    /// pieces: the large cases go through many pieces of the pipeline.
    pub fn tcp(
        shared_memory: bool,
    ) -> impl Fn(Arc<dyn Store>, usize, usize, Duration) -> Result<TcpProcessGroup, CollectiveError> + Sync
    {
        move |store, rank, world, timeout| {
            let options = TcpGroupOptions {
                timeout,
                piece_bytes: 64 << 10,
                shared_memory: Some(shared_memory),
                ..Default::default()
            };
            let g = TcpProcessGroup::new(store, rank, world, options)?;
            // The suite must run the transport it is named after.
            let label = if shared_memory {
                " (shared memory)"
            } else {
                ""
            };
            if world > 1 {
                assert_eq!(g.link_labels(), Some((label, label)), "rank {rank}");
            }
            Ok(g)
        }
    }

    conformance_suite!(sockets, tcp(false), 4);
    conformance_suite!(shared_memory, tcp(true), 4);

    /// Two groups formed through one store under different prefixes, with the same rank
    /// numbers, run collectives at the same time without seeing each other's keys or data.
    #[test]
    fn two_groups_on_one_store_do_not_interfere() {
        let server = store_server();
        let world = 3;
        let results: Vec<(String, usize, Vec<i64>)> = std::thread::scope(|s| {
            let handles: Vec<_> = ["pg/a", "pg/b"]
                .into_iter()
                .enumerate()
                .flat_map(|(job, prefix)| (0..world).map(move |rank| (job, prefix, rank)))
                .map(|(job, prefix, rank)| {
                    let store = client(&server);
                    s.spawn(move || {
                        let options = TcpGroupOptions {
                            timeout: GENEROUS,
                            piece_bytes: 4096,
                            shared_memory: Some(job == 1),
                            store_prefix: prefix.into(),
                            ..Default::default()
                        };
                        let mut g = TcpProcessGroup::new(store, rank, world, options)
                            .unwrap_or_else(|e| panic!("{prefix} rank {rank}: {e}"));
                        // Different data per group: group b's inputs are 1000 x group a's.
                        let scale = if job == 0 { 1 } else { 1000 };
                        let mut buf: Vec<i64> = (0..100_003)
                            .map(|i| scale * (i as i64 % 17 + rank as i64))
                            .collect();
                        for _ in 0..5 {
                            g.all_reduce(&mut buf, ReduceOp::Max)
                                .unwrap_or_else(|e| panic!("{prefix} rank {rank}: {e}"));
                        }
                        g.all_reduce(&mut buf, ReduceOp::Sum)
                            .unwrap_or_else(|e| panic!("{prefix} rank {rank}: {e}"));
                        (prefix.to_string(), scale as usize, buf)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank"))
                .collect()
        });
        for (prefix, scale, buf) in results {
            let scale = scale as i64;
            let expected = |i: usize| world as i64 * scale * (i as i64 % 17 + world as i64 - 1);
            let wrong = buf.iter().enumerate().find(|&(i, &v)| v != expected(i));
            assert!(wrong.is_none(), "{prefix}: element {wrong:?}");
        }
    }
}

#[cfg(feature = "cuda")]
mod nccl {
    //! Needs one GPU per rank and NCCL: skipped elsewhere, with the reason recorded
    //! ([`crate::testing::skip`]; `.ci/run` prints it). On one GPU the closed-form table runs
    //! at world size 1, so every collective reaches NCCL at least once. The mismatch check is
    //! an NCCL option; the suite turns it on.
    use super::*;
    use crate::cuda::{check_cuda_available, check_nccl_available};
    use crate::group::nccl::{NcclGroupOptions, NcclProcessGroup};

    /// How many ranks can run here (one per visible GPU, at most 4), or why none can.
    fn gpus() -> Result<usize, String> {
        check_cuda_available(0).map_err(|e| e.to_string())?;
        check_nccl_available().map_err(|e| e.to_string())?;
        Ok((0..4)
            .take_while(|&d| check_cuda_available(d).is_ok())
            .count())
    }

    fn nccl(
        store: Arc<dyn Store>,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<NcclProcessGroup, CollectiveError> {
        let options = NcclGroupOptions {
            timeout,
            check_collectives: true,
            ..Default::default()
        };
        NcclProcessGroup::with_options(store, rank, world, rank, options)
    }

    /// Runs `test` when at least `ranks` GPUs are here; else records why it is skipped.
    fn with_gpus(ranks: usize, test: impl FnOnce(usize)) {
        use crate::testing::{skip, Needs};
        match gpus() {
            Ok(n) if n >= ranks => test(n),
            Ok(n) => skip(
                Needs::Gpu,
                &format!("needs {ranks} GPUs, this machine has {n}"),
            ),
            Err(reason) => skip(Needs::Gpu, &format!("no GPU with NCCL here: {reason}")),
        }
    }

    #[test]
    fn collectives_match_closed_forms() {
        with_gpus(1, |n| super::collectives_match_closed_forms(&nccl, n));
    }

    #[test]
    fn mismatched_calls_fail_on_every_rank() {
        with_gpus(3, |_| super::mismatched_calls_fail_on_every_rank(&nccl));
    }

    #[test]
    fn invalid_arguments_fail_on_every_rank() {
        with_gpus(3, |_| super::invalid_arguments_fail_on_every_rank(&nccl));
    }

    #[test]
    fn a_rank_that_never_calls_is_named_at_the_timeout() {
        with_gpus(3, |_| {
            super::a_rank_that_never_calls_is_named_at_the_timeout(&nccl)
        });
    }

    #[test]
    fn a_rank_that_never_joins_is_named() {
        with_gpus(3, |_| super::a_rank_that_never_joins_is_named(&nccl));
    }

    #[test]
    fn a_failed_set_up_aborts_every_rank() {
        with_gpus(2, |_| super::a_failed_set_up_aborts_every_rank(&nccl));
    }

    /// A one-rank all-reduce of device memory over sizes 4 KiB – 1 GiB: time per call (what
    /// this group's non-blocking launch and polling add to NCCL) and the bytes per second,
    /// against a device-to-device copy of the same bytes in the same run. At world size 1 the
    /// bus bandwidth factor 2(n-1)/n is 0, so the figure is the latency floor, not a link's.
    #[test]
    #[ignore = "a GPU benchmark: cargo test --features cuda -- --ignored nccl_one_rank_all_reduce_sweep"]
    fn nccl_one_rank_all_reduce_sweep() {
        use crate::call::DataType;
        use cudarc::driver::{CudaContext, DevicePtr};
        with_gpus(1, |_| {
            let store: Arc<dyn Store> = Arc::new(crate::store::MemoryStore::new());
            let mut group = nccl(store, 0, 1, Duration::from_secs(120)).expect("one-rank group");
            let context = CudaContext::new(0).expect("CUDA context of device 0");
            let stream = context.default_stream();
            println!(
                "{:>12} {:>12} {:>12} {:>14}",
                "bytes", "time(us)", "algbw(GB/s)", "d2d copy(us)"
            );
            let mut bytes = 4usize << 10;
            while bytes <= 1 << 30 {
                let count = bytes / 4;
                let ones = vec![1.0f32; count];
                let buffer = stream.clone_htod(&ones).expect("upload");
                let mut copy = stream.alloc_zeros::<f32>(count).expect("alloc");
                stream.synchronize().expect("sync");
                let iterations = if bytes <= 16 << 20 { 50 } else { 10 };
                let (ptr, _record) = buffer.device_ptr(&stream);
                let all_reduce = |group: &mut NcclProcessGroup| {
                    // SAFETY: `ptr` holds `count` f32 on device 0, the group's device, and
                    // nothing else touches `buffer` until the loop ends (the stream is synced).
                    unsafe { group.all_reduce_device(ptr, count, DataType::F32, ReduceOp::Sum) }
                        .expect("all_reduce_device");
                };
                all_reduce(&mut group);
                let start = Instant::now();
                for _ in 0..iterations {
                    all_reduce(&mut group);
                }
                let per_call = start.elapsed().as_secs_f64() / iterations as f64;
                let start = Instant::now();
                for _ in 0..iterations {
                    stream.memcpy_dtod(&buffer, &mut copy).expect("copy");
                }
                stream.synchronize().expect("sync");
                let per_copy = start.elapsed().as_secs_f64() / iterations as f64;
                let back = stream.clone_dtoh(&buffer).expect("download");
                assert!(
                    back.iter().all(|&x| x == 1.0),
                    "a one-rank sum changed the data"
                );
                println!(
                    "{bytes:>12} {:>12.1} {:>12.1} {:>14.1}",
                    per_call * 1e6,
                    bytes as f64 / per_call / 1e9,
                    per_copy * 1e6
                );
                bytes *= 4;
            }
        });
    }
}
