//! Forming the TCP ring: rendezvous through the store, shared-memory ends, then the two
//! connections with their hellos (steps 1–3 of the set-up in the [module docs](super)).

use std::io;
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use super::options::TcpGroupOptions;
use super::transport::{DataReceiver, DataSender, SocketData};
use crate::call::CollectiveDesc;
use crate::error::CollectiveError;
use crate::group::greeting::{accept_greeted, connect_and_greet, Greeting};
use crate::group::netif;
use crate::group::rendezvous::Rendezvous;
use crate::group::shm::{self, ShmDir, ShmReceiver, ShmSender};

/// A non-blocking connection to a ring neighbour: the per-collective headers go through it, and
/// the data too unless the link uses shared memory.
pub(super) struct Link {
    pub stream: TcpStream,
    pub peer: usize,
    pub peer_addr: String,
}

impl Link {
    pub fn fd(&self) -> libc::c_int {
        self.stream.as_raw_fd()
    }

    /// The error for an I/O failure on this link (or its data path) during `desc`.
    pub fn lost(&self, desc: &CollectiveDesc, rank: usize, source: io::Error) -> CollectiveError {
        CollectiveError::PeerLost {
            rank,
            peer: self.peer,
            peer_addr: self.peer_addr.clone(),
            desc: *desc,
            source,
        }
    }
}

/// The ring's two connections: to the successor (data goes out) and from the predecessor
/// (data comes in), each also carrying one header the other way per collective; and the data
/// path of each, the socket itself or shared memory.
pub(super) struct Ring {
    pub next: Link,
    pub prev: Link,
    pub data_out: Box<dyn DataSender>,
    pub data_in: Box<dyn DataReceiver>,
}

/// This rank's shared-memory ends, made before the neighbours are known.
struct ShmEnds {
    dir: ShmDir,
    receiver: ShmReceiver,
    sender: ShmSender,
}

/// One rank's view of the set-up.
struct Setup<'a> {
    rdv: &'a Rendezvous,
    options: &'a TcpGroupOptions,
    rank: usize,
    world: usize,
}

/// Steps 1–3 of the set-up (module docs). Returns the ring and the directory of this rank's
/// shared files, which the caller keeps until the first barrier (the neighbours open them
/// during set-up). Collective, bounded by the rendezvous's deadline.
pub(super) fn connect_ring(
    rdv: &Rendezvous,
    options: &TcpGroupOptions,
    rank: usize,
    world: usize,
) -> Result<(Ring, Option<ShmDir>), CollectiveError> {
    let s = Setup {
        rdv,
        options,
        rank,
        world,
    };
    rdv.join()?;
    // Before our address: whoever sees the address also finds this.
    let host = shm::host_identity();
    let shm_ends = host.as_ref().and_then(|_| s.shm_ends());
    let published = match (&host, &shm_ends) {
        (Some(host), Some(ends)) => format!("{host}\n{}", ends.dir.path().display()),
        _ => String::new(),
    };
    rdv.publish("shm", published.as_bytes())?;

    let ip = options
        .advertise_ip
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let (listener, local) = rdv.listen_and_publish(ip)?;
    rdv.wait_joined()?;
    rdv.wait_published("addr")?;

    let (next_rank, prev_rank) = ((rank + 1) % world, (rank + world - 1) % world);
    let text = |v: Vec<u8>| String::from_utf8_lossy(&v).to_string();
    let next_addr = text(rdv.published("addr", next_rank)?);
    let prev_addr = text(rdv.published("addr", prev_rank)?);
    let (next_shm, prev_shm, shm_dir) = match shm_ends {
        Some(ends) => s.shm_links(ends, host.as_deref().unwrap_or(""), next_rank, prev_rank)?,
        None => (None, None, None),
    };

    // Connecting first cannot deadlock: the successor's kernel completes the connection from
    // its listen backlog before the successor calls accept.
    let next = s.connect_next(&next_addr, next_rank)?;
    let mut prev = s.accept_prev(&listener, prev_rank)?;
    prev.peer_addr = prev_addr;
    let ring = s.ring(next, prev, next_shm, prev_shm)?;
    let interface = netif::interface_of(local.ip()).unwrap_or_else(|| "?".into());
    tracing::info!(
        rank,
        listen = %local,
        interface = %interface,
        next = %format!("rank {next_rank} at {}{}", ring.next.peer_addr, ring.data_out.label()),
        prev = %format!("rank {prev_rank} at {}{}", ring.prev.peer_addr, ring.data_in.label()),
        "ring connected"
    );
    Ok((ring, shm_dir))
}

impl Setup<'_> {
    /// This rank's shared-memory ends, or `None` (with the reason logged) where they are not
    /// wanted or cannot be made; the links then use TCP.
    fn shm_ends(&self) -> Option<ShmEnds> {
        if !self.options.uses_shared_memory() {
            return None;
        }
        let made = ShmDir::create(self.rank).and_then(|dir| {
            let receiver = ShmReceiver::create(&dir, self.options.shared_memory_ring_bytes)?;
            let sender = ShmSender::create(&dir)?;
            Ok(ShmEnds {
                dir,
                receiver,
                sender,
            })
        });
        match made {
            Ok(ends) => Some(ends),
            Err(e) => {
                tracing::debug!(rank = self.rank, "no shared memory (using TCP): {e}");
                None
            }
        }
    }

    /// Connects our shared-memory ends to the neighbours that share our host. A link uses
    /// shared memory when both ends made theirs and share a host (both sides decide alike from
    /// the same published values).
    #[allow(clippy::type_complexity)]
    fn shm_links(
        &self,
        ends: ShmEnds,
        our_host: &str,
        next_rank: usize,
        prev_rank: usize,
    ) -> Result<(Option<ShmSender>, Option<ShmReceiver>, Option<ShmDir>), CollectiveError> {
        let dir_of =
            |r: usize| -> Result<Option<PathBuf>, CollectiveError> {
                let theirs = self.rdv.published("shm", r)?;
                let theirs = String::from_utf8_lossy(&theirs);
                let (their_host, their_dir) = theirs.split_once('\n').unwrap_or(("", ""));
                Ok((!their_host.is_empty() && their_host == our_host)
                    .then(|| PathBuf::from(their_dir)))
            };
        let open_failed = |peer: usize, dir: &Path, e: io::Error| {
            self.rdv.setup_error(format!(
                "cannot open rank {peer}'s shared memory in {}: {e} (set BURN_DDP_SHM=0 to use TCP only)",
                dir.display()
            ))
        };
        let ShmEnds {
            dir,
            mut receiver,
            mut sender,
        } = ends;
        let mut next_shm = None;
        if let Some(next_dir) = dir_of(next_rank)? {
            sender
                .connect(&next_dir)
                .map_err(|e| open_failed(next_rank, &next_dir, e))?;
            next_shm = Some(sender);
        }
        let mut prev_shm = None;
        if let Some(prev_dir) = dir_of(prev_rank)? {
            receiver
                .connect(&prev_dir)
                .map_err(|e| open_failed(prev_rank, &prev_dir, e))?;
            prev_shm = Some(receiver);
        }
        Ok((next_shm, prev_shm, Some(dir)))
    }

    /// Makes both connections non-blocking and picks each link's data path.
    fn ring(
        &self,
        next: Link,
        prev: Link,
        next_shm: Option<ShmSender>,
        prev_shm: Option<ShmReceiver>,
    ) -> Result<Ring, CollectiveError> {
        let configure = |e: io::Error| {
            self.rdv
                .setup_error(format!("cannot configure socket: {e}"))
        };
        for link in [&next, &prev] {
            link.stream.set_nonblocking(true).map_err(configure)?;
            let _ = link.stream.set_nodelay(true);
        }
        let data_out: Box<dyn DataSender> = match next_shm {
            Some(shm) => Box::new(shm),
            None => Box::new(SocketData::new(&next.stream).map_err(configure)?),
        };
        let data_in: Box<dyn DataReceiver> = match prev_shm {
            Some(shm) => Box::new(shm),
            None => Box::new(SocketData::new(&prev.stream).map_err(configure)?),
        };
        Ok(Ring {
            next,
            prev,
            data_out,
            data_in,
        })
    }

    /// This rank's hello.
    fn greeting(&self) -> Greeting<'_> {
        Greeting {
            rank: self.rank,
            world: self.world,
            token: &self.options.token,
        }
    }

    /// Connects to the successor (it may not listen yet) and greets it.
    fn connect_next(&self, addr: &str, peer: usize) -> Result<Link, CollectiveError> {
        let stream =
            connect_and_greet(self.rdv, self.greeting(), peer, addr, self.options.timeout)?;
        Ok(Link {
            stream,
            peer,
            peer_addr: addr.to_string(),
        })
    }

    /// Accepts connections until the predecessor's arrives; strangers are refused and logged.
    fn accept_prev(&self, listener: &TcpListener, peer: usize) -> Result<Link, CollectiveError> {
        let (stream, from) = accept_greeted(
            self.rdv,
            listener,
            self.greeting(),
            peer,
            "ring",
            self.options.timeout,
        )?;
        Ok(Link {
            stream,
            peer,
            peer_addr: from.to_string(),
        })
    }
}
