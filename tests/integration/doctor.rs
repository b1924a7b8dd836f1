//! `trainer doctor`.
