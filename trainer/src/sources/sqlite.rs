//! `[data] source = "sqlite"`, as the config names it: `data.table`, checked with the config
//! (no SQLite needed). The table is read by `sqlite_dataset.rs` (cargo feature
//! `sqlite`), in burn-dataset's `SqliteDataset` format.

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

#[cfg(test)]
mod tests {
    use super::*;

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
