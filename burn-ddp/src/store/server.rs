//! [`TcpStoreServer`]: a [`MemoryStore`] served over TCP, one thread per connected rank.
//!
//! Hosted by rank 0 (or by the `trainer` launcher on the first node) at `MASTER_ADDR:MASTER_PORT`.
//! A connection must open with a `Hello` carrying the protocol magic and the job's token; anything
//! else is answered with an error, logged with the peer's address, and closed — the job goes on.
//! Dropping the server closes the listener and every connection and joins every thread.

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::connection::{read_frame, write_frame, FrameError};
use super::contract::Store;
use super::memory::{MemoryStore, WaitOutcome};
use super::wire::{decode_request, encode_response, Request, Response, MAGIC};
use crate::error::StoreError;

/// How long a new connection may take to send its hello before it is dropped, so a silent
/// stranger cannot hold a thread forever.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// The store server. See the module docs.
pub struct TcpStoreServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    accept_thread: Option<JoinHandle<()>>,
}

struct Shared {
    store: MemoryStore,
    token: String,
    shutdown: AtomicBool,
    next_id: AtomicU64,
    /// Clones of the open connections, so shutdown can unblock their threads.
    connections: Mutex<HashMap<u64, TcpStream>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl TcpStoreServer {
    /// Binds `bind_addr` (`host:port`; port 0 picks a free one) and starts serving.
    ///
    /// Only clients whose hello carries `token` are served (an empty token admits any client of
    /// this protocol).
    pub fn bind(bind_addr: &str, token: &str) -> Result<Self, StoreError> {
        let listener = TcpListener::bind(bind_addr).map_err(|source| StoreError::Bind {
            addr: bind_addr.to_string(),
            source,
        })?;
        let local_addr = listener.local_addr().map_err(|source| StoreError::Bind {
            addr: bind_addr.to_string(),
            source,
        })?;
        let shared = Arc::new(Shared {
            store: MemoryStore::new(),
            token: token.to_string(),
            shutdown: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            connections: Mutex::new(HashMap::new()),
            workers: Mutex::new(Vec::new()),
        });
        let accept_shared = shared.clone();
        let accept_thread = std::thread::Builder::new()
            .name("ddp-store-accept".into())
            .spawn(move || accept_loop(listener, accept_shared))
            .map_err(|source| StoreError::Bind {
                addr: bind_addr.to_string(),
                source,
            })?;
        tracing::debug!(%local_addr, "rendezvous store listening");
        Ok(Self {
            local_addr,
            shared,
            accept_thread: Some(accept_thread),
        })
    }

    /// The address actually bound (with the OS-chosen port when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.store.close();
        // Wake the blocking accept() with a connection of our own; it sees the flag and returns.
        let wake_addr = match self.local_addr {
            SocketAddr::V4(a) if a.ip().is_unspecified() => {
                SocketAddr::from(([127, 0, 0, 1], a.port()))
            }
            SocketAddr::V6(a) if a.ip().is_unspecified() => {
                SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, a.port()))
            }
            other => other,
        };
        let _ = TcpStream::connect_timeout(&wake_addr, Duration::from_secs(1));
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
        for (_, conn) in lock(&self.shared.connections).drain() {
            let _ = conn.shutdown(Shutdown::Both);
        }
        let workers: Vec<_> = lock(&self.shared.workers).drain(..).collect();
        for w in workers {
            let _ = w.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("rendezvous store: accept failed: {e}");
                continue;
            }
        };
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        if let Ok(clone) = stream.try_clone() {
            lock(&shared.connections).insert(id, clone);
        }
        let conn_shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("ddp-store-conn-{id}"))
            .spawn(move || {
                serve_connection(stream, &conn_shared);
                lock(&conn_shared.connections).remove(&id);
            });
        match spawned {
            Ok(handle) => {
                let mut workers = lock(&shared.workers);
                workers.retain(|h| !h.is_finished());
                workers.push(handle);
            }
            Err(e) => tracing::warn!("rendezvous store: cannot start a connection thread: {e}"),
        }
    }
}

fn serve_connection(mut stream: TcpStream, shared: &Shared) {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "unknown peer".into());
    let _ = stream.set_nodelay(true);
    if let Err(reason) = handshake(&mut stream, shared) {
        if !shared.shutdown.load(Ordering::SeqCst) {
            tracing::warn!("rendezvous store: refused connection from {peer}: {reason}");
            let _ = write_frame(&mut stream, &encode_response(&Response::Error(reason)));
        }
        return;
    }
    loop {
        let payload = match read_frame(&mut stream) {
            Ok(p) => p,
            Err(FrameError::Io(_)) => return, // client gone (normal at the end of a job)
            Err(FrameError::Wire(e)) => {
                tracing::warn!("rendezvous store: closing connection from {peer}: {e}");
                let _ = write_frame(
                    &mut stream,
                    &encode_response(&Response::Error(e.to_string())),
                );
                return;
            }
        };
        let response = match decode_request(&payload) {
            Ok(request) => handle(request, shared),
            Err(e) => {
                tracing::warn!("rendezvous store: closing connection from {peer}: {e}");
                let _ = write_frame(
                    &mut stream,
                    &encode_response(&Response::Error(e.to_string())),
                );
                return;
            }
        };
        if write_frame(&mut stream, &encode_response(&response)).is_err() {
            return;
        }
    }
}

/// Checks the first frame: the protocol magic and the job token.
fn handshake(stream: &mut TcpStream, shared: &Shared) -> Result<(), String> {
    stream
        .set_read_timeout(Some(HELLO_TIMEOUT))
        .map_err(|e| e.to_string())?;
    let payload = read_frame(stream).map_err(|e| match e {
        FrameError::Io(e) => format!("no hello within {HELLO_TIMEOUT:?}: {e}"),
        FrameError::Wire(e) => e.to_string(),
    })?;
    match decode_request(&payload).map_err(|e| e.to_string())? {
        Request::Hello { magic, .. } if magic != MAGIC => {
            Err(format!("bad protocol magic {magic:#x}"))
        }
        Request::Hello { token, .. } if token != shared.token => {
            Err("wrong job token (is this rank part of another job?): every launcher of a multi-node job must share one BURN_DDP_TOKEN (without it each draws its own): set the same BURN_DDP_TOKEN=<secret> in each node's environment".into())
        }
        Request::Hello { .. } => {
            stream.set_read_timeout(None).map_err(|e| e.to_string())?;
            write_frame(stream, &encode_response(&Response::Ok)).map_err(|e| e.to_string())
        }
        other => Err(format!("expected a hello, got {other:?}")),
    }
}

fn handle(request: Request, shared: &Shared) -> Response {
    let store = &shared.store;
    let timed_out = |outcome: WaitOutcome| match outcome {
        WaitOutcome::TimedOut { missing } => Response::TimedOut { missing },
        WaitOutcome::Closed => Response::Error("the store is shutting down".into()),
    };
    match request {
        Request::Hello { .. } => Response::Error("hello sent twice".into()),
        Request::Set { key, value } => match store.set(&key, &value) {
            Ok(()) => Response::Ok,
            Err(e) => Response::Error(e.to_string()),
        },
        Request::Get { key, timeout } => match store.wait_for(&[&key], timeout) {
            Ok(map) => Response::Value(map.get(&key).cloned().unwrap_or_default()),
            Err(outcome) => timed_out(outcome),
        },
        Request::Add { key, delta } => match store.add_counter(&key, delta) {
            Ok(v) => Response::Counter(v),
            Err(message) => Response::Error(message),
        },
        Request::Wait { keys, timeout } => {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            match store.wait_for(&keys, timeout) {
                Ok(_) => Response::Ok,
                Err(outcome) => timed_out(outcome),
            }
        }
        Request::Check { keys } => {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            match store.check(&keys) {
                Ok(b) => Response::Bool(b),
                Err(e) => Response::Error(e.to_string()),
            }
        }
        Request::Delete { key } => match store.delete_key(&key) {
            Ok(b) => Response::Bool(b),
            Err(e) => Response::Error(e.to_string()),
        },
    }
}
