//! The launcher's side of fencing (burn-ddp's [`burn_ddp::elastic::fencing`]): with
//! `--survivors-continue`, each process this launcher starts gets an identity of its own
//! ([`burn_ddp::elastic::fencing::FENCE_ID_VAR`]); while it waits for them, the launcher
//! asks the job's store, a few times a second, whether the job left one of them out, and ends
//! that one with SIGKILL. A rank that froze (a hung driver, `SIGSTOP`) then never holds the
//! job: the survivors finish and the launcher exits with them.
//!
//! The store is node 0's (this launcher's own on node 0). One that cannot be reached is asked
//! again a little later (at the end of a multi-node job node 0's launcher leaves first); one
//! still unreachable after [`WARN_AFTER`] is said once: the job's ranks need that store too,
//! so they fail on their own.

use std::time::{Duration, Instant};

use burn_ddp::elastic::fencing::fenced;
use burn_ddp::store::TcpStore;

use crate::launcher::launch_plan::LaunchPlan;

/// How often the launcher looks for fenced processes: a frozen rank is ended within this of
/// the job's decision.
const LOOK_EVERY: Duration = Duration::from_millis(250);
/// The deadline of the connection to the store and of each look: short, since the launcher
/// supervises its ranks on the same thread.
const STORE_DEADLINE: Duration = Duration::from_secs(1);
/// How long after a failed look the launcher asks again.
const RETRY_AFTER: Duration = Duration::from_secs(2);
/// How long the store may stay unreachable, while ranks run, before the launcher says so.
const WARN_AFTER: Duration = Duration::from_secs(10);

/// The identities this launcher gives its processes, and its look-out for fenced ones.
pub(crate) struct Fencing {
    /// Tells this launcher's processes apart from any other launcher's, over the job's life
    /// (a node's launcher started again draws a new one).
    nonce: String,
    /// Processes started so far (each identity is used once).
    started: usize,
    endpoint: String,
    token: String,
    store: Option<TcpStore>,
    /// Since when the store could not be reached, if it cannot.
    failing_since: Option<Instant>,
    /// The launcher said that the store stays unreachable.
    warned: bool,
    next_look: Instant,
}

impl Fencing {
    /// The fencing of a launcher whose job's store is at the plan's address and `port`;
    /// `nonce`: this launcher's random identity.
    pub(crate) fn new(plan: &LaunchPlan, port: u16, nonce: String) -> Self {
        // Node 0 reaches its own store over loopback (it listens on every interface).
        let endpoint = match plan.store_host.is_some() {
            true => format!("127.0.0.1:{port}"),
            false => format!("{}:{port}", plan.master_addr),
        };
        Self {
            nonce,
            started: 0,
            endpoint,
            token: plan.token.clone(),
            store: None,
            failing_since: None,
            warned: false,
            next_look: Instant::now(),
        }
    }

    /// The identity of the next process this launcher starts.
    pub(crate) fn next_identity(&mut self) -> String {
        self.started += 1;
        format!("{}-{}", self.nonce, self.started)
    }

    /// Of `running` (index, identity), the processes the job left out, each with the job's
    /// reason; empty between looks (at most one every [`LOOK_EVERY`]).
    pub(crate) fn left_out<'a>(
        &mut self,
        running: impl Iterator<Item = (usize, &'a str)>,
    ) -> Vec<(usize, String)> {
        let now = Instant::now();
        let running: Vec<(usize, &str)> = running.collect();
        if running.is_empty() || now < self.next_look {
            return Vec::new();
        }
        self.next_look = now + LOOK_EVERY;
        let looked = self.connected().and_then(|store| {
            let mut out = Vec::new();
            for &(index, identity) in &running {
                if let Some(why) = fenced(store, identity)? {
                    out.push((index, why));
                }
            }
            Ok(out)
        });
        match looked {
            Ok(out) => {
                self.failing_since = None;
                out
            }
            Err(e) => {
                // A new connection next time, a little later.
                self.store = None;
                self.next_look = now + RETRY_AFTER;
                let since = *self.failing_since.get_or_insert(now);
                if !self.warned && since.elapsed() >= WARN_AFTER {
                    self.warned = true;
                    eprintln!(
                        "trainer launcher: cannot ask the job's store at {} which ranks it left out ({e}); a rank that freezes meanwhile is not ended by this launcher",
                        self.endpoint
                    );
                }
                Vec::new()
            }
        }
    }

    /// The store, connected at the first look.
    fn connected(&mut self) -> Result<&TcpStore, burn_ddp::StoreError> {
        let store = match self.store.take() {
            Some(store) => store,
            None => TcpStore::connect(&self.endpoint, &self.token, STORE_DEADLINE)?,
        };
        Ok(self.store.insert(store))
    }
}
