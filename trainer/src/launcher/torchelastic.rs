//! torchrun's error file: a rank that fails writes its error where `TORCHELASTIC_ERROR_FILE`
//! says, in the JSON layout of PyTorch's `@record` decorator, so torchrun's failure summary
//! shows the root cause (the first failing rank's message) instead of "error_file: <N/A>".

use std::time::{SystemTime, UNIX_EPOCH};

/// The variable torchrun sets for each worker.
pub const ERROR_FILE_VAR: &str = "TORCHELASTIC_ERROR_FILE";

/// The file's content for `message`: `{"message": {"message", "extraInfo": {"py_callstack",
/// "timestamp"}}}` (the timestamp in seconds, as a string, as `@record` writes it).
pub fn error_file_json(message: &str, unix_seconds: u64) -> String {
    serde_json::json!({
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": message,
                "timestamp": unix_seconds.to_string(),
            }
        }
    })
    .to_string()
}

/// Writes `message` to torchrun's error file when there is one. Best effort: a failure to
/// write is reported on stderr and does not change the exit code.
pub fn record_failure(message: &str) {
    let Some(path) = std::env::var_os(ERROR_FILE_VAR).filter(|p| !p.is_empty()) else {
        return;
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if let Err(e) = std::fs::write(&path, error_file_json(message, now)) {
        eprintln!(
            "cannot write torchrun's error file {}: {e}",
            std::path::Path::new(&path).display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_torchrun_reads() {
        let v: serde_json::Value =
            serde_json::from_str(&error_file_json("bad \"input\"", 17)).unwrap();
        assert_eq!(v["message"]["message"], "bad \"input\"");
        assert_eq!(v["message"]["extraInfo"]["timestamp"], "17");
    }
}
