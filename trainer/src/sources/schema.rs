//! The columns a table source (CSV, SQLite) reads, and how the cells of one row become an item:
//! features as `f32`, the target as a class index (classifier) or as numbers (regression).

use serde::{Deserialize, Serialize};

use crate::app::AppError;
use crate::data::ClassificationItem;
use models::RegressionItem;

/// `data.features`: how many (synthetic data) or which columns (csv, sqlite).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(
    untagged,
    expecting = "a number of features (synthetic data) or a list of column names (csv, sqlite)"
)]
pub enum Features {
    Count(usize),
    Columns(Vec<String>),
}

impl Features {
    /// Features per sample.
    pub fn len(&self) -> usize {
        match self {
            Self::Count(n) => *n,
            Self::Columns(columns) => columns.len(),
        }
    }

    /// True when there are no features.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The column names, when the features are columns.
    pub fn columns(&self) -> Option<&[String]> {
        match self {
            Self::Count(_) => None,
            Self::Columns(columns) => Some(columns),
        }
    }
}

/// `data.target` of the regression app: one column or several.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(untagged, expecting = "a column name or a list of column names")]
pub enum Targets {
    One(String),
    Many(Vec<String>),
}

impl Targets {
    /// The target columns, in order.
    pub fn columns(&self) -> Vec<String> {
        match self {
            Self::One(column) => vec![column.clone()],
            Self::Many(columns) => columns.clone(),
        }
    }
}

/// Checks the feature and target columns of a table source against each other: at least one
/// of each, none empty, none named twice. Cheap: the config only.
pub fn check_columns(features: &Features, targets: &[String]) -> Result<(), AppError> {
    let Some(features) = features.columns() else {
        return Err(AppError::key(
            "data.features",
            "name the feature columns (a list of column names, e.g. [\"x1\", \"x2\"]) for a csv or sqlite source",
        ));
    };
    if features.is_empty() {
        return Err(AppError::key("data.features", "names no column"));
    }
    if targets.is_empty() {
        return Err(AppError::key(
            "data.target",
            "is missing: name the target column (e.g. target = \"label\")",
        ));
    }
    let all: Vec<&String> = features.iter().chain(targets).collect();
    for (i, column) in all.iter().enumerate() {
        if column.trim().is_empty() {
            return Err(AppError::key(
                "data.features/target",
                "a column name is empty",
            ));
        }
        if all[..i].contains(column) {
            return Err(AppError::key(
                "data.features/target",
                format!("column '{column}' is named twice (a target cannot be a feature)"),
            ));
        }
    }
    Ok(())
}

/// One cell of a row, as the file holds it (a CSV cell is always text).
#[derive(Debug, Clone, PartialEq)]
// SQLite's types: only text is read in a build without the `sqlite` feature (`sqlite_dataset.rs`).
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub enum Cell {
    Null,
    Integer(i64),
    Real(f64),
    Text(String),
    /// A blob, by its length in bytes.
    Blob(usize),
}

impl Cell {
    /// The cell as a message quotes it.
    fn shown(&self) -> String {
        match self {
            Self::Null => "NULL".into(),
            Self::Integer(i) => i.to_string(),
            Self::Real(r) => r.to_string(),
            Self::Text(text) => format!("{text:?}"),
            Self::Blob(len) => format!("a blob of {len} bytes"),
        }
    }
}

/// What is wrong with one cell of a row: its column and what was expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellError {
    pub column: String,
    pub message: String,
}

/// Turns the cells of one row, in the order of [`Decode::columns`], into an item.
pub trait Decode<I>: Send + Sync + 'static {
    /// The columns to read: the features, then the target(s).
    fn columns(&self) -> &[String];
    /// The item of one row, or the first cell at fault.
    fn decode(&self, cells: &[Cell]) -> Result<I, CellError>;
}

/// Feature columns and a class column: [`ClassificationItem`]s.
#[derive(Debug, Clone)]
pub struct ClassColumns {
    /// The features, then the target.
    columns: Vec<String>,
    classes: usize,
    labels: Option<Vec<String>>,
}

impl ClassColumns {
    /// `target` holds a class index in `0..classes`, or, with `labels`, one of the labels (its
    /// index is the class).
    pub fn new(
        features: Vec<String>,
        target: String,
        classes: usize,
        labels: Option<Vec<String>>,
    ) -> Self {
        let mut columns = features;
        columns.push(target);
        Self {
            columns,
            classes,
            labels,
        }
    }

    fn class(&self, cell: &Cell) -> Result<usize, String> {
        if let Some(labels) = &self.labels {
            let text = match cell {
                Cell::Text(text) => Some(text.trim().to_owned()),
                Cell::Integer(i) => Some(i.to_string()),
                _ => None,
            };
            return text
                .and_then(|t| labels.iter().position(|label| *label == t))
                .ok_or_else(|| {
                    format!(
                        "expected one of the labels {labels:?} (data.labels), found {}",
                        cell.shown()
                    )
                });
        }
        let index = match cell {
            Cell::Integer(i) => u64::try_from(*i).ok(),
            Cell::Real(r) if r.fract() == 0.0 && *r >= 0.0 && *r < 1e15 => Some(*r as u64),
            Cell::Text(text) => text.trim().parse::<u64>().ok(),
            _ => None,
        };
        match index.and_then(|i| usize::try_from(i).ok()) {
            Some(i) if i < self.classes => Ok(i),
            _ => Err(format!(
                "expected a class index (an integer in 0..={}, data.classes = {}), found {}{}",
                self.classes - 1,
                self.classes,
                cell.shown(),
                if matches!(cell, Cell::Text(t) if t.trim().parse::<i64>().is_err()) {
                    "; name the classes with data.labels = [...] if the column holds names"
                } else {
                    ""
                }
            )),
        }
    }
}

impl Decode<ClassificationItem> for ClassColumns {
    fn columns(&self) -> &[String] {
        &self.columns
    }

    fn decode(&self, cells: &[Cell]) -> Result<ClassificationItem, CellError> {
        // `columns` ends with the target (`new`).
        let n = self.columns.len() - 1;
        let features = numbers(&self.columns[..n], &cells[..n.min(cells.len())])?;
        let label = match cells.get(n) {
            Some(cell) => self.class(cell),
            None => Err("no cell".to_owned()),
        };
        let label = label.map_err(|message| CellError {
            column: self.columns[n].clone(),
            message,
        })?;
        Ok(ClassificationItem { features, label })
    }
}

/// Feature columns and number target columns: [`RegressionItem`]s.
#[derive(Debug, Clone)]
pub struct ValueColumns {
    /// The features, then the targets.
    columns: Vec<String>,
    features: usize,
}

impl ValueColumns {
    pub fn new(features: Vec<String>, targets: Vec<String>) -> Self {
        let count = features.len();
        let mut columns = features;
        columns.extend(targets);
        Self {
            columns,
            features: count,
        }
    }
}

impl Decode<RegressionItem> for ValueColumns {
    fn columns(&self) -> &[String] {
        &self.columns
    }

    fn decode(&self, cells: &[Cell]) -> Result<RegressionItem, CellError> {
        let (features, targets) = self.columns.split_at(self.features);
        let split = self.features.min(cells.len());
        Ok(RegressionItem {
            features: numbers(features, &cells[..split])?,
            targets: numbers(targets, &cells[split..])?,
        })
    }
}

/// The cells of `columns` as finite `f32`s.
fn numbers(columns: &[String], cells: &[Cell]) -> Result<Vec<f32>, CellError> {
    if columns.len() != cells.len() {
        return Err(CellError {
            column: columns.first().cloned().unwrap_or_default(),
            message: format!("{} cells for {} columns", cells.len(), columns.len()),
        });
    }
    columns
        .iter()
        .zip(cells)
        .map(|(column, cell)| {
            number(cell).map_err(|message| CellError {
                column: column.clone(),
                message,
            })
        })
        .collect()
}

/// A cell as a finite `f32`: an integer, a real, or text that parses as one.
fn number(cell: &Cell) -> Result<f32, String> {
    let value = match cell {
        Cell::Integer(i) => *i as f32,
        Cell::Real(r) => *r as f32,
        Cell::Text(text) if text.trim().is_empty() => {
            return Err("expected a number, found an empty cell".into())
        }
        Cell::Text(text) => text
            .trim()
            .parse::<f32>()
            .map_err(|_| format!("expected a number, found {}", cell.shown()))?,
        Cell::Null | Cell::Blob(_) => {
            return Err(format!("expected a number, found {}", cell.shown()))
        }
    };
    if value.is_finite() {
        Ok(value)
    } else {
        Err(format!(
            "expected a finite number (within f32 range), found {}",
            cell.shown()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(cells: &[&str]) -> Vec<Cell> {
        cells.iter().map(|c| Cell::Text((*c).into())).collect()
    }

    fn names(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn class_rows_decode_and_name_the_bad_cell() {
        let schema = ClassColumns::new(names(&["a", "b"]), "y".into(), 3, None);
        assert_eq!(schema.columns(), names(&["a", "b", "y"]).as_slice());
        let item = schema.decode(&text(&[" 1.5", "-2e1", "2"])).unwrap();
        assert_eq!((item.features, item.label), (vec![1.5, -20.0], 2));
        let item = schema
            .decode(&[Cell::Integer(4), Cell::Real(0.25), Cell::Real(1.0)])
            .unwrap();
        assert_eq!((item.features, item.label), (vec![4.0, 0.25], 1));

        let error = |cells: Vec<Cell>| schema.decode(&cells).unwrap_err();
        assert_eq!(
            error(text(&["1", "abc", "0"])),
            CellError {
                column: "b".into(),
                message: "expected a number, found \"abc\"".into()
            }
        );
        assert_eq!(
            error(text(&["", "1", "0"])).message,
            "expected a number, found an empty cell"
        );
        assert!(error(text(&["inf", "1", "0"])).message.contains("finite"));
        assert!(error(text(&["1e39", "1", "0"])).message.contains("finite"));
        assert!(error(vec![Cell::Null, Cell::Integer(1), Cell::Integer(0)])
            .message
            .contains("NULL"));
        let bad_class = error(text(&["1", "2", "3"]));
        assert_eq!(bad_class.column, "y");
        assert_eq!(
            bad_class.message,
            "expected a class index (an integer in 0..=2, data.classes = 3), found \"3\""
        );
        assert_eq!(
            error(text(&["1", "2", "cat"])).message,
            "expected a class index (an integer in 0..=2, data.classes = 3), found \"cat\"; \
             name the classes with data.labels = [...] if the column holds names"
        );
        assert!(
            error(vec![Cell::Integer(1), Cell::Integer(1), Cell::Integer(-1)])
                .message
                .starts_with("expected a class index")
        );
        assert!(
            error(vec![Cell::Integer(1), Cell::Integer(1), Cell::Real(0.5)])
                .message
                .starts_with("expected a class index")
        );
    }

    #[test]
    fn labels_map_names_to_classes() {
        let labels = Some(names(&["cat", "dog", "7"]));
        let schema = ClassColumns::new(names(&["x"]), "kind".into(), 3, labels);
        assert_eq!(schema.decode(&text(&["1", " dog "])).unwrap().label, 1);
        assert_eq!(
            schema
                .decode(&[Cell::Real(0.0), Cell::Integer(7)])
                .unwrap()
                .label,
            2
        );
        let error = schema.decode(&text(&["1", "cow"])).unwrap_err();
        assert_eq!(
            error.message,
            "expected one of the labels [\"cat\", \"dog\", \"7\"] (data.labels), found \"cow\""
        );
    }

    #[test]
    fn value_rows_decode_features_then_targets() {
        let schema = ValueColumns::new(names(&["a"]), names(&["y1", "y2"]));
        let item = schema.decode(&text(&["1", "2", "3"])).unwrap();
        assert_eq!((item.features, item.targets), (vec![1.0], vec![2.0, 3.0]));
        let error = schema.decode(&text(&["1", "2", "x"])).unwrap_err();
        assert_eq!(error.column, "y2");
    }

    #[test]
    fn column_checks_name_the_key() {
        let cols = |names: &[&str]| Features::Columns(super::tests::names(names));
        assert!(check_columns(&cols(&["a", "b"]), &names(&["y"])).is_ok());
        let message = |f: &Features, t: &[&str]| check_columns(f, &names(t)).unwrap_err().0;
        assert!(message(&Features::Count(3), &["y"]).starts_with("data.features: name"));
        assert!(message(&cols(&[]), &["y"]).contains("names no column"));
        assert!(message(&cols(&["a"]), &[]).starts_with("data.target: is missing"));
        assert!(message(&cols(&["a", "y"]), &["y"]).contains("'y' is named twice"));
        assert!(message(&cols(&["a", " "]), &["y"]).contains("empty"));
    }

    #[test]
    fn features_and_targets_parse_from_toml() {
        #[derive(Deserialize)]
        struct T {
            features: Features,
            target: Targets,
        }
        let t: T = toml::from_str("features = 8\ntarget = \"y\"").unwrap();
        assert_eq!(
            (t.features, t.target),
            (Features::Count(8), Targets::One("y".into()))
        );
        let t: T = toml::from_str("features = [\"a\", \"b\"]\ntarget = [\"y\", \"z\"]").unwrap();
        assert_eq!(t.features.len(), 2);
        assert_eq!(t.target.columns(), names(&["y", "z"]));
        let error = toml::from_str::<T>("features = \"a\"\ntarget = \"y\"")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(error.contains("a list of column names"), "{error}");
    }
}
