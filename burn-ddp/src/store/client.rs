//! [`TcpStore`]: the client side of the rendezvous store.

use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::backoff::Backoff;
use super::connection::{is_timeout, read_frame, write_frame, FrameError};
use super::contract::Store;
use super::wire::{decode_response, encode_request, Request, Response, MAGIC};
use crate::error::StoreError;

/// Extra time the client waits for the server's answer beyond the server-side timeout of a
/// blocking request, so the server's "timed out" answer (which names the missing keys) arrives
/// before the socket's own timeout fires.
const ANSWER_SLACK: Duration = Duration::from_secs(5);

/// A connection to a [`super::TcpStoreServer`]. Thread-safe: requests are serialised on one
/// connection; a request the server may hold (a wait) lets the requests already waiting for
/// the connection go first, so a heartbeat beaten through it is never starved by a loop of
/// waits (a group's set-up waits in one-second slices).
pub struct TcpStore {
    addr: String,
    stream: Mutex<TcpStream>,
    /// Requests waiting for `stream` now.
    queued: AtomicUsize,
    /// Deadline for the round trip of non-waiting requests.
    timeout: Duration,
}

impl TcpStore {
    /// Connects to `addr` (`host:port`), retrying with capped back-off until `connect_timeout`
    /// passes (rank 0 may start after the others), then sends the hello with `token`.
    pub fn connect(addr: &str, token: &str, connect_timeout: Duration) -> Result<Self, StoreError> {
        let deadline = Instant::now() + connect_timeout;
        let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_secs(1));
        let stream = loop {
            let last_error = match resolve(addr) {
                Ok(addrs) => {
                    let mut last = String::from("no address");
                    let mut connected = None;
                    for a in addrs {
                        let left = deadline.saturating_duration_since(Instant::now());
                        match TcpStream::connect_timeout(&a, left.max(Duration::from_millis(10))) {
                            Ok(s) => {
                                connected = Some(s);
                                break;
                            }
                            Err(e) => last = e.to_string(),
                        }
                    }
                    match connected {
                        Some(s) => break s,
                        None => last,
                    }
                }
                Err(e) => e,
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(StoreError::Connect {
                    addr: addr.to_string(),
                    timeout: connect_timeout,
                    last_error,
                });
            }
            backoff.sleep(deadline);
        };
        let _ = stream.set_nodelay(true);
        let store = Self {
            addr: addr.to_string(),
            stream: Mutex::new(stream),
            queued: AtomicUsize::new(0),
            timeout: connect_timeout.max(Duration::from_secs(1)),
        };
        match store.request(
            &Request::Hello {
                magic: MAGIC,
                token: token.to_string(),
            },
            "hello",
            Duration::ZERO,
        )? {
            Response::Ok => Ok(store),
            other => Err(store.unexpected("hello", other)),
        }
    }

    /// The server's address as given.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// This end's IP address on the connection to the server: the interface that routes to
    /// rank 0, which is what the other ranks can reach too (used to publish ring addresses).
    pub fn local_ip(&self) -> Option<IpAddr> {
        let stream = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        stream.local_addr().ok().map(|a| a.ip())
    }

    /// Sends one request and reads its answer. `wait` is how long the server may block on it.
    fn request(
        &self,
        request: &Request,
        operation: &str,
        wait: Duration,
    ) -> Result<Response, StoreError> {
        let io_err = |source| StoreError::Io {
            addr: self.addr.clone(),
            operation: operation.to_string(),
            source,
        };
        let mut stream = self.take_turn(!wait.is_zero());
        let round_trip = self.timeout
            + wait
            + if wait.is_zero() {
                Duration::ZERO
            } else {
                ANSWER_SLACK
            };
        stream.set_read_timeout(Some(round_trip)).map_err(io_err)?;
        stream
            .set_write_timeout(Some(self.timeout))
            .map_err(io_err)?;
        write_frame(&mut stream, &encode_request(request)).map_err(io_err)?;
        let payload = match read_frame(&mut stream) {
            Ok(p) => p,
            Err(FrameError::Io(e)) if is_timeout(&e) => {
                return Err(StoreError::Timeout {
                    addr: self.addr.clone(),
                    operation: operation.to_string(),
                    timeout: round_trip,
                })
            }
            Err(FrameError::Io(e)) => return Err(io_err(e)),
            Err(FrameError::Wire(source)) => {
                return Err(StoreError::Protocol {
                    addr: self.addr.clone(),
                    source,
                })
            }
        };
        match decode_response(&payload) {
            Ok(Response::Error(message)) => Err(StoreError::Refused {
                addr: self.addr.clone(),
                operation: operation.to_string(),
                message,
            }),
            Ok(Response::TimedOut { missing }) => Err(StoreError::Timeout {
                addr: self.addr.clone(),
                operation: format!("{operation} (missing: {})", missing.join(", ")),
                timeout: wait,
            }),
            Ok(r) => Ok(r),
            Err(source) => Err(StoreError::Protocol {
                addr: self.addr.clone(),
                source,
            }),
        }
    }

    /// The connection, for one request. std's mutex is not fair: a thread that releases it and
    /// asks again at once (a loop of server-side waits) may take it every time, so a request
    /// that may be held (`blocking`) first lets those already queued go; they only ever wait
    /// for a request in flight, so this wait is short.
    fn take_turn(&self, blocking: bool) -> std::sync::MutexGuard<'_, TcpStream> {
        if blocking {
            while self.queued.load(Ordering::Acquire) > 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        self.queued.fetch_add(1, Ordering::AcqRel);
        let stream = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        self.queued.fetch_sub(1, Ordering::AcqRel);
        stream
    }

    fn unexpected(&self, operation: &str, response: Response) -> StoreError {
        StoreError::Refused {
            addr: self.addr.clone(),
            operation: operation.to_string(),
            message: format!("unexpected answer {response:?}"),
        }
    }
}

fn resolve(addr: &str) -> Result<Vec<SocketAddr>, String> {
    addr.to_socket_addrs()
        .map(|a| a.collect())
        .map_err(|e| format!("cannot resolve {addr}: {e}"))
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let op = format!("set({key:?})");
        let req = Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        };
        match self.request(&req, &op, Duration::ZERO)? {
            Response::Ok => Ok(()),
            other => Err(self.unexpected(&op, other)),
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, StoreError> {
        let op = format!("get({key:?})");
        let req = Request::Get {
            key: key.to_string(),
            timeout,
        };
        match self.request(&req, &op, timeout)? {
            Response::Value(v) => Ok(v),
            other => Err(self.unexpected(&op, other)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        let op = format!("add({key:?})");
        let req = Request::Add {
            key: key.to_string(),
            delta,
        };
        match self.request(&req, &op, Duration::ZERO)? {
            Response::Counter(v) => Ok(v),
            other => Err(self.unexpected(&op, other)),
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let op = format!("wait({keys:?})");
        let req = Request::Wait {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            timeout,
        };
        match self.request(&req, &op, timeout)? {
            Response::Ok => Ok(()),
            other => Err(self.unexpected(&op, other)),
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let op = format!("check({keys:?})");
        let req = Request::Check {
            keys: keys.iter().map(|k| k.to_string()).collect(),
        };
        match self.request(&req, &op, Duration::ZERO)? {
            Response::Bool(b) => Ok(b),
            other => Err(self.unexpected(&op, other)),
        }
    }

    fn delete_key(&self, key: &str) -> Result<bool, StoreError> {
        let op = format!("delete({key:?})");
        let req = Request::Delete {
            key: key.to_string(),
        };
        match self.request(&req, &op, Duration::ZERO)? {
            Response::Bool(b) => Ok(b),
            other => Err(self.unexpected(&op, other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::TcpStoreServer;
    use std::io::{Read, Write};
    use std::sync::Arc;

    #[test]
    fn tcp_store_conformance() {
        // The servers live until the end of the test, after every client is done.
        let servers = std::cell::RefCell::new(Vec::new());
        crate::store::conformance::run_all(|| {
            let server = TcpStoreServer::bind("127.0.0.1:0", "t").unwrap();
            let addr = server.local_addr().to_string();
            servers.borrow_mut().push(server);
            let a = TcpStore::connect(&addr, "t", Duration::from_secs(10)).unwrap();
            let b = TcpStore::connect(&addr, "t", Duration::from_secs(10)).unwrap();
            (Arc::new(a), Arc::new(b))
        });
    }

    #[test]
    fn wrong_token_and_garbage_are_refused_and_the_store_goes_on() {
        let server = TcpStoreServer::bind("127.0.0.1:0", "secret").unwrap();
        let addr = server.local_addr().to_string();
        let err = TcpStore::connect(&addr, "guess", Duration::from_secs(5))
            .err()
            .expect("a wrong token must be refused");
        assert!(err.to_string().contains("token"), "{err}");

        let mut raw = TcpStream::connect(&addr).unwrap();
        raw.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut answer = Vec::new();
        let _ = raw.read_to_end(&mut answer); // the server answers with an error and closes

        let good = TcpStore::connect(&addr, "secret", Duration::from_secs(5)).unwrap();
        good.set("k", b"v").unwrap();
        assert_eq!(good.get("k", Duration::from_secs(1)).unwrap(), b"v");
    }

    use crate::testing::ClosedPort;

    #[test]
    fn unreachable_server_times_out_with_the_address() {
        // Held (bound, not listening) until the end of the test: nobody can listen there.
        let closed = ClosedPort::new();
        let addr = format!("127.0.0.1:{}", closed.port);
        let err = TcpStore::connect(&addr, "", Duration::from_millis(300))
            .err()
            .expect("nobody listens there");
        assert!(matches!(err, StoreError::Connect { .. }), "{err}");
        assert!(err.to_string().contains(&addr), "{err}");
        assert!(err.to_string().contains("refused"), "{err}");
        drop(closed);
    }

    #[test]
    fn port_in_use_is_a_bind_error() {
        let first = TcpStoreServer::bind("127.0.0.1:0", "").unwrap();
        let err = TcpStoreServer::bind(&first.local_addr().to_string(), "")
            .err()
            .expect("the port is taken");
        assert!(matches!(err, StoreError::Bind { .. }), "{err}");
        assert!(err.to_string().contains("MASTER_PORT"), "{err}");
    }
}
