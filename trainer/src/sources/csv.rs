//! `[data] source = "csv"`: a CSV file with a header row naming its columns, of any width;
//! the config names the feature and target columns.
//!
//! Opening reads the file once, sequentially: it finds the byte offset of every record and
//! checks every record (its field count, and that the cells read decode: numbers, classes), so
//! that a bad cell is an error before training starts, naming its line and column. It keeps
//! only the offsets (8 bytes a record), not the values. `get(i)` then reads record `i` alone
//! (one positioned read) and parses it: a rank reads only the records of its shard.
//!
//! Format: RFC 4180 as the `csv` crate reads it (comma-separated, `"`-quoted fields may hold
//! commas and line breaks, blank lines skipped), UTF-8, not compressed. Numbers are parsed as
//! `f32`, surrounding spaces ignored.

use std::fs::File;
use std::io::{BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use csv::{ByteRecord, ReaderBuilder};

use super::error::{Place, SourceError};
use super::schema::{Cell, Decode};
use super::table::{Rows, TableDataset};

/// The records of an opened CSV file, by byte offset.
#[derive(Debug)]
pub struct CsvRows {
    path: PathBuf,
    file: File,
    /// Where each record starts, then where the last one ends.
    bounds: Vec<u64>,
    /// The field of each column read.
    fields: Vec<usize>,
    /// Fields of every record (the header's).
    width: usize,
}

/// Opens the CSV file `path` and checks every record with `decoder` (module docs).
///
/// # Errors
///
/// [`SourceError::Open`] (missing, unreadable), [`SourceError::Format`] (compressed, a record
/// with another number of fields than the header, malformed CSV, not UTF-8),
/// [`SourceError::MissingColumn`], [`SourceError::Cell`] (a cell that does not decode, with its
/// line and column), [`SourceError::Empty`] (no header, or no record).
pub fn open<I, D: Decode<I>>(
    path: &Path,
    decoder: D,
) -> Result<TableDataset<CsvRows, D, I>, SourceError> {
    let file = open_plain(path)?;
    let file_reader = BufReader::with_capacity(
        1 << 16,
        File::open(path).map_err(|error| SourceError::Open {
            path: path.to_owned(),
            error,
        })?,
    );
    let mut reader = ReaderBuilder::new()
        .has_headers(true)
        .flexible(true)
        .from_reader(file_reader);
    let header = reader
        .byte_headers()
        .map_err(|e| csv_error(path, e))?
        .clone();
    if header.is_empty() {
        return Err(SourceError::Empty {
            path: path.to_owned(),
            what: "is empty: the csv source needs a header row naming the columns, then one row per sample".into(),
        });
    }
    let names: Vec<String> = header
        .iter()
        .map(|name| String::from_utf8_lossy(name).trim().to_owned())
        .collect();
    let fields = column_fields(path, &names, decoder.columns())?;

    let rows = CsvRows {
        path: path.to_owned(),
        file,
        bounds: Vec::new(),
        fields,
        width: names.len(),
    };
    let mut bounds = Vec::new();
    let mut record = ByteRecord::new();
    while reader
        .read_byte_record(&mut record)
        .map_err(|e| csv_error(path, e))?
    {
        let (byte, line) = record.position().map_or((0, 0), |p| (p.byte(), p.line()));
        let place = Place::Line(line);
        let cells = rows.cells_of(&record, &place)?;
        decoder
            .decode(&cells)
            .map_err(|e| SourceError::cell(path, place, e))?;
        bounds.push(byte);
    }
    if bounds.is_empty() {
        return Err(SourceError::Empty {
            path: path.to_owned(),
            what: "has a header but no rows: it contains no samples".into(),
        });
    }
    bounds.push(reader.position().byte());
    Ok(TableDataset::new(CsvRows { bounds, ..rows }, decoder))
}

/// The file at `path`, refused when it is gzip-compressed (by its magic number).
fn open_plain(path: &Path) -> Result<File, SourceError> {
    let opened = |error| SourceError::Open {
        path: path.to_owned(),
        error,
    };
    let file = File::open(path).map_err(opened)?;
    let mut magic = [0u8; 2];
    let read = (&file).take(2).read(&mut magic).map_err(opened)?;
    if read == 2 && magic == [0x1f, 0x8b] {
        return Err(format(
            path,
            None,
            "the file is gzip-compressed; the csv source reads plain-text CSV (decompress it, e.g. with gunzip)",
        ));
    }
    Ok(file)
}

/// The field index of each of `columns` in the header `names` (each named exactly once).
fn column_fields(
    path: &Path,
    names: &[String],
    columns: &[String],
) -> Result<Vec<usize>, SourceError> {
    columns
        .iter()
        .map(|column| {
            let mut at = names.iter().enumerate().filter(|(_, n)| *n == column);
            match (at.next(), at.next()) {
                (Some((field, _)), None) => Ok(field),
                (Some(_), Some(_)) => Err(format(
                    path,
                    Some(Place::Line(1)),
                    &format!("the header names column '{column}' more than once"),
                )),
                (None, _) => Err(SourceError::MissingColumn {
                    path: path.to_owned(),
                    within: "the header".into(),
                    column: column.clone(),
                    available: names.to_vec(),
                }),
            }
        })
        .collect()
}

impl CsvRows {
    /// The cells of the columns read, from one record of `width` fields.
    fn cells_of(&self, record: &ByteRecord, place: &Place) -> Result<Vec<Cell>, SourceError> {
        if record.len() != self.width {
            return Err(format(
                &self.path,
                Some(place.clone()),
                &format!("has {} fields, the header has {}", record.len(), self.width),
            ));
        }
        self.fields
            .iter()
            .map(|&field| {
                let bytes = record.get(field).unwrap_or_default();
                String::from_utf8(bytes.to_vec())
                    .map(Cell::Text)
                    .map_err(|_| {
                        format(
                            &self.path,
                            Some(place.clone()),
                            &format!("field {} is not UTF-8 text", field + 1),
                        )
                    })
            })
            .collect()
    }
}

impl Rows for CsvRows {
    fn path(&self) -> &Path {
        &self.path
    }

    fn len(&self) -> usize {
        self.bounds.len().saturating_sub(1)
    }

    fn cells(&self, index: usize) -> Result<(Vec<Cell>, Place), SourceError> {
        let (start, end) = (self.bounds[index], self.bounds[index + 1]);
        let place = Place::Record { index, byte: start };
        let mut bytes = vec![0u8; usize::try_from(end - start).unwrap_or(0)];
        self.file
            .read_exact_at(&mut bytes, start)
            .map_err(|error| SourceError::Read {
                path: self.path.clone(),
                error,
            })?;
        let mut reader = ReaderBuilder::new()
            .has_headers(false)
            .flexible(true)
            .from_reader(bytes.as_slice());
        let mut record = ByteRecord::new();
        match reader.read_byte_record(&mut record) {
            Ok(true) => {}
            Ok(false) => {
                return Err(format(
                    &self.path,
                    Some(place),
                    "no record there (has the file changed since it was opened?)",
                ))
            }
            Err(e) => return Err(format(&self.path, Some(place), &e.to_string())),
        }
        let cells = self.cells_of(&record, &place)?;
        Ok((cells, place))
    }
}

fn format(path: &Path, place: Option<Place>, message: &str) -> SourceError {
    SourceError::Format {
        path: path.to_owned(),
        place,
        message: message.to_owned(),
    }
}

/// A `csv` crate error: an I/O error, or malformed CSV at a line.
fn csv_error(path: &Path, error: csv::Error) -> SourceError {
    let place = error.position().map(|p| Place::Line(p.line()));
    let message = error.to_string();
    match error.into_kind() {
        csv::ErrorKind::Io(error) => SourceError::Read {
            path: path.to_owned(),
            error,
        },
        _ => format(path, place, &message),
    }
}

#[cfg(test)]
mod tests {
    use burn::data::dataset::Dataset;

    use super::*;
    use crate::sources::schema::{ClassColumns, ValueColumns};

    fn file(name: &str, text: impl AsRef<[u8]>) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("trainer-csv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn class_schema() -> ClassColumns {
        ClassColumns::new(vec!["a".into(), "b".into()], "y".into(), 2, None)
    }

    #[test]
    fn reads_records_by_offset_in_any_order() {
        let path = file(
            "ok.csv",
            "id,b,note,a,y\n1,0.5,\"x, \"\"quoted\"\"\nover lines\",2,1\n\n2, 1.5 ,plain,-3,0\r\n3,2,z,4,1",
        );
        let data = open(&path, class_schema()).unwrap();
        assert_eq!(data.len(), 3);
        let item = |i| data.get(i).unwrap();
        assert_eq!((item(2).features, item(2).label), (vec![4.0, 2.0], 1));
        assert_eq!((item(0).features, item(0).label), (vec![2.0, 0.5], 1));
        assert_eq!((item(1).features, item(1).label), (vec![-3.0, 1.5], 0));
        // Past the end, Burn's `Dataset::get` panics.
        let past = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| data.get(3)));
        assert!(past.is_err(), "index 3 of 3 rows");
    }

    #[test]
    fn regression_rows_with_several_targets() {
        let path = file("reg.csv", "x,t1,t2\n1,2,3\n4,5,6\n");
        let schema = ValueColumns::new(vec!["x".into()], vec!["t2".into(), "t1".into()]);
        let data = open(&path, schema).unwrap();
        let item = data.get(1).unwrap();
        assert_eq!((item.features, item.targets), (vec![4.0], vec![6.0, 5.0]));
    }

    fn error(name: &str, text: impl AsRef<[u8]>) -> String {
        let path = file(name, text);
        let message = open(&path, class_schema()).unwrap_err().to_string();
        message.replace(&path.display().to_string(), "FILE")
    }

    #[test]
    fn bad_files_name_the_line_and_column() {
        assert_eq!(
            error("cell.csv", "a,b,y\n1,2,0\n1,x,1\n"),
            "FILE line 3, column 'b': expected a number, found \"x\""
        );
        assert_eq!(
            error("missing.csv", "a,c,y\n1,2,0\n"),
            "FILE: no column 'b' in the header (its columns: a, c, y); check data.features and data.target"
        );
        assert_eq!(
            error("width.csv", "a,b,y\n1,2,0\n1,2\n"),
            "FILE line 3: has 2 fields, the header has 3"
        );
        assert_eq!(
            error("class.csv", "a,b,y\n1,2,2\n"),
            "FILE line 2, column 'y': expected a class index (an integer in 0..=1, data.classes = 2), found \"2\""
        );
        assert_eq!(
            error("twice.csv", "a,b,y,a\n1,2,0,1\n"),
            "FILE line 1: the header names column 'a' more than once"
        );
        assert_eq!(
            error("header-only.csv", "a,b,y\n"),
            "FILE has a header but no rows: it contains no samples"
        );
        assert!(error("empty.csv", "").starts_with("FILE is empty"));
        let gz = error("gz.csv", b"\x1f\x8brest");
        assert!(gz.contains("gzip-compressed"), "{gz}");
        let missing = open(Path::new("/no/such.csv"), class_schema()).unwrap_err();
        assert!(matches!(missing, SourceError::Open { .. }), "{missing}");
    }

    #[test]
    fn a_file_changed_after_opening_is_an_error_not_a_panic() {
        let path = file("changed.csv", "a,b,y\n1,2,0\n3,4,1\n");
        let data = open(&path, class_schema()).unwrap();
        std::fs::write(&path, "a,b,y\n1,2,0\n3,zz,1\n").unwrap();
        let message = data
            .read(1)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            message.ends_with("record 2 (byte 12), column 'b': expected a number, found \"zz\""),
            "{message}"
        );
        std::fs::write(&path, "a").unwrap();
        assert!(data.read(1).is_err());
    }
}
