//! [`TcpProcessGroup`]: the ring collectives over TCP.
//!
//! # Set-up (through the store)
//! 1. Each rank claims its rank number (`add`; a second claim is an error: two processes were
//!    given the same `RANK`), publishes its world size and checks it against rank 0's.
//! 2. Each rank listens on an OS-chosen port on the address that routes to the store, publishes
//!    `ip:port`, and waits (with the group timeout) until every rank has published; a rank that
//!    never arrives is named in the error. A rank that fails here publishes `pg/abort`, so the
//!    others stop at once instead of waiting out the timeout.
//! 3. Each rank connects to its successor and sends a hello (rank, world size, job token), and
//!    accepts its predecessor's connection; connections with a wrong hello are refused and
//!    logged, and the rank keeps waiting for the right one.
//! 4. A barrier over the new ring proves that every link works.
//!
//! # One collective
//! All I/O is non-blocking and driven by one thread with `poll(2)`: the rank writes the
//! collective's header to both neighbours, then streams pieces to its successor as the plan
//! ([`super::ring`]) allows while it receives and reduces pieces from its predecessor. One thread
//! per rank keeps the two cores of a small machine for two ranks' copies and reductions instead of
//! four threads contending for them. Received headers are checked before any data is used.
//!
//! # Same-host neighbours: shared memory
//! When a neighbour runs on the same host (same kernel and network namespace, see
//! [`shm::host_identity`]), the data of that link goes through a shared-memory ring buffer
//! ([`super::shm`]) instead of the socket: no copies into and out of the kernel, no TCP stack.
//! The TCP connection stays for the set-up, the per-collective headers (so mismatch checks are
//! the same) and as the other half of liveness. `TcpGroupOptions::shared_memory = false` (or
//! `BURN_DDP_SHM=0`) keeps everything on TCP.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ring::{self, RecvAction, RingPlan};
use super::shm::{self, ShmDir, ShmReceiver, ShmSender};
use super::wire::{self, RingHello, HEADER_LEN, HELLO_FIXED_LEN};
use super::{check, CallLog, CollectiveDesc, CollectiveKind, Element, ProcessGroup, ReduceOp};
use crate::error::{CollectiveError, StoreError};
use crate::store::Store;

/// Settings of a [`TcpProcessGroup`]. Every rank should use the same values.
#[derive(Debug, Clone)]
pub struct TcpGroupOptions {
    /// Deadline of set-up and of each collective (PyTorch's default is 30 min for NCCL; 5 min
    /// here: a collective on a CPU ring that takes longer than that has a dead peer).
    pub timeout: Duration,
    /// After this long without finishing a collective, log who has not arrived (Horovod's stall
    /// warning, 60 s). Repeats every such interval until the timeout.
    pub stall_warning: Duration,
    /// Bytes per pipelined piece; smaller pieces overlap more, larger ones cost fewer syscalls.
    pub piece_bytes: usize,
    /// The job's shared secret; ring connections without it are refused.
    pub token: String,
    /// The address to listen on and publish for ring connections. `None`: loopback.
    pub advertise_ip: Option<IpAddr>,
    /// Move data to neighbours on the same host through shared memory (module docs). Default:
    /// on, unless the environment variable `BURN_DDP_SHM` is `0`.
    pub shared_memory: bool,
}

impl Default for TcpGroupOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(300),
            stall_warning: Duration::from_secs(60),
            piece_bytes: 1 << 20,
            token: String::new(),
            advertise_ip: None,
            shared_memory: std::env::var("BURN_DDP_SHM").map_or(true, |v| v != "0"),
        }
    }
}

/// A non-blocking connection to a ring neighbour.
struct Link {
    stream: TcpStream,
    peer: usize,
    peer_addr: String,
}

impl Link {
    fn fd(&self) -> libc::c_int {
        self.stream.as_raw_fd()
    }
}

/// The ring's two connections: to the successor (data goes out) and from the predecessor
/// (data comes in). Each also carries one header the other way per collective. A neighbour on
/// this host gets the data through shared memory instead of its socket.
struct Ring {
    next: Link,
    prev: Link,
    next_shm: Option<ShmSender>,
    prev_shm: Option<ShmReceiver>,
}

/// This rank's shared-memory ends, made before the neighbours are known.
struct ShmSetup {
    dir: ShmDir,
    receiver: ShmReceiver,
    sender: ShmSender,
}

/// A process group whose collectives run over a TCP ring. See the module docs.
pub struct TcpProcessGroup {
    rank: usize,
    world_size: usize,
    store: Arc<dyn Store>,
    ring: Option<Ring>,
    options: TcpGroupOptions,
    calls: CallLog,
    /// Receive buffer for pieces that are reduced (u64 words so any element type is aligned).
    scratch: Vec<u64>,
}

/// What a rank publishes under `pg/shm/{rank}`: its host identity and shared-memory directory.
fn shm_key(rank: usize) -> String {
    format!("pg/shm/{rank}")
}

const KEY_ABORT: &str = "pg/abort";

impl TcpProcessGroup {
    /// Forms the group: rendezvous through `store`, ring connections, then a barrier.
    ///
    /// Collective: every rank of the job calls it with its own `rank` and the same
    /// `world_size`. Fails with a message naming the rank(s) at fault when world sizes disagree,
    /// a rank number is claimed twice, or a rank does not arrive within `options.timeout`.
    pub fn new(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        options: TcpGroupOptions,
    ) -> Result<Self, CollectiveError> {
        if world_size == 0 || rank >= world_size {
            return Err(CollectiveError::Setup {
                rank,
                message: format!("rank {rank} is not in 0..{world_size}"),
            });
        }
        let mut group = Self {
            rank,
            world_size,
            store,
            ring: None,
            options,
            calls: CallLog::new(rank),
            scratch: Vec::new(),
        };
        if world_size > 1 {
            // Kept until the first barrier: the neighbours open its files during set-up.
            let shm_dir;
            match group.connect_ring() {
                Ok((ring, dir)) => {
                    group.ring = Some(ring);
                    shm_dir = dir;
                }
                Err(e) => {
                    // Tell the other ranks, so they fail now rather than at their timeout.
                    let _ = group
                        .store
                        .set(KEY_ABORT, format!("rank {rank}: {e}").as_bytes());
                    return Err(e);
                }
            }
            group.barrier()?;
            // Both neighbours have entered the barrier, so they have opened our files.
            drop(shm_dir);
            if let Some(ring) = &mut group.ring {
                ring.next_shm.iter_mut().for_each(ShmSender::go_live);
                ring.prev_shm.iter_mut().for_each(ShmReceiver::go_live);
            }
        }
        tracing::debug!(rank, world_size, "process group ready");
        Ok(group)
    }

    fn setup_error(&self, message: String) -> CollectiveError {
        CollectiveError::Setup {
            rank: self.rank,
            message,
        }
    }

    fn store_error(&self, source: StoreError) -> CollectiveError {
        CollectiveError::Store {
            rank: self.rank,
            source,
        }
    }

    /// This rank's shared-memory ends, or `None` (with the reason logged) where they cannot be
    /// made; the links then use TCP.
    fn shm_setup(&self) -> Option<ShmSetup> {
        if !self.options.shared_memory {
            return None;
        }
        let made = ShmDir::create(self.rank).and_then(|dir| {
            let receiver = ShmReceiver::create(&dir)?;
            let sender = ShmSender::create(&dir)?;
            Ok(ShmSetup {
                dir,
                receiver,
                sender,
            })
        });
        match made {
            Ok(setup) => Some(setup),
            Err(e) => {
                tracing::debug!(rank = self.rank, "no shared memory (using TCP): {e}");
                None
            }
        }
    }

    /// Steps 1–3 of the set-up (module docs), and the shared-memory links to neighbours on this
    /// host. Returns the ring and the directory of our shared files (to keep until the barrier).
    fn connect_ring(&self) -> Result<(Ring, Option<ShmDir>), CollectiveError> {
        let (rank, world) = (self.rank, self.world_size);
        let deadline = Instant::now() + self.options.timeout;
        let store = &self.store;

        let claims = store
            .add(&format!("pg/claims/{rank}"), 1)
            .map_err(|e| self.store_error(e))?;
        if claims > 1 {
            return Err(self.setup_error(format!(
                "rank {rank} joined twice: two processes were started with RANK={rank}"
            )));
        }
        store
            .set(&format!("pg/world/{rank}"), world.to_string().as_bytes())
            .map_err(|e| self.store_error(e))?;
        if rank != 0 {
            let theirs = self.wait_get("pg/world/0", deadline)?;
            let theirs = String::from_utf8_lossy(&theirs).to_string();
            if theirs != world.to_string() {
                return Err(self.setup_error(format!(
                    "world size mismatch: rank 0 was started with WORLD_SIZE={theirs}, rank {rank} with WORLD_SIZE={world}"
                )));
            }
        }

        // Before our address: whoever sees the address also finds this.
        let host = shm::host_identity();
        let shm_ends = host.as_ref().and_then(|_| self.shm_setup());
        let published = match (&host, &shm_ends) {
            (Some(host), Some(ends)) => format!("{host}\n{}", ends.dir.path().display()),
            _ => String::new(),
        };
        store
            .set(&shm_key(rank), published.as_bytes())
            .map_err(|e| self.store_error(e))?;

        let ip = self
            .options
            .advertise_ip
            .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| self.setup_error(format!("cannot listen on {ip}: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| self.setup_error(format!("cannot read the listening address: {e}")))?;
        store
            .set(&format!("pg/addr/{rank}"), local.to_string().as_bytes())
            .map_err(|e| self.store_error(e))?;

        let addr_keys: Vec<String> = (0..world).map(|r| format!("pg/addr/{r}")).collect();
        self.wait_all(&addr_keys, deadline)?;
        if rank == 0 {
            // Ranks that declared another world size than ours fail on their side; name them here.
            for r in 1..world {
                let w = self.wait_get(&format!("pg/world/{r}"), deadline)?;
                if w != world.to_string().as_bytes() {
                    return Err(self.setup_error(format!(
                        "world size mismatch: rank {r} was started with WORLD_SIZE={}, rank 0 with WORLD_SIZE={world}",
                        String::from_utf8_lossy(&w)
                    )));
                }
            }
        }

        let next_rank = (rank + 1) % world;
        let prev_rank = (rank + world - 1) % world;
        let next_addr =
            String::from_utf8_lossy(&self.wait_get(&addr_keys[next_rank], deadline)?).to_string();
        let prev_addr =
            String::from_utf8_lossy(&self.wait_get(&addr_keys[prev_rank], deadline)?).to_string();

        // A link uses shared memory when both ends made theirs and share a host (both sides
        // decide alike from the same published values).
        let (mut next_shm, mut prev_shm, mut shm_dir) = (None, None, None);
        if let Some(ends) = shm_ends {
            let ours =
                String::from_utf8_lossy(&self.wait_get(&shm_key(rank), deadline)?).to_string();
            let dir_of = |r: usize| -> Result<Option<PathBuf>, CollectiveError> {
                let theirs = self.wait_get(&shm_key(r), deadline)?;
                let theirs = String::from_utf8_lossy(&theirs);
                let (their_host, their_dir) = theirs.split_once('\n').unwrap_or(("", ""));
                let our_host = ours.split_once('\n').map_or("", |(h, _)| h);
                Ok((!their_host.is_empty() && their_host == our_host)
                    .then(|| PathBuf::from(their_dir)))
            };
            let ShmSetup {
                dir,
                mut receiver,
                mut sender,
            } = ends;
            let open_failed = |peer: usize, dir: &Path, e: io::Error| {
                self.setup_error(format!(
                    "cannot open rank {peer}'s shared memory in {}: {e} (set BURN_DDP_SHM=0 to use TCP only)",
                    dir.display()
                ))
            };
            if let Some(next_dir) = dir_of(next_rank)? {
                sender
                    .connect(&next_dir)
                    .map_err(|e| open_failed(next_rank, &next_dir, e))?;
                next_shm = Some(sender);
            }
            if let Some(prev_dir) = dir_of(prev_rank)? {
                receiver
                    .connect(&prev_dir)
                    .map_err(|e| open_failed(prev_rank, &prev_dir, e))?;
                prev_shm = Some(receiver);
            }
            shm_dir = Some(dir);
        }

        // Connecting first cannot deadlock: the successor's kernel completes the connection from
        // its listen backlog before the successor calls accept.
        let next = self.connect_next(&next_addr, next_rank, deadline)?;
        let prev = self.accept_prev(&listener, prev_rank, deadline)?;
        for link in [&next, &prev] {
            link.stream
                .set_nonblocking(true)
                .map_err(|e| self.setup_error(format!("cannot configure socket: {e}")))?;
            let _ = link.stream.set_nodelay(true);
        }
        let interface = super::netif::interface_of(local.ip()).unwrap_or_else(|| "?".into());
        let via = |shm: bool| if shm { " (shared memory)" } else { "" };
        tracing::info!(
            rank,
            listen = %local,
            interface = %interface,
            next = %format!("rank {next_rank} at {next_addr}{}", via(next_shm.is_some())),
            prev = %format!("rank {prev_rank} at {prev_addr}{}", via(prev_shm.is_some())),
            "ring connected"
        );
        let ring = Ring {
            next,
            prev: Link {
                peer_addr: prev_addr,
                ..prev
            },
            next_shm,
            prev_shm,
        };
        Ok((ring, shm_dir))
    }

    /// `get` that gives up early when another rank aborted the rendezvous.
    fn wait_get(&self, key: &str, deadline: Instant) -> Result<Vec<u8>, CollectiveError> {
        self.wait_all(&[key.to_string()], deadline)?;
        self.store
            .get(key, Duration::from_secs(1))
            .map_err(|e| self.store_error(e))
    }

    /// Waits for `keys` in slices of a second, checking for a published abort in between.
    fn wait_all(&self, keys: &[String], deadline: Instant) -> Result<(), CollectiveError> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.store.wait(&refs, left.min(Duration::from_secs(1))) {
                Ok(()) => return Ok(()),
                Err(StoreError::Timeout { .. }) => {
                    if self
                        .store
                        .check(&[KEY_ABORT])
                        .map_err(|e| self.store_error(e))?
                    {
                        let why = self
                            .store
                            .get(KEY_ABORT, Duration::from_secs(1))
                            .map_err(|e| self.store_error(e))?;
                        return Err(self.setup_error(format!(
                            "another rank aborted the rendezvous: {}",
                            String::from_utf8_lossy(&why)
                        )));
                    }
                    if left.is_zero() {
                        let missing: Vec<String> = keys
                            .iter()
                            .filter(|k| !self.store.check(&[k.as_str()]).unwrap_or(false))
                            .map(|k| k.rsplit('/').next().unwrap_or(k).to_string())
                            .collect();
                        return Err(self.setup_error(format!(
                            "rank(s) {} never joined within {:?} (were all {} ranks started, with the same MASTER_ADDR/MASTER_PORT?)",
                            missing.join(", "),
                            self.options.timeout,
                            self.world_size
                        )));
                    }
                }
                Err(e) => return Err(self.store_error(e)),
            }
        }
    }

    fn connect_next(
        &self,
        addr: &str,
        peer: usize,
        deadline: Instant,
    ) -> Result<Link, CollectiveError> {
        let sock: SocketAddr = addr.parse().map_err(|_| {
            self.setup_error(format!("rank {peer} published a bad address {addr:?}"))
        })?;
        let mut backoff = Duration::from_millis(10);
        let mut stream = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(&sock, left.max(Duration::from_millis(10))) {
                Ok(s) => break s,
                Err(e) if left.is_zero() => {
                    return Err(self.setup_error(format!(
                        "cannot connect to rank {peer} at {addr}: {e} (is a firewall blocking it? on several machines, set an address the others can reach)"
                    )))
                }
                Err(_) => {
                    std::thread::sleep(backoff.min(left));
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        };
        let hello = wire::encode_hello(&RingHello {
            rank: self.rank as u32,
            world_size: self.world_size as u32,
            token: self.options.token.clone(),
        });
        stream
            .set_write_timeout(Some(self.options.timeout))
            .and_then(|_| stream.write_all(&hello))
            .map_err(|e| self.setup_error(format!("cannot greet rank {peer} at {addr}: {e}")))?;
        Ok(Link {
            stream,
            peer,
            peer_addr: addr.to_string(),
        })
    }

    /// Accepts connections until the predecessor's arrives; strangers are refused and logged.
    fn accept_prev(
        &self,
        listener: &TcpListener,
        peer: usize,
        deadline: Instant,
    ) -> Result<Link, CollectiveError> {
        listener
            .set_nonblocking(true)
            .map_err(|e| self.setup_error(format!("cannot configure the listener: {e}")))?;
        loop {
            match listener.accept() {
                Ok((mut stream, from)) => match self.read_hello(&mut stream, peer, deadline) {
                    Ok(()) => {
                        return Ok(Link {
                            stream,
                            peer,
                            peer_addr: from.to_string(),
                        })
                    }
                    Err(why) => {
                        tracing::warn!(
                            rank = self.rank,
                            "refused a ring connection from {from}: {why}"
                        );
                        let _ = stream.shutdown(Shutdown::Both);
                    }
                },
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(self.setup_error(format!(
                            "rank {peer} did not connect within {:?}",
                            self.options.timeout
                        )));
                    }
                    wait_fds(
                        &mut [pollfd(listener.as_raw_fd(), libc::POLLIN)],
                        left.min(Duration::from_secs(1)),
                    )
                    .map_err(|e| self.setup_error(format!("poll failed: {e}")))?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.setup_error(format!("accept failed: {e}"))),
            }
        }
    }

    fn read_hello(
        &self,
        stream: &mut TcpStream,
        peer: usize,
        deadline: Instant,
    ) -> Result<(), String> {
        let left = deadline.saturating_duration_since(Instant::now());
        stream
            .set_nonblocking(false)
            .and_then(|_| {
                stream.set_read_timeout(Some(
                    left.clamp(Duration::from_millis(10), Duration::from_secs(10)),
                ))
            })
            .map_err(|e| e.to_string())?;
        let mut fixed = [0u8; HELLO_FIXED_LEN];
        stream
            .read_exact(&mut fixed)
            .map_err(|e| format!("no hello: {e}"))?;
        let (rank, world, token_len) =
            wire::decode_hello_fixed(&fixed).map_err(|e| e.to_string())?;
        let mut token = vec![0u8; token_len];
        stream
            .read_exact(&mut token)
            .map_err(|e| format!("truncated hello: {e}"))?;
        if token != self.options.token.as_bytes() {
            return Err("wrong job token".into());
        }
        if rank as usize != peer || world as usize != self.world_size {
            return Err(format!(
                "expected rank {peer} of {}, got rank {rank} of {world}",
                self.world_size
            ));
        }
        Ok(())
    }

    /// Closes the ring so the neighbours fail fast, and refuses every later call.
    fn abort(&mut self, why: &CollectiveError) {
        if let Some(ring) = self.ring.take() {
            let _ = ring.next.stream.shutdown(Shutdown::Both);
            let _ = ring.prev.stream.shutdown(Shutdown::Both);
        }
        self.calls.abort(why);
    }

    /// Runs one collective: checks, header exchange and the plan; aborts the group on error.
    fn run<T: Element>(
        &mut self,
        kind: CollectiveKind,
        len: usize,
        buffer: &mut [T],
        plan: impl FnOnce(usize) -> RingPlan,
        op: ReduceOp,
        precheck: Option<String>,
    ) -> Result<CollectiveDesc, CollectiveError> {
        let desc = match self.calls.begin(kind, T::DTYPE, len, precheck) {
            Ok(desc) => desc,
            Err(err) => {
                self.abort(&err);
                return Err(err);
            }
        };
        if self.world_size == 1 {
            return Ok(desc);
        }
        let piece_elems = (self.options.piece_bytes / std::mem::size_of::<T>()).max(1);
        let plan = plan(piece_elems);
        let result = self.exchange(&desc, buffer, &plan, op);
        if let Err(e) = &result {
            self.abort(e);
        }
        result.map(|()| desc)
    }

    /// The event loop of one collective (module docs).
    fn exchange<T: Element>(
        &mut self,
        desc: &CollectiveDesc,
        buffer: &mut [T],
        plan: &RingPlan,
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let rank = self.rank;
        let elem = std::mem::size_of::<T>();
        let largest = plan
            .recvs
            .iter()
            .map(|r| r.range.len() * elem)
            .max()
            .unwrap_or(0);
        if self.scratch.len() * 8 < largest {
            self.scratch.resize(largest.div_ceil(8), 0);
        }
        let Some(ring) = self.ring.as_mut() else {
            return Err(CollectiveError::Aborted {
                rank,
                first_error: "the ring is not connected".into(),
            });
        };
        let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut self.scratch[..]);
        let header = wire::encode_header(desc);

        let mut st = ExchangeState::default();
        let start = Instant::now();
        let deadline = start + self.options.timeout;
        let mut next_warning = start + self.options.stall_warning;

        loop {
            let mut progress = false;

            // 1. Successor: our header, then every send the plan allows.
            loop {
                let n = if st.fwd_header < HEADER_LEN {
                    write_some(&mut ring.next, &header[st.fwd_header..], desc, rank)?
                } else if st.send < plan.sends.len() && st.recv >= plan.sends[st.send].after_recvs {
                    let bytes: &[u8] =
                        bytemuck::cast_slice(&buffer[plan.sends[st.send].range.clone()]);
                    if bytes.is_empty() {
                        st.send += 1;
                        continue;
                    }
                    let bytes = &bytes[st.send_off..];
                    match &mut ring.next_shm {
                        Some(shm) => shm
                            .write_some(bytes)
                            .map_err(|e| peer_lost(&ring.next, desc, rank, e))?,
                        None => write_some(&mut ring.next, bytes, desc, rank)?,
                    }
                } else {
                    break;
                };
                let Some(n) = n else { break };
                progress = true;
                if st.fwd_header < HEADER_LEN {
                    st.fwd_header += n;
                } else {
                    st.send_off += n;
                    if st.send_off == plan.sends[st.send].range.len() * elem {
                        st.send += 1;
                        st.send_off = 0;
                    }
                }
            }

            // 2. Predecessor: our header, backwards, so it can check us too.
            if st.back_header < HEADER_LEN {
                if let Some(n) = write_some(&mut ring.prev, &header[st.back_header..], desc, rank)?
                {
                    st.back_header += n;
                    progress = true;
                }
            }

            // 3. Successor's header, backwards.
            if st.next_header_len < HEADER_LEN {
                if let Some(n) = read_some(
                    &mut ring.next,
                    &mut st.next_header[st.next_header_len..],
                    desc,
                    rank,
                )? {
                    st.next_header_len += n;
                    progress = true;
                    if st.next_header_len == HEADER_LEN {
                        check_header(&st.next_header, desc, &ring.next, rank)?;
                    }
                }
            }

            // 4. Predecessor: its header, then the pieces of the plan.
            loop {
                let n = if st.prev_header_len < HEADER_LEN {
                    read_some(
                        &mut ring.prev,
                        &mut st.prev_header[st.prev_header_len..],
                        desc,
                        rank,
                    )?
                } else if st.recv < plan.recvs.len() {
                    let item = &plan.recvs[st.recv];
                    let total = item.range.len() * elem;
                    if total == 0 {
                        st.recv += 1;
                        continue;
                    }
                    let dst: &mut [u8] = match item.action {
                        // Copies land in place: no second pass over the bytes.
                        RecvAction::Copy => {
                            &mut bytemuck::cast_slice_mut(&mut buffer[item.range.clone()])
                                [st.recv_off..]
                        }
                        RecvAction::Reduce => &mut scratch[st.recv_off..total],
                    };
                    match &mut ring.prev_shm {
                        Some(shm) => shm
                            .read_some(dst)
                            .map_err(|e| peer_lost(&ring.prev, desc, rank, e))?,
                        None => read_some(&mut ring.prev, dst, desc, rank)?,
                    }
                } else {
                    break;
                };
                let Some(n) = n else { break };
                progress = true;
                if st.prev_header_len < HEADER_LEN {
                    st.prev_header_len += n;
                    if st.prev_header_len == HEADER_LEN {
                        check_header(&st.prev_header, desc, &ring.prev, rank)?;
                    }
                    continue;
                }
                st.recv_off += n;
                let item = &plan.recvs[st.recv];
                let total = item.range.len() * elem;
                if st.recv_off == total {
                    if item.action == RecvAction::Reduce {
                        let incoming: &[T] = bytemuck::cast_slice(&scratch[..total]);
                        T::reduce_into(&mut buffer[item.range.clone()], incoming, op);
                    }
                    st.recv += 1;
                    st.recv_off = 0;
                }
            }

            let done = st.fwd_header == HEADER_LEN
                && st.back_header == HEADER_LEN
                && st.next_header_len == HEADER_LEN
                && st.prev_header_len == HEADER_LEN
                && st.send == plan.sends.len()
                && st.recv == plan.recvs.len();
            if done {
                return Ok(());
            }
            if progress {
                continue;
            }

            // Nothing moved: sleep in poll(2) until a socket is ready or a deadline passes.
            let now = Instant::now();
            if now >= deadline {
                return Err(CollectiveError::Timeout {
                    rank,
                    desc: *desc,
                    elapsed: now - start,
                    timeout: self.options.timeout,
                    waiting_on: st.waiting_on(ring, plan),
                });
            }
            if now >= next_warning {
                let waiting_on = st.waiting_on(ring, plan);
                let stalled = stall_report(self.store.as_ref(), rank, self.world_size, desc.seq);
                tracing::warn!(
                    "rank {rank}: {desc} has made no progress for {:?}: waiting for {waiting_on}. {stalled}",
                    now - start
                );
                next_warning = now + self.options.stall_warning;
            }
            let want_data_out = st.fwd_header == HEADER_LEN
                && st.send < plan.sends.len()
                && st.recv >= plan.sends[st.send].after_recvs;
            let want_data_in = st.prev_header_len == HEADER_LEN && st.recv < plan.recvs.len();
            let mut next_events = 0;
            if st.fwd_header < HEADER_LEN || (want_data_out && ring.next_shm.is_none()) {
                next_events |= libc::POLLOUT;
            }
            if st.next_header_len < HEADER_LEN {
                next_events |= libc::POLLIN;
            }
            let mut prev_events = 0;
            if st.back_header < HEADER_LEN {
                prev_events |= libc::POLLOUT;
            }
            if st.prev_header_len < HEADER_LEN || (want_data_in && ring.prev_shm.is_none()) {
                prev_events |= libc::POLLIN;
            }
            // Shared-memory links wake us through their FIFOs (room to write, data to read).
            let space_fd = match &ring.next_shm {
                Some(shm) if want_data_out => shm.wakeup_fd(),
                _ => -1,
            };
            let data_fd = match &ring.prev_shm {
                Some(shm) if want_data_in => shm.wakeup_fd(),
                _ => -1,
            };
            // A socket we expect nothing from is not polled: a neighbour that has finished this
            // collective and closed (end of job) must not wake us in a loop.
            let mut fds = [
                pollfd(
                    if next_events == 0 { -1 } else { ring.next.fd() },
                    next_events,
                ),
                pollfd(
                    if prev_events == 0 { -1 } else { ring.prev.fd() },
                    prev_events,
                ),
                pollfd(space_fd, libc::POLLIN),
                pollfd(data_fd, libc::POLLIN),
            ];
            let wake = deadline.min(next_warning).saturating_duration_since(now);
            wait_fds(&mut fds, wake).map_err(|source| CollectiveError::PeerLost {
                rank,
                peer: ring.next.peer,
                peer_addr: ring.next.peer_addr.clone(),
                desc: *desc,
                source,
            })?;
        }
    }
}

/// Progress of one collective's event loop.
#[derive(Default)]
struct ExchangeState {
    fwd_header: usize,
    back_header: usize,
    next_header: [u8; HEADER_LEN],
    next_header_len: usize,
    prev_header: [u8; HEADER_LEN],
    prev_header_len: usize,
    send: usize,
    send_off: usize,
    recv: usize,
    recv_off: usize,
}

impl ExchangeState {
    /// What the rank is blocked on, for timeout and stall messages.
    fn waiting_on(&self, ring: &Ring, plan: &RingPlan) -> String {
        let who = |l: &Link| format!("rank {} ({})", l.peer, l.peer_addr);
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

fn check_header(
    bytes: &[u8; HEADER_LEN],
    ours: &CollectiveDesc,
    link: &Link,
    rank: usize,
) -> Result<(), CollectiveError> {
    let theirs = wire::decode_header(bytes).map_err(|source| CollectiveError::Protocol {
        rank,
        peer: link.peer,
        desc: *ours,
        source,
    })?;
    if theirs != *ours {
        return Err(CollectiveError::Mismatch {
            rank,
            peer: link.peer,
            ours: *ours,
            theirs,
        });
    }
    Ok(())
}

fn peer_lost(
    link: &Link,
    desc: &CollectiveDesc,
    rank: usize,
    source: io::Error,
) -> CollectiveError {
    CollectiveError::PeerLost {
        rank,
        peer: link.peer,
        peer_addr: link.peer_addr.clone(),
        desc: *desc,
        source,
    }
}

/// Non-blocking write: `Some(n)` bytes written, `None` when the socket is full.
fn write_some(
    link: &mut Link,
    bytes: &[u8],
    desc: &CollectiveDesc,
    rank: usize,
) -> Result<Option<usize>, CollectiveError> {
    loop {
        match link.stream.write(bytes) {
            Ok(0) => {
                return Err(peer_lost(link, desc, rank, io::ErrorKind::WriteZero.into()));
            }
            Ok(n) => return Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(peer_lost(link, desc, rank, e)),
        }
    }
}

/// Non-blocking read: `Some(n)` bytes read, `None` when nothing is there yet; EOF is an error
/// because every byte a collective reads was promised by the peer's plan.
fn read_some(
    link: &mut Link,
    buf: &mut [u8],
    desc: &CollectiveDesc,
    rank: usize,
) -> Result<Option<usize>, CollectiveError> {
    loop {
        match link.stream.read(buf) {
            Ok(0) => {
                let eof = io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection",
                );
                return Err(peer_lost(link, desc, rank, eof));
            }
            Ok(n) => return Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(peer_lost(link, desc, rank, e)),
        }
    }
}

fn pollfd(fd: libc::c_int, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

/// `poll(2)` on `fds` for at most `timeout`; returns when one is ready, the time is up, or a
/// signal arrives (the caller's loop re-checks everything in each case).
fn wait_fds(fds: &mut [libc::pollfd], timeout: Duration) -> io::Result<()> {
    let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a valid, exclusively borrowed array of `fds.len()` pollfd structs for the
    // whole call; poll only writes their `revents` fields.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

/// On a stall, records this rank's position in the store and reports the others'. Ranks that
/// have not reported are either still computing (not yet in this collective) or stalled for less
/// time than this one.
fn stall_report(store: &dyn Store, rank: usize, world: usize, seq: u64) -> String {
    if store
        .set(&format!("pg/stall/{rank}"), seq.to_string().as_bytes())
        .is_err()
    {
        return "(the store is unreachable, so other ranks' positions are unknown)".into();
    }
    let mut stalled_here = Vec::new();
    let mut elsewhere = Vec::new();
    for r in (0..world).filter(|&r| r != rank) {
        let key = format!("pg/stall/{r}");
        match store.check(&[&key]) {
            Ok(true) => match store.get(&key, Duration::from_secs(1)) {
                Ok(v) if v == seq.to_string().as_bytes() => stalled_here.push(r.to_string()),
                Ok(v) => {
                    elsewhere.push(format!("{r} (stalled at #{})", String::from_utf8_lossy(&v)))
                }
                Err(_) => elsewhere.push(format!("{r} (unknown)")),
            },
            _ => elsewhere.push(r.to_string()),
        }
    }
    format!(
        "Ranks also stalled in #{seq}: [{}]; ranks not seen in it: [{}]",
        stalled_here.join(", "),
        elsewhere.join(", ")
    )
}

impl ProcessGroup for TcpProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce<T: Element>(
        &mut self,
        buffer: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let (world, rank, len) = (self.world_size, self.rank, buffer.len());
        self.run(
            CollectiveKind::AllReduce(op),
            len,
            buffer,
            |piece| ring::all_reduce_plan(world, rank, len, piece),
            op,
            None,
        )?;
        if op == ReduceOp::Avg {
            buffer.iter_mut().for_each(|x| *x = x.div_world(world));
        }
        Ok(())
    }

    fn broadcast<T: Element>(
        &mut self,
        buffer: &mut [T],
        root: usize,
    ) -> Result<(), CollectiveError> {
        let (world, rank, len) = (self.world_size, self.rank, buffer.len());
        let precheck = check::root(root, world);
        self.run(
            CollectiveKind::Broadcast { root },
            len,
            buffer,
            |piece| ring::broadcast_plan(world, rank, root.min(world - 1), len, piece),
            ReduceOp::Sum,
            precheck,
        )
        .map(|_| ())
    }

    fn all_gather<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CollectiveError> {
        let (world, rank, block) = (self.world_size, self.rank, input.len());
        let precheck = check::all_gather(world, block, output.len());
        if precheck.is_none() {
            output[rank * block..(rank + 1) * block].copy_from_slice(input);
        }
        self.run(
            CollectiveKind::AllGather,
            block,
            output,
            |piece| ring::all_gather_plan(world, rank, block, piece),
            ReduceOp::Sum,
            precheck,
        )
        .map(|_| ())
    }

    fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        let (world, rank, block) = (self.world_size, self.rank, output.len());
        let precheck = check::reduce_scatter(world, input.len(), block);
        let mut work = input.to_vec();
        self.run(
            CollectiveKind::ReduceScatter(op),
            block,
            &mut work,
            |piece| ring::reduce_scatter_plan(world, rank, block, piece),
            op,
            precheck,
        )?;
        output.copy_from_slice(&work[rank * block..(rank + 1) * block]);
        if op == ReduceOp::Avg {
            output.iter_mut().for_each(|x| *x = x.div_world(world));
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        let (world, rank) = (self.world_size, self.rank);
        let mut token = [1i64];
        self.run(
            CollectiveKind::Barrier,
            1,
            &mut token,
            |piece| ring::all_reduce_plan(world, rank, 1, piece),
            ReduceOp::Sum,
            None,
        )?;
        debug_assert_eq!(token[0], world as i64);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! Threads in one process, real sockets on loopback. The multi-process suite lives in the
    //! workspace's `tests/`.
    use super::*;
    use crate::store::MemoryStore;

    fn with_group<R: Send + 'static>(
        world: usize,
        options: TcpGroupOptions,
        body: impl Fn(&mut TcpProcessGroup) -> R + Send + Sync + 'static,
    ) -> Vec<R> {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let body = Arc::new(body);
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (store, body, options) = (store.clone(), body.clone(), options.clone());
                std::thread::spawn(move || {
                    let mut group = TcpProcessGroup::new(store, rank, world, options).unwrap();
                    body(&mut group)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn collectives_on_threads() {
        let options = TcpGroupOptions {
            piece_bytes: 16, // many pieces, to exercise the pipeline
            ..Default::default()
        };
        let results = with_group(3, options, |g| {
            let r = g.rank() as i64;
            let mut a: Vec<i64> = (0..10).map(|i| i * 10 + r).collect();
            g.all_reduce(&mut a, ReduceOp::Sum).unwrap();
            let mut m = vec![r as f32; 5];
            g.all_reduce(&mut m, ReduceOp::Max).unwrap();
            let mut b = vec![r; 7];
            g.broadcast(&mut b, 1).unwrap();
            let mut gathered = vec![0i64; 6];
            g.all_gather(&[r, -r], &mut gathered).unwrap();
            let mut out = [0i64; 2];
            g.reduce_scatter(&[1, 2, 3, 4, 5, 6], &mut out, ReduceOp::Sum)
                .unwrap();
            g.barrier().unwrap();
            (a, m, b, gathered, out)
        });
        for (rank, (a, m, b, gathered, out)) in results.into_iter().enumerate() {
            assert_eq!(a, (0..10).map(|i| 30 * i + 3).collect::<Vec<i64>>());
            assert_eq!(m, vec![2.0; 5]);
            assert_eq!(b, vec![1; 7]);
            assert_eq!(gathered, vec![0, 0, 1, -1, 2, -2]);
            let r = rank as i64;
            assert_eq!(out, [3 * (2 * r + 1), 3 * (2 * r + 2)]);
        }
    }

    /// 16-bit floats (compressed gradient buckets) travel at 2 bytes an element and reduce
    /// through `f32`: sums of small integers are exact, and every rank gets the same bits.
    #[test]
    fn sixteen_bit_floats_on_threads() {
        use half::{bf16, f16};
        let options = TcpGroupOptions {
            piece_bytes: 6, // 3 elements a piece: pieces end mid-word of the packed layout
            ..Default::default()
        };
        let results = with_group(3, options, |g| {
            let r = g.rank() as f32;
            let mut a: Vec<bf16> = (0..11).map(|i| bf16::from_f32(i as f32 + r)).collect();
            g.all_reduce(&mut a, ReduceOp::Sum).unwrap();
            let mut b: Vec<f16> = (0..11).map(|i| f16::from_f32(-(i as f32) * r)).collect();
            g.all_reduce(&mut b, ReduceOp::Avg).unwrap();
            let mut c = vec![f16::from_f32(r); 4];
            g.all_reduce(&mut c, ReduceOp::Max).unwrap();
            (a, b, c)
        });
        for (a, b, c) in results {
            let a: Vec<f32> = a.iter().map(|x| x.to_f32()).collect();
            let b: Vec<f32> = b.iter().map(|x| x.to_f32()).collect();
            assert_eq!(a, (0..11).map(|i| 3.0 * i as f32 + 3.0).collect::<Vec<_>>());
            assert_eq!(b, (0..11).map(|i| -(i as f32)).collect::<Vec<_>>());
            assert_eq!(c, vec![f16::from_f32(2.0); 4]);
        }
    }

    #[test]
    fn strangers_on_the_ring_port_are_refused_and_the_group_forms() {
        use std::io::Write as _;
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let options = TcpGroupOptions {
            token: "job-token".into(),
            ..Default::default()
        };
        let spawn_rank = |rank: usize| {
            let (store, options) = (store.clone(), options.clone());
            std::thread::spawn(move || {
                let mut g = TcpProcessGroup::new(store, rank, 2, options).unwrap();
                let mut v = [rank as i64 + 1];
                g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                v[0]
            })
        };
        let rank0 = spawn_rank(0);
        let addr =
            String::from_utf8(store.get("pg/addr/0", Duration::from_secs(30)).unwrap()).unwrap();
        // Queued in rank 0's backlog before its real predecessor: garbage, then a wrong token.
        let mut garbage = TcpStream::connect(&addr).unwrap();
        garbage
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut impostor = TcpStream::connect(&addr).unwrap();
        impostor
            .write_all(&wire::encode_hello(&RingHello {
                rank: 1,
                world_size: 2,
                token: "guess".into(),
            }))
            .unwrap();
        let rank1 = spawn_rank(1);
        assert_eq!(rank0.join().unwrap(), 3);
        assert_eq!(rank1.join().unwrap(), 3);
    }

    #[test]
    fn stall_report_names_who_is_stalled_and_who_was_not_seen() {
        let store = MemoryStore::new();
        store.set("pg/stall/1", b"5").unwrap();
        store.set("pg/stall/3", b"4").unwrap();
        let report = stall_report(&store, 0, 4, 5);
        assert_eq!(
            report,
            "Ranks also stalled in #5: [1]; ranks not seen in it: [2, 3 (stalled at #4)]"
        );
        assert_eq!(
            store.get("pg/stall/0", Duration::from_secs(1)).unwrap(),
            b"5"
        );
    }

    #[test]
    fn mismatched_lengths_name_both_sides() {
        let results = with_group(2, TcpGroupOptions::default(), |g| {
            let mut buf = vec![0f32; 4 + g.rank()];
            let first = g
                .all_reduce(&mut buf, ReduceOp::Sum)
                .unwrap_err()
                .to_string();
            let second = g.barrier().unwrap_err();
            (first, second)
        });
        for (first, second) in results {
            assert!(
                first.contains("mismatch")
                    && first.contains("4 elements")
                    && first.contains("5 elements"),
                "{first}"
            );
            assert!(
                matches!(second, CollectiveError::Aborted { .. }),
                "{second}"
            );
        }
    }
}
