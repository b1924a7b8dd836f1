//! Why a data source could not be opened or one of its items read. Every message names the
//! file (or folder), and where in it: the line, the row, the column or the entry.

use std::fmt;
use std::io;
use std::path::PathBuf;

use crate::data::io_message;
use crate::features::FeatureMissing;

/// Where in a file a problem is: what the message puts after the path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// A CSV record, by the 1-based line it starts on.
    Line(u64),
    /// A CSV record read after opening (`get`): its 0-based index among the records and its
    /// byte offset (line numbers are not kept).
    Record { index: usize, byte: u64 },
    /// A row of an SQLite table, by its `row_id`.
    Row { table: String, row_id: i64 },
}

impl fmt::Display for Place {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Line(line) => write!(f, "line {line}"),
            Self::Record { index, byte } => write!(f, "record {} (byte {byte})", index + 1),
            Self::Row { table, row_id } => write!(f, "table '{table}' row_id {row_id}"),
        }
    }
}

/// A data source's error (module docs). The apps turn it into an `AppError` (exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The file or folder could not be opened (missing, unreadable).
    #[error("cannot open data file '{}': {} (set data.path in the config)", path.display(), io_message(error))]
    Open { path: PathBuf, error: io::Error },

    /// Reading failed after opening.
    #[error("cannot read data file '{}': {}", path.display(), io_message(error))]
    Read { path: PathBuf, error: io::Error },

    /// The file is not in the source's format (e.g. a compressed CSV, a malformed record, not
    /// an SQLite database).
    #[error("{}{}: {message}", path.display(), place.as_ref().map(|p| format!(" {p}")).unwrap_or_default())]
    Format {
        path: PathBuf,
        place: Option<Place>,
        message: String,
    },

    /// A column named by the config is not in the file.
    #[error("{}: no column '{column}' in {within} (its columns: {}); check data.features and data.target", path.display(), listed(available))]
    MissingColumn {
        path: PathBuf,
        /// "the header", "table 'train'".
        within: String,
        column: String,
        available: Vec<String>,
    },

    /// A cell that does not hold what its column must (a number, a class).
    #[error("{} {place}, column '{column}': {message}", path.display())]
    Cell {
        path: PathBuf,
        place: Place,
        column: String,
        message: String,
    },

    /// No SQLite table of that name.
    #[error("{}: no table '{table}' (its tables: {}); set data.table", path.display(), listed(tables))]
    NoTable {
        path: PathBuf,
        table: String,
        tables: Vec<String>,
    },

    /// The file holds no samples, or the folder no class or no image.
    #[error("{} {what}", path.display())]
    Empty { path: PathBuf, what: String },

    /// An image that cannot be decoded.
    #[error("cannot decode image '{}': {message}", path.display())]
    Image { path: PathBuf, message: String },

    /// This build cannot read the source (it lacks the cargo feature that reads it).
    #[error(transparent)]
    NotBuilt(#[from] FeatureMissing),
}

/// `names` comma-separated, or "none".
fn listed(names: &[String]) -> String {
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

impl SourceError {
    /// A cell of `path` at `place` that does not decode.
    pub fn cell(path: &std::path::Path, place: Place, e: super::schema::CellError) -> Self {
        Self::Cell {
            path: path.to_owned(),
            place,
            column: e.column,
            message: e.message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_file_and_the_place() {
        let path = PathBuf::from("d/x.csv");
        let cell = SourceError::Cell {
            path: path.clone(),
            place: Place::Line(7),
            column: "price".into(),
            message: "expected a number, found \"abc\"".into(),
        };
        assert_eq!(
            cell.to_string(),
            "d/x.csv line 7, column 'price': expected a number, found \"abc\""
        );
        let row = SourceError::Cell {
            path: "t.db".into(),
            place: Place::Row {
                table: "train".into(),
                row_id: 3,
            },
            column: "y".into(),
            message: "m".into(),
        };
        assert_eq!(
            row.to_string(),
            "t.db table 'train' row_id 3, column 'y': m"
        );
        let missing = SourceError::MissingColumn {
            path,
            within: "the header".into(),
            column: "z".into(),
            available: vec!["a".into(), "b".into()],
        };
        assert_eq!(
            missing.to_string(),
            "d/x.csv: no column 'z' in the header (its columns: a, b); check data.features and data.target"
        );
        let open = SourceError::Open {
            path: "/no/such".into(),
            error: io::Error::from_raw_os_error(2),
        };
        assert_eq!(
            open.to_string(),
            "cannot open data file '/no/such': No such file or directory (set data.path in the config)"
        );
        let record = SourceError::Format {
            path: "x.csv".into(),
            place: Some(Place::Record { index: 4, byte: 99 }),
            message: "m".into(),
        };
        assert_eq!(record.to_string(), "x.csv record 5 (byte 99): m");
    }
}
