//! The optional parts of the engine, each behind a cargo feature of `trainer`: all are in its
//! `default` (the `trainer` binary has them), and a user's crate that depends on trainer with
//! `default-features = false` compiles only those it names, and none of the others' crates.
//! Whether this build has one, and the usage error (exit code 2) when a config or command asks
//! for one it lacks. Imports nothing of the engine: the config's defaults ask it too.
//!
//! Each optional part lives beside its user, under one `cfg` rule: the folder's front declares
//! the real module under `#[cfg(feature = "x")]` and, side by side, a stand-in with the same
//! names under `#[cfg(not(feature = "x"))]`. The real modules are the only files that name the
//! optional crates; the rest of the engine calls the same names in every build.
//!
//! | feature | real module | stand-in | what |
//! |---|---|---|---|
//! | `sqlite` | `sources/sqlite_dataset.rs` | `sources/sqlite_dataset_stand_in.rs` | `[data] source = "sqlite"`, read with rusqlite |
//! | `image-folder` | `sources/image_folder.rs` | `sources/image_folder_stand_in.rs` | `[data] source = "image-folder"`, decoded with `image` |
//! | `plots` | `report/plot/draw.rs` | `report/plot/draw_stand_in.rs` | a chart into a PNG (plotters, the embedded DejaVu font) |
//! | `tensorboard` | `report/tensorboard.rs` | `report/tensorboard_stand_in.rs` | TensorBoard event files (prost, crc32c) |
//!
//! The devices (`wgpu`, `cuda`) are not optional parts of this kind: `engine/device.rs` picks
//! the training device at run time and says whether this build and machine can run it.
//!
//! A config asking for a part this build lacks is refused before any rank starts (the apps'
//! source checks and the pre-flight's check of `output.plots` and `output.tensorboard`, exit
//! code 2, naming the feature); the stand-ins refuse the same way if they are reached anyway.

use std::fmt;

/// An optional part of the engine (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Feature {
    /// `[data] source = "sqlite"`: rusqlite, with SQLite compiled from source.
    Sqlite,
    /// `[data] source = "image-folder"`: the `image` crate's PNG, JPEG and BMP decoders.
    ImageFolder,
    /// `trainer plot` and `output.plots`: plotters and the embedded DejaVu font.
    Plots,
    /// `output.tensorboard`: prost (protobuf) and crc32c.
    Tensorboard,
}

impl Feature {
    /// Every optional part.
    pub const ALL: [Feature; 4] = [
        Feature::Sqlite,
        Feature::ImageFolder,
        Feature::Plots,
        Feature::Tensorboard,
    ];

    /// The cargo feature's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sqlite => "sqlite",
            Self::ImageFolder => "image-folder",
            Self::Plots => "plots",
            Self::Tensorboard => "tensorboard",
        }
    }

    /// Whether this build has it.
    pub fn built(self) -> bool {
        match self {
            Self::Sqlite => cfg!(feature = "sqlite"),
            Self::ImageFolder => cfg!(feature = "image-folder"),
            Self::Plots => cfg!(feature = "plots"),
            Self::Tensorboard => cfg!(feature = "tensorboard"),
        }
    }

    /// The error for `what` (a config key and value, a command) asking for this feature, with
    /// the advice for the running program ([`advice`]).
    pub fn missing(self, what: impl Into<String>) -> FeatureMissing {
        FeatureMissing {
            what: what.into(),
            feature: self,
            advice: advice(self, &this_program()),
        }
    }

    /// `Ok` in a build with this feature, else the error for `what` asking for it.
    pub fn require(self, what: impl Into<String>) -> Result<(), FeatureMissing> {
        if self.built() {
            Ok(())
        } else {
            Err(self.missing(what))
        }
    }
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How to get a build with `feature`, for `program` (the running binary's name): the `trainer`
/// binary's own feature, or, in a program of the user's crate, the feature named in that
/// crate's dependency on trainer (the crate that builds the binary decides).
pub fn advice(feature: Feature, program: &str) -> String {
    if program == "trainer" {
        format!("rebuild with `cargo build --release -p trainer --features {feature}` (trainer's default features have it)")
    } else {
        format!(
            "turn it on in the Cargo.toml of {program}'s crate: `trainer = {{ ..., features = [\"{feature}\"] }}`"
        )
    }
}

/// The running binary's name (its file's stem), as the advice to rebuild takes it (here and
/// in `engine/device.rs`).
pub(crate) fn this_program() -> String {
    std::env::args_os()
        .next()
        .map(std::path::PathBuf::from)
        .and_then(|path| path.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "this program".into())
}

/// A config or command asks for a part this build was compiled without: a usage error (exit
/// code 2) saying how to get it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} needs trainer's cargo feature `{feature}`, which this build was compiled without: {advice}")]
pub struct FeatureMissing {
    /// What asked for it: `data.source = "sqlite"`, `output.tensorboard = true`, ...
    pub what: String,
    pub feature: Feature,
    /// How to turn it on ([`advice`]).
    pub advice: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_feature_names_itself_and_how_to_turn_it_on() {
        let mut e = Feature::Sqlite.missing("data.source = \"sqlite\"");
        e.advice = advice(Feature::Sqlite, "my-model");
        assert_eq!(
            e.to_string(),
            "data.source = \"sqlite\" needs trainer's cargo feature `sqlite`, which this build \
             was compiled without: turn it on in the Cargo.toml of my-model's crate: \
             `trainer = { ..., features = [\"sqlite\"] }`"
        );
        assert!(advice(Feature::Plots, "trainer").contains("-p trainer --features plots"));
        for feature in Feature::ALL {
            let required = feature.require("x");
            assert_eq!(required.is_ok(), feature.built(), "{feature}");
            if let Err(e) = required {
                assert!(e.to_string().contains(&format!("`{feature}`")), "{e}");
            }
        }
    }
}
