//! The directories the job writes to (`output.dir`, `checkpoint.dir`): there, writable, with
//! room (under [`LOW_DISK_BYTES`] free is a warning).

use std::path::PathBuf;

use super::units::size;
use crate::finding::Finding;

/// Below this much free space in an output directory, a warning.
pub const LOW_DISK_BYTES: u64 = 1 << 30;

/// What was found where the job writes (`output.dir`, `checkpoint.dir`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirState {
    /// A file stands where the directory should be.
    IsFile,
    /// `existing` (the directory, or its nearest existing parent) can be written; `free`
    /// bytes there.
    Writable {
        existing: PathBuf,
        free: Option<u64>,
    },
    /// `existing` cannot be written, for `why`.
    NotWritable { existing: PathBuf, why: String },
}

/// The directories of the config the job writes to: `(config key, path, state)`.
pub fn output_dirs(dirs: &[(&'static str, PathBuf, DirState)]) -> Finding {
    const CHECK: &str = "output";
    if dirs.is_empty() {
        return Finding::skip(
            CHECK,
            "no --config: output.dir and checkpoint.dir not checked",
        );
    }
    let mut shown = Vec::new();
    let mut low = None;
    for (key, path, state) in dirs {
        let path_text = path.display();
        match state {
            DirState::IsFile => {
                return Finding::fail(
                    CHECK,
                    format!("{key} = \"{path_text}\" is a file, not a directory"),
                    format!("point {key} at a directory (it is created if missing)"),
                )
            }
            DirState::NotWritable { existing, why } => {
                return Finding::fail(
                    CHECK,
                    format!(
                        "{key} = \"{path_text}\": {} cannot be written ({why})",
                        existing.display()
                    ),
                    format!("point {key} at a directory you can write, or fix its permissions"),
                )
            }
            DirState::Writable { existing, free } => {
                let free_text = free.map_or_else(String::new, |f| format!(", {} free", size(f)));
                shown.push(format!("{key} = \"{path_text}\" writable{free_text}"));
                if free.is_some_and(|f| f < LOW_DISK_BYTES) {
                    low = Some((*key, existing.clone(), free.unwrap_or(0)));
                }
            }
        }
    }
    match low {
        Some((key, existing, free)) => Finding::warn(
            CHECK,
            format!(
                "{}: only {} free on {} ({key})",
                shown.join("; "),
                size(free),
                existing.display()
            ),
            "free some space, or point the directory elsewhere: checkpoints and metrics are written there",
        ),
        None => Finding::ok(CHECK, shown.join("; ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::finding::Status;

    const MIB: u64 = 1 << 20;

    #[test]
    fn output_directories_must_be_writable_with_room() {
        let writable = |free| DirState::Writable {
            existing: "/data".into(),
            free: Some(free),
        };
        assert_eq!(output_dirs(&[]).status, Status::Skip);
        let ok = output_dirs(&[("output.dir", "/data/run".into(), writable(10 << 30))]);
        assert_eq!(ok.status, Status::Ok);
        let low = output_dirs(&[("output.dir", "/data/run".into(), writable(MIB))]);
        assert_eq!(low.status, Status::Warn);
        let file = output_dirs(&[("checkpoint.dir", "/data/x".into(), DirState::IsFile)]);
        assert_eq!(file.status, Status::Fail);
        assert!(file.detail.contains("checkpoint.dir"));
        let locked = DirState::NotWritable {
            existing: "/".into(),
            why: "Permission denied".into(),
        };
        assert_eq!(
            output_dirs(&[("output.dir", "/run".into(), locked)]).status,
            Status::Fail
        );
    }
}
