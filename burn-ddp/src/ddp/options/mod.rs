//! What the user chooses for the job's synchronisation, as values (pure: no I/O).
//!
//! - [`ddp_options`]: [`DdpOptions`](ddp_options::DdpOptions), the job's synchronisation as
//!   one value.
//! - [`transport`]: [`GradientTransport`](transport::GradientTransport), where gradients are
//!   summed, and the rules that choose it.
//! - [`zero_stage`]: [`ZeroStage`](zero_stage::ZeroStage), 0 to 3.
//! - [`groups`]: the process groups a rank forms for those options, each with its
//!   shared-memory ring (what the doctor counts in `/dev/shm`).
//! - `config_names` (feature `serde`): the config names of the options that are `Option`s
//!   (compression, the buffer rule), as serde `with` modules. With feature `serde` the options
//!   read and write the trainer's `[distributed]` names.

#[cfg(feature = "serde")]
pub mod config_names;
pub mod ddp_options;
pub mod groups;
pub mod transport;
pub mod zero_stage;
