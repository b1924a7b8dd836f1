//! The lines of `metrics.jsonl`, read leniently (pure: text in, records out).
//!
//! The file is written by [`crate::report::record::Record`]; older files lack the `start` and `finish`
//! lines and the `time` of `train` lines, so every field not needed to place a point is
//! optional here, unknown fields are ignored, and lines of unknown kinds (`finish`, kinds added
//! later) are skipped. A `null` metric value (a NaN when written) reads as `None`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use super::error::PlotError;

/// One line of `metrics.jsonl` that the charts use.
#[derive(Debug, Clone, PartialEq)]
pub enum Line {
    Start(StartLine),
    Train(TrainLine),
    Valid(ValidLine),
}

/// A run (fresh or resumed) started: `{"kind":"start",...}`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct StartLine {
    /// The optimizer step it starts after (0 for a fresh run).
    #[serde(default)]
    pub step: usize,
    /// The epoch it starts in (0-based).
    pub epoch: Option<usize>,
    pub world_size: Option<usize>,
    /// The step of the checkpoint it resumed from.
    pub resumed_from: Option<usize>,
    /// The launcher's restart count.
    #[serde(default)]
    pub restart: u64,
}

/// Training metrics at an optimizer step: `{"kind":"train",...}`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TrainLine {
    /// 0-based.
    pub epoch: Option<usize>,
    pub step: usize,
    pub lr: Option<f64>,
    /// Global samples per second (all ranks).
    pub samples_per_sec: Option<f64>,
    pub world_size: Option<usize>,
    #[serde(default)]
    pub metrics: BTreeMap<String, Option<f64>>,
    /// Seconds per optimizer step by phase, over the ranks.
    pub time: Option<Box<TimeLine>>,
}

/// A validation: `{"kind":"valid",...}`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ValidLine {
    /// The epoch during which it ran (0-based).
    pub epoch: usize,
    /// The optimizer step of the model it validated.
    pub step: Option<usize>,
    #[serde(default)]
    pub metrics: BTreeMap<String, Option<f64>>,
}

/// The `time` of a `train` line: seconds per optimizer step, each phase over the ranks.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct TimeLine {
    pub data: Option<SpreadLine>,
    pub compute: Option<SpreadLine>,
    pub sync: Option<SpreadLine>,
    pub optimizer: Option<SpreadLine>,
    pub checkpoint: Option<SpreadLine>,
    /// A whole step's wall time.
    pub step: Option<SpreadLine>,
    pub slowest_rank: Option<usize>,
}

/// A quantity over the ranks (a [`crate::report::timing::Spread`] as written, each part optional).
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
pub struct SpreadLine {
    pub min: Option<f64>,
    pub median: Option<f64>,
    pub max: Option<f64>,
}

/// Parses every line of `text` (the contents of `path`, which is only named in errors).
///
/// Blank lines and lines of unknown kinds are skipped. A line that is not a JSON object, or a
/// `start`/`train`/`valid` line missing a field a chart needs (or with a field of the wrong
/// type), is [`PlotError::BadLine`] with its 1-based line number — except a last line without
/// its newline that is not JSON: a line the run is still writing, left out.
pub fn parse_lines(text: &str, path: &Path) -> Result<Vec<Line>, PlotError> {
    let mut lines = Vec::new();
    let unfinished = (!text.ends_with('\n')).then(|| text.lines().count());
    for (index, raw) in text.lines().enumerate() {
        let raw = raw.trim();
        if raw.is_empty() {
            continue;
        }
        let being_written = unfinished == Some(index + 1);
        if being_written && serde_json::from_str::<serde_json::Value>(raw).is_err() {
            continue;
        }
        let bad = |reason: String| PlotError::BadLine {
            path: path.to_path_buf(),
            line: index + 1,
            reason,
        };
        let value: serde_json::Value =
            serde_json::from_str(raw).map_err(|e| bad(format!("not JSON: {}", json_reason(&e))))?;
        let Some(object) = value.as_object() else {
            return Err(bad("not a JSON object".into()));
        };
        let kind = object
            .get("kind")
            .and_then(|k| k.as_str())
            .unwrap_or("")
            .to_string();
        let typed = |what: &str, e: serde_json::Error| bad(format!("a {what} record: {e}"));
        let line = match kind.as_str() {
            "start" => Line::Start(serde_json::from_value(value).map_err(|e| typed(&kind, e))?),
            "train" => Line::Train(serde_json::from_value(value).map_err(|e| typed(&kind, e))?),
            "valid" => Line::Valid(serde_json::from_value(value).map_err(|e| typed(&kind, e))?),
            _ => continue,
        };
        lines.push(line);
    }
    Ok(lines)
}

/// serde_json's message without its "at line 1" (the line is the file's, named apart).
fn json_reason(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.rfind(" at line ") {
        Some(i) => format!("{} at column {}", &text[..i], e.column()),
        None => text,
    }
}
