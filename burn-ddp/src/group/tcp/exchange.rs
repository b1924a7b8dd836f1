//! One collective on the ring: the event loop that moves a [`RingPlan`]'s pieces (see "One
//! collective" in the [module docs](super)).
//!
//! Each turn of the loop does four things, as far as the sockets and the plan allow, then
//! sleeps in `poll(2)` only if none of them moved a byte:
//! 1. to the successor: our header, then every piece the plan lets us send;
//! 2. to the predecessor: our header, backwards, so it can check us too;
//! 3. from the successor: its header, checked against ours;
//! 4. from the predecessor: its header, checked, then the pieces of the plan, each copied in
//!    place or reduced into the buffer once complete.
//!
//! With a staged collective ([`StagedBuffer`]) a piece is filled before its first send or
//! receive and reported once received, and a turn in which no byte moved does one piece of
//! the staging's work instead of sleeping.
//!
//! Headers always travel on the sockets; pieces travel on each link's [`DataSender`] /
//! [`DataReceiver`](super::transport::DataReceiver), whichever transport it is.

use std::time::{Duration, Instant};

use super::setup::{Link, Ring};
use super::transport::{socket_read, socket_write, Wakeup};
use crate::call::{CollectiveDesc, ReduceOp};
use crate::error::CollectiveError;
use crate::group::element::Element;
use crate::group::liveness::PeerLiveness;
use crate::group::poll::{pollfd, wait_fds};
use crate::group::ring::{RecvAction, RingPlan, SendItem};
use crate::group::staging::StagedBuffer;
use crate::group::stall::StallReporter;
use crate::group::wire::{self, HEADER_LEN};

/// What one collective needs besides the ring and the buffers.
pub(super) struct Call<'a> {
    pub desc: &'a CollectiveDesc,
    pub plan: &'a RingPlan,
    pub op: ReduceOp,
    pub rank: usize,
    pub timeout: Duration,
}

/// Runs the event loop of one collective (module docs) until the plan is done, an error, or
/// `call.timeout`. `scratch` holds the largest received piece that is reduced.
pub(super) fn exchange<T: Element>(
    ring: &mut Ring,
    call: &Call<'_>,
    buffer: &mut [T],
    scratch: &mut [u8],
    (mut stall, mut liveness): (StallReporter<'_>, Option<PeerLiveness<'_>>),
    mut staged: Option<&mut StagedBuffer<'_, T>>,
) -> Result<(), CollectiveError> {
    let mut st = Progress::new(call);
    let start = Instant::now();
    let deadline = start + call.timeout;
    // Set when the last poll found a neighbour's socket closed while we waited on its data
    // path (see `poll_set`): if nothing moves after that either, the neighbour is gone.
    let mut closed: Option<bool> = None;
    loop {
        let mut moved = st.send(ring, buffer, staged.as_deref_mut())?;
        moved |= st.send_back_header(ring)?;
        moved |= st.recv_next_header(ring)?;
        moved |= st.recv(ring, buffer, scratch, staged.as_deref_mut())?;
        if st.done() {
            return Ok(());
        }
        // The sockets have nothing for us: a piece of the staging's work instead of a sleep.
        if !moved && staged.as_deref_mut().is_some_and(|s| s.idle(buffer)) {
            moved = true;
        }
        if moved {
            closed = None;
            continue;
        }
        if let Some(prev) = closed {
            let link = if prev { &ring.prev } else { &ring.next };
            return Err(link.lost(
                call.desc,
                call.rank,
                std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection",
                ),
            ));
        }
        // Nothing moved: sleep in poll(2) until a descriptor is ready or a deadline passes.
        let now = Instant::now();
        if now >= deadline {
            return Err(CollectiveError::Timeout {
                rank: call.rank,
                desc: *call.desc,
                elapsed: now - start,
                timeout: call.timeout,
                waiting_on: st.waiting_on(ring),
            });
        }
        stall.warn_if_due(now, call.desc, Some(call.desc.seq), || st.waiting_on(ring));
        if let Some((silent, quiet)) = liveness.as_mut().and_then(|l| l.silent_peers(now)) {
            return Err(CollectiveError::PeerSilent {
                rank: call.rank,
                desc: *call.desc,
                silent: silent.into_boxed_slice(),
                quiet,
                waiting_on: st.waiting_on(ring),
            });
        }
        let next_check = liveness.as_ref().map_or(deadline, PeerLiveness::next_check);
        let wake = deadline
            .min(stall.next_warning())
            .min(next_check)
            .saturating_duration_since(now);
        let mut fds = st.poll_set(ring);
        wait_fds(&mut fds, wake).map_err(|e| ring.next.lost(call.desc, call.rank, e))?;
        let hung_up = |fd: &libc::pollfd| {
            fd.fd >= 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
        };
        if hung_up(&fds[1]) {
            closed = Some(true);
        } else if hung_up(&fds[0]) {
            closed = Some(false);
        }
    }
}

/// How far one collective has come.
struct Progress<'a> {
    call: &'a Call<'a>,
    header: [u8; HEADER_LEN],
    /// Bytes of our header written to the successor / predecessor.
    fwd_header: usize,
    back_header: usize,
    /// The neighbours' headers, as far as received.
    next_header: [u8; HEADER_LEN],
    next_header_len: usize,
    prev_header: [u8; HEADER_LEN],
    prev_header_len: usize,
    /// The plan's next send and receive, and the bytes of each already moved.
    send: usize,
    send_off: usize,
    recv: usize,
    recv_off: usize,
}

impl<'a> Progress<'a> {
    fn new(call: &'a Call<'a>) -> Self {
        Self {
            call,
            header: wire::encode_header(call.desc),
            fwd_header: 0,
            back_header: 0,
            next_header: [0; HEADER_LEN],
            next_header_len: 0,
            prev_header: [0; HEADER_LEN],
            prev_header_len: 0,
            send: 0,
            send_off: 0,
            recv: 0,
            recv_off: 0,
        }
    }

    fn done(&self) -> bool {
        self.fwd_header == HEADER_LEN
            && self.back_header == HEADER_LEN
            && self.next_header_len == HEADER_LEN
            && self.prev_header_len == HEADER_LEN
            && self.send == self.call.plan.sends.len()
            && self.recv == self.call.plan.recvs.len()
    }

    /// The next send, if the receives it waits for are complete.
    fn sendable(&self) -> Option<&'a SendItem> {
        let plan: &'a RingPlan = self.call.plan;
        plan.sends
            .get(self.send)
            .filter(|item| self.recv >= item.after_recvs)
    }

    /// Step 1: our header, then every send the plan allows, to the successor (each piece
    /// filled by the staging first).
    fn send<T: Element>(
        &mut self,
        ring: &mut Ring,
        buffer: &mut [T],
        mut staged: Option<&mut StagedBuffer<'_, T>>,
    ) -> Result<bool, CollectiveError> {
        let (desc, rank) = (self.call.desc, self.call.rank);
        let mut moved = false;
        loop {
            let sent = if self.fwd_header < HEADER_LEN {
                socket_write(&mut ring.next.stream, &self.header[self.fwd_header..])
            } else if let Some(item) = self.sendable() {
                if self.send_off == 0 {
                    if let Some(staged) = staged.as_deref_mut() {
                        staged.before_send(self.send, buffer);
                    }
                }
                let bytes: &[u8] = bytemuck::cast_slice(&buffer[item.range.clone()]);
                if self.send_off == bytes.len() {
                    // Complete (or empty): on to the next piece.
                    self.send += 1;
                    self.send_off = 0;
                    continue;
                }
                ring.data_out.send_some(&bytes[self.send_off..])
            } else {
                return Ok(moved);
            };
            let Some(n) = sent.map_err(|e| ring.next.lost(desc, rank, e))? else {
                return Ok(moved);
            };
            moved = true;
            if self.fwd_header < HEADER_LEN {
                self.fwd_header += n;
            } else {
                self.send_off += n;
            }
        }
    }

    /// Step 2: our header, backwards, to the predecessor.
    fn send_back_header(&mut self, ring: &mut Ring) -> Result<bool, CollectiveError> {
        if self.back_header == HEADER_LEN {
            return Ok(false);
        }
        let sent = socket_write(&mut ring.prev.stream, &self.header[self.back_header..])
            .map_err(|e| ring.prev.lost(self.call.desc, self.call.rank, e))?;
        let Some(n) = sent else { return Ok(false) };
        self.back_header += n;
        Ok(true)
    }

    /// Step 3: the successor's header, backwards.
    fn recv_next_header(&mut self, ring: &mut Ring) -> Result<bool, CollectiveError> {
        if self.next_header_len == HEADER_LEN {
            return Ok(false);
        }
        let got = socket_read(
            &mut ring.next.stream,
            &mut self.next_header[self.next_header_len..],
        )
        .map_err(|e| ring.next.lost(self.call.desc, self.call.rank, e))?;
        let Some(n) = got else { return Ok(false) };
        self.next_header_len += n;
        if self.next_header_len == HEADER_LEN {
            check_header(&self.next_header, self.call, &ring.next)?;
        }
        Ok(true)
    }

    /// Step 4: the predecessor's header, then the pieces of the plan (each filled by the
    /// staging before it is written, and reported to it once written).
    fn recv<T: Element>(
        &mut self,
        ring: &mut Ring,
        buffer: &mut [T],
        scratch: &mut [u8],
        mut staged: Option<&mut StagedBuffer<'_, T>>,
    ) -> Result<bool, CollectiveError> {
        let (desc, rank) = (self.call.desc, self.call.rank);
        let elem = std::mem::size_of::<T>();
        let mut moved = false;
        loop {
            if self.prev_header_len < HEADER_LEN {
                let got = socket_read(
                    &mut ring.prev.stream,
                    &mut self.prev_header[self.prev_header_len..],
                )
                .map_err(|e| ring.prev.lost(desc, rank, e))?;
                let Some(n) = got else { return Ok(moved) };
                moved = true;
                self.prev_header_len += n;
                if self.prev_header_len == HEADER_LEN {
                    check_header(&self.prev_header, self.call, &ring.prev)?;
                }
                continue;
            }
            let Some(item) = self.call.plan.recvs.get(self.recv) else {
                return Ok(moved);
            };
            let total = item.range.len() * elem;
            if self.recv_off == total {
                // Complete (or empty): reduce it if the plan says so, then the next piece.
                if item.action == RecvAction::Reduce && total > 0 {
                    let incoming: &[T] = bytemuck::cast_slice(&scratch[..total]);
                    T::reduce_into(&mut buffer[item.range.clone()], incoming, self.call.op);
                }
                if let Some(staged) = staged.as_deref_mut() {
                    staged.after_recv(self.recv);
                }
                self.recv += 1;
                self.recv_off = 0;
                continue;
            }
            if self.recv_off == 0 {
                // Before the first byte lands: a copy lands in place, and a reduce needs the
                // local values.
                if let Some(staged) = staged.as_deref_mut() {
                    staged.before_recv(self.recv, buffer);
                }
            }
            let dst: &mut [u8] = match item.action {
                // Copies land in place: no second pass over the bytes.
                RecvAction::Copy => {
                    &mut bytemuck::cast_slice_mut(&mut buffer[item.range.clone()])[self.recv_off..]
                }
                RecvAction::Reduce => &mut scratch[self.recv_off..total],
            };
            let got = ring
                .data_in
                .recv_some(dst)
                .map_err(|e| ring.prev.lost(desc, rank, e))?;
            let Some(n) = got else { return Ok(moved) };
            moved = true;
            self.recv_off += n;
        }
    }

    /// The descriptors to sleep on when nothing moved. A socket we expect nothing from is not
    /// polled: a neighbour that has finished this collective and closed (end of job) must not
    /// wake us in a loop.
    fn poll_set(&self, ring: &Ring) -> [libc::pollfd; 4] {
        let mut next_events = 0;
        if self.fwd_header < HEADER_LEN {
            next_events |= libc::POLLOUT;
        }
        if self.next_header_len < HEADER_LEN {
            next_events |= libc::POLLIN;
        }
        let mut prev_events = 0;
        if self.back_header < HEADER_LEN {
            prev_events |= libc::POLLOUT;
        }
        if self.prev_header_len < HEADER_LEN {
            prev_events |= libc::POLLIN;
        }
        let want_out = self.fwd_header == HEADER_LEN && self.sendable().is_some();
        let want_in = self.prev_header_len == HEADER_LEN && self.recv < self.call.plan.recvs.len();
        // While we wait on a neighbour's data path (for its data, or for room in its buffer),
        // its socket closing means it is gone: a shared-memory link cannot always tell (until
        // the first barrier has completed each side holds its own FIFO open, see
        // `ShmReceiver::go_live`), and a neighbour that left normally would have sent (or
        // taken) everything first.
        if want_in {
            prev_events |= libc::POLLRDHUP;
        }
        if want_out {
            next_events |= libc::POLLRDHUP;
        }
        let link = |l: &Link, events| pollfd(if events == 0 { -1 } else { l.fd() }, events);
        let data = |w: Option<Wakeup>| w.map_or(pollfd(-1, 0), |w| pollfd(w.fd, w.events));
        [
            link(&ring.next, next_events),
            link(&ring.prev, prev_events),
            data(want_out.then(|| ring.data_out.wakeup())),
            data(want_in.then(|| ring.data_in.wakeup())),
        ]
    }

    /// What the rank is blocked on, for timeout and stall messages.
    fn waiting_on(&self, ring: &Ring) -> String {
        let who = |l: &Link| format!("rank {} ({})", l.peer, l.peer_addr);
        let plan = self.call.plan;
        if self.prev_header_len < HEADER_LEN {
            format!("{} to enter this collective", who(&ring.prev))
        } else if self.next_header_len < HEADER_LEN {
            format!("{} to enter this collective", who(&ring.next))
        } else if self.recv < plan.recvs.len() {
            format!(
                "data from {} (piece {} of {})",
                who(&ring.prev),
                self.recv,
                plan.recvs.len()
            )
        } else {
            format!(
                "{} to take our data (piece {} of {})",
                who(&ring.next),
                self.send,
                plan.sends.len()
            )
        }
    }
}

/// Decodes a neighbour's header and compares it with our call.
fn check_header(
    bytes: &[u8; HEADER_LEN],
    call: &Call<'_>,
    link: &Link,
) -> Result<(), CollectiveError> {
    let (rank, ours) = (call.rank, *call.desc);
    let theirs = wire::decode_header(bytes).map_err(|source| CollectiveError::Protocol {
        rank,
        peer: link.peer,
        desc: ours,
        source,
    })?;
    if theirs != ours {
        return Err(CollectiveError::Mismatch {
            rank,
            peer: link.peer,
            ours,
            theirs,
        });
    }
    Ok(())
}
