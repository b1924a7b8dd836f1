//! [`StageLinks`]: the point-to-point connections of one pipeline stage to its neighbours,
//! over TCP. Activations go to the next stage, the gradients of those activations come back.
//!
//! Set-up (collective over the whole world, bounded by the timeout): every rank joins a
//! rendezvous under the store prefix `pipeline/`, publishes its plan (stage count, schedule,
//! micro-batches: a neighbour with another plan is refused at once, naming both ranks) and a
//! listening address; then it connects to its next stage and accepts its previous stage, which
//! greets with its rank, the world size and the job token (`group::greeting`, as the ring's
//! links: a stranger is refused and logged, and the wait goes on).
//!
//! Sends never wait for the receiver's program order: each outgoing connection has a writer
//! thread fed through a queue, so two neighbours sending to each other at once (1F1B's steady
//! state) cannot deadlock on full socket buffers. Receives wait, each until the link's timeout,
//! and a neighbour that closed its connection (exited, crashed) is named.

use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpStream};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::frame::{self, Flow, FIXED_LEN};
use super::layout::PipelineLayout;
use crate::error::CollectiveError;
use crate::group::greeting::{accept_greeted, connect_and_greet, Greeting};
use crate::group::rendezvous::Rendezvous;
use crate::group::TcpGroupOptions;
use crate::store::{PrefixStore, Store};

/// Why a link failed. Every variant names this rank and the neighbour.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error(transparent)]
    Setup(#[from] CollectiveError),
    #[error(
        "rank {rank}: the pipeline plans differ: this rank runs {ours:?}, its neighbour rank {peer} runs {theirs:?}. Every rank must be started with the same pipeline_stages, schedule and micro-batches"
    )]
    PlanMismatch {
        rank: usize,
        peer: usize,
        ours: String,
        theirs: String,
    },
    #[error(
        "rank {rank}: connection with pipeline neighbour rank {peer} ({peer_addr}) failed while {during}: {source}. Rank {peer} probably exited or crashed: look at its log"
    )]
    Lost {
        rank: usize,
        peer: usize,
        peer_addr: String,
        during: String,
        source: io::Error,
    },
    #[error(
        "rank {rank}: waited {timeout:?} for rank {peer} ({peer_addr}) while {during}: the neighbour is stuck or much slower (raise the timeout if it is only slow)"
    )]
    Timeout {
        rank: usize,
        peer: usize,
        peer_addr: String,
        during: String,
        timeout: Duration,
    },
    #[error(
        "rank {rank}: rank {peer} sent {got}, but this rank expected {expected}: the two ranks run different pipeline schedules or models"
    )]
    Unexpected {
        rank: usize,
        peer: usize,
        expected: String,
        got: String,
    },
}

/// A received activation or gradient: its shape and row-major values.
pub type Received = (Vec<usize>, Vec<f32>);

/// Which neighbour.
#[derive(Clone, Copy)]
enum Side {
    Next,
    Previous,
}

/// One neighbour: the socket read here, and the writer thread that sends to it.
struct Peer {
    rank: usize,
    addr: String,
    reader: TcpStream,
    queue: Option<Sender<Vec<u8>>>,
    writer: Option<JoinHandle<()>>,
    /// The writer thread's failure, if it had one.
    write_error: Arc<Mutex<Option<io::Error>>>,
    /// Frames queued and not yet written (0 again after a failed write).
    pending: Arc<(Mutex<usize>, Condvar)>,
}

/// A stage's links to its neighbours (module docs).
pub struct StageLinks {
    rank: usize,
    timeout: Duration,
    next: Option<Peer>,
    previous: Option<Peer>,
}

impl StageLinks {
    /// Connects `rank` to its neighbours of `layout`, through the store's `namespace` (one per
    /// pipeline of the job, e.g. `pg/default/pipeline`). Collective over every rank of the world
    /// (ranks without neighbours too, as the rendezvous counts them); `plan` must be the same
    /// string on every rank (e.g. `"stages=2 schedule=1f1b micro_batches=4"`). Fails after
    /// `timeout` naming a rank that never arrived; a rank that fails publishes why, and the
    /// others still waiting stop within a second.
    pub fn connect(
        store: Arc<dyn Store>,
        namespace: &str,
        layout: &PipelineLayout,
        rank: usize,
        plan: &str,
        options: &TcpGroupOptions,
    ) -> Result<Self, LinkError> {
        let world = layout.world_size();
        let timeout = options.timeout;
        let rdv = Rendezvous::new(PrefixStore::new(namespace, store), rank, world, timeout);
        let formed = Self::form(&rdv, layout, rank, plan, options);
        if let Err(e) = &formed {
            rdv.abort(&CollectiveError::Setup {
                rank,
                message: e.to_string(),
            });
        }
        formed
    }

    /// The steps of [`connect`](Self::connect).
    fn form(
        rdv: &Rendezvous,
        layout: &PipelineLayout,
        rank: usize,
        plan: &str,
        options: &TcpGroupOptions,
    ) -> Result<Self, LinkError> {
        let timeout = options.timeout;
        let ours = Greeting {
            rank,
            world: layout.world_size(),
            token: &options.token,
        };
        rdv.join()?;
        rdv.publish("plan", plan.as_bytes())?;
        let ip = options
            .advertise_ip
            .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
        let (listener, _) = rdv.listen_and_publish(ip)?;
        rdv.wait_joined()?;
        let neighbours = [layout.previous_stage(rank), layout.next_stage(rank)];
        for peer in neighbours.into_iter().flatten() {
            let theirs = String::from_utf8_lossy(&rdv.published("plan", peer)?).into_owned();
            if theirs != plan {
                return Err(LinkError::PlanMismatch {
                    rank,
                    peer,
                    ours: plan.to_owned(),
                    theirs,
                });
            }
        }
        let setup = |e: io::Error, peer| {
            LinkError::Setup(rdv.setup_error(format!("setting up the link with rank {peer}: {e}")))
        };
        let next = match layout.next_stage(rank) {
            Some(peer) => {
                let addr = String::from_utf8_lossy(&rdv.published("addr", peer)?).into_owned();
                let stream = connect_and_greet(rdv, ours, peer, &addr, timeout)?;
                Some(Peer::new(peer, addr, stream, timeout).map_err(|e| setup(e, peer))?)
            }
            None => None,
        };
        let previous = match layout.previous_stage(rank) {
            Some(peer) => {
                let (stream, from) =
                    accept_greeted(rdv, &listener, ours, peer, "pipeline", timeout)?;
                Some(
                    Peer::new(peer, from.to_string(), stream, timeout)
                        .map_err(|e| setup(e, peer))?,
                )
            }
            None => None,
        };
        Ok(Self {
            rank,
            timeout,
            next,
            previous,
        })
    }

    /// Sends micro-batch `micro_batch`'s output (`shape`, row-major `values`) to the next
    /// stage. Returns without waiting for the receiver. Not collective.
    pub fn send_activation(
        &mut self,
        micro_batch: usize,
        shape: &[usize],
        values: &[f32],
    ) -> Result<(), LinkError> {
        let bytes = frame::encode(Flow::Activation, micro_batch, shape, values);
        let rank = self.rank;
        self.neighbour(Side::Next)?.send(rank, bytes)
    }

    /// Sends the gradient with respect to micro-batch `micro_batch`'s input to the previous
    /// stage. Returns without waiting for the receiver. Not collective.
    pub fn send_gradient(
        &mut self,
        micro_batch: usize,
        shape: &[usize],
        values: &[f32],
    ) -> Result<(), LinkError> {
        let bytes = frame::encode(Flow::Gradient, micro_batch, shape, values);
        let rank = self.rank;
        self.neighbour(Side::Previous)?.send(rank, bytes)
    }

    /// Waits (until the timeout) for micro-batch `micro_batch`'s activation from the previous
    /// stage: its shape and values.
    pub fn recv_activation(&mut self, micro_batch: usize) -> Result<Received, LinkError> {
        let (rank, timeout) = (self.rank, self.timeout);
        self.neighbour(Side::Previous)?
            .receive(rank, Flow::Activation, micro_batch, timeout)
    }

    /// Waits (until the timeout) for the gradient of micro-batch `micro_batch`'s output from
    /// the next stage.
    pub fn recv_gradient(&mut self, micro_batch: usize) -> Result<Received, LinkError> {
        let (rank, timeout) = (self.rank, self.timeout);
        self.neighbour(Side::Next)?
            .receive(rank, Flow::Gradient, micro_batch, timeout)
    }

    /// The link to the next or the previous stage, or an error if this stage has none.
    fn neighbour(&mut self, side: Side) -> Result<&mut Peer, LinkError> {
        let rank = self.rank;
        let (peer, which) = match side {
            Side::Next => (self.next.as_mut(), "next"),
            Side::Previous => (self.previous.as_mut(), "previous"),
        };
        peer.ok_or_else(|| {
            LinkError::Setup(CollectiveError::Setup {
                rank,
                message: format!("this stage has no {which} stage to exchange with"),
            })
        })
    }

    /// How long each receive waits from now on (the set-up's timeout until then).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Waits (until the timeout) until everything sent has been handed to the kernel, or
    /// fails naming the neighbour a send to which failed. The links stay open.
    pub fn flush(&mut self) -> Result<(), LinkError> {
        let (rank, timeout) = (self.rank, self.timeout);
        for peer in [self.next.as_mut(), self.previous.as_mut()]
            .into_iter()
            .flatten()
        {
            peer.drain(rank, timeout)?;
        }
        Ok(())
    }
}

/// How long dropping the links waits for queued frames to leave before cutting the
/// connections (a neighbour that stopped reading must not hold this rank for a whole timeout).
const DROP_GRACE: Duration = Duration::from_secs(5);

impl Drop for StageLinks {
    fn drop(&mut self) {
        let (rank, grace) = (self.rank, self.timeout.min(DROP_GRACE));
        for peer in [self.next.as_mut(), self.previous.as_mut()]
            .into_iter()
            .flatten()
        {
            let _ = peer.drain(rank, grace);
            // Fails a write still stuck on a full socket at once, so the join below returns.
            let _ = peer.reader.shutdown(std::net::Shutdown::Both);
            let _ = peer.finish_writes(rank);
        }
    }
}

impl Peer {
    fn new(rank: usize, addr: String, stream: TcpStream, timeout: Duration) -> io::Result<Self> {
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(timeout))?;
        let mut out = stream.try_clone()?;
        let (queue, frames) = mpsc::channel::<Vec<u8>>();
        let write_error = Arc::new(Mutex::new(None));
        let pending = Arc::new((Mutex::new(0usize), Condvar::new()));
        let (slot, count) = (Arc::clone(&write_error), Arc::clone(&pending));
        let writer = std::thread::Builder::new()
            .name(format!("pipeline-send-{rank}"))
            .spawn(move || {
                for bytes in frames {
                    let written = out.write_all(&bytes);
                    let (left, changed) = &*count;
                    let mut left = left.lock().unwrap_or_else(PoisonError::into_inner);
                    if let Err(e) = written {
                        *slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
                        *left = 0;
                        changed.notify_all();
                        return;
                    }
                    *left = left.saturating_sub(1);
                    changed.notify_all();
                }
            })?;
        Ok(Self {
            rank,
            addr,
            reader: stream,
            queue: Some(queue),
            writer: Some(writer),
            write_error,
            pending,
        })
    }

    fn lost(&self, rank: usize, during: String, source: io::Error) -> LinkError {
        LinkError::Lost {
            rank,
            peer: self.rank,
            peer_addr: self.addr.clone(),
            during,
            source,
        }
    }

    /// The writer thread's failure, if it had one (it stays: every later send fails too).
    fn failed_write(&self) -> Option<io::Error> {
        let slot = self
            .write_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        slot.as_ref()
            .map(|e| io::Error::new(e.kind(), e.to_string()))
    }

    fn send(&mut self, rank: usize, bytes: Vec<u8>) -> Result<(), LinkError> {
        if let Some(e) = self.failed_write() {
            return Err(self.lost(rank, "sending".into(), e));
        }
        let (pending, _) = &*self.pending;
        *pending.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        let sent = self.queue.as_ref().map(|q| q.send(bytes));
        match sent {
            Some(Ok(())) => Ok(()),
            _ => {
                let mut left = pending.lock().unwrap_or_else(PoisonError::into_inner);
                *left = left.saturating_sub(1);
                drop(left);
                Err(self.lost(
                    rank,
                    "sending".into(),
                    io::Error::new(io::ErrorKind::BrokenPipe, "the sending thread has stopped"),
                ))
            }
        }
    }

    fn drain(&mut self, rank: usize, timeout: Duration) -> Result<(), LinkError> {
        let (left, changed) = &*self.pending;
        let left = left.lock().unwrap_or_else(PoisonError::into_inner);
        let (left, _) = changed
            .wait_timeout_while(left, timeout, |left| *left > 0)
            .unwrap_or_else(PoisonError::into_inner);
        let stuck = *left > 0;
        drop(left);
        if let Some(e) = self.failed_write() {
            return Err(self.lost(rank, "sending".into(), e));
        }
        if stuck {
            return Err(LinkError::Timeout {
                rank,
                peer: self.rank,
                peer_addr: self.addr.clone(),
                during: "sending".into(),
                timeout,
            });
        }
        Ok(())
    }

    fn finish_writes(&mut self, rank: usize) -> Result<(), LinkError> {
        self.queue.take();
        if let Some(writer) = self.writer.take() {
            // Bounded: every write has the link's timeout, and `Drop` shuts the socket first.
            let _ = writer.join();
        }
        match self.failed_write() {
            Some(e) => Err(self.lost(rank, "sending".into(), e)),
            None => Ok(()),
        }
    }

    fn receive(
        &mut self,
        rank: usize,
        flow: Flow,
        micro_batch: usize,
        timeout: Duration,
    ) -> Result<Received, LinkError> {
        let during = format!("receiving the {flow:?} of micro-batch {micro_batch}").to_lowercase();
        let deadline = Instant::now() + timeout;
        let mut fixed = [0u8; FIXED_LEN];
        self.read_exact(rank, &mut fixed, deadline, &during, timeout)?;
        let (got_flow, got_micro, dims) =
            frame::decode_fixed(&fixed).map_err(|problem| LinkError::Unexpected {
                rank,
                peer: self.rank,
                expected: during.clone(),
                got: problem,
            })?;
        if (got_flow, got_micro) != (flow, micro_batch) {
            return Err(LinkError::Unexpected {
                rank,
                peer: self.rank,
                expected: format!("the {flow:?} of micro-batch {micro_batch}"),
                got: format!("the {got_flow:?} of micro-batch {got_micro}"),
            });
        }
        let mut shape_bytes = vec![0u8; 8 * dims];
        self.read_exact(rank, &mut shape_bytes, deadline, &during, timeout)?;
        let shape = frame::decode_shape(&shape_bytes);
        let bytes = frame::payload_bytes(&shape).ok_or_else(|| LinkError::Unexpected {
            rank,
            peer: self.rank,
            expected: format!("at most {} bytes of values", frame::MAX_PAYLOAD),
            got: format!("a tensor of shape {shape:?}"),
        })?;
        let mut value_bytes = vec![0u8; bytes];
        self.read_exact(rank, &mut value_bytes, deadline, &during, timeout)?;
        Ok((shape, frame::decode_values(&value_bytes)))
    }

    /// Fills `buf` before `deadline`.
    fn read_exact(
        &mut self,
        rank: usize,
        buf: &mut [u8],
        deadline: Instant,
        during: &str,
        timeout: Duration,
    ) -> Result<(), LinkError> {
        let mut filled = 0;
        while filled < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(LinkError::Timeout {
                    rank,
                    peer: self.rank,
                    peer_addr: self.addr.clone(),
                    during: during.to_owned(),
                    timeout,
                });
            }
            let set = self.reader.set_read_timeout(Some(left));
            match set.and_then(|()| self.reader.read(&mut buf[filled..])) {
                Ok(0) => {
                    let eof = io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the neighbour closed the connection",
                    );
                    return Err(self.lost(rank, during.to_owned(), eof));
                }
                Ok(n) => filled += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) || e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.lost(rank, during.to_owned(), e)),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::pipeline::schedule::{stage_actions, Action, PipelineSchedule};
    use crate::store::MemoryStore;

    const LOCAL: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
    const LONG: Duration = Duration::from_secs(120);

    /// Runs `body(rank, links)` on every rank of `layout` in its own thread, with `plan_of`'s
    /// plan, and returns each rank's result.
    fn on_every_rank<T: Send + 'static>(
        layout: PipelineLayout,
        timeout: Duration,
        plan_of: fn(usize) -> &'static str,
        body: impl Fn(usize, Result<StageLinks, LinkError>) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let body = Arc::new(body);
        let threads: Vec<_> = (0..layout.world_size())
            .map(|rank| {
                let (store, body) = (Arc::clone(&store), Arc::clone(&body));
                std::thread::spawn(move || {
                    let links = StageLinks::connect(
                        store,
                        "pipeline",
                        &layout,
                        rank,
                        plan_of(rank),
                        &TcpGroupOptions {
                            timeout,
                            advertise_ip: Some(LOCAL),
                            ..Default::default()
                        },
                    );
                    body(rank, links)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a rank's thread panicked"))
            .collect()
    }

    fn same_plan(_: usize) -> &'static str {
        "stages=3 schedule=1f1b micro_batches=6"
    }

    /// Each stage adds 1 going forward; the last stage's gradient is its output; each stage
    /// passes the gradient back times 2. 2 Mi values per message: far past the socket buffers,
    /// so the steady state's crossing sends would deadlock if sends waited for the receiver.
    #[test]
    fn one_f_one_b_traffic_crosses_without_deadlock_and_arrives_intact() {
        let layout = PipelineLayout::new(6, 3).unwrap();
        let micro = 6;
        let results = on_every_rank(layout, LONG, same_plan, move |rank, links| {
            let mut links = links.unwrap();
            let stage = layout.position(rank).stage;
            let n = 1 << 21;
            let mut outputs = vec![Vec::new(); micro];
            let mut first_grads = Vec::new();
            for action in stage_actions(PipelineSchedule::OneForwardOneBackward, 3, stage, micro) {
                match action {
                    Action::Forward(i) => {
                        let input = if stage == 0 {
                            vec![(rank * 100 + i) as f32; n]
                        } else {
                            let (shape, values) = links.recv_activation(i).unwrap();
                            assert_eq!(shape, vec![n / 2, 2]);
                            values
                        };
                        let output: Vec<f32> = input.iter().map(|v| v + 1.0).collect();
                        if stage < 2 {
                            links.send_activation(i, &[n / 2, 2], &output).unwrap();
                        }
                        outputs[i] = output;
                    }
                    Action::Backward(i) => {
                        let grad = if stage == 2 {
                            std::mem::take(&mut outputs[i])
                        } else {
                            links.recv_gradient(i).unwrap().1
                        };
                        let back: Vec<f32> = grad.iter().map(|g| g * 2.0).collect();
                        if stage > 0 {
                            links.send_gradient(i, &[n], &back).unwrap();
                        } else {
                            first_grads.push((back[0], back[n - 1]));
                        }
                    }
                }
            }
            links.flush().unwrap();
            first_grads
        });
        for (rank, grads) in results.iter().enumerate() {
            if layout.position(rank).stage != 0 {
                assert!(grads.is_empty());
                continue;
            }
            // x + 3 after three stages, times 2 on each stage on the way back.
            let expected: Vec<(f32, f32)> = (0..micro)
                .map(|i| {
                    let v = ((rank * 100 + i) as f32 + 3.0) * 8.0;
                    (v, v)
                })
                .collect();
            assert_eq!(grads, &expected, "rank {rank}");
        }
    }

    #[test]
    fn a_neighbour_with_another_plan_is_refused_naming_both_ranks() {
        let layout = PipelineLayout::new(2, 2).unwrap();
        let plan_of = |rank| {
            if rank == 0 {
                "stages=2 m=4"
            } else {
                "stages=2 m=8"
            }
        };
        let errors = on_every_rank(layout, LONG, plan_of, |_, links| {
            links.err().map(|e| e.to_string())
        });
        let rank_0 = errors[0].as_deref().unwrap_or_default();
        assert!(
            rank_0.contains("rank 0") && rank_0.contains("rank 1") && rank_0.contains("m=8"),
            "{rank_0}"
        );
        assert!(errors[1]
            .as_deref()
            .unwrap_or_default()
            .contains("\"stages=2 m=4\""));
    }

    #[test]
    fn strangers_on_a_stage_port_are_refused_and_the_links_form() {
        use crate::group::wire::{encode_hello, RingHello};
        let layout = PipelineLayout::new(3, 3).unwrap();
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let options = TcpGroupOptions {
            timeout: LONG,
            advertise_ip: Some(LOCAL),
            token: "job-token".into(),
            ..Default::default()
        };
        let spawn_rank = |rank: usize| {
            let (store, options) = (Arc::clone(&store), options.clone());
            std::thread::spawn(move || {
                let mut links =
                    StageLinks::connect(store, "pipeline", &layout, rank, "plan", &options)
                        .unwrap();
                match rank {
                    1 => {
                        links.send_activation(0, &[2], &[1.0, 2.0]).unwrap();
                        links.flush().unwrap();
                        None
                    }
                    2 => Some(links.recv_activation(0).unwrap()),
                    _ => None,
                }
            })
        };
        // Stage 2 listens for stage 1; before stage 1 starts, stage 2's backlog gets garbage
        // and a hello with the wrong token.
        let (stage0, stage2) = (spawn_rank(0), spawn_rank(2));
        let addr = String::from_utf8(store.get("pipeline/addr/2", LONG).unwrap()).unwrap();
        let mut garbage = TcpStream::connect(&addr).unwrap();
        garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut impostor = TcpStream::connect(&addr).unwrap();
        impostor
            .write_all(&encode_hello(&RingHello {
                rank: 1,
                world_size: 3,
                token: "guess".into(),
            }))
            .unwrap();
        let stage1 = spawn_rank(1);
        assert!(stage0.join().unwrap().is_none());
        assert!(stage1.join().unwrap().is_none());
        assert_eq!(stage2.join().unwrap(), Some((vec![2], vec![1.0, 2.0])));
    }

    #[test]
    fn a_neighbour_that_exits_is_named_at_once() {
        let layout = PipelineLayout::new(2, 2).unwrap();
        let errors = on_every_rank(layout, LONG, same_plan, |rank, links| {
            let mut links = links.unwrap();
            if rank == 1 {
                drop(links); // as if the process exited
                return None;
            }
            let started = Instant::now();
            let error = links.recv_gradient(0).unwrap_err();
            assert!(
                started.elapsed() < LONG / 2,
                "waited for the timeout instead"
            );
            Some(error.to_string())
        });
        let error = errors[0].as_deref().unwrap_or_default();
        assert!(
            error.contains("rank 1") && error.contains("closed the connection"),
            "{error}"
        );
    }

    #[test]
    fn a_silent_neighbour_times_out_naming_it() {
        let layout = PipelineLayout::new(2, 2).unwrap();
        let (done, wait) = mpsc::channel::<()>();
        let wait = Mutex::new(wait);
        let errors = on_every_rank(
            layout,
            Duration::from_secs(1),
            same_plan,
            move |rank, links| {
                let mut links = links.unwrap();
                if rank == 1 {
                    // Alive and connected, but sends nothing until rank 0 has given up.
                    let _ = wait.lock().unwrap().recv();
                    return None;
                }
                let error = links.recv_gradient(0).unwrap_err();
                let _ = done.send(());
                Some(error.to_string())
            },
        );
        let error = errors[0].as_deref().unwrap_or_default();
        assert!(error.contains("waited 1s for rank 1"), "{error}");
    }

    #[test]
    fn a_frame_out_of_order_names_what_was_expected() {
        let layout = PipelineLayout::new(2, 2).unwrap();
        let errors = on_every_rank(layout, LONG, same_plan, |rank, links| {
            let mut links = links.unwrap();
            if rank == 0 {
                links.send_activation(1, &[1], &[0.5]).unwrap();
                links.flush().unwrap();
                return None;
            }
            Some(links.recv_activation(0).unwrap_err().to_string())
        });
        let error = errors[1].as_deref().unwrap_or_default();
        assert!(
            error.contains("Activation of micro-batch 1")
                && error.contains("expected the Activation of micro-batch 0"),
            "{error}"
        );
    }
}
