//! The doctor's measurements of this machine: file systems, limits, sockets, name resolution.
//! Each returns plain facts (or why it could not get them) for [`super::checks`] to judge; each
//! that can block has a deadline.

use std::ffi::CString;
use std::io::{Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket,
};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use burn_ddp::group::netif;

use super::checks::{DirState, FsSpace, PortProbe};

/// How long a name lookup or a connection may take.
const NET_DEADLINE: Duration = Duration::from_secs(5);

/// Cores this process may use (`available_parallelism`: affinity and cgroup quota included).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Free and total bytes of the file system holding `path` (`statvfs(3)`).
pub fn fs_space(path: &Path) -> Result<FsSpace, String> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| format!("{}: NUL in the path", path.display()))?;
    // SAFETY: an all-zero statvfs is a valid value (plain integers).
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is a valid NUL-terminated string and `st` a writable statvfs, both alive
    // for the duration of the call.
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    let unit = st.f_frsize as u64;
    Ok(FsSpace {
        free: (st.f_bavail as u64).saturating_mul(unit),
        total: (st.f_blocks as u64).saturating_mul(unit),
    })
}

/// A listener on 127.0.0.1, a connection to it, one byte there and back: the round trip.
pub fn loopback_roundtrip() -> Result<Duration, String> {
    let start = Instant::now();
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| format!("bind: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("local address: {e}"))?;
    let mut client =
        TcpStream::connect_timeout(&addr, NET_DEADLINE).map_err(|e| format!("connect: {e}"))?;
    // The kernel has completed the connection (it is in the backlog), so accept returns at once.
    let (mut server, _) = listener.accept().map_err(|e| format!("accept: {e}"))?;
    for s in [&client, &server] {
        s.set_read_timeout(Some(NET_DEADLINE))
            .map_err(|e| format!("timeout: {e}"))?;
    }
    let mut byte = [42u8];
    client
        .write_all(&byte)
        .and_then(|()| server.read_exact(&mut byte))
        .and_then(|()| server.write_all(&byte))
        .and_then(|()| client.read_exact(&mut byte))
        .map_err(|e| format!("exchange: {e}"))?;
    Ok(start.elapsed())
}

/// The addresses `host` resolves to, within [`NET_DEADLINE`] (the system resolver has no
/// deadline of its own, so it runs on a thread that is abandoned if it does not answer).
pub fn resolve(host: &str) -> Result<Vec<IpAddr>, String> {
    let (tx, rx) = mpsc::channel();
    let name = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    std::thread::spawn(move || {
        let result = (name.as_str(), 0u16)
            .to_socket_addrs()
            .map(|addrs| addrs.map(|a| a.ip()).collect::<Vec<_>>())
            .map_err(|e| e.to_string());
        let _ = tx.send(result);
    });
    rx.recv_timeout(NET_DEADLINE).unwrap_or_else(|_| {
        Err(format!(
            "no answer from the resolver within {} s",
            NET_DEADLINE.as_secs()
        ))
    })
}

/// The local address (and its interface) the kernel would send from to reach `ip`: a UDP
/// socket is "connected" there, which picks a route without sending anything.
pub fn route_to(ip: IpAddr) -> Result<(IpAddr, Option<String>), String> {
    let any: IpAddr = match ip {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let socket = UdpSocket::bind((any, 0)).map_err(|e| e.to_string())?;
    socket
        .connect(SocketAddr::new(ip, 9))
        .map_err(|e| e.to_string())?;
    let source = socket.local_addr().map_err(|e| e.to_string())?.ip();
    Ok((source, netif::interface_of(source)))
}

/// Whether `ip` is one of this machine's addresses.
pub fn is_local_address(ip: IpAddr) -> bool {
    ip.is_loopback() || netif::interface_of(ip).is_some()
}

/// Binds `host:port` (and lets it go at once): what the store will do.
pub fn bind_port(host: &str, port: u16) -> PortProbe {
    let result = TcpListener::bind((host, port))
        .map(drop)
        .map_err(|e| (e.kind(), e.to_string()));
    PortProbe::Bind {
        host: host.to_string(),
        result,
    }
}

/// Connects to `host:port` within [`NET_DEADLINE`]: whether someone hosts the store there.
pub fn connect_port(host: &str, port: u16) -> PortProbe {
    let endpoint = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    let result = resolve(host).and_then(|ips| {
        let mut last = format!("{host} resolves to no address");
        for ip in ips {
            match TcpStream::connect_timeout(&SocketAddr::new(ip, port), NET_DEADLINE) {
                Ok(_) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
        }
        Err(last)
    });
    PortProbe::Connect { endpoint, result }
}

/// Whether the job can write under `path`: a file in the way, or the directory (or its nearest
/// existing parent, where it will be created) writable, with its free space.
pub fn dir_state(path: &Path) -> DirState {
    if path.exists() && !path.is_dir() {
        return DirState::IsFile;
    }
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map(|d| d.join(path))
            .unwrap_or_else(|_| path.to_path_buf())
    };
    let existing: PathBuf = absolute
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"))
        .to_path_buf();
    if !existing.is_dir() {
        return DirState::NotWritable {
            why: "a file where a directory is needed".into(),
            existing,
        };
    }
    let Ok(c_path) = CString::new(existing.as_os_str().as_bytes()) else {
        return DirState::NotWritable {
            existing,
            why: "NUL in the path".into(),
        };
    };
    // SAFETY: a valid NUL-terminated path for the duration of the call.
    if unsafe { libc::access(c_path.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        return DirState::NotWritable {
            existing,
            why: std::io::Error::last_os_error().to_string(),
        };
    }
    let free = fs_space(&existing).ok().map(|s| s.free);
    DirState::Writable { existing, free }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_machine_can_be_measured() {
        assert!(cores() >= 1);
        let tmp = fs_space(&std::env::temp_dir()).unwrap();
        assert!(tmp.total >= tmp.free);
        assert!(fs_space(Path::new("/no/such/dir")).is_err());
        loopback_roundtrip().unwrap();
        let (source, interface) = route_to(Ipv4Addr::LOCALHOST.into()).unwrap();
        assert!(source.is_loopback());
        assert!(interface.is_some());
        assert!(is_local_address(Ipv4Addr::LOCALHOST.into()));
        assert_eq!(
            resolve("127.0.0.1").unwrap(),
            [IpAddr::from(Ipv4Addr::LOCALHOST)]
        );
    }

    #[test]
    fn a_bound_port_is_seen_in_use() {
        let held = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = held.local_addr().unwrap().port();
        match bind_port("127.0.0.1", port) {
            PortProbe::Bind {
                result: Err((kind, _)),
                ..
            } => assert_eq!(kind, std::io::ErrorKind::AddrInUse),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            connect_port("127.0.0.1", port),
            PortProbe::Connect { result: Ok(()), .. }
        ));
    }

    #[test]
    fn a_file_in_the_way_is_found() {
        let dir = std::env::temp_dir().join(format!("doctor-dir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("file");
        std::fs::write(&file, b"x").unwrap();
        assert_eq!(dir_state(&file), DirState::IsFile);
        assert!(matches!(
            dir_state(&dir.join("new/run")),
            DirState::Writable { ref existing, .. } if existing == &dir
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
