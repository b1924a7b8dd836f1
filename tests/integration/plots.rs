//! `trainer plot`: PNG charts of a run.
