//! Errors of the model registry, of model configurations and of the synthetic
//! data sets.

/// Why a model could not be selected, configured or built.
///
/// Every message names the model and, for options, the offending key of the
/// `[model]` table, so the trainer can print it as is.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    /// `name` is not in the registry.
    #[error("unknown model '{name}' (known models: {})", .known.join(", "))]
    UnknownModel {
        /// The name that was asked for.
        name: String,
        /// The registered names, [`crate::MODEL_NAMES`].
        known: &'static [&'static str],
    },

    /// An option of the `[model]` table is unknown, wrongly typed or out of range.
    #[error("invalid option `{field}` in [model] for model '{model}': {message}")]
    InvalidOptions {
        /// The registered model name.
        model: String,
        /// The key of the `[model]` table at fault.
        field: String,
        /// What is wrong with it (for type errors, serde's message).
        message: String,
    },

    /// The model cannot take this data (for example `cnn` on non-image data).
    #[error("model '{model}' cannot be used with this data: {reason}")]
    IncompatibleInput {
        /// The registered model name.
        model: String,
        /// What the model needs and what the data has.
        reason: String,
    },
}

/// A problem found by [`crate::ModelOptions::check`]; the registry turns it
/// into a [`ModelError`] by adding the model name.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CheckError {
    /// An option value is out of range or inconsistent with another option.
    #[error("model.{field}: {message}")]
    Option {
        /// The key of the `[model]` table at fault.
        field: &'static str,
        /// What is wrong with it, including the value found.
        message: String,
    },
    /// The data does not fit the model; says what the model needs and what it got.
    #[error("{0}")]
    Input(String),
}

impl CheckError {
    /// An out-of-range or inconsistent option `field`.
    pub fn option(field: &'static str, message: impl Into<String>) -> Self {
        Self::Option {
            field,
            message: message.into(),
        }
    }

    /// Data the model cannot take; `reason` says what it needs and what it got.
    pub fn input(reason: impl Into<String>) -> Self {
        Self::Input(reason.into())
    }

    pub(crate) fn into_model_error(self, model: &str) -> ModelError {
        match self {
            Self::Option { field, message } => ModelError::InvalidOptions {
                model: model.to_owned(),
                field: field.to_owned(),
                message,
            },
            Self::Input(reason) => ModelError::IncompatibleInput {
                model: model.to_owned(),
                reason,
            },
        }
    }
}

/// Invalid arguments to a synthetic data set's constructor (for example
/// [`crate::SyntheticText::new`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DatasetError {
    /// An argument is out of range or inconsistent with another one.
    #[error("invalid argument `{argument}` of {dataset}: {message}")]
    InvalidArgument {
        /// The data set type, e.g. `"SyntheticText"`.
        dataset: &'static str,
        /// The constructor argument at fault.
        argument: &'static str,
        /// What is wrong with it, including the value found.
        message: String,
    },
}
