//! `[data] source = "sqlite"` (cargo feature `sqlite`): a table of an SQLite database in the
//! format of burn-dataset's `SqliteDataset` (what Burn's Hugging Face importer writes: one
//! table per split, a `row_id` column numbering the rows from 1, one column per field), read
//! with rusqlite (SQLite compiled from source: no system library). The config names the table
//! (`data.table`, default `"train"`: [`crate::sources::sqlite`]) and the feature and target
//! columns.
//!
//! Opening checks the schema (the table, `row_id`, the named columns) and then every row once,
//! in one query (`row_id` runs 1, 2, 3, ... without gaps; the cells read decode), so a bad cell
//! is an error before training starts, naming its `row_id` and column. `get(i)` then reads row
//! `row_id = i + 1` alone, its named columns only, decoded as the check decoded them: a rank
//! reads only the rows of its shard.
//!
//! Tables serialised as one MessagePack `item` blob per row (SqliteDataset's other layout) are
//! not read: their fields are not columns.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use burn::data::dataset::Dataset;
use rusqlite::types::ValueRef;
use rusqlite::{Connection, OpenFlags};

use crate::sources::error::{Place, SourceError};
use crate::sources::schema::{Cell, Decode};
use crate::sources::table::{Rows, TableDataset};

/// The rows of an opened table, each read by its own `SELECT ... WHERE row_id = ?`.
pub struct SqliteRows {
    path: PathBuf,
    table: String,
    columns: Vec<String>,
    len: usize,
    /// The statement that reads one row's `columns`, its `row_id` bound.
    select: String,
    /// Connections not in use. Burn's data loader calls `get` from several worker threads at
    /// once and a connection runs one statement at a time, so each read takes a connection from
    /// here (opening one when every connection is busy) and puts it back after: the pool grows
    /// to the number of threads reading at once, and they read in parallel (SQLite allows many
    /// readers of a file). One `Mutex<Connection>` would make the workers wait for each other;
    /// a connection per thread would outlive the data set in every thread that ever read it.
    /// The lock is held only to take or return a connection, never during a read.
    idle: Mutex<Vec<Connection>>,
}

/// Opens table `table` of the SQLite database `path` and checks every row with `decoder`
/// (module docs).
///
/// # Errors
///
/// [`SourceError::Open`] (no such file), [`SourceError::Format`] (not an SQLite database, no
/// `row_id` column, gaps in `row_id`), [`SourceError::NoTable`] (listing the tables),
/// [`SourceError::MissingColumn`] (listing the columns), [`SourceError::Cell`] (with its
/// `row_id` and column), [`SourceError::Empty`] (no rows).
pub fn open<I, D: Decode<I>>(
    path: &Path,
    table: &str,
    decoder: D,
) -> Result<TableDataset<SqliteRows, D, I>, SourceError> {
    let db = connect(path)?;
    let columns = decoder.columns().to_vec();
    check_schema(&db, path, table, &columns)?;
    let len = check_rows(&db, path, table, &columns, &decoder)?;
    let select = format!(
        "SELECT {} FROM {} WHERE row_id = ?1",
        listed(&columns),
        quoted(table)
    );
    let rows = SqliteRows {
        path: path.to_owned(),
        table: table.to_owned(),
        columns,
        len,
        select,
        // The connection of the check is the first one a read takes.
        idle: Mutex::new(vec![db]),
    };
    Ok(TableDataset::new(rows, decoder))
}

/// [`open`] as the data set the apps split.
pub fn dataset<I, D>(
    path: &Path,
    table: &str,
    decoder: D,
) -> Result<Box<dyn Dataset<I>>, SourceError>
where
    I: Send + Sync + 'static,
    D: Decode<I>,
{
    Ok(Box::new(open(path, table, decoder)?))
}

/// A read-only connection to the existing database `path`.
fn connect(path: &Path) -> Result<Connection, SourceError> {
    // Opened read-only, SQLite would refuse a missing file with a vaguer message ("unable to
    // open database file") than the one every source gives.
    std::fs::metadata(path).map_err(|error| SourceError::Open {
        path: path.to_owned(),
        error,
    })?;
    read_only(path).map_err(|e| not_a_database(path, e))
}

/// A connection that reads `path` and writes nothing (it never creates the file). Each is used
/// by one thread at a time ([`SqliteRows::idle`]), so SQLite's own locking of a connection is
/// left out.
fn read_only(path: &Path) -> rusqlite::Result<Connection> {
    Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
}

fn not_a_database(path: &Path, e: rusqlite::Error) -> SourceError {
    format(
        path,
        None,
        format!("cannot read it as an SQLite database: {e}"),
    )
}

/// Checks that `table` exists and has a `row_id` column and every one of `wanted`.
fn check_schema(
    db: &Connection,
    path: &Path,
    table: &str,
    wanted: &[String],
) -> Result<(), SourceError> {
    let sql = |e| not_a_database(path, e);
    let tables = strings(
        db,
        "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') ORDER BY name",
        0,
    )
    .map_err(sql)?;
    if !tables.iter().any(|t| t == table) {
        return Err(SourceError::NoTable {
            path: path.to_owned(),
            table: table.to_owned(),
            tables,
        });
    }
    let names = strings(db, &format!("PRAGMA table_info({})", quoted(table)), 1).map_err(sql)?;
    if !names.iter().any(|n| n.eq_ignore_ascii_case("row_id")) {
        return Err(format(
            path,
            None,
            format!(
                "table '{table}' has no row_id column (its columns: {}): the sqlite source reads \
                 tables in burn-dataset's SqliteDataset format (row_id = 1, 2, 3, ... and a column per field)",
                names.join(", ")
            ),
        ));
    }
    if let Some(column) = wanted.iter().find(|c| !names.contains(c)) {
        return Err(SourceError::MissingColumn {
            path: path.to_owned(),
            within: format!("table '{table}'"),
            column: column.clone(),
            available: names,
        });
    }
    Ok(())
}

/// Reads every row of `columns` in one query: `row_id` must run 1, 2, 3, ... and the cells
/// must decode. Returns the number of rows.
fn check_rows<I, D: Decode<I>>(
    db: &Connection,
    path: &Path,
    table: &str,
    columns: &[String],
    decoder: &D,
) -> Result<usize, SourceError> {
    let sql = |e: rusqlite::Error| format(path, None, format!("cannot read table '{table}': {e}"));
    let select = format!(
        "SELECT row_id, {} FROM {} ORDER BY row_id",
        listed(columns),
        quoted(table)
    );
    let mut statement = db.prepare(&select).map_err(sql)?;
    let mut rows = statement.query([]).map_err(sql)?;
    let mut len = 0usize;
    while let Some(row) = rows.next().map_err(sql)? {
        let expected = len as i64 + 1;
        let row_id = match row.get_ref(0).map_err(sql)? {
            ValueRef::Integer(id) => id,
            other => {
                return Err(format(
                    path,
                    None,
                    format!(
                        "table '{table}': row_id must be an integer, found {:?} after row_id {}",
                        other.data_type(),
                        expected - 1
                    ),
                ))
            }
        };
        let place = Place::Row {
            table: table.to_owned(),
            row_id,
        };
        if row_id != expected {
            return Err(format(
                path,
                Some(place),
                format!(
                    "row_id must run 1, 2, 3, ... without gaps (SqliteDataset reads item i at row_id i + 1); \
                     expected row_id {expected}"
                ),
            ));
        }
        let cells = (1..=columns.len())
            .map(|k| row.get_ref(k).map(cell))
            .collect::<Result<Vec<Cell>, _>>()
            .map_err(sql)?;
        decoder
            .decode(&cells)
            .map_err(|e| SourceError::cell(path, place, e))?;
        len += 1;
    }
    if len == 0 {
        return Err(SourceError::Empty {
            path: path.to_owned(),
            what: format!("table '{table}' has no rows: it contains no samples"),
        });
    }
    Ok(len)
}

impl SqliteRows {
    /// The cells of row `row_id`, read on a connection of the pool (module docs of
    /// [`SqliteRows::idle`]).
    fn read(&self, row_id: i64) -> rusqlite::Result<Vec<Cell>> {
        let taken = self
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let db = match taken {
            Some(db) => db,
            None => read_only(&self.path)?,
        };
        let cells = db.prepare_cached(&self.select).and_then(|mut statement| {
            statement.query_row([row_id], |row| {
                (0..self.columns.len())
                    .map(|k| row.get_ref(k).map(cell))
                    .collect()
            })
        });
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(db);
        cells
    }
}

impl Rows for SqliteRows {
    fn path(&self) -> &Path {
        &self.path
    }

    fn len(&self) -> usize {
        self.len
    }

    fn cells(&self, index: usize) -> Result<(Vec<Cell>, Place), SourceError> {
        let row_id = index as i64 + 1;
        let place = Place::Row {
            table: self.table.clone(),
            row_id,
        };
        match self.read(row_id) {
            Ok(cells) => Ok((cells, place)),
            Err(error) => Err(format(
                &self.path,
                Some(place),
                format!(
                    "cannot read the row: {error} (has the table changed since it was opened?)"
                ),
            )),
        }
    }
}

/// The column `index` of the rows of `sql`, as text.
fn strings(db: &Connection, sql: &str, index: usize) -> rusqlite::Result<Vec<String>> {
    let mut statement = db.prepare(sql)?;
    let rows = statement.query_map([], |row| row.get::<_, String>(index))?;
    let strings: rusqlite::Result<Vec<String>> = rows.collect();
    strings
}

/// `columns` as the list of a `SELECT`.
fn listed(columns: &[String]) -> String {
    columns
        .iter()
        .map(|c| quoted(c))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `name` as an SQL identifier in double quotes.
fn quoted(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn cell(value: ValueRef<'_>) -> Cell {
    match value {
        ValueRef::Null => Cell::Null,
        ValueRef::Integer(i) => Cell::Integer(i),
        ValueRef::Real(r) => Cell::Real(r),
        ValueRef::Text(text) => Cell::Text(String::from_utf8_lossy(text).into_owned()),
        ValueRef::Blob(blob) => Cell::Blob(blob.len()),
    }
}

fn format(path: &Path, place: Option<Place>, message: impl Into<String>) -> SourceError {
    SourceError::Format {
        path: path.to_owned(),
        place,
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sources::schema::{ClassColumns, ValueColumns};

    /// A database under the temp dir with `sql` run in it.
    fn database(name: &str, sql: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("trainer-sqlite-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        Connection::open(&path).unwrap().execute_batch(sql).unwrap();
        path
    }

    const TRAIN: &str = "CREATE TABLE train (row_id INTEGER PRIMARY KEY, a REAL, \"b c\" INTEGER, label INTEGER, name TEXT, img BLOB);
        INSERT INTO train VALUES (1, 0.5, 2, 1, 'one', x'0102'), (2, -1.5, 3, 0, 'two', NULL), (3, 4, 5, 1, 'three', x'');";

    fn schema() -> ClassColumns {
        ClassColumns::new(vec!["a".into(), "b c".into()], "label".into(), 2, None)
    }

    #[test]
    fn reads_each_row_by_its_row_id() {
        let path = database("ok.db", TRAIN);
        let data = open(&path, "train", schema()).unwrap();
        assert_eq!(data.len(), 3);
        let item = data.get(1).unwrap();
        assert_eq!((item.features, item.label), (vec![-1.5, 3.0], 0));
        assert_eq!(data.get(2).unwrap().features, vec![4.0, 5.0]);
        // Past the end, Burn's `Dataset::get` panics.
        let past = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| data.get(3)));
        assert!(past.is_err(), "index 3 of 3 rows");

        let labels = Some(vec!["three".to_owned(), "one".into(), "two".into()]);
        let by_name = ClassColumns::new(vec!["a".into()], "name".into(), 3, labels);
        let data = open(&path, "train", by_name).unwrap();
        assert_eq!(data.get(0).unwrap().label, 1);
        let values = ValueColumns::new(vec!["b c".into()], vec!["a".into()]);
        let data = open(&path, "train", values).unwrap();
        assert_eq!(data.get(2).unwrap().targets, vec![4.0]);
    }

    fn error(name: &str, sql: &str, table: &str) -> String {
        let path = database(name, sql);
        let message = open(&path, table, schema()).err().map(|e| e.to_string());
        message
            .unwrap_or_default()
            .replace(&path.display().to_string(), "DB")
    }

    #[test]
    fn bad_tables_name_the_row_and_column() {
        assert_eq!(
            error("table.db", TRAIN, "test"),
            "DB: no table 'test' (its tables: train); set data.table"
        );
        assert_eq!(
            error("column.db", "CREATE TABLE train (row_id INTEGER PRIMARY KEY, a REAL, label INTEGER);", "train"),
            "DB: no column 'b c' in table 'train' (its columns: row_id, a, label); check data.features and data.target"
        );
        assert_eq!(
            error(
                "cell.db",
                &format!("{TRAIN} INSERT INTO train VALUES (4, 'abc', 1, 0, '', NULL);"),
                "train"
            ),
            "DB table 'train' row_id 4, column 'a': expected a number, found \"abc\""
        );
        assert_eq!(
            error(
                "null.db",
                &format!("{TRAIN} INSERT INTO train VALUES (4, 1, NULL, 0, '', NULL);"),
                "train"
            ),
            "DB table 'train' row_id 4, column 'b c': expected a number, found NULL"
        );
        assert_eq!(
            error("gap.db", &format!("{TRAIN} INSERT INTO train VALUES (5, 1, 1, 0, '', NULL);"), "train"),
            "DB table 'train' row_id 5: row_id must run 1, 2, 3, ... without gaps (SqliteDataset reads item i at row_id i + 1); expected row_id 4"
        );
        assert!(error(
            "norowid.db",
            "CREATE TABLE train (a REAL, \"b c\" REAL, label INTEGER);",
            "train"
        )
        .contains("has no row_id column"));
        assert_eq!(
            error("empty.db", "CREATE TABLE train (row_id INTEGER PRIMARY KEY, a REAL, \"b c\" REAL, label INTEGER);", "train"),
            "DB table 'train' has no rows: it contains no samples"
        );

        let dir = std::env::temp_dir().join(format!("trainer-sqlite-{}", std::process::id()));
        let text = dir.join("text.db");
        std::fs::write(&text, "not a database, just text that is long enough to have a header ........................................").unwrap();
        let message = open(&text, "train", schema())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            message.contains("cannot read it as an SQLite database"),
            "{message}"
        );
        let missing = open(&dir.join("none.db"), "train", schema()).err();
        assert!(
            matches!(missing, Some(SourceError::Open { .. })),
            "{missing:?}"
        );
        assert!(
            !dir.join("none.db").exists(),
            "a missing file is not created"
        );
    }
}
