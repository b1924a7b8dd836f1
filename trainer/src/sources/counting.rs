//! A test hook: with `TRAINER_COUNT_DATA_READS=<dir>` in its environment, each rank writes the
//! index of every item it reads (`Dataset::get`) to `<dir>/reads-train-rank<R>.txt` and
//! `<dir>/reads-valid-rank<R>.txt`, one line per read, as it reads it. The tests use it to show
//! that a rank reads only its shard. Without the variable, data sets are left as they are.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use burn::data::dataset::{Dataset, DatasetError};

use crate::app::{AppError, Datasets};
use crate::launcher::worker_env::RANK_VAR;

/// The environment variable naming the folder of the read logs.
pub const COUNT_READS_VAR: &str = "TRAINER_COUNT_DATA_READS";

/// A data set that logs the index of every `get` to a file.
pub struct CountingDataset<I> {
    inner: Arc<dyn Dataset<I>>,
    log: Mutex<File>,
}

impl<I> CountingDataset<I> {
    /// Logs the reads of `inner` to a new file `path` (truncated if it exists).
    pub fn new(inner: Arc<dyn Dataset<I>>, path: &Path) -> std::io::Result<Self> {
        Ok(Self {
            inner,
            log: Mutex::new(File::create(path)?),
        })
    }
}

impl<I: Send + Sync> Dataset<I> for CountingDataset<I> {
    fn get(&self, index: usize) -> Result<I, DatasetError> {
        {
            // Unbuffered: every line is on disk however the process ends.
            let mut log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
            let _ = writeln!(log, "{index}");
        }
        self.inner.get(index)
    }

    fn len(&self) -> usize {
        self.inner.len()
    }
}

/// `data`, each set wrapped in a [`CountingDataset`] when [`COUNT_READS_VAR`] is set (module
/// docs); the rank is `RANK` (0 when unset).
pub fn count_reads_if_asked<I: Send + Sync + 'static>(
    data: Datasets<I>,
) -> Result<Datasets<I>, AppError> {
    let Some(dir) = std::env::var_os(COUNT_READS_VAR).map(PathBuf::from) else {
        return Ok(data);
    };
    let rank = std::env::var(RANK_VAR).unwrap_or_else(|_| "0".into());
    let wrap = |set: Arc<dyn Dataset<I>>, name: &str| {
        let path = dir.join(format!("reads-{name}-rank{rank}.txt"));
        CountingDataset::new(set, &path)
            .map(|counted| Arc::new(counted) as Arc<dyn Dataset<I>>)
            .map_err(|e| {
                AppError(format!(
                    "{COUNT_READS_VAR}: cannot create {}: {e}",
                    path.display()
                ))
            })
    };
    Ok(Datasets {
        train: wrap(data.train, "train")?,
        valid: data.valid.map(|v| wrap(v, "valid")).transpose()?,
    })
}

#[cfg(test)]
mod tests {
    use burn::data::dataset::InMemDataset;

    use super::*;

    #[test]
    fn logs_every_read_index() {
        let path = std::env::temp_dir().join(format!("trainer-reads-{}.txt", std::process::id()));
        let inner: Arc<dyn Dataset<u8>> = Arc::new(InMemDataset::new(vec![10, 11, 12]));
        let counted = CountingDataset::new(inner, &path).unwrap();
        assert_eq!(counted.len(), 3);
        assert_eq!(counted.get(2).unwrap(), 12);
        assert_eq!(counted.get(0).unwrap(), 10);
        assert_eq!(counted.get(2).unwrap(), 12);
        // Past the end, Burn's data sets panic; the read is logged first.
        let past = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| counted.get(5)));
        assert!(past.is_err());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "2\n0\n2\n5\n");
        let _ = std::fs::remove_file(path);
    }
}
