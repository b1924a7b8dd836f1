//! [`ZeroStage`]: how much of the training state is divided among the ranks (DeepSpeed's ZeRO
//! stages). Stages 0, 1 and 2 exist here, so a stage 3 cannot be represented: it is refused
//! where a number becomes a stage ([`ZeroStage::try_from`], and so the config's `zero_stage`
//! with feature `serde`).

use std::fmt;
use std::str::FromStr;

/// The ZeRO stage of a data-parallel job. With feature `serde` it is written as its number,
/// `0`, `1` or `2` (the trainer's `distributed.zero_stage`); 3 is refused.
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
}

impl ZeroStage {
    /// Whether each parameter's optimizer state lives on one rank only (stages 1 and 2): the
    /// owner steps it and sends the new values to the others.
    pub fn shards_optimizer_state(self) -> bool {
        self != Self::Off
    }
}

/// A ZeRO stage number that is not implemented (3: sharded parameters, or any other). The
/// message reads after the name of the setting that held it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("must be 0 (plain DDP), 1 (sharded optimizer state) or 2 (sharded gradients and optimizer state), got {0}; stage 3 (sharded parameters) is not implemented")]
pub struct UnsupportedZeroStage(pub u8);

/// A ZeRO stage that does not parse from text ([`ZeroStage::from_str`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ZeroStageParseError {
    #[error("{0:?} is not a ZeRO stage: use 0 (plain DDP), 1 (sharded optimizer state) or 2 (sharded gradients and optimizer state)")]
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
        }
    }
}

/// `"0"`, `"1"` or `"2"` (a command-line flag's value).
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
    fn stages_0_1_and_2_are_the_only_ones() {
        for stage in [
            ZeroStage::Off,
            ZeroStage::OptimizerState,
            ZeroStage::Gradients,
        ] {
            assert_eq!(ZeroStage::try_from(u8::from(stage)), Ok(stage));
            assert_eq!(stage.to_string().parse::<ZeroStage>(), Ok(stage));
        }
        assert_eq!(ZeroStage::default(), ZeroStage::Off);
        for stage in [3, 4, 255] {
            let refused = ZeroStage::try_from(stage).unwrap_err();
            assert_eq!(refused, UnsupportedZeroStage(stage));
            let message = refused.to_string();
            assert!(
                message.starts_with("must be 0 (plain DDP), 1 (sharded optimizer state) or 2")
                    && message.contains(&format!("got {stage}")),
                "{message}"
            );
        }
        assert_eq!(
            "3".parse::<ZeroStage>(),
            Err(ZeroStageParseError::Unsupported(UnsupportedZeroStage(3)))
        );
        assert!(matches!(
            "one".parse::<ZeroStage>(),
            Err(ZeroStageParseError::NotANumber(_))
        ));
    }
}
