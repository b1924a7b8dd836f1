//! A rank dies with whatever launcher started it.
//!
//! The trainer's own launcher arms `PR_SET_PDEATHSIG` in each rank ([`crate::launcher::launch`]). A rank
//! started by another launcher (torchrun, `mpirun`, srun's step daemon) has no such guard: if
//! the launcher is killed with SIGKILL, the rank would go on training and writing checkpoints
//! as an orphan. [`die_with_parent`] watches the parent instead: when the process is
//! re-parented (its parent died), it stops itself at once.
//!
//! Why a watch and not `PR_SET_PDEATHSIG` here: that signal fires when the *thread* that
//! forked the process exits, not the process, and a launcher may start ranks from a thread
//! that ends long before it does; only the launcher's own child setup can arm it safely. The
//! watch reads `getppid()` every [`POLL`], so an orphan lives at most that long.

use std::io::Write;
use std::time::Duration;

/// How often the parent is checked.
pub const POLL: Duration = Duration::from_millis(200);

/// Starts a background thread that SIGKILLs this process once its parent is gone. Returns
/// `false` (and watches nothing) when the parent is pid 0 or 1: this process is a container's
/// init or a child of it — or was orphaned before it could tell, which cannot be told apart.
pub fn die_with_parent() -> bool {
    // SAFETY: getppid(2) cannot fail and touches no memory.
    let parent = unsafe { libc::getppid() };
    if parent <= 1 {
        return false;
    }
    let spawned = std::thread::Builder::new()
        .name("parent-watch".into())
        .spawn(move || loop {
            std::thread::sleep(POLL);
            // SAFETY: as above.
            let now = unsafe { libc::getppid() };
            if now != parent {
                // Not eprintln!: stderr is often a pipe to the dead launcher, and a failed
                // write must not panic this thread instead of stopping the process.
                let _ = writeln!(
                    std::io::stderr(),
                    "error: the launcher that started this rank (pid {parent}) is gone: stopping, as its other ranks do"
                );
                // SAFETY: kill(2) on our own pid with a signal number; no memory is involved.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            }
        });
    spawned.is_ok()
}
