//! [`C10dStore`]: a client of PyTorch's c10d `TCPStore` server (the store torchrun's agent
//! hosts), behind the crate's [`Store`] trait.

use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::wire::{
    check_echo, decode_check, decode_len, decode_wait, handshake, QueryType, RequestBuf, WaitReply,
    MAX_KEY_LEN, MAX_VALUE_LEN,
};
use crate::error::{StoreError, WireError};
use crate::store::backoff::Backoff;
use crate::store::connection::is_timeout;
use crate::store::contract::Store;

/// What torch's own `TCPStore` client puts before every key (its `keyPrefix_`). This client does
/// the same, so a key set here is the key a Python `TCPStore` client of the same server reads.
pub const TORCH_KEY_PREFIX: &str = "/";

/// Keys named in a wait's timeout error at most (each costs a `CHECK` round trip).
const MAX_KEYS_NAMED: usize = 16;

/// A connection to a c10d `TCPStore` server. Thread-safe: requests are serialised on one
/// connection.
///
/// Every call has a deadline: waits their own timeout, the others the client's round-trip
/// timeout (the connect timeout, at least 1 s). A reply that breaks the protocol is a
/// [`StoreError::Protocol`], never a panic; after any failure mid-exchange the connection is
/// dropped (the byte stream is no longer in step) and the next call opens a new one.
///
/// Semantics are those of torch's server: `add` stores decimal text (so `get` of a counter reads
/// e.g. `b"3"`, as the [`Store`] contract says), `get` of an absent key waits for it.
pub struct C10dStore {
    addr: String,
    conn: Mutex<Option<TcpStream>>,
    timeout: Duration,
}

/// The result of an exchange whose bytes stayed in step: `Err` is a failure that leaves the
/// connection usable (a wait that timed out and was cancelled).
type InStep<T> = Result<T, StoreError>;

impl C10dStore {
    /// Connects to the server at `addr` (`host:port`) and checks that it speaks the protocol
    /// (validate, then a ping it must echo), retrying refused or dropped connections with capped
    /// back-off until `connect_timeout` passes. A peer that answers something else than the echo
    /// fails at once with [`StoreError::Protocol`].
    pub fn connect(addr: &str, connect_timeout: Duration) -> Result<Self, StoreError> {
        let timeout = connect_timeout.max(Duration::from_secs(1));
        let stream = open(addr, connect_timeout)?;
        Ok(Self {
            addr: addr.to_string(),
            conn: Mutex::new(Some(stream)),
            timeout,
        })
    }

    /// The server's address as given.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// This end's IP address on the connection to the server (see
    /// [`crate::store::TcpStore::local_ip`]).
    pub fn local_ip(&self) -> Option<IpAddr> {
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        conn.as_ref()
            .and_then(|s| s.local_addr().ok())
            .map(|a| a.ip())
    }

    /// Torch's `compare_set`: when `key` holds `expected` (or is absent and `expected` is empty)
    /// it becomes `desired`. Returns the value stored afterwards — except that for an absent key
    /// and a non-empty `expected` the server answers `expected` and stores nothing.
    pub fn compare_set(
        &self,
        key: &str,
        expected: &[u8],
        desired: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        let op = format!("compare_set({key:?})");
        self.check_sizes(&op, &[key], &[expected, desired])?;
        let request = RequestBuf::new(QueryType::CompareSet)
            .bytes(wire_key(key).as_bytes())
            .bytes(expected)
            .bytes(desired)
            .finish();
        self.exchange(&op, |c| {
            c.send(&request)?;
            Ok(Ok(c.read_bytes()?))
        })
    }

    /// Runs one exchange on the connection (opening one first if the last broke). `f` returns
    /// `Err` when the stream is out of step (the connection is then dropped), `Ok(Err)` for a
    /// failure that left it in step.
    fn exchange<T>(
        &self,
        operation: &str,
        f: impl FnOnce(&mut Exchange<'_>) -> Result<InStep<T>, StoreError>,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let stream = match conn.take() {
            Some(s) => s,
            None => open(&self.addr, self.timeout)?,
        };
        let mut ex = Exchange {
            stream,
            addr: &self.addr,
            operation,
            round_trip: self.timeout,
        };
        match f(&mut ex) {
            Ok(result) => {
                *conn = Some(ex.stream);
                result
            }
            Err(e) => Err(e), // the stream is dropped here
        }
    }

    /// Refuses keys and values the server would drop the connection for.
    fn check_sizes(&self, op: &str, keys: &[&str], values: &[&[u8]]) -> Result<(), StoreError> {
        let refuse = |message: String| StoreError::Refused {
            addr: self.addr.clone(),
            operation: op.to_string(),
            message,
        };
        if let Some(k) = keys
            .iter()
            .find(|k| k.len() + TORCH_KEY_PREFIX.len() > MAX_KEY_LEN)
        {
            return Err(refuse(format!(
                "a key of {} bytes exceeds the c10d TCPStore limit of {MAX_KEY_LEN} bytes",
                k.len()
            )));
        }
        if let Some(v) = values.iter().find(|v| v.len() > MAX_VALUE_LEN) {
            return Err(refuse(format!(
                "a value of {} bytes exceeds the c10d TCPStore limit of {MAX_VALUE_LEN} bytes",
                v.len()
            )));
        }
        Ok(())
    }
}

fn wire_key(key: &str) -> String {
    format!("{TORCH_KEY_PREFIX}{key}")
}

/// Opens a connection and runs the handshake, retrying refused connections and connections
/// dropped during the handshake until `timeout` passes.
fn open(addr: &str, timeout: Duration) -> Result<TcpStream, StoreError> {
    let deadline = Instant::now() + timeout;
    let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_secs(1));
    loop {
        let last_error = match open_once(addr, deadline) {
            Ok(stream) => return Ok(stream),
            Err(Attempt::Fatal(e)) => return Err(e),
            Err(Attempt::Retry(why)) => why,
        };
        if Instant::now() >= deadline {
            return Err(StoreError::Connect {
                addr: addr.to_string(),
                timeout,
                last_error,
            });
        }
        backoff.sleep(deadline);
    }
}

enum Attempt {
    /// Worth another try (nobody listening yet, connection reset).
    Retry(String),
    /// The peer is there but is not a c10d store, or did not answer in time.
    Fatal(StoreError),
}

fn open_once(addr: &str, deadline: Instant) -> Result<TcpStream, Attempt> {
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| Attempt::Retry(format!("cannot resolve {addr}: {e}")))?
        .collect();
    let mut last = String::from("no address");
    let mut stream = None;
    for a in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&a, left.max(Duration::from_millis(10))) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = e.to_string(),
        }
    }
    let stream = stream.ok_or(Attempt::Retry(last))?;
    let _ = stream.set_nodelay(true);
    let budget = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_secs(1));
    let mut ex = Exchange {
        stream,
        addr,
        operation: "handshake (validate + ping)",
        round_trip: budget,
    };
    let nonce = nonce();
    let shook = ex.send(&handshake(nonce)).and_then(|()| {
        let mut echo = [0u8; 4];
        ex.read_exact(&mut echo)?;
        check_echo(nonce, echo).map_err(|source| StoreError::Protocol {
            addr: addr.to_string(),
            source,
        })
    });
    match shook {
        Ok(()) => Ok(ex.stream),
        Err(StoreError::Io { source, .. }) => Err(Attempt::Retry(format!(
            "the connection broke during the handshake: {source}"
        ))),
        Err(e) => Err(Attempt::Fatal(e)),
    }
}

/// A nonce for the ping: different per connection, so a reply cannot be a stale echo.
fn nonce() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    nanos ^ std::process::id().rotate_left(16)
}

/// One exchange on a connection: blocking reads and writes, each bounded by a deadline.
struct Exchange<'a> {
    stream: TcpStream,
    addr: &'a str,
    operation: &'a str,
    /// Deadline of every read and write that does not say otherwise.
    round_trip: Duration,
}

impl Exchange<'_> {
    fn error(&self, e: io::Error, budget: Duration) -> StoreError {
        if is_timeout(&e) {
            StoreError::Timeout {
                addr: self.addr.to_string(),
                operation: self.operation.to_string(),
                timeout: budget,
            }
        } else {
            StoreError::Io {
                addr: self.addr.to_string(),
                operation: self.operation.to_string(),
                source: e,
            }
        }
    }

    fn protocol(&self, source: WireError) -> StoreError {
        StoreError::Protocol {
            addr: self.addr.to_string(),
            source,
        }
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        let budget = self.round_trip;
        write_all_by(&mut self.stream, bytes, Instant::now() + budget)
            .map_err(|e| self.error(e, budget))
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), StoreError> {
        let budget = self.round_trip;
        read_exact_by(&mut self.stream, buf, Instant::now() + budget)
            .map_err(|e| self.error(e, budget))
    }

    fn read_u8(&mut self) -> Result<u8, StoreError> {
        let mut b = [0u8; 1];
        self.read_exact(&mut b)?;
        Ok(b[0])
    }

    fn read_i64(&mut self) -> Result<i64, StoreError> {
        let mut b = [0u8; 8];
        self.read_exact(&mut b)?;
        Ok(i64::from_le_bytes(b))
    }

    fn read_bytes(&mut self) -> Result<Vec<u8>, StoreError> {
        let mut header = [0u8; 8];
        self.read_exact(&mut header)?;
        let len = decode_len(header).map_err(|e| self.protocol(e))?;
        let mut value = vec![0u8; len];
        self.read_exact(&mut value)?;
        Ok(value)
    }

    fn read_wait_reply(&mut self) -> Result<WaitReply, StoreError> {
        let b = self.read_u8()?;
        decode_wait(b).map_err(|e| self.protocol(e))
    }

    /// `WAIT` for `keys` (already prefixed) up to `timeout`. On the deadline: `CANCEL_WAIT`,
    /// then the pending replies are read so the stream stays in step. A wait that ended just as
    /// it was cancelled counts as done.
    fn wait(&mut self, keys: &[String], timeout: Duration) -> Result<InStep<()>, StoreError> {
        self.send(&RequestBuf::new(QueryType::Wait).keys(keys).finish())?;
        let mut first = [0u8; 1];
        match read_exact_by(&mut self.stream, &mut first, Instant::now() + timeout) {
            Ok(()) => {
                return match decode_wait(first[0]).map_err(|e| self.protocol(e))? {
                    WaitReply::StopWaiting => Ok(Ok(())),
                    WaitReply::Canceled => Err(self.protocol(WireError::UnknownCode {
                        what: "c10d WAIT reply (a cancel nobody asked for)",
                        code: first[0],
                    })),
                }
            }
            Err(e) if is_timeout(&e) => {}
            Err(e) => return Err(self.error(e, timeout)),
        }
        self.send(&RequestBuf::new(QueryType::CancelWait).finish())?;
        match self.read_wait_reply()? {
            WaitReply::Canceled => Ok(Err(StoreError::Timeout {
                addr: self.addr.to_string(),
                operation: self.operation.to_string(),
                timeout,
            })),
            WaitReply::StopWaiting => match self.read_wait_reply()? {
                WaitReply::Canceled => Ok(Ok(())),
                WaitReply::StopWaiting => Err(self.protocol(WireError::UnknownCode {
                    what: "c10d CANCEL_WAIT reply (a second stop-waiting)",
                    code: 0,
                })),
            },
        }
    }

    fn check(&mut self, keys: &[String]) -> Result<bool, StoreError> {
        self.send(&RequestBuf::new(QueryType::Check).keys(keys).finish())?;
        let b = self.read_u8()?;
        decode_check(b).map_err(|e| self.protocol(e))
    }
}

/// `write_all` that gives up at `deadline` (`TimedOut`).
fn write_all_by(stream: &mut TcpStream, mut buf: &[u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        stream.set_write_timeout(Some(left(deadline)?))?;
        match stream.write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// `read_exact` that gives up at `deadline` (`TimedOut`), however slowly the bytes trickle in.
/// The peer closing the connection mid-way is `UnexpectedEof`.
fn read_exact_by(stream: &mut TcpStream, mut buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        stream.set_read_timeout(Some(left(deadline)?))?;
        match stream.read(buf) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the server closed the connection",
                ))
            }
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Time left until `deadline`, or `TimedOut` when none (a zero socket timeout means "forever").
fn left(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(io::ErrorKind::TimedOut.into())
    } else {
        Ok(left)
    }
}

impl Store for C10dStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let op = format!("set({key:?})");
        self.check_sizes(&op, &[key], &[value])?;
        // `SET` has no reply, so it is followed by a `PING` in the same write: the server
        // handles a connection's requests in order, so the echo means the value is stored and
        // visible to every other client when `set` returns (the contract of [`Store::set`]).
        let nonce = nonce();
        let mut request = RequestBuf::new(QueryType::Set)
            .bytes(wire_key(key).as_bytes())
            .bytes(value)
            .finish();
        request.extend(RequestBuf::new(QueryType::Ping).u32(nonce).finish());
        self.exchange(&op, |c| {
            c.send(&request)?;
            let mut echo = [0u8; 4];
            c.read_exact(&mut echo)?;
            check_echo(nonce, echo).map_err(|e| c.protocol(e))?;
            Ok(Ok(()))
        })
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        // The server's GET does not wait (an absent key reads as empty), so wait first, as
        // torch's client does.
        let op = format!("get({key:?})");
        self.check_sizes(&op, &[key], &[])?;
        let keys = [wire_key(key)];
        self.exchange(&op, |c| {
            if let Err(e) = c.wait(&keys, timeout)? {
                return Ok(Err(e));
            }
            c.send(
                &RequestBuf::new(QueryType::Get)
                    .bytes(keys[0].as_bytes())
                    .finish(),
            )?;
            Ok(Ok(c.read_bytes()?))
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        // Torch's server adds to the decimal text stored under the key and closes the connection
        // when that is not a number: that surfaces here as a lost connection.
        let op = format!("add({key:?})");
        self.check_sizes(&op, &[key], &[])?;
        let request = RequestBuf::new(QueryType::Add)
            .bytes(wire_key(key).as_bytes())
            .i64(delta)
            .finish();
        self.exchange(&op, |c| {
            c.send(&request)?;
            Ok(Ok(c.read_i64()?))
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        if keys.is_empty() {
            return Ok(());
        }
        let op = format!("wait({keys:?})");
        self.check_sizes(&op, keys, &[])?;
        let wire: Vec<String> = keys.iter().map(|k| wire_key(k)).collect();
        self.exchange(&op, |c| {
            let Err(timed_out) = c.wait(&wire, timeout)? else {
                return Ok(Ok(()));
            };
            if keys.len() > MAX_KEYS_NAMED {
                return Ok(Err(timed_out));
            }
            // Name the keys still missing, as our own server does.
            let mut missing = Vec::new();
            for (key, w) in keys.iter().zip(&wire) {
                if !c.check(std::slice::from_ref(w))? {
                    missing.push(*key);
                }
            }
            Ok(Err(StoreError::Timeout {
                addr: self.addr.clone(),
                operation: format!("{op} (missing: {})", missing.join(", ")),
                timeout,
            }))
        })
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        if keys.is_empty() {
            return Ok(true);
        }
        let op = format!("check({keys:?})");
        self.check_sizes(&op, keys, &[])?;
        let wire: Vec<String> = keys.iter().map(|k| wire_key(k)).collect();
        self.exchange(&op, |c| Ok(Ok(c.check(&wire)?)))
    }

    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        let op = format!("delete({key:?})");
        self.check_sizes(&op, &[key], &[])?;
        let request = RequestBuf::new(QueryType::DeleteKey)
            .bytes(wire_key(key).as_bytes())
            .finish();
        self.exchange(&op, |c| {
            c.send(&request)?;
            Ok(Ok(c.read_i64()? > 0))
        })
    }
}

impl std::fmt::Debug for C10dStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("C10dStore")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}
