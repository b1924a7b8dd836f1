//! The 16-bit float formats of compressed gradients: [`HalfFormat`].

use half::{bf16, f16};

/// A 16-bit float format for gradients on the wire (`distributed.gradient_compression`).
///
/// - `Bf16`: 8 exponent bits like `f32`, 8 significant bits: no overflow, relative error 2^-9.
/// - `F16`: 5 exponent bits (largest finite 65504), 11 significant bits: relative error 2^-12
///   but overflow past 65504, and magnitudes up to 2^-25 become 0; the reducer divides by the
///   world size *before* rounding (PyTorch's `fp16_compress_hook` rounds first, then divides)
///   so that a sum cannot overflow where the mean does not.
///
/// With feature `serde` it is written as its [`name`](HalfFormat::name); the trainer's
/// `distributed.gradient_compression` adds `"none"` for no compression
/// (`ddp::options::config_names::compression`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum HalfFormat {
    #[cfg_attr(feature = "serde", serde(rename = "bf16"))]
    Bf16,
    #[cfg_attr(feature = "serde", serde(rename = "fp16"))]
    F16,
}

impl HalfFormat {
    /// The bits of the 16-bit float nearest to `x` (ties to even).
    pub fn round(self, x: f32) -> u16 {
        match self {
            Self::Bf16 => bf16::from_f32(x).to_bits(),
            Self::F16 => f16::from_f32(x).to_bits(),
        }
    }

    /// The `f32` that 16-bit `bits` denote (exact: every bf16 and f16 is an `f32`).
    pub fn widen(self, bits: u16) -> f32 {
        match self {
            Self::Bf16 => bf16::from_bits(bits).to_f32(),
            Self::F16 => f16::from_bits(bits).to_f32(),
        }
    }

    /// The name used in configs and messages: `"bf16"`, `"fp16"`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F16 => "fp16",
        }
    }
}
