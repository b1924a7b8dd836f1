//! `[data] source = "sqlite"`: a table of an SQLite database in the format of burn-dataset's
//! [`SqliteDataset`] (what Burn's Hugging Face importer writes: one table per split, a
//! `row_id` column numbering the rows from 1, one column per field). The config names the
//! table (`data.table`, default `"train"`) and the feature and target columns.
//!
//! Opening checks the schema (the table, `row_id`, the named columns) and then every row once,
//! in one query (`row_id` runs 1, 2, 3, ... without gaps; the cells read decode), so a bad cell
//! is an error before training starts, naming its `row_id` and column. `get(i)` then reads row
//! `row_id = i + 1` alone through `SqliteDataset` (which deserialises it into a map of cells):
//! a rank reads only the rows of its shard.
//!
//! Tables serialised as one MessagePack `item` blob per row (SqliteDataset's other layout) are
//! not read: their fields are not columns.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use burn::data::dataset::{Dataset, SqliteDataset};
use rusqlite::types::ValueRef;
use rusqlite::{Connection, OpenFlags};
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, SeqAccess, Visitor};

use super::error::{Place, SourceError};
use super::schema::{Cell, Decode};
use super::table::{Rows, TableDataset};

/// The `data.table` when none is given (Burn's name for the training split).
pub const DEFAULT_TABLE: &str = "train";

/// Whether `table` can be a `data.table`: an SQL identifier (`SqliteDataset` puts it into its
/// statements as it is), letters, digits and `_`, not starting with a digit.
pub fn is_table_name(table: &str) -> bool {
    let mut chars = table.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `data.table` checked as [`is_table_name`] says, as a usage error naming the key.
pub fn check_table_name(table: &str) -> Result<(), crate::app::AppError> {
    if is_table_name(table) {
        return Ok(());
    }
    Err(crate::app::AppError::key(
        "data.table",
        format!(
            "\"{table}\" is not a table name (letters, digits and _, not starting with a digit)"
        ),
    ))
}

/// One row as `SqliteDataset` deserialises it: every column by name.
type RowMap = HashMap<String, Cell>;

/// The rows of an opened table, read through `SqliteDataset`.
pub struct SqliteRows {
    path: PathBuf,
    table: String,
    columns: Vec<String>,
    dataset: SqliteDataset<RowMap>,
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
    // SQLite would create a missing file, and SqliteDataset's pool retries for 30 s first.
    std::fs::metadata(path).map_err(|error| SourceError::Open {
        path: path.to_owned(),
        error,
    })?;
    let sql = |e: rusqlite::Error| {
        format(
            path,
            None,
            format!("cannot read it as an SQLite database: {e}"),
        )
    };
    let db = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(sql)?;

    let tables = strings(
        &db,
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
    let names = strings(&db, &format!("PRAGMA table_info({})", quoted(table)), 1).map_err(sql)?;
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
    let columns = decoder.columns().to_vec();
    for column in &columns {
        if !names.contains(column) {
            return Err(SourceError::MissingColumn {
                path: path.to_owned(),
                within: format!("table '{table}'"),
                column: column.clone(),
                available: names,
            });
        }
    }

    let len = check_rows(&db, path, table, &columns, &decoder)?;
    drop(db);
    let dataset = SqliteDataset::<RowMap>::from_db_file(path, table).map_err(|e| {
        format(
            path,
            None,
            format!("burn-dataset's SqliteDataset cannot open table '{table}': {e}"),
        )
    })?;
    if dataset.len() != len {
        return Err(format(
            path,
            None,
            format!(
                "SqliteDataset sees {} rows in table '{table}', the check saw {len} (is the file being written?)",
                dataset.len()
            ),
        ));
    }
    let rows = SqliteRows {
        path: path.to_owned(),
        table: table.to_owned(),
        columns,
        dataset,
    };
    Ok(TableDataset::new(rows, decoder))
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
        columns
            .iter()
            .map(|c| quoted(c))
            .collect::<Vec<_>>()
            .join(", "),
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

impl Rows for SqliteRows {
    fn path(&self) -> &Path {
        &self.path
    }

    fn len(&self) -> usize {
        self.dataset.len()
    }

    fn cells(&self, index: usize) -> Result<(Vec<Cell>, Place), SourceError> {
        let place = Place::Row {
            table: self.table.clone(),
            row_id: index as i64 + 1,
        };
        let mut row = match self.dataset.get(index) {
            Ok(row) => row,
            Err(error) => {
                return Err(format(
                    &self.path,
                    Some(place),
                    format!(
                        "cannot read the row: {error} (has the table changed since it was opened?)"
                    ),
                ))
            }
        };
        let cells = self
            .columns
            .iter()
            .map(|column| row.remove(column).unwrap_or(Cell::Null))
            .collect();
        Ok((cells, place))
    }
}

/// The column `index` of the rows of `sql`, as text.
fn strings(db: &Connection, sql: &str, index: usize) -> rusqlite::Result<Vec<String>> {
    let mut statement = db.prepare(sql)?;
    let rows = statement.query_map([], |row| row.get::<_, String>(index))?;
    let strings: rusqlite::Result<Vec<String>> = rows.collect();
    strings
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

/// Any SQLite value, as `SqliteDataset` hands it over (burn-dataset's row deserializer over
/// turso; a blob comes as a sequence of bytes): never an error.
impl<'de> Deserialize<'de> for Cell {
    fn deserialize<De: Deserializer<'de>>(deserializer: De) -> Result<Self, De::Error> {
        deserializer.deserialize_any(CellVisitor)
    }
}

struct CellVisitor;

impl<'de> Visitor<'de> for CellVisitor {
    type Value = Cell;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an SQLite value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Cell, E> {
        Ok(Cell::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Cell, E> {
        Ok(Cell::Null)
    }

    fn visit_some<De: Deserializer<'de>>(self, deserializer: De) -> Result<Cell, De::Error> {
        Cell::deserialize(deserializer)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Cell, E> {
        Ok(Cell::Integer(i64::from(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Cell, E> {
        Ok(Cell::Integer(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Cell, E> {
        Ok(i64::try_from(v).map_or(Cell::Real(v as f64), Cell::Integer))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Cell, E> {
        Ok(Cell::Real(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Cell, E> {
        Ok(Cell::Text(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Cell, E> {
        Ok(Cell::Text(v))
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Cell, E> {
        Ok(Cell::Blob(v.len()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Cell, A::Error> {
        let mut len = 0;
        while seq.next_element::<IgnoredAny>()?.is_some() {
            len += 1;
        }
        Ok(Cell::Blob(len))
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
    fn reads_rows_through_sqlite_dataset() {
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

    #[test]
    fn table_names_are_identifiers() {
        for ok in ["train", "_x1", "Test_2"] {
            assert!(is_table_name(ok), "{ok}");
        }
        for bad in ["", "1x", "a b", "t;drop", "t\"", "é"] {
            assert!(!is_table_name(bad), "{bad}");
        }
    }
}
