//! Each rank's stderr, forwarded by the launcher with a `[rank N]` tag, and its last lines kept
//! so that a failure report can end with the failing rank's own words — where the user looks —
//! instead of leaving them buried under every other rank's output.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// Lines kept per rank for the failure report.
const TAIL_LINES: usize = 30;

pub struct RankLog {
    rank: usize,
    tail: Arc<Mutex<VecDeque<String>>>,
    reader: Option<JoinHandle<()>>,
}

impl RankLog {
    /// Starts forwarding `stderr` of rank `rank` to the launcher's stderr, line by line, and
    /// to `file` when given (the rank's own log, untagged).
    pub fn forward(
        rank: usize,
        stderr: impl Read + Send + 'static,
        mut file: Option<File>,
    ) -> Self {
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
        let keep = tail.clone();
        let reader = std::thread::Builder::new()
            .name(format!("rank-{rank}-stderr"))
            .spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if let Some(f) = &mut file {
                        // A full disk must not stop the job: the terminal still gets the line.
                        let _ = writeln!(f, "{line}");
                    }
                    let tagged = if line.starts_with("[rank ") {
                        line
                    } else {
                        format!("[rank {rank}] {line}")
                    };
                    // One write of the line with its newline: `eprintln!` may write them apart, and
                    // a rank's stdout (the same terminal or pipe) could land in between.
                    let _ = std::io::stderr().write_all(format!("{tagged}\n").as_bytes());
                    let mut tail = keep.lock().unwrap_or_else(|p| p.into_inner());
                    if tail.len() == TAIL_LINES {
                        tail.pop_front();
                    }
                    tail.push_back(tagged);
                }
            })
            .ok();
        Self { rank, tail, reader }
    }

    /// Waits for the rank's stderr to close (it has exited), then returns its last lines.
    pub fn last_lines(mut self) -> (usize, Vec<String>) {
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        let tail = self.tail.lock().unwrap_or_else(|p| p.into_inner());
        (self.rank, tail.iter().cloned().collect())
    }
}
