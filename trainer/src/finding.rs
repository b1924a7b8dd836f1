//! What `trainer doctor` says about one check, and the report they make together (pure).
//!
//! ```text
//! ok    cores         2 cores; 2 ranks x 1 thread (the launcher's share of the cores)
//! FAIL  /dev/shm      64 KiB free of 64 KiB; the shared-memory ring needs 8.0 MiB for 2 ranks
//!                     fix: enlarge /dev/shm (...), or set BURN_DDP_SHM=0 to use loopback TCP
//! ```

use std::fmt::Write as _;

/// How a check came out. Ordered from harmless to blocking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Status {
    /// Not applicable here (a one-rank job has nothing to all-reduce), or not asked for.
    Skip,
    /// Fine.
    Ok,
    /// A job runs, but worse than it could (slower, or with little headroom).
    Warn,
    /// A job would fail, or would not do what was asked: `trainer doctor` exits 1.
    Fail,
}

impl Status {
    /// The word printed in the first column (`FAIL` in capitals, to be seen).
    pub fn label(self) -> &'static str {
        match self {
            Self::Skip => "skip",
            Self::Ok => "ok",
            Self::Warn => "warn",
            Self::Fail => "FAIL",
        }
    }
}

/// One check's result: what was found and, unless all is well, what to do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Short name of the check (`/dev/shm`, `port`, ...), the second column.
    pub check: &'static str,
    pub status: Status,
    /// What was measured or seen, with the numbers.
    pub detail: String,
    /// What to do about it (every warning and failure has one).
    pub advice: Option<String>,
}

impl Finding {
    pub fn ok(check: &'static str, detail: impl Into<String>) -> Self {
        Self::new(check, Status::Ok, detail, None)
    }

    pub fn skip(check: &'static str, detail: impl Into<String>) -> Self {
        Self::new(check, Status::Skip, detail, None)
    }

    pub fn warn(check: &'static str, detail: impl Into<String>, advice: impl Into<String>) -> Self {
        Self::new(check, Status::Warn, detail, Some(advice.into()))
    }

    pub fn fail(check: &'static str, detail: impl Into<String>, advice: impl Into<String>) -> Self {
        Self::new(check, Status::Fail, detail, Some(advice.into()))
    }

    /// A finding with `status` chosen by the caller (a problem that blocks one job and only
    /// slows another); `advice` is kept for [`Status::Warn`] and [`Status::Fail`].
    pub fn new(
        check: &'static str,
        status: Status,
        detail: impl Into<String>,
        advice: Option<String>,
    ) -> Self {
        Self {
            check,
            status,
            detail: detail.into(),
            advice: advice.filter(|_| status >= Status::Warn),
        }
    }
}

/// Width of the check-name column.
const CHECK_WIDTH: usize = 13;

/// The report: one line per finding (`STATUS  CHECK  DETAIL`), its advice indented below it.
pub fn render(findings: &[Finding]) -> String {
    let mut out = String::new();
    let indent = " ".repeat(6 + CHECK_WIDTH + 1);
    for f in findings {
        let _ = writeln!(
            out,
            "{:<5} {:<width$} {}",
            f.status.label(),
            f.check,
            f.detail,
            width = CHECK_WIDTH
        );
        if let Some(advice) = &f.advice {
            let _ = writeln!(out, "{indent}fix: {advice}");
        }
    }
    out
}

/// The last line: how many checks failed or warned.
pub fn summary(findings: &[Finding]) -> String {
    let count = |s: Status| findings.iter().filter(|f| f.status == s).count();
    let (fails, warns) = (count(Status::Fail), count(Status::Warn));
    let plural = |n: usize, word: &str| format!("{n} {word}{}", if n == 1 { "" } else { "s" });
    match (fails, warns) {
        (0, 0) => "all checks passed: this machine can run the job".into(),
        (0, w) => format!(
            "no problems, {}: the job can run (see the advice above)",
            plural(w, "warning")
        ),
        (f, w) => format!(
            "{}, {}: fix the lines marked FAIL before starting the job",
            plural(f, "problem"),
            plural(w, "warning")
        ),
    }
}

/// `trainer doctor`'s exit code: 1 when any check failed, else 0 (warnings allowed).
pub fn exit_code(findings: &[Finding]) -> u8 {
    u8::from(findings.iter().any(|f| f.status == Status::Fail))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_aligned_and_advice_follows_its_line() {
        let text = render(&[
            Finding::ok("cores", "2 cores"),
            Finding::fail("port", "29500 is in use", "pick another"),
        ]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "ok    cores         2 cores");
        assert_eq!(lines[1], "FAIL  port          29500 is in use");
        assert_eq!(lines[2], format!("{}fix: pick another", " ".repeat(20)));
        assert_eq!(lines.len(), 3);
    }

    #[test]
    fn only_a_failure_makes_the_exit_code_1() {
        let ok = Finding::ok("a", "x");
        let warn = Finding::warn("b", "y", "z");
        assert_eq!(exit_code(&[ok.clone(), warn.clone()]), 0);
        assert_eq!(exit_code(&[ok, warn, Finding::fail("c", "d", "e")]), 1);
        assert_eq!(exit_code(&[]), 0);
    }

    #[test]
    fn ok_and_skip_carry_no_advice_and_the_summary_counts() {
        assert_eq!(
            Finding::new("a", Status::Ok, "x", Some("y".into())).advice,
            None
        );
        let findings = [
            Finding::fail("a", "x", "y"),
            Finding::warn("b", "x", "y"),
            Finding::warn("c", "x", "y"),
        ];
        assert_eq!(
            summary(&findings),
            "1 problem, 2 warnings: fix the lines marked FAIL before starting the job"
        );
        assert!(summary(&[Finding::ok("a", "x")]).starts_with("all checks passed"));
    }
}
