//! How long this process has lived, from the kernel's record of its start (Linux's `/proc`):
//! what a restarted rank reports of how fast it got back to work, exec and dynamic loading
//! included.

use std::time::Duration;

/// This process's age; `None` where `/proc` cannot tell.
pub(crate) fn process_age() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
    // SAFETY: sysconf reads a system constant; no memory is involved.
    let ticks_per_sec = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    age_from(&stat, &uptime, u64::try_from(ticks_per_sec).ok()?)
}

/// [`process_age`] in words, for log lines: `"1.23 s"`.
pub(crate) fn process_age_text() -> String {
    process_age().map_or_else(
        || "an unknown time".to_string(),
        |age| format!("{:.2} s", age.as_secs_f64()),
    )
}

/// The age of the process whose `/proc/<pid>/stat` is `stat`, with the system's `/proc/uptime`
/// and clock ticks per second. The process's start is the stat's field 22, in ticks since boot,
/// counted after the command name's closing parenthesis (the name may hold spaces).
fn age_from(stat: &str, uptime: &str, ticks_per_sec: u64) -> Option<Duration> {
    let fields = stat.rsplit_once(')')?.1;
    let start_ticks: u64 = fields.split_whitespace().nth(19)?.parse().ok()?;
    let up: f64 = uptime.split_whitespace().next()?.parse().ok()?;
    let started = start_ticks as f64 / ticks_per_sec.max(1) as f64;
    (up >= started).then(|| Duration::from_secs_f64(up - started))
}

#[cfg(test)]
mod tests {
    use super::{age_from, process_age};
    use std::time::Duration;

    #[test]
    fn the_age_is_uptime_less_the_start_in_ticks() {
        // A command name with a space and a parenthesis; starttime (field 22) is 12345.
        let stat =
            "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 12345 1000 10";
        let age = age_from(stat, "200.50 380.00\n", 100);
        assert_eq!(age.map(|a| a.as_millis()), Some(77_050));
        assert_eq!(
            age_from(stat, "100.00 1.00", 100),
            None,
            "started after now"
        );
        assert_eq!(age_from("garbage", "1 1", 100), None);
    }

    #[test]
    fn this_process_has_an_age_under_a_day() {
        let age = process_age();
        assert!(
            age.is_some_and(|a| a < Duration::from_secs(86_400)),
            "{age:?}"
        );
    }
}
