//! How a ring link moves a collective's data, behind one small interface: through the link's
//! own TCP socket ([`SocketData`]), or through a shared-memory ring buffer when the neighbour is
//! on this host ([`ShmSender`] / [`ShmReceiver`], see [`crate::group::shm`]).
//!
//! Both are non-blocking: a call moves what it can now and says `None` when it can move nothing,
//! and [`Wakeup`] names the descriptor that `poll(2)` waits on until it can. The exchange loop
//! ([`super::exchange`]) is written once against these traits; it never asks which one it has.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use crate::group::shm::{ShmReceiver, ShmSender};

/// A descriptor and the `poll(2)` events that mean a stalled transfer can go on.
#[derive(Debug, Clone, Copy)]
pub(super) struct Wakeup {
    pub fd: libc::c_int,
    pub events: libc::c_short,
}

/// The sending half of a link's data path (towards the successor).
pub(super) trait DataSender: Send {
    /// Moves up to `bytes.len()` bytes towards the peer: `Some(n)`, or `None` when there is no
    /// room now (poll [`wakeup`](Self::wakeup)). `Err` when the peer is gone.
    fn send_some(&mut self, bytes: &[u8]) -> io::Result<Option<usize>>;
    /// What to poll after `send_some` returned `None`.
    fn wakeup(&self) -> Wakeup;
    /// Called once the group's first barrier has completed (both ends are connected).
    fn go_live(&mut self) {}
    /// How the set-up log names the transport ("" for the socket itself).
    fn label(&self) -> &'static str;
}

/// The receiving half of a link's data path (from the predecessor).
pub(super) trait DataReceiver: Send {
    /// Moves up to `buf.len()` bytes from the peer into `buf`: `Some(n)`, or `None` when nothing
    /// has arrived (poll [`wakeup`](Self::wakeup)). `Err` when the peer is gone: every byte a
    /// collective reads was promised by the peer's plan, so the end of the stream is an error.
    fn recv_some(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>>;
    /// What to poll after `recv_some` returned `None`.
    fn wakeup(&self) -> Wakeup;
    /// Called once the group's first barrier has completed (both ends are connected).
    fn go_live(&mut self) {}
    /// How the set-up log names the transport ("" for the socket itself).
    fn label(&self) -> &'static str;
}

/// Data over the link's TCP socket, through a second handle of it (the first carries the
/// per-collective headers; both are one connection, so the bytes keep their order per
/// direction).
pub(super) struct SocketData(TcpStream);

impl SocketData {
    pub fn new(stream: &TcpStream) -> io::Result<Self> {
        stream.try_clone().map(Self)
    }
}

impl DataSender for SocketData {
    fn send_some(&mut self, bytes: &[u8]) -> io::Result<Option<usize>> {
        socket_write(&mut self.0, bytes)
    }
    fn wakeup(&self) -> Wakeup {
        Wakeup {
            fd: self.0.as_raw_fd(),
            events: libc::POLLOUT,
        }
    }
    fn label(&self) -> &'static str {
        ""
    }
}

impl DataReceiver for SocketData {
    fn recv_some(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        socket_read(&mut self.0, buf)
    }
    fn wakeup(&self) -> Wakeup {
        Wakeup {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
        }
    }
    fn label(&self) -> &'static str {
        ""
    }
}

// Shared-memory links wake the other side through FIFOs: room to write, data to read.
impl DataSender for ShmSender {
    fn send_some(&mut self, bytes: &[u8]) -> io::Result<Option<usize>> {
        self.write_some(bytes)
    }
    fn wakeup(&self) -> Wakeup {
        Wakeup {
            fd: self.wakeup_fd(),
            events: libc::POLLIN,
        }
    }
    fn go_live(&mut self) {
        ShmSender::go_live(self)
    }
    fn label(&self) -> &'static str {
        " (shared memory)"
    }
}

impl DataReceiver for ShmReceiver {
    fn recv_some(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        self.read_some(buf)
    }
    fn wakeup(&self) -> Wakeup {
        Wakeup {
            fd: self.wakeup_fd(),
            events: libc::POLLIN,
        }
    }
    fn go_live(&mut self) {
        ShmReceiver::go_live(self)
    }
    fn label(&self) -> &'static str {
        " (shared memory)"
    }
}

/// Non-blocking write: `Some(n)` bytes written, `None` when the socket is full.
pub(super) fn socket_write(stream: &mut TcpStream, bytes: &[u8]) -> io::Result<Option<usize>> {
    loop {
        match stream.write(bytes) {
            Ok(0) if !bytes.is_empty() => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => return Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Non-blocking read: `Some(n)` bytes read, `None` when nothing is there yet; EOF is an error.
pub(super) fn socket_read(stream: &mut TcpStream, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        match stream.read(buf) {
            Ok(0) if !buf.is_empty() => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection",
                ))
            }
            Ok(n) => return Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}
