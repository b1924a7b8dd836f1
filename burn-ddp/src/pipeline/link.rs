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
mod tests;
