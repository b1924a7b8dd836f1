//! Opening a point-to-point connection between two ranks of a job — the ring's links and the
//! pipeline's links between stages: the connecting rank retries until the rendezvous deadline
//! (its peer may not listen yet) and greets with a hello (its rank, the world size, the job
//! token, [`wire::encode_hello`]); the accepting rank takes connections until its expected
//! peer's hello arrives, refusing and logging strangers (a rank of another job, a port
//! scanner) instead of failing on them.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::error::CollectiveError;
use crate::group::poll::{pollfd, wait_fds};
use crate::group::rendezvous::Rendezvous;
use crate::group::wire::{self, RingHello, HELLO_FIXED_LEN};
use crate::store::backoff::Backoff;

/// Who greets: this rank of a job of `world` ranks with the job token `token`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Greeting<'a> {
    pub rank: usize,
    pub world: usize,
    pub token: &'a str,
}

/// Connects to rank `peer` at `addr`, retrying with capped back-off until the rendezvous'
/// deadline, and sends this rank's hello (bounded by `write_timeout`).
pub(crate) fn connect_and_greet(
    rdv: &Rendezvous,
    ours: Greeting<'_>,
    peer: usize,
    addr: &str,
    write_timeout: Duration,
) -> Result<TcpStream, CollectiveError> {
    let deadline = rdv.deadline();
    let sock: SocketAddr = addr
        .parse()
        .map_err(|_| rdv.setup_error(format!("rank {peer} published a bad address {addr:?}")))?;
    let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_secs(1));
    let mut stream = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&sock, left.max(Duration::from_millis(10))) {
            Ok(s) => break s,
            Err(e) if left.is_zero() => {
                return Err(rdv.setup_error(format!(
                    "cannot connect to rank {peer} at {addr}: {e} (is a firewall blocking it? on several machines, set an address the others can reach)"
                )))
            }
            Err(_) => backoff.sleep(deadline),
        }
    };
    let hello = wire::encode_hello(&RingHello {
        rank: ours.rank as u32,
        world_size: ours.world as u32,
        token: ours.token.to_owned(),
    });
    stream
        .set_write_timeout(Some(write_timeout))
        .and_then(|_| stream.write_all(&hello))
        .map_err(|e| rdv.setup_error(format!("cannot greet rank {peer} at {addr}: {e}")))?;
    Ok(stream)
}

/// Accepts connections on `listener` until rank `peer`'s arrives with the job's token and world
/// size, before the rendezvous' deadline (`timeout` names it in the error); others are refused
/// and logged as strangers to this `link` (e.g. "ring"). Returns the stream and its address.
pub(crate) fn accept_greeted(
    rdv: &Rendezvous,
    listener: &TcpListener,
    ours: Greeting<'_>,
    peer: usize,
    link: &str,
    timeout: Duration,
) -> Result<(TcpStream, SocketAddr), CollectiveError> {
    let deadline = rdv.deadline();
    listener
        .set_nonblocking(true)
        .map_err(|e| rdv.setup_error(format!("cannot configure the listener: {e}")))?;
    let mut refused = String::new();
    loop {
        match listener.accept() {
            Ok((mut stream, from)) => match read_hello(&mut stream, deadline, ours, peer) {
                Ok(()) => return Ok((stream, from)),
                Err(why) => {
                    tracing::warn!(
                        rank = ours.rank,
                        "refused a {link} connection from {from}: {why}"
                    );
                    refused = format!(" (refused a connection from {from}: {why})");
                    let _ = stream.shutdown(Shutdown::Both);
                }
            },
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(rdv.setup_error(format!(
                        "rank {peer} did not connect within {timeout:?}{refused}"
                    )));
                }
                wait_fds(
                    &mut [pollfd(listener.as_raw_fd(), libc::POLLIN)],
                    left.min(Duration::from_secs(1)),
                )
                .map_err(|e| rdv.setup_error(format!("poll failed: {e}")))?;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(rdv.setup_error(format!("accept failed: {e}"))),
        }
    }
}

/// Reads and checks a hello: the job's token, then the expected rank and world size.
fn read_hello(
    stream: &mut TcpStream,
    deadline: Instant,
    ours: Greeting<'_>,
    peer: usize,
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
    let (rank, world, token_len) = wire::decode_hello_fixed(&fixed).map_err(|e| e.to_string())?;
    let mut token = vec![0u8; token_len];
    stream
        .read_exact(&mut token)
        .map_err(|e| format!("truncated hello: {e}"))?;
    if token != ours.token.as_bytes() {
        return Err("wrong job token: every rank of a job must have the same BURN_DDP_TOKEN (set the same BURN_DDP_TOKEN=<secret> in each node's environment)".into());
    }
    if rank as usize != peer || world as usize != ours.world {
        return Err(format!(
            "expected rank {peer} of {}, got rank {rank} of {world}",
            ours.world
        ));
    }
    Ok(())
}
