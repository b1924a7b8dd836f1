//! `poll(2)` for the groups' sockets, pipes and listeners: one entry, and a bounded wait.

use std::io;
use std::time::Duration;

/// A `pollfd` entry for `fd`, waiting for `events`.
pub(crate) fn pollfd(fd: libc::c_int, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

/// `poll(2)` on `fds` for at most `timeout`; returns when one is ready, the time is up, or a
/// signal arrives (the caller's loop re-checks everything in each case). Entries with a negative
/// `fd` are ignored by the kernel.
pub(crate) fn wait_fds(fds: &mut [libc::pollfd], timeout: Duration) -> io::Result<()> {
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
