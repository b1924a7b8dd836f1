//! [`ZeroStage`]: how much of the training state is divided among the ranks (DeepSpeed's ZeRO
//! stages). Only stages 0 and 1 exist here, so a stage 2 or 3 cannot be represented: it is
//! refused where a number becomes a stage ([`ZeroStage::try_from`], and so the config's
//! `zero_stage` with feature `serde`).

use std::fmt;
use std::str::FromStr;

/// The ZeRO stage of a data-parallel job. With feature `serde` it is written as its number,
/// `0` or `1` (the trainer's `distributed.zero_stage`); 2 and 3 are refused.
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
}

/// A ZeRO stage number that is not implemented (2: sharded gradients, 3: sharded parameters,
/// or any other). The message reads after the name of the setting that held it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("must be 0 (plain DDP) or 1 (sharded optimizer state), got {0}; stages 2 and 3 (sharded gradients, parameters) are not implemented")]
pub struct UnsupportedZeroStage(pub u8);

/// A ZeRO stage that does not parse from text ([`ZeroStage::from_str`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ZeroStageParseError {
    #[error("{0:?} is not a ZeRO stage: use 0 (plain DDP) or 1 (sharded optimizer state)")]
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
            other => Err(UnsupportedZeroStage(other)),
        }
    }
}

impl From<ZeroStage> for u8 {
    fn from(stage: ZeroStage) -> Self {
        match stage {
            ZeroStage::Off => 0,
            ZeroStage::OptimizerState => 1,
        }
    }
}

/// `"0"` or `"1"` (a command-line flag's value).
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
    fn stages_0_and_1_are_the_only_ones() {
        for stage in [ZeroStage::Off, ZeroStage::OptimizerState] {
            assert_eq!(ZeroStage::try_from(u8::from(stage)), Ok(stage));
            assert_eq!(stage.to_string().parse::<ZeroStage>(), Ok(stage));
        }
        assert_eq!(ZeroStage::default(), ZeroStage::Off);
        for stage in [2, 3, 255] {
            let refused = ZeroStage::try_from(stage).unwrap_err();
            assert_eq!(refused, UnsupportedZeroStage(stage));
            let message = refused.to_string();
            assert!(
                message.starts_with("must be 0 (plain DDP) or 1 (sharded optimizer state)")
                    && message.contains(&format!("got {stage}")),
                "{message}"
            );
        }
        assert_eq!(
            "2".parse::<ZeroStage>(),
            Err(ZeroStageParseError::Unsupported(UnsupportedZeroStage(2)))
        );
        assert!(matches!(
            "one".parse::<ZeroStage>(),
            Err(ZeroStageParseError::NotANumber(_))
        ));
    }
}
