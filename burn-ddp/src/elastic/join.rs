//! Processes joining a job that is training, through the job's rendezvous store (the plan
//! and the admissions themselves are [`super::admission`]'s).
//!
//! Keys in the job's own namespace (a joiner knows no generation): `join/requests` (a
//! counter: a request's number), `join/request/{n}` (the joiner's settings fingerprint),
//! `join/beat/{n}` (the joiner's heartbeat, a counter), `join/reply/{n}` ([`Reply`]),
//! `join/open` (the job trains and admits joiners) and `join/closed` (the job has ended: nobody
//! joins any more).
//! In each generation's namespace: `join/planned/{step}` ([`PlannedJoin`]), the join due at
//! the boundary after step `step`.
//!
//! At every step boundary each member calls [`JoinWatch::at_boundary`]. Rank 0 reads the
//! request counter (one store round trip) and, when requests wait, plans their join for the
//! boundary after the next step; the others look for the plan due at this boundary (one round
//! trip). Rank 0 wrote it before it took part in the step that ends there, and no rank
//! finishes a step without every rank's part in its gradient all-reduce, so the plan is in
//! the store when the others look, and they all admit the joiners together. Keyed by its
//! boundary, a plan is never taken for another boundary's (one whose every request was
//! refused stays in the store while the generation lasts).

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::admission::{Admission, PlannedJoin, Reply};
use crate::error::DdpError;
use crate::store::heartbeat::{beat_period, Heartbeat, Silence};
use crate::store::Store;

/// How often a waiting party looks at the store.
const POLL: Duration = Duration::from_millis(10);
/// The deadline of one store read of a value known to be there (or about to be: a request's
/// fingerprint follows its number).
const READ: Duration = Duration::from_secs(5);
const REQUESTS: &str = "join/requests";
const OPEN: &str = "join/open";
const CLOSED: &str = "join/closed";

/// The plan of the join due at the boundary after step `step`.
fn planned_key(step: u64) -> String {
    format!("join/planned/{step}")
}

fn request_key(n: u64) -> String {
    format!("join/request/{n}")
}

fn reply_key(n: u64) -> String {
    format!("join/reply/{n}")
}

fn beat_key(n: u64) -> String {
    format!("join/beat/{n}")
}

/// A process's request to join the job, from [`ask_to_join`]: it beats the request's
/// heartbeat (`join/beat/{n}`) for as long as it lives, so the members that admit it tell a
/// joiner that died on its way in from a slow one within their failure detection time.
pub struct JoinRequest {
    number: u64,
    _beat: Heartbeat,
}

/// Asks the job behind `root` (the job's store) to let this process join, with its settings
/// `fingerprint`, and starts the request's heartbeat (every `beat_every`). Not collective: the
/// job's members admit it at a step boundary ([`JoinWatch`]); wait for their answer with
/// [`JoinRequest::answer`].
///
/// # Errors
/// [`DdpError::Store`] when the store fails.
pub fn ask_to_join(
    root: &Arc<dyn Store>,
    fingerprint: &str,
    beat_every: Duration,
) -> Result<JoinRequest, DdpError> {
    let number = u64::try_from(root.add(REQUESTS, 1)?).unwrap_or(0);
    let beat = Heartbeat::start(Arc::clone(root), beat_key(number), beat_every);
    root.set(&request_key(number), fingerprint.as_bytes())?;
    Ok(JoinRequest {
        number,
        _beat: beat,
    })
}

impl JoinRequest {
    /// The request's number (the order in which the job admits its joiners).
    pub fn number(&self) -> u64 {
        self.number
    }

    /// Waits for the job's answer, until `deadline`.
    ///
    /// # Errors
    /// [`DdpError::Mismatch`] when the job refused this process (its settings differ);
    /// [`DdpError::Membership`] when the job did not answer in time; [`DdpError::JobEnded`]
    /// when the job ended first; [`DdpError::Store`] when the store fails.
    pub fn answer(&self, root: &dyn Store, deadline: Instant) -> Result<Admission, DdpError> {
        let (n, started) = (self.number, Instant::now());
        let key = reply_key(n);
        loop {
            if root.check(&[&key])? {
                let bytes = root.get(&key, READ)?;
                return match Reply::decode(&bytes) {
                    Some(Reply::Admitted(admission)) => Ok(admission),
                    Some(Reply::Refused(reason)) => Err(DdpError::Mismatch(format!(
                        "the job refused this process: {reason}; start it with the job's config"
                    ))),
                    None => Err(DdpError::Membership(format!(
                        "the job's answer to join request {n} cannot be read: {:?}",
                        String::from_utf8_lossy(&bytes)
                    ))),
                };
            }
            if root.check(&[CLOSED])? {
                return Err(DdpError::JobEnded);
            }
            if Instant::now() >= deadline {
                return Err(DdpError::Membership(format!(
                    "the job did not admit this process within {:?} (join request {n}): its ranks admit joiners at step boundaries while training, with [fault_tolerance] on_rank_failure = \"continue\"",
                    started.elapsed()
                )));
            }
            std::thread::sleep(POLL);
        }
    }
}

/// Watches the heartbeats of the joiners of `requests` until `done` fires (or its sender is
/// dropped): the first found silent for longer than twice `detection` (eight missed beats: a
/// loaded machine may starve a live joiner's beating thread for a moment), with how long it
/// was silent, else `None`. A member runs it beside forming the grown group, whose set-up would
/// otherwise wait for a dead joiner until its deadline.
pub(crate) fn watch_joiners(
    root: &dyn Store,
    requests: &[u64],
    detection: Duration,
    done: &mpsc::Receiver<()>,
) -> Option<(u64, Duration)> {
    let now = Instant::now();
    let mut watches: Vec<(u64, Silence)> = requests
        .iter()
        .map(|&n| (n, Silence::after_detection(detection, now)))
        .collect();
    let every = beat_period(detection);
    loop {
        match done.recv_timeout(every) {
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            _ => return None,
        }
        for (n, watch) in &mut watches {
            // A store error counts as no beat: the set-up's own deadline still holds.
            let beats = root.add(&beat_key(*n), 0).unwrap_or(0);
            if let Some(silent) = watch.observe(beats, Instant::now()) {
                return Some((*n, silent));
            }
        }
    }
}

/// Where a job stands for a process that would take part in it ([`job_state`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobState {
    /// Not training yet: its processes start it.
    NotStarted,
    /// Training, and admitting joiners: a process joins it.
    Training,
    /// Over: nothing left to do.
    Ended,
}

/// Rank 0, once the job trains with joiners admitted at its step boundaries: a process that
/// comes later (a launcher whose node came back) joins instead of starting the job.
pub fn open(root: &dyn Store) -> Result<(), DdpError> {
    Ok(root.set(OPEN, b"")?)
}

/// Where the job behind `root` stands ([`open`], [`close`]). Not collective.
pub fn job_state(root: &dyn Store) -> Result<JobState, DdpError> {
    if root.check(&[CLOSED])? {
        Ok(JobState::Ended)
    } else if root.check(&[OPEN])? {
        Ok(JobState::Training)
    } else {
        Ok(JobState::NotStarted)
    }
}

/// Tells every process that asks to join from now on that the job has ended. Rank 0 calls it
/// when the run is over.
pub fn close(root: &dyn Store) -> Result<(), DdpError> {
    Ok(root.set(CLOSED, b"")?)
}

/// What a member of the job knows of joins between step boundaries (the same on every
/// member).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JoinWatch {
    /// Every request up to this number has been dealt with.
    handled: u64,
    /// Rank 0: the join it planned in this generation, until it is due.
    planned: Option<PlannedJoin>,
}

/// Where a member stands when it looks for joiners.
#[derive(Debug, Clone, Copy)]
pub struct Boundary<'a> {
    /// This member's rank in its generation.
    pub rank: usize,
    /// Optimizer steps applied.
    pub step: u64,
    /// The job's world size now.
    pub world: usize,
    /// The most ranks the job may grow to (`None`: no bound): rank 0 refuses the requests
    /// beyond it, in request order (the launcher's `--nnodes MIN:MAX`).
    pub max_world: Option<usize>,
    /// Rank 0's settings fingerprint, to refuse a joiner whose settings differ (`None`: any).
    pub fingerprint: Option<&'a str>,
    /// Set: admit a joiner at this very boundary, waiting up to this long for one to ask
    /// (the tests' scripted join); every member must pass it alike.
    pub wait_for_joiner: Option<Duration>,
}

impl JoinWatch {
    /// A member of a job that has dealt with every request up to `handled` (0 at the start).
    pub fn new(handled: u64) -> Self {
        Self {
            handled,
            planned: None,
        }
    }

    /// A new generation: a join planned in the last one is void (rank 0 plans the waiting
    /// requests again).
    pub fn regrouped(&mut self) {
        self.planned = None;
    }

    /// At the step boundary `at`: the join due now, if any (module docs). `root` is the
    /// job's store, `group` this generation's namespace of it. Rank 0 refuses, here, the
    /// requests whose fingerprint differs from `at.fingerprint`. Not collective, but every
    /// member must call it at every boundary.
    ///
    /// # Errors
    /// [`DdpError::Store`] when the store fails or a value does not come in time;
    /// [`DdpError::Membership`] when a plan cannot be read or no joiner asks within the
    /// scripted wait.
    pub fn at_boundary(
        &mut self,
        root: &dyn Store,
        group: &dyn Store,
        at: Boundary<'_>,
    ) -> Result<Option<PlannedJoin>, DdpError> {
        if at.rank != 0 {
            // The others hold no plan: the one due now is in the store by now (module docs).
            let due = read_plan(group, at.step, at.wait_for_joiner)?;
            if let Some(plan) = &due {
                self.handled = plan.handled;
            }
            return Ok(due);
        }
        if self.planned.is_none() {
            self.planned = self.plan(root, group, at)?;
        }
        match &self.planned {
            Some(plan) if plan.step == at.step => {
                let plan = plan.clone();
                self.handled = plan.handled;
                self.planned = None;
                Ok(Some(plan))
            }
            _ => Ok(None),
        }
    }

    /// Rank 0: plans the waiting requests' join (after the next step, or now when scripted).
    fn plan(
        &self,
        root: &dyn Store,
        group: &dyn Store,
        at: Boundary<'_>,
    ) -> Result<Option<PlannedJoin>, DdpError> {
        let mut waiting = u64::try_from(root.add(REQUESTS, 0)?).unwrap_or(0);
        let step = match at.wait_for_joiner {
            Some(wait) => {
                let deadline = Instant::now() + wait;
                while waiting <= self.handled {
                    if Instant::now() >= deadline {
                        return Err(DdpError::Membership(format!(
                            "no process asked to join within {wait:?} at step {} (the scripted join)",
                            at.step
                        )));
                    }
                    std::thread::sleep(POLL);
                    waiting = u64::try_from(root.add(REQUESTS, 0)?).unwrap_or(0);
                }
                at.step
            }
            None if waiting > self.handled => at.step + 1,
            None => return Ok(None),
        };
        let mut requests = Vec::new();
        let room = at.max_world.map(|max| max.saturating_sub(at.world));
        for n in self.handled + 1..=waiting {
            let theirs = root.get(&request_key(n), READ)?;
            let refusal = match (at.fingerprint, room, at.max_world) {
                (Some(ours), ..) if theirs != ours.as_bytes() => Some(format!(
                    "its settings differ from the job's (job: {ours}; this process: {})",
                    String::from_utf8_lossy(&theirs)
                )),
                (_, Some(room), Some(max)) if requests.len() >= room => Some(format!(
                    "the job is at its largest: {} rank(s) with {} joining, and it grows to at most {max} (the launcher's --nnodes MIN:MAX, or fault_tolerance.max_world_size)",
                    at.world,
                    requests.len()
                )),
                _ => None,
            };
            match refusal {
                Some(reason) => root.set(&reply_key(n), &Reply::Refused(reason).encode())?,
                None => requests.push(n),
            }
        }
        let plan = PlannedJoin {
            step,
            handled: waiting,
            requests,
        };
        group.set(&planned_key(step), &plan.encode())?;
        Ok(Some(plan))
    }
}

/// The others: the plan of the join due at the boundary after step `step`, if rank 0 wrote
/// one (waiting for it when `wait` is set: rank 0 waits up to `wait` for a joiner first).
fn read_plan(
    group: &dyn Store,
    step: u64,
    wait: Option<Duration>,
) -> Result<Option<PlannedJoin>, DdpError> {
    let key = planned_key(step);
    let bytes = match wait {
        Some(wait) => group.get(&key, wait + READ)?,
        None if group.check(&[&key])? => group.get(&key, READ)?,
        None => return Ok(None),
    };
    PlannedJoin::decode(&bytes).map(Some).ok_or_else(|| {
        DdpError::Membership(format!(
            "the planned join in the store cannot be read: {:?}",
            String::from_utf8_lossy(&bytes)
        ))
    })
}

/// Rank 0, at the planned boundary: tells each joiner of `plan` its place in the job of
/// `world` ranks grown as generation `generation`.
pub fn reply_to_joiners(
    root: &dyn Store,
    plan: &PlannedJoin,
    world: usize,
    generation: u64,
) -> Result<(), DdpError> {
    for (request, admission) in plan.admissions(world, generation) {
        root.set(&reply_key(request), &Reply::Admitted(admission).encode())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use std::time::Instant;

    use super::{
        ask_to_join, close, job_state, open, reply_to_joiners, watch_joiners, Boundary, JobState,
        JoinWatch,
    };
    use crate::elastic::Admission;
    use crate::error::DdpError;
    use crate::store::{MemoryStore, PrefixStore, Store};

    /// Asks and waits for the answer, as a joiner does.
    fn request_to_join(
        root: &Arc<dyn Store>,
        fingerprint: &str,
        timeout: Duration,
    ) -> Result<Admission, DdpError> {
        let request = ask_to_join(root, fingerprint, Duration::from_millis(20))?;
        request.answer(root.as_ref(), Instant::now() + timeout)
    }

    fn at(rank: usize, step: u64, wait: Option<Duration>) -> Boundary<'static> {
        Boundary {
            rank,
            step,
            world: 2,
            max_world: None,
            fingerprint: Some("cfg-a"),
            wait_for_joiner: wait,
        }
    }

    /// A request seen at step 4 joins after step 5 on rank 0 and rank 1 alike; a joiner with
    /// other settings is refused; the joiner is told its place.
    #[test]
    fn a_request_joins_after_the_next_step_on_every_member() {
        let root: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let group: Arc<dyn Store> = Arc::new(PrefixStore::new("gen-1", Arc::clone(&root)));
        let (mut zero, mut one) = (JoinWatch::new(0), JoinWatch::new(0));
        let none = |w: &mut JoinWatch, rank, step| {
            w.at_boundary(root.as_ref(), group.as_ref(), at(rank, step, None))
                .map_err(|e| e.to_string())
        };
        assert_eq!(none(&mut zero, 0, 3), Ok(None));
        assert_eq!(none(&mut one, 1, 3), Ok(None));
        let joiner = {
            let root = Arc::clone(&root);
            std::thread::spawn(move || {
                request_to_join(&root, "cfg-a", Duration::from_secs(30)).map_err(|e| e.to_string())
            })
        };
        let odd = {
            let root = Arc::clone(&root);
            std::thread::spawn(move || {
                request_to_join(&root, "cfg-b", Duration::from_secs(30)).map_err(|e| e.to_string())
            })
        };
        while root.add("join/requests", 0).unwrap_or(0) < 2 {
            std::thread::sleep(Duration::from_millis(5));
        }
        let planned = none(&mut zero, 0, 4);
        assert_eq!(
            planned,
            Ok(None),
            "planned for the next boundary, not this one"
        );
        let due = none(&mut zero, 0, 5).ok().flatten();
        let due_one = none(&mut one, 1, 5).ok().flatten();
        assert_eq!(due, due_one);
        let plan = due.expect("the join is due at step 5");
        assert_eq!((plan.step, plan.handled, plan.requests.len()), (5, 2, 1));
        assert!(reply_to_joiners(root.as_ref(), &plan, 2, 1).is_ok());
        let results = [joiner.join(), odd.join()];
        let admitted = results
            .iter()
            .filter(|r| matches!(r, Ok(Ok(a)) if a.rank == 2 && a.world == 3 && a.step == 5))
            .count();
        let refused = results
            .iter()
            .filter(|r| matches!(r, Ok(Err(e)) if e.contains("settings differ")))
            .count();
        assert_eq!((admitted, refused), (1, 1), "{results:?}");
        // Dealt with: nothing more is planned.
        assert_eq!(none(&mut zero, 0, 6), Ok(None));
    }

    /// A join whose every request was refused leaves its plan in the generation's namespace
    /// (the generation does not change): at the next boundaries the members take it for
    /// dealt with, and a later request's plan is due on rank 1 where it is on rank 0.
    #[test]
    fn a_plan_nobody_joined_by_does_not_hide_the_next_one() {
        let root: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let group: Arc<dyn Store> = Arc::new(PrefixStore::new("gen-1", Arc::clone(&root)));
        let (mut zero, mut one) = (JoinWatch::new(0), JoinWatch::new(0));
        let mut both = |step| {
            let due = |w: &mut JoinWatch, rank| {
                w.at_boundary(root.as_ref(), group.as_ref(), at(rank, step, None))
                    .map(|p| p.map(|p| (p.step, p.requests)))
                    .map_err(|e| e.to_string())
            };
            (due(&mut zero, 0), due(&mut one, 1))
        };
        let odd = ask_to_join(&root, "cfg-b", Duration::from_millis(20));
        assert!(odd.is_ok());
        assert_eq!(both(3), (Ok(None), Ok(None)));
        assert_eq!(both(4), (Ok(Some((4, vec![]))), Ok(Some((4, vec![])))));
        assert_eq!(both(5), (Ok(None), Ok(None)), "the refused plan is spent");
        let good = ask_to_join(&root, "cfg-a", Duration::from_millis(20));
        assert!(good.is_ok());
        assert_eq!(both(6), (Ok(None), Ok(None)), "planned for step 7");
        assert_eq!(both(7), (Ok(Some((7, vec![2]))), Ok(Some((7, vec![2])))));
    }

    /// A job of 2 that grows to at most 3: of two joiners, the first to ask joins and the
    /// second is refused, named why.
    #[test]
    fn joiners_beyond_the_largest_world_are_refused() {
        let root: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let group: Arc<dyn Store> = Arc::new(PrefixStore::new("gen-1", Arc::clone(&root)));
        let first = ask_to_join(&root, "cfg-a", Duration::from_millis(20));
        let second = ask_to_join(&root, "cfg-a", Duration::from_millis(20));
        let (Ok(first), Ok(second)) = (first, second) else {
            panic!("the requests could not be written");
        };
        let mut watch = JoinWatch::new(0);
        let mut boundary = |step| {
            let bounded = Boundary {
                max_world: Some(3),
                ..at(0, step, None)
            };
            watch
                .at_boundary(root.as_ref(), group.as_ref(), bounded)
                .map_err(|e| e.to_string())
        };
        assert_eq!(boundary(4), Ok(None), "planned for the next boundary");
        let plan = boundary(5).ok().flatten().expect("a join is planned");
        assert_eq!(
            (plan.handled, plan.requests.clone()),
            (2, vec![first.number()])
        );
        assert!(reply_to_joiners(root.as_ref(), &plan, 2, 1).is_ok());
        let deadline = Instant::now() + Duration::from_secs(30);
        let admitted = first
            .answer(root.as_ref(), deadline)
            .map_err(|e| e.to_string());
        assert!(
            matches!(&admitted, Ok(a) if a.rank == 2 && a.world == 3),
            "{admitted:?}"
        );
        let refused = second
            .answer(root.as_ref(), deadline)
            .map_err(|e| e.to_string());
        assert!(
            matches!(&refused, Err(e) if e.contains("at most 3")),
            "{refused:?}"
        );
    }

    /// A job is not started, training, then ended; a process that asks after it closed is told
    /// so.
    #[test]
    fn a_joiner_of_an_ended_job_is_told_so() {
        let root: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let state = || job_state(root.as_ref()).map_err(|e| e.to_string());
        assert_eq!(state(), Ok(JobState::NotStarted));
        assert!(open(root.as_ref()).is_ok());
        assert_eq!(state(), Ok(JobState::Training));
        assert!(close(root.as_ref()).is_ok());
        assert_eq!(state(), Ok(JobState::Ended));
        let got = request_to_join(&root, "cfg", Duration::from_secs(30));
        assert!(matches!(got, Err(DdpError::JobEnded)), "{got:?}");
    }

    /// The scripted join: every member waits at the boundary for a joiner, and it joins there.
    #[test]
    fn a_scripted_join_waits_for_its_joiner_at_that_boundary() {
        let root: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let group: Arc<dyn Store> = Arc::new(PrefixStore::new("gen-2", Arc::clone(&root)));
        let wait = Some(Duration::from_secs(30));
        let member = |rank: usize| {
            let (root, group) = (Arc::clone(&root), Arc::clone(&group));
            std::thread::spawn(move || {
                JoinWatch::new(0)
                    .at_boundary(root.as_ref(), group.as_ref(), at(rank, 8, wait))
                    .map_err(|e| e.to_string())
            })
        };
        let (zero, one) = (member(0), member(1));
        std::thread::sleep(Duration::from_millis(50));
        let joiner = {
            let root = Arc::clone(&root);
            std::thread::spawn(move || {
                request_to_join(&root, "cfg-a", Duration::from_secs(30)).map_err(|e| e.to_string())
            })
        };
        let plans = [zero.join(), one.join()];
        let plan = match &plans {
            [Ok(Ok(Some(a))), Ok(Ok(Some(b)))] if a == b => a.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!((plan.step, plan.requests.clone()), (8, vec![1]));
        assert!(reply_to_joiners(root.as_ref(), &plan, 2, 3).is_ok());
        let admission = joiner.join().ok().and_then(Result::ok);
        assert_eq!(
            admission.map(|a| (a.rank, a.world, a.generation)),
            Some((2, 3, 3))
        );
    }

    /// A joiner that beats is never called gone; one whose request died (its heartbeat
    /// stopped) is, within the detection time, long before any set-up deadline.
    #[test]
    fn a_joiner_that_stops_beating_is_called_gone() {
        let root: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let detection = Duration::from_millis(200);
        let alive = ask_to_join(&root, "cfg", detection / 4).map_err(|e| e.to_string());
        let dead = ask_to_join(&root, "cfg", detection / 4).map_err(|e| e.to_string());
        let (Ok(alive), Ok(dead)) = (alive, dead) else {
            panic!("asking failed");
        };
        let (n_alive, n_dead) = (alive.number(), dead.number());
        let (done, until_done) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            let root = &root;
            let watcher = scope
                .spawn(move || watch_joiners(root.as_ref(), &[n_alive], detection, &until_done));
            std::thread::sleep(detection * 3);
            drop(done);
            assert_eq!(watcher.join().ok(), Some(None), "a beating joiner is alive");
        });
        drop(dead);
        let (_never, running) = std::sync::mpsc::channel();
        let started = Instant::now();
        let gone = watch_joiners(root.as_ref(), &[n_alive, n_dead], detection, &running);
        assert_eq!(gone.map(|(n, _)| n), Some(n_dead));
        assert!(started.elapsed() < Duration::from_secs(10));
        drop(alive);
    }
}
