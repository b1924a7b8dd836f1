//! Errors of the trainer binary that are not tied to one module. Exit codes are classified
//! where the binary ends ([`crate::run::report`]), so this module imports none of the others.

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
