//! A table file (CSV, SQLite) as a Burn [`Dataset`]: row `i` is read and decoded on
//! `get(i)`, and nothing else.

use std::marker::PhantomData;
use std::path::Path;

use burn::data::dataset::{Dataset, DatasetError};

use super::error::{Place, SourceError};
use super::schema::{Cell, Decode};

/// The rows of an opened table file, read one at a time.
pub trait Rows: Send + Sync + 'static {
    /// The file.
    fn path(&self) -> &Path;
    /// Rows in the table.
    fn len(&self) -> usize;
    /// The cells of row `index` (`< len`), in the order of the columns the table was opened
    /// with, and where the row is (for messages).
    fn cells(&self, index: usize) -> Result<(Vec<Cell>, Place), SourceError>;
}

/// Rows `R` decoded into items `I` by `D`. Every row was checked when the table was opened, so
/// `get` fails only if the file changed since; its error (a [`SourceError`] in Burn's
/// [`DatasetError`]) then says why, naming the file and the place.
pub struct TableDataset<R, D, I> {
    rows: R,
    decoder: D,
    item: PhantomData<fn() -> I>,
}

impl<R: Rows, D: Decode<I>, I> TableDataset<R, D, I> {
    /// `rows` (already checked with `decoder`) as items.
    pub(crate) fn new(rows: R, decoder: D) -> Self {
        Self {
            rows,
            decoder,
            item: PhantomData,
        }
    }

    /// Item `index` (`< len`), or why it cannot be read.
    pub fn read(&self, index: usize) -> Result<I, SourceError> {
        let (cells, place) = self.rows.cells(index)?;
        self.decoder
            .decode(&cells)
            .map_err(|e| SourceError::cell(self.rows.path(), place, e))
    }
}

impl<R: Rows, D, I> std::fmt::Debug for TableDataset<R, D, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableDataset")
            .field("path", &self.rows.path())
            .field("len", &self.rows.len())
            .finish()
    }
}

impl<R: Rows, D: Decode<I>, I: Send + Sync> Dataset<I> for TableDataset<R, D, I> {
    /// # Panics
    ///
    /// If `index >= len()` (Burn's `Dataset::get` contract).
    fn get(&self, index: usize) -> Result<I, DatasetError> {
        let len = self.rows.len();
        assert!(
            index < len,
            "{}: index {index} out of range (the table has {len} rows)",
            self.rows.path().display()
        );
        self.read(index).map_err(DatasetError::new)
    }

    fn len(&self) -> usize {
        self.rows.len()
    }
}
