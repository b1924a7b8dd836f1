//! The TOML configuration: schema, defaults and validation. Every error names the file and the
//! field, and is a usage error (exit code 2).
//!
//! | file | owns |
//! |---|---|
//! | `schema.rs` | the sections ([`Config`] and the engine's `*Config` tables), one default per field, the fingerprints compared across ranks |
//! | `validate.rs` | reading a file: [`Config::load`] and [`Config::parse`], the checks across fields, [`ConfigError`] |
//! | `tests.rs` | the defaults, the parse errors and each check, on small files |

mod schema;
mod validate;

#[cfg(test)]
mod tests;

pub use schema::*;
pub use validate::ConfigError;
