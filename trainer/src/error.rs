//! Errors of the trainer binary that are not tied to one module.

/// A problem with the user's input (command line, a program to launch): exit code 2, message
/// only.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// The error and its causes, each cause once: library errors already include their source in
/// their message, so a cause whose text is already shown is not repeated.
pub fn describe_error(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if !text.contains(&s) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&s);
        }
    }
    text
}

/// 2 for input problems (the user must fix a command line, config, data or checkpoint), 1 for
/// everything else.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    let usage = e.chain().any(|c| {
        c.is::<UsageError>()
            || c.is::<crate::config::ConfigError>()
            || c.is::<crate::app::AppError>()
            || c.is::<crate::data::DataError>()
            || c.is::<models::ModelError>()
            || c.is::<crate::checkpoint::CheckpointMismatch>()
            || c.is::<burn_ddp::InitError>()
            || c.downcast_ref::<burn_ddp::DdpError>()
                .is_some_and(burn_ddp::DdpError::is_usage)
    });
    if usage {
        2
    } else {
        1
    }
}
