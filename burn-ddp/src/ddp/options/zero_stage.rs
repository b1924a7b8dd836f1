//! [`ZeroStage`]: how much of the training state is divided among the ranks (DeepSpeed's ZeRO
//! stages): 0, 1, 2 and 3. Any other number is refused where a number becomes a stage
//! ([`ZeroStage::try_from`], and so the config's `zero_stage` with feature `serde`).

use std::fmt;
use std::str::FromStr;

/// The ZeRO stage of a data-parallel job. With feature `serde` it is written as its number,
/// `0` to `3` (the trainer's `distributed.zero_stage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(try_from = "u8", into = "u8")
)]
pub enum ZeroStage {
    /// Stage 0: every rank holds the whole optimizer state (plain DDP).
    #[default]
    Off,
    /// Stage 1: each parameter's optimizer state lives on one rank, which steps it and sends
    /// the new values to the others (DeepSpeed's stage 1, PyTorch's
    /// `ZeroRedundancyOptimizer`). Runs over the host.
    OptimizerState,
    /// Stage 2: stage 1, and each rank keeps only the gradients of the parameters it owns.
    /// Every gradient bucket is reduce-scattered to its parameters' owners as soon as it is
    /// full (during backward for marked blocks), and the rest of the bucket is dropped
    /// (DeepSpeed's stage 2). Runs over the host.
    Gradients,
    /// Stage 3: each rank keeps only a flat shard of every parameter of the blocks the model
    /// marks with [`mark_block`](crate::mark_block), of its gradient and of its optimizer
    /// state; a block is gathered whole for its forward and again for its backward, and its
    /// gradient reduce-scattered into the shards (DeepSpeed's stage 3, PyTorch's FSDP with
    /// `fully_shard` per block). Parameters outside marked blocks stay whole on every rank.
    /// Runs over the host. See [`DataParallel::fully_shard`](crate::DataParallel::fully_shard).
    Parameters,
}

impl ZeroStage {
    /// Whether no rank holds the whole optimizer state (stages 1, 2 and 3).
    pub fn shards_optimizer_state(self) -> bool {
        self != Self::Off
    }

    /// Whether each parameter's optimizer state lives on one rank, its owner, which steps it
    /// and sends the new values to the others (stages 1 and 2; stage 3 steps shards instead).
    pub fn has_owners(self) -> bool {
        matches!(self, Self::OptimizerState | Self::Gradients)
    }

    /// Whether marked blocks' parameters are sharded (stage 3).
    pub fn shards_parameters(self) -> bool {
        self == Self::Parameters
    }
}

/// A number that is not a ZeRO stage. The message reads after the name of the setting that
/// held it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("must be 0 (plain DDP), 1 (sharded optimizer state), 2 (sharded gradients and optimizer state) or 3 (sharded parameters, gradients and optimizer state), got {0}")]
pub struct UnsupportedZeroStage(pub u8);

/// A ZeRO stage that does not parse from text ([`ZeroStage::from_str`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ZeroStageParseError {
    #[error("{0:?} is not a ZeRO stage: use 0 (plain DDP), 1 (sharded optimizer state), 2 (sharded gradients and optimizer state) or 3 (sharded parameters)")]
    NotANumber(String),
    #[error(transparent)]
    Unsupported(#[from] UnsupportedZeroStage),
}

impl TryFrom<u8> for ZeroStage {
    type Error = UnsupportedZeroStage;

    fn try_from(stage: u8) -> Result<Self, Self::Error> {
        match stage {
            0 => Ok(Self::Off),
            1 => Ok(Self::OptimizerState),
            2 => Ok(Self::Gradients),
            3 => Ok(Self::Parameters),
            other => Err(UnsupportedZeroStage(other)),
        }
    }
}

impl From<ZeroStage> for u8 {
    fn from(stage: ZeroStage) -> Self {
        match stage {
            ZeroStage::Off => 0,
            ZeroStage::OptimizerState => 1,
            ZeroStage::Gradients => 2,
            ZeroStage::Parameters => 3,
        }
    }
}

/// `"0"` to `"3"` (a command-line flag's value).
impl FromStr for ZeroStage {
    type Err = ZeroStageParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let number: u8 = text
            .trim()
            .parse()
            .map_err(|_| ZeroStageParseError::NotANumber(text.to_string()))?;
        Ok(Self::try_from(number)?)
    }
}

/// The stage's number.
impl fmt::Display for ZeroStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", u8::from(*self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_0_to_3_are_the_only_ones() {
        for stage in [
            ZeroStage::Off,
            ZeroStage::OptimizerState,
            ZeroStage::Gradients,
            ZeroStage::Parameters,
        ] {
            assert_eq!(ZeroStage::try_from(u8::from(stage)), Ok(stage));
            assert_eq!(stage.to_string().parse::<ZeroStage>(), Ok(stage));
        }
        assert_eq!(ZeroStage::default(), ZeroStage::Off);
        for stage in [4, 5, 255] {
            let refused = ZeroStage::try_from(stage).unwrap_err();
            assert_eq!(refused, UnsupportedZeroStage(stage));
            let message = refused.to_string();
            assert!(
                message.starts_with("must be 0 (plain DDP), 1 (sharded optimizer state), 2")
                    && message.contains(&format!("got {stage}")),
                "{message}"
            );
        }
        assert_eq!(
            "4".parse::<ZeroStage>(),
            Err(ZeroStageParseError::Unsupported(UnsupportedZeroStage(4)))
        );
        assert!(ZeroStage::Parameters.shards_parameters() && !ZeroStage::Parameters.has_owners());
        assert!(matches!(
            "one".parse::<ZeroStage>(),
            Err(ZeroStageParseError::NotANumber(_))
        ));
    }
}
