//! [`C10dStore`] against the real thing: PyTorch's `TCPStore` server (libuv and classic
//! backends) in a Python process named by `TORCH_PYTHON`, plus peers that are not a c10d store.
//! Without `TORCH_PYTHON` the tests that need torch record a skip ([`crate::testing::skip`]).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::C10dStore;
use crate::error::StoreError;
use crate::store::{PrefixStore, Store, TcpStoreServer};
use crate::testing::{skip, Needs};

/// The Python side: hosts two servers (libuv, classic), prints their ports, then runs
/// `set PORT KEY HEXVALUE` / `get PORT KEY` / `add PORT KEY N` lines from stdin as a torch
/// client, answering `ok [HEX|N]` or `err MESSAGE`. It exits when stdin closes (the test binary
/// is gone), so no server outlives the tests.
const SERVER_PY: &str = r#"
import sys, datetime
import torch.distributed as d
libuv = d.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, use_libuv=True)
classic = d.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, use_libuv=False)
print(libuv.port, classic.port, flush=True)
clients = {}
for line in sys.stdin:
    op, port, key, *arg = line.split()
    try:
        c = clients.get(port) or clients.setdefault(port, d.TCPStore(
            "127.0.0.1", int(port), None, False, timeout=datetime.timedelta(seconds=5),
            wait_for_workers=False))
        if op == "set":
            c.set(key, bytes.fromhex(arg[0])); out = "ok"
        elif op == "get":
            out = "ok " + c.get(key).hex()
        elif op == "add":
            out = "ok %d" % c.add(key, int(arg[0]))
        else:
            out = "err unknown op " + op
    except Exception as e:
        out = "err " + str(e).replace("\n", " ")
    print(out, flush=True)
"#;

struct TorchServers {
    libuv: u16,
    classic: u16,
    io: Mutex<(ChildStdin, BufReader<ChildStdout>)>,
    _child: Child,
}

impl TorchServers {
    /// Runs one line of [`SERVER_PY`]'s client protocol; the answer after `ok `.
    fn python(&self, line: &str) -> Result<String, String> {
        let mut io = self.io.lock().unwrap_or_else(|p| p.into_inner());
        writeln!(io.0, "{line}").unwrap();
        let mut answer = String::new();
        io.1.read_line(&mut answer).unwrap();
        let answer = answer.trim_end();
        match answer.strip_prefix("ok") {
            Some(rest) => Ok(rest.trim().to_string()),
            None => Err(answer.to_string()),
        }
    }
}

/// The shared Python process, started by the first test that needs it; `None` (after recording
/// the skip) without `TORCH_PYTHON`.
fn torch() -> Option<&'static TorchServers> {
    static SERVERS: OnceLock<Option<TorchServers>> = OnceLock::new();
    let Ok(python) = std::env::var("TORCH_PYTHON") else {
        skip(
            Needs::Torch,
            "TORCH_PYTHON (a Python with torch) is not set: no real c10d TCPStore to test against",
        );
        return None;
    };
    let servers = SERVERS.get_or_init(|| {
        let mut child = Command::new(&python)
            .args(["-W", "ignore", "-c", SERVER_PY])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run TORCH_PYTHON={python}: {e}"));
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        // The ports, with a deadline: importing torch takes seconds, not minutes.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = stdout.read_line(&mut line);
            let _ = tx.send((line, stdout));
        });
        let (line, stdout) = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the torch server did not print its ports within 120 s");
        let ports: Vec<u16> = line
            .split_whitespace()
            .map(|p| p.parse().unwrap())
            .collect();
        assert_eq!(ports.len(), 2, "unexpected first line {line:?}");
        Some(TorchServers {
            libuv: ports[0],
            classic: ports[1],
            io: Mutex::new((stdin, stdout)),
            _child: child,
        })
    });
    servers.as_ref()
}

fn addr(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

/// A namespace of the shared server no other test uses.
fn fresh(name: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("{name}-{}", N.fetch_add(1, Ordering::Relaxed))
}

#[test]
fn c10d_store_conformance_against_torch() {
    let Some(servers) = torch() else { return };
    for port in [servers.libuv, servers.classic] {
        crate::store::conformance::run_all(|| {
            let a = C10dStore::connect(&addr(port), Duration::from_secs(10)).unwrap();
            let b = C10dStore::connect(&addr(port), Duration::from_secs(10)).unwrap();
            let ns = fresh("conformance");
            (
                Arc::new(PrefixStore::new(ns.clone(), Arc::new(a))),
                Arc::new(PrefixStore::new(ns, Arc::new(b))),
            )
        });
    }
}

#[test]
fn get_of_a_missing_key_times_out_on_time_and_the_connection_goes_on() {
    let Some(servers) = torch() else { return };
    for port in [servers.libuv, servers.classic] {
        let s = C10dStore::connect(&addr(port), Duration::from_secs(10)).unwrap();
        let key = fresh("missing");
        let start = Instant::now();
        let err = s.get(&key, Duration::from_millis(300)).unwrap_err();
        let took = start.elapsed();
        assert!(matches!(err, StoreError::Timeout { .. }), "{err}");
        assert!(err.to_string().contains(&key), "{err}");
        assert!(took >= Duration::from_millis(300), "{took:?}");
        assert!(took < Duration::from_secs(3), "{took:?}");
        // The cancelled wait left the stream in step: the same connection still works.
        s.set(&key, b"now").unwrap();
        assert_eq!(s.get(&key, Duration::from_secs(5)).unwrap(), b"now");
        let err = s.wait(&[&key, "absent-a"], Duration::from_millis(100));
        let err = err.unwrap_err().to_string();
        assert!(err.contains("missing: absent-a"), "{err}");
    }
}

#[test]
fn compare_set_and_counters_follow_torch() {
    let Some(servers) = torch() else { return };
    let s = C10dStore::connect(&addr(servers.libuv), Duration::from_secs(10)).unwrap();
    let k = fresh("cas");
    // Absent key, empty expectation: set.
    assert_eq!(s.compare_set(&k, b"", b"a").unwrap(), b"a");
    // Wrong expectation: unchanged, the current value comes back.
    assert_eq!(s.compare_set(&k, b"x", b"b").unwrap(), b"a");
    assert_eq!(s.compare_set(&k, b"a", b"b").unwrap(), b"b");
    assert_eq!(s.get(&k, Duration::from_secs(1)).unwrap(), b"b");
    // Counters are decimal text, as our own store keeps them.
    let n = fresh("n");
    assert_eq!(s.add(&n, 3).unwrap(), 3);
    assert_eq!(s.get(&n, Duration::from_secs(1)).unwrap(), b"3");
    // A value that is not a number makes the server drop the connection: a clear error, and
    // the next call reconnects.
    s.set(&k, b"not a number").unwrap();
    let err = s.add(&k, 1).unwrap_err();
    assert!(err.to_string().contains("add"), "{err}");
    assert_eq!(s.add(&n, -4).unwrap(), -1);
}

#[test]
fn python_clients_read_ours_and_we_read_theirs() {
    let Some(servers) = torch() else { return };
    for port in [servers.libuv, servers.classic] {
        let s = C10dStore::connect(&addr(port), Duration::from_secs(10)).unwrap();
        let ours = fresh("ours");
        s.set(&ours, b"\x00from rust").unwrap();
        assert_eq!(
            servers.python(&format!("get {port} {ours}")).unwrap(),
            "0066726f6d2072757374"
        );
        let theirs = fresh("theirs");
        servers
            .python(&format!("set {port} {theirs} 707974686f6e"))
            .unwrap();
        assert_eq!(s.get(&theirs, Duration::from_secs(5)).unwrap(), b"python");
        let n = fresh("count");
        assert_eq!(servers.python(&format!("add {port} {n} 2")).unwrap(), "2");
        assert_eq!(s.add(&n, 5).unwrap(), 7);
        assert_eq!(servers.python(&format!("add {port} {n} 0")).unwrap(), "7");
        assert!(s.check(&[&ours, &theirs, &n]).unwrap());
        assert!(s.delete_key(&ours).unwrap());
        assert!(!s.delete_key(&ours).unwrap());
    }
}

#[test]
fn keys_and_values_the_server_would_refuse_are_refused_here() {
    let Some(servers) = torch() else { return };
    let s = C10dStore::connect(&addr(servers.libuv), Duration::from_secs(10)).unwrap();
    let long_key = "k".repeat(super::wire::MAX_KEY_LEN);
    let err = s.set(&long_key, b"").unwrap_err();
    assert!(matches!(err, StoreError::Refused { .. }), "{err}");
    let big = vec![0u8; super::wire::MAX_VALUE_LEN + 1];
    let err = s.set("big", &big).unwrap_err();
    assert!(err.to_string().contains("limit"), "{err}");
    s.set("small", b"fine").unwrap();
}

/// A listener that answers every connection with `answer` (after reading what the client
/// sends), then keeps it open until the test ends.
fn fake_server(answer: &'static [u8]) -> (String, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let handle = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut hello = [0u8; 10];
        let _ = conn.read_exact(&mut hello);
        let _ = conn.write_all(answer);
        let mut rest = Vec::new();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let _ = conn.read_to_end(&mut rest);
    });
    (addr, handle)
}

#[test]
fn a_peer_answering_garbage_is_a_protocol_error_at_once() {
    let (addr, server) = fake_server(b"HTTP/1.1 400 Bad Request\r\n\r\n");
    let start = Instant::now();
    let err = C10dStore::connect(&addr, Duration::from_secs(30)).unwrap_err();
    assert!(matches!(err, StoreError::Protocol { .. }), "{err}");
    assert!(err.to_string().contains("does not speak"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(5));
    drop(server);
}

#[test]
fn a_silent_peer_times_out_within_the_deadline() {
    let (addr, server) = fake_server(b"");
    let start = Instant::now();
    let err = C10dStore::connect(&addr, Duration::from_millis(1500)).unwrap_err();
    let took = start.elapsed();
    assert!(matches!(err, StoreError::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("handshake"), "{err}");
    assert!(took < Duration::from_secs(4), "{took:?}");
    drop(server);
}

#[test]
fn our_own_store_is_not_mistaken_for_a_c10d_one() {
    // Pointing the c10d client at a burn-ddp store (a launcher variable mix-up) says so.
    let server = TcpStoreServer::bind("127.0.0.1:0", "t").unwrap();
    let start = Instant::now();
    let err =
        C10dStore::connect(&server.local_addr().to_string(), Duration::from_secs(3)).unwrap_err();
    assert!(matches!(err, StoreError::Protocol { .. }), "{err}");
    assert!(err.to_string().contains("does not speak"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[test]
fn a_server_that_dies_mid_reply_is_a_lost_connection() {
    // Echoes the handshake's nonce, then answers a GET with a length and too few bytes.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut hello = [0u8; 10];
        conn.read_exact(&mut hello).unwrap();
        conn.write_all(&hello[6..10]).unwrap();
        let mut wait = [0u8; 1 + 8 + 8 + 2];
        conn.read_exact(&mut wait).unwrap(); // WAIT, 1 key, "/k"
        conn.write_all(&[0]).unwrap(); // stop waiting
        let mut get = [0u8; 1 + 8 + 2];
        conn.read_exact(&mut get).unwrap();
        conn.write_all(&100u64.to_le_bytes()).unwrap();
        conn.write_all(b"short").unwrap();
    });
    let s = C10dStore::connect(&addr, Duration::from_secs(1)).unwrap();
    let err = s.get("k", Duration::from_secs(5)).unwrap_err();
    assert!(matches!(err, StoreError::Io { .. }), "{err}");
    assert!(err.to_string().contains("get(\"k\")"), "{err}");
    server.join().unwrap();
    // Nobody listens any more: the reconnect fails with the address, within the client's
    // round-trip timeout (1 s).
    let start = Instant::now();
    let err = s.set("k", b"v").unwrap_err();
    assert!(matches!(err, StoreError::Connect { .. }), "{err}");
    assert!(err.to_string().contains(&addr), "{err}");
    assert!(start.elapsed() < Duration::from_secs(4));
}

#[test]
fn a_huge_length_is_refused_before_allocating() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut hello = [0u8; 10];
        conn.read_exact(&mut hello).unwrap();
        conn.write_all(&hello[6..10]).unwrap();
        let mut cas = [0u8; 1 + 8 + 2 + 8 + 8];
        conn.read_exact(&mut cas).unwrap(); // COMPARE_SET "/k", "", ""
        conn.write_all(&u64::MAX.to_le_bytes()).unwrap();
        let _ = TcpStream::shutdown(&conn, std::net::Shutdown::Write);
    });
    let s = C10dStore::connect(&addr, Duration::from_secs(5)).unwrap();
    let err = s.compare_set("k", b"", b"").unwrap_err();
    assert!(matches!(err, StoreError::Protocol { .. }), "{err}");
    assert!(err.to_string().contains("exceeds"), "{err}");
    server.join().unwrap();
}
