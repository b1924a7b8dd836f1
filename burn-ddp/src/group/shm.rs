//! A shared-memory byte channel between two ranks on one host: the data path of a ring link
//! whose neighbour shares this machine (the TCP connection stays, for headers and set-up).
//!
//! Over loopback TCP every byte is copied into the kernel by the sender and out of it by the
//! receiver, with a system call per few hundred KiB and the TCP stack in between. Here the
//! sender copies straight into a ring buffer that both processes map, and the receiver copies
//! straight out of it.
//!
//! # Layout of the shared file
//! ```text
//! offset 0     head: u64   bytes ever written (only the sender stores it)
//! offset 64    tail: u64   bytes ever read    (only the receiver stores it)
//! offset 4096  data: capacity bytes, byte k of the stream at data[k % capacity]
//! ```
//! The receiver chooses the capacity (the group's `shared_memory_ring_bytes`) and sizes the file;
//! the sender reads it from the file's size.
//! The sender writes bytes, then publishes them with a release store of `head`; the receiver
//! acquires `head`, copies, then frees the space with a release store of `tail`. Each counter has
//! one writer, so no read-modify-write is needed.
//!
//! # Waking up
//! A process that finds the ring empty (receiver) or full (sender) sleeps in `poll(2)` on a named
//! pipe (FIFO) that the other side writes one byte to after every store: `data` FIFO from sender
//! to receiver, `space` FIFO from receiver to sender. The sleeper drains its FIFO *before*
//! reading the counter, so a store that lands after the check is followed by a byte that wakes
//! it: no lost wake-ups. A full FIFO (64 KiB of unread bytes) already guarantees a wake-up, so
//! such a write is skipped.
//!
//! # A dead peer
//! The kernel closes a dead process's FIFO ends, and the survivor's read end then reports
//! end-of-file (`POLLHUP`): a receiver waiting for data from a dead sender, or a sender waiting
//! for room from a dead receiver, fails at once, as with a TCP connection. Bytes the sender
//! published before it went are still delivered (a sender that finished and left is not dead).
//!
//! # Files
//! The receiver creates the shared file and its `data` FIFO, the sender its `space` FIFO, each in
//! a private directory under `/dev/shm` (mode 0700: only this user can open them), opens its own
//! ends, and publishes the directory through the store; the peer opens the other ends. Once the
//! ring's first barrier proves both sides have opened everything, each rank removes its
//! directory ([`ShmDir::remove`]); the mappings and open descriptors keep working. Until then
//! each side also holds a write end of its own FIFO, so that a peer that has not yet opened it
//! does not read as a dead one ([`ShmReceiver::go_live`]).

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of ring buffer per link unless the group's options say otherwise: four of the TCP
/// group's default 1 MiB pieces.
pub const DEFAULT_CAPACITY: usize = 4 << 20;
const DATA_OFFSET: usize = 4096;

/// `/dev/shm` space each rank of a group of several ranks reserves while the group lives for a
/// ring of `capacity` bytes: its ring file, counters and data (made before the rank knows whether
/// a neighbour shares its host, so every rank of a multi-rank job on this machine takes this
/// much).
pub const fn file_bytes(capacity: usize) -> usize {
    DATA_OFFSET + capacity
}
const HEAD_OFFSET: usize = 0;
const TAIL_OFFSET: usize = 64;
const RING_FILE: &str = "ring";
const DATA_FIFO: &str = "data";
const SPACE_FIFO: &str = "space";

/// What identifies "the same host" for shared memory: the running kernel (boot id) and the
/// network namespace (ranks in different namespaces are treated as different machines, which
/// is what a namespace test of several "nodes" wants). `None` where `/proc` cannot tell.
pub fn host_identity() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let netns = std::fs::read_link("/proc/self/ns/net").ok()?;
    Some(format!("{}/{}", boot.trim(), netns.display()))
}

/// This rank's directory of shared files under `/dev/shm`, removed on drop.
#[derive(Debug)]
pub struct ShmDir {
    path: PathBuf,
}

impl ShmDir {
    /// A fresh private directory named after this process and rank. Directories left by
    /// processes that no longer exist (killed during set-up) are removed first.
    pub fn create(rank: usize) -> io::Result<Self> {
        let base = Path::new("/dev/shm");
        let prefix = format!("burn-ddp-{}-", pid_namespace());
        remove_stale(base, &prefix);
        for attempt in 0..100u32 {
            let path = base.join(format!("{prefix}{}-r{rank}-{attempt}", std::process::id()));
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(Self { path }),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "no free directory name under /dev/shm",
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the directory and its files (open ends and mappings stay valid).
    pub fn remove(&self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

impl Drop for ShmDir {
    fn drop(&mut self) {
        self.remove();
    }
}

/// The inode of this process's pid namespace: process ids are only meaningful within it
/// (containers sharing `/dev/shm` may have different ones).
fn pid_namespace() -> String {
    std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .and_then(|link| {
            let link = link.to_string_lossy().into_owned();
            let inode = link.strip_prefix("pid:[")?.strip_suffix(']')?.to_string();
            Some(inode)
        })
        .unwrap_or_else(|| "0".into())
}

/// Removes `<prefix><pid>-…` directories in `base` (ours: same pid namespace) whose process is
/// gone. Only our own user's can be removed (they are mode 0700); anything else is left alone.
fn remove_stale(base: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A shared mapping of the ring file.
struct Mapping {
    base: NonNull<u8>,
    len: usize,
    /// Bytes of the data area: `len - DATA_OFFSET`.
    capacity: usize,
}

// SAFETY: the mapping is plain shared memory; all cross-process (and cross-thread) access to it
// goes through the atomics at HEAD/TAIL and the byte ranges they hand over (module docs).
unsafe impl Send for Mapping {}

impl Mapping {
    /// Maps the first [`file_bytes`]`(capacity)` bytes of `file`.
    fn new(file: &File, capacity: usize) -> io::Result<Self> {
        let len = file_bytes(capacity);
        // SAFETY: a fresh shared read-write mapping of `len` bytes of `file` (which is at least
        // that long: the receiver sized it before publishing); checked for MAP_FAILED below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(io::Error::last_os_error)?;
        Ok(Self {
            base,
            len,
            capacity,
        })
    }

    fn counter(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: offset 0 and 64 lie in the mapping's first page, are 8-byte aligned (the
        // mapping is page-aligned) and are only ever accessed as AtomicU64 by both processes.
        unsafe { &*self.base.as_ptr().add(offset).cast::<AtomicU64>() }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: DATA_OFFSET < len.
        unsafe { self.base.as_ptr().add(DATA_OFFSET) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are exactly what mmap returned; nothing refers to it afterwards.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

fn fifo(path: &Path) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a path"))?;
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o600) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn open_fifo(path: &Path, write: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(!write)
        .write(write)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
}

/// Drains a wake-up FIFO: `Ok(false)` when every writer has gone (the peer died or left).
fn drain(fifo: &mut File) -> io::Result<bool> {
    let mut sink = [0u8; 4096];
    loop {
        match fifo.read(&mut sink) {
            Ok(0) => return Ok(false),
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Wakes the peer, best effort: a full FIFO already guarantees a wake-up, and a peer that has
/// closed its end needs none (it has left after taking what it needed, or died, which the side
/// that waits on it finds out through its own FIFO).
fn kick(fifo: &mut File) {
    loop {
        match fifo.write(&[1]) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            _ => return,
        }
    }
}

fn peer_gone() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the peer closed its end of the shared-memory link",
    )
}

/// The receiving end of a link: owns the ring file and the `data` FIFO in this rank's directory.
pub struct ShmReceiver {
    map: Mapping,
    data_wakeups: File,
    /// Our own write end of `data` until [`go_live`](Self::go_live): the read end reports
    /// end-of-file while no writer has it open, and the sender may not have opened it yet.
    keepalive: Option<File>,
    /// Opened by [`ShmReceiver::connect`]: the sender's `space` FIFO.
    space_kicks: Option<File>,
    tail: u64,
}

/// The sending end: maps the receiver's ring file, owns the `space` FIFO in this rank's
/// directory.
pub struct ShmSender {
    map: Option<Mapping>,
    space_wakeups: File,
    /// As for [`ShmReceiver`], for `space`.
    keepalive: Option<File>,
    data_kicks: Option<File>,
    head: u64,
}

impl ShmReceiver {
    /// Creates the ring file (of `capacity` data bytes, at least one) and the `data` FIFO in
    /// `dir` and opens this side's ends.
    pub fn create(dir: &ShmDir, capacity: usize) -> io::Result<Self> {
        if capacity == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a shared-memory ring needs at least one byte",
            ));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dir.path().join(RING_FILE))?;
        // Reserve the pages now: on a full tmpfs this fails here (and the link uses TCP), where
        // a sparse file would fail later with SIGBUS on first touch.
        // SAFETY: a valid open descriptor; the call only allocates file space.
        let rc = unsafe {
            libc::posix_fallocate(file.as_raw_fd(), 0, file_bytes(capacity) as libc::off_t)
        };
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        let map = Mapping::new(&file, capacity)?;
        fifo(&dir.path().join(DATA_FIFO))?;
        let data_wakeups = open_fifo(&dir.path().join(DATA_FIFO), false)?;
        let keepalive = Some(open_fifo(&dir.path().join(DATA_FIFO), true)?);
        Ok(Self {
            map,
            data_wakeups,
            keepalive,
            space_kicks: None,
            tail: 0,
        })
    }

    /// Opens the sender's `space` FIFO, found in the sender's directory `peer_dir`.
    pub fn connect(&mut self, peer_dir: &Path) -> io::Result<()> {
        self.space_kicks = Some(open_fifo(&peer_dir.join(SPACE_FIFO), true)?);
        Ok(())
    }

    /// Lets the end of the sender's process show as end-of-file. Call once the sender is known
    /// to have connected (the group's first barrier has completed).
    pub fn go_live(&mut self) {
        self.keepalive = None;
    }

    /// The descriptor to poll (`POLLIN`) when [`read_some`](Self::read_some) found nothing.
    pub fn wakeup_fd(&self) -> libc::c_int {
        self.data_wakeups.as_raw_fd()
    }

    /// Copies up to `buf.len()` bytes of the stream into `buf`: `Some(n)` with `n > 0`, or
    /// `None` when nothing has arrived (poll [`wakeup_fd`](Self::wakeup_fd) then). `Err` when
    /// the sender is gone.
    pub fn read_some(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        if buf.is_empty() {
            return Ok(Some(0));
        }
        // Check, drain the wake-ups, check again: anything published after the second check
        // is followed by a wake-up that our poll will see.
        let mut available = 0;
        for check in 0..2 {
            let head = self.map.counter(HEAD_OFFSET).load(Ordering::Acquire);
            available = (head - self.tail) as usize;
            if available > 0 || check == 1 {
                break;
            }
            if !drain(&mut self.data_wakeups)? {
                // The sender is gone; what it published before going is still read above.
                let head = self.map.counter(HEAD_OFFSET).load(Ordering::Acquire);
                if head == self.tail {
                    return Err(peer_gone());
                }
            }
        }
        if available == 0 {
            return Ok(None);
        }
        let n = available.min(buf.len());
        let capacity = self.map.capacity;
        let start = (self.tail % capacity as u64) as usize;
        let first = n.min(capacity - start);
        // SAFETY: bytes [tail, tail + n) of the stream were published by the sender's release
        // store of head (acquired above) and are not written again until our tail store below
        // frees them; `start + first <= capacity` and `n - first <= start`, so both copies stay
        // inside the data area; `buf` is a distinct local buffer of at least `n` bytes.
        unsafe {
            let data = self.map.data();
            std::ptr::copy_nonoverlapping(data.add(start), buf.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(data, buf.as_mut_ptr().add(first), n - first);
        }
        self.tail += n as u64;
        self.map
            .counter(TAIL_OFFSET)
            .store(self.tail, Ordering::Release);
        if let Some(kicks) = &mut self.space_kicks {
            kick(kicks);
        }
        Ok(Some(n))
    }
}

impl ShmSender {
    /// Creates the `space` FIFO in `dir` and opens this side's end.
    pub fn create(dir: &ShmDir) -> io::Result<Self> {
        fifo(&dir.path().join(SPACE_FIFO))?;
        let space_wakeups = open_fifo(&dir.path().join(SPACE_FIFO), false)?;
        let keepalive = Some(open_fifo(&dir.path().join(SPACE_FIFO), true)?);
        Ok(Self {
            map: None,
            space_wakeups,
            keepalive,
            data_kicks: None,
            head: 0,
        })
    }

    /// Maps the receiver's ring file and opens its `data` FIFO, in the receiver's `peer_dir`.
    /// The ring's capacity is the file's size less the counters' page (the receiver sized it).
    pub fn connect(&mut self, peer_dir: &Path) -> io::Result<()> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(peer_dir.join(RING_FILE))?;
        let size = file.metadata()?.len();
        let capacity = usize::try_from(size)
            .ok()
            .and_then(|size| size.checked_sub(DATA_OFFSET))
            .filter(|&capacity| capacity > 0)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("the peer's ring file has {size} bytes"),
                )
            })?;
        self.map = Some(Mapping::new(&file, capacity)?);
        self.data_kicks = Some(open_fifo(&peer_dir.join(DATA_FIFO), true)?);
        Ok(())
    }

    /// Lets the end of the receiver's process show as end-of-file. Call once the receiver is
    /// known to have connected (the group's first barrier has completed).
    pub fn go_live(&mut self) {
        self.keepalive = None;
    }

    /// The descriptor to poll (`POLLIN`) when [`write_some`](Self::write_some) found no room.
    pub fn wakeup_fd(&self) -> libc::c_int {
        self.space_wakeups.as_raw_fd()
    }

    /// Copies up to `bytes.len()` bytes into the ring: `Some(n)` with `n > 0`, or `None` when
    /// it is full (poll [`wakeup_fd`](Self::wakeup_fd) then). `Err` when the receiver is gone or
    /// the link was never connected.
    pub fn write_some(&mut self, bytes: &[u8]) -> io::Result<Option<usize>> {
        if bytes.is_empty() {
            return Ok(Some(0));
        }
        let (Some(map), Some(kicks)) = (&self.map, &mut self.data_kicks) else {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the shared-memory link is not connected",
            ));
        };
        // Check, drain, check again (as in `ShmReceiver::read_some`).
        let mut free = 0;
        for check in 0..2 {
            let tail = map.counter(TAIL_OFFSET).load(Ordering::Acquire);
            free = map.capacity - (self.head - tail) as usize;
            if free > 0 || check == 1 {
                break;
            }
            if !drain(&mut self.space_wakeups)? {
                return Err(peer_gone());
            }
        }
        if free == 0 {
            return Ok(None);
        }
        let n = free.min(bytes.len());
        let start = (self.head % map.capacity as u64) as usize;
        let first = n.min(map.capacity - start);
        // SAFETY: bytes [head, head + n) of the stream are free: the receiver released them
        // with its store of tail (acquired above) and reads them only after our head store
        // below; both copies stay inside the data area (as in `read_some`).
        unsafe {
            let data = map.data();
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), data.add(start), first);
            std::ptr::copy_nonoverlapping(bytes.as_ptr().add(first), data, n - first);
        }
        self.head += n as u64;
        map.counter(HEAD_OFFSET).store(self.head, Ordering::Release);
        kick(kicks);
        Ok(Some(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks in poll on `fd` until it is readable (test helper).
    fn wait(fd: libc::c_int) {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut p, 1, 10_000) };
    }

    fn pair() -> (ShmSender, ShmReceiver, ShmDir, ShmDir) {
        pair_of(DEFAULT_CAPACITY)
    }

    fn pair_of(capacity: usize) -> (ShmSender, ShmReceiver, ShmDir, ShmDir) {
        let (send_dir, recv_dir) = (ShmDir::create(90).unwrap(), ShmDir::create(91).unwrap());
        let mut rx = ShmReceiver::create(&recv_dir, capacity).unwrap();
        let mut tx = ShmSender::create(&send_dir).unwrap();
        tx.connect(recv_dir.path()).unwrap();
        rx.connect(send_dir.path()).unwrap();
        tx.go_live();
        rx.go_live();
        (tx, rx, send_dir, recv_dir)
    }

    /// Many times the capacity, in odd-sized writes and reads on two threads, arrives intact
    /// and in order (wrap-around, full and empty ring, wake-ups both ways), for the default
    /// ring and for a small one of an odd size (the sender learns it from the file).
    #[test]
    fn a_stream_longer_than_the_ring_arrives_intact() {
        for capacity in [DEFAULT_CAPACITY, 65_537] {
            stream_through_a_ring_of(capacity);
        }
    }

    fn stream_through_a_ring_of(capacity: usize) {
        let (mut tx, mut rx, send_dir, recv_dir) = pair_of(capacity);
        // The files may go once both ends are open.
        send_dir.remove();
        recv_dir.remove();
        let total = 3 * capacity + 12_345;
        let stream: Vec<u8> = (0..total).map(|i| (i * 7 + i / 251) as u8).collect();
        let expected = stream.clone();
        let writer = std::thread::spawn(move || {
            let mut off = 0;
            let mut chunk = 1;
            while off < stream.len() {
                let end = (off + chunk).min(stream.len());
                match tx.write_some(&stream[off..end]).unwrap() {
                    Some(n) => off += n,
                    None => wait(tx.wakeup_fd()),
                }
                chunk = (chunk * 3 + 1) % 1_500_007;
            }
            tx
        });
        let mut got = vec![0u8; total];
        let mut off = 0;
        let mut chunk = 5;
        while off < total {
            let end = (off + chunk).min(total);
            match rx.read_some(&mut got[off..end]).unwrap() {
                Some(n) => off += n,
                None => wait(rx.wakeup_fd()),
            }
            chunk = (chunk * 5 + 3) % 999_983 + 1;
        }
        let _tx = writer.join().unwrap();
        assert!(
            got == expected,
            "the stream through {capacity} bytes arrived damaged"
        );
    }

    #[test]
    fn a_vanished_peer_is_an_error_not_a_wait() {
        let (tx, mut rx, _a, _b) = pair();
        drop(tx);
        let mut buf = [0u8; 8];
        let err = rx.read_some(&mut buf).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");

        // What a sender published before leaving is still delivered, then end-of-file.
        let (mut tx, mut rx, _c, _d) = pair();
        assert_eq!(tx.write_some(&[1, 2, 3]).unwrap(), Some(3));
        drop(tx);
        assert_eq!(rx.read_some(&mut buf).unwrap(), Some(3));
        assert_eq!(&buf[..3], &[1, 2, 3]);
        assert!(rx.read_some(&mut buf).is_err());

        // A sender fills the ring of a vanished receiver, then fails instead of waiting.
        let (mut tx, rx, _e, _f) = pair();
        drop(rx);
        let chunk = vec![0u8; 1 << 20];
        let mut outcome = Ok(Some(0));
        for _ in 0..=DEFAULT_CAPACITY / chunk.len() {
            outcome = tx.write_some(&chunk);
            if outcome.is_err() {
                break;
            }
        }
        let err = outcome.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");
    }

    #[test]
    fn the_directory_is_private_and_removed_and_stale_ones_are_cleaned() {
        // A directory of a process that cannot exist (pids are below 2^22 on Linux), in our pid
        // namespace, and one of another namespace, which is not ours to judge.
        let stale = PathBuf::from(format!(
            "/dev/shm/burn-ddp-{}-4294967295-r0-0",
            pid_namespace()
        ));
        let foreign = Path::new("/dev/shm/burn-ddp-1-4294967295-r0-0");
        std::fs::create_dir_all(stale.join("x")).unwrap();
        std::fs::create_dir_all(foreign).unwrap();
        let dir = ShmDir::create(92).unwrap();
        assert!(!stale.exists(), "stale directory removed");
        assert!(foreign.exists(), "another namespace's directory left alone");
        std::fs::remove_dir(foreign).unwrap();
        let path = dir.path().to_path_buf();
        let mode = std::fs::metadata(&path).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o700
        );
        drop(dir);
        assert!(!path.exists());
        assert!(host_identity().is_some());
    }
}
