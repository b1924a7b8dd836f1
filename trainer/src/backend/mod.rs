//! Every backend and cargo feature of the engine, in one place: the `cfg`s of the crate are
//! here, and the rest of the engine calls what this module gives in every build.
//!
//! | file | cargo feature | what |
//! |---|---|---|
//! | `device.rs` | `wgpu`, `cuda` | the device of `output.device`, whether this build and machine can run it, the doctor's device facts |
//! | `features.rs` | | which optional parts this build has; the usage error naming a missing one |
//! | `sqlite.rs` | `sqlite` | `[data] source = "sqlite"`, read with rusqlite |
//! | `image_folder.rs` | `image-folder` | `[data] source = "image-folder"`, decoded with `image` |
//! | `draw.rs` | `plots` | a chart into a PNG (plotters, the embedded DejaVu font) |
//! | `tensorboard.rs` | `tensorboard` | TensorBoard event files (prost, crc32c) |
//! | `stand_ins.rs` | | the same names, refusing, for the optional parts a build lacks |
//!
//! The optional parts (`sqlite`, `image-folder`, `plots`, `tensorboard`) are in the `trainer`
//! binary's default features; a user's crate that depends on trainer with
//! `default-features = false` compiles none of their crates. The files of this folder are the
//! only ones that name those crates. A config asking for a part this build lacks is refused
//! before any rank starts (the apps' source checks and [`outputs_available`], exit code 2,
//! naming the feature); the stand-ins refuse the same way if they are reached anyway.

mod device;
pub mod features;
mod stand_ins;

pub use device::*;

#[cfg(feature = "plots")]
pub(crate) mod draw;
#[cfg(feature = "image-folder")]
pub(crate) mod image_folder;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;
#[cfg(feature = "tensorboard")]
pub(crate) mod tensorboard;

#[cfg(not(feature = "plots"))]
pub(crate) use stand_ins::draw;
#[cfg(not(feature = "image-folder"))]
pub(crate) use stand_ins::image_folder;
#[cfg(not(feature = "sqlite"))]
pub(crate) use stand_ins::sqlite;
#[cfg(not(feature = "tensorboard"))]
pub(crate) use stand_ins::tensorboard;

use crate::config::OutputConfig;
use crate::error::UsageError;
use features::Feature;

/// `output.plots` and `output.tensorboard` asked of a build without their features: a usage
/// error (exit code 2) naming the feature.
pub fn outputs_available(output: &OutputConfig) -> Result<(), UsageError> {
    let asked = [
        (output.plots, Feature::Plots, "output.plots = true"),
        (
            output.tensorboard,
            Feature::Tensorboard,
            "output.tensorboard = true",
        ),
    ];
    for (on, feature, what) in asked {
        if on {
            feature
                .require(what)
                .map_err(|e| UsageError(e.to_string()))?;
        }
    }
    Ok(())
}
