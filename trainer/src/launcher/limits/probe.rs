//! This machine's limits, measured now: `getrlimit` and the kernel's task counts in `/proc`.
//! Each returns plain facts (or why it could not get them) for [`super::checks`] to judge.

use super::checks::{KernelTasks, Limit};

/// Open-file descriptors (`RLIMIT_NOFILE`) of this process.
pub fn open_file_limit() -> Result<Limit, String> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid pointer.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    limit(rc, lim)
}

/// Processes and threads (`RLIMIT_NPROC`) of this user.
pub fn process_limit() -> Result<Limit, String> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid pointer.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut lim) };
    limit(rc, lim)
}

/// A `getrlimit` result as a [`Limit`] (`RLIM_INFINITY` as `None`).
fn limit(rc: libc::c_int, lim: libc::rlimit) -> Result<Limit, String> {
    if rc != 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    // rlim_t is u64 on 64-bit Linux, but not everywhere.
    #[allow(clippy::unnecessary_cast)]
    let value = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v as u64);
    Ok(Limit {
        soft: value(lim.rlim_cur),
        hard: value(lim.rlim_max),
    })
}

/// The kernel's task cap (`kernel.pid_max`, `kernel.threads-max`) and the tasks that exist
/// now (the fourth field of `/proc/loadavg`, `running/total`).
pub fn kernel_tasks() -> Result<KernelTasks, String> {
    let number = |path: &str| -> Result<u64, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
        text.trim()
            .parse()
            .map_err(|_| format!("{path}: not a number: {:?}", text.trim()))
    };
    let loadavg =
        std::fs::read_to_string("/proc/loadavg").map_err(|e| format!("/proc/loadavg: {e}"))?;
    let existing = loadavg
        .split_whitespace()
        .nth(3)
        .and_then(|field| field.split_once('/'))
        .and_then(|(_, total)| total.parse().ok())
        .ok_or_else(|| format!("/proc/loadavg: no task count in {:?}", loadavg.trim()))?;
    Ok(KernelTasks {
        pid_max: number("/proc/sys/kernel/pid_max")?,
        threads_max: number("/proc/sys/kernel/threads-max")?,
        existing,
    })
}

/// Whether this process runs as root (which `RLIMIT_NPROC` does not bind).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_machine_s_limits_can_be_measured() {
        assert!(open_file_limit().is_ok());
        assert!(process_limit().is_ok());
        let tasks = kernel_tasks().unwrap();
        assert!(tasks.existing >= 1 && tasks.existing <= tasks.pid_max.max(tasks.threads_max));
    }
}
