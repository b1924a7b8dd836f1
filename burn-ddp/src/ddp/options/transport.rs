//! [`GradientTransport`]: where gradients are summed, and the one home of the rules that
//! choose it — what `Auto` means ([`GradientTransport::resolve`]), that NCCL needs a CUDA
//! device ([`GradientTransport::check_device`]), and that ZeRO stages 1 and 2 run over the host
//! ([`GradientTransport::choose`], the whole decision). Pure: [`crate::ddp::GradientSync`] forms
//! what they choose; the trainer's config check and `trainer doctor` ask the same functions.

use crate::ddp::options::zero_stage::ZeroStage;

/// Where gradients are summed (PyTorch's choice of backend for the DDP process group).
/// Metrics, checkpoints and the start-up broadcast always use the TCP group.
///
/// With feature `serde`: `"auto"`, `"host"`, `"nccl"` (the trainer's
/// `distributed.gradient_sync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
pub enum GradientTransport {
    /// NCCL for a job of several ranks on a CUDA device of Burn's CUDA backend, the host
    /// otherwise: a job of one rank has nothing to average, so it needs no NCCL library.
    #[default]
    Auto,
    /// Through host memory and the TCP ring (shared memory between ranks of one machine), on
    /// any device.
    Host,
    /// On the GPU with NCCL (Burn's CUDA backend, a build with feature `cuda`). Also with one
    /// rank: a one-GPU machine tests the NCCL path this way.
    Nccl,
}

/// Why the asked transport cannot run here: an input to fix (the message says how).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// NCCL asked for on a device that is not a CUDA device of Burn's CUDA backend.
    #[error(
        "gradient transport NCCL needs Burn's CUDA backend; use the automatic or host transport on this device"
    )]
    NcclNeedsCuda,
    /// NCCL asked for in a build of burn-ddp without feature `cuda`.
    #[error("gradient transport NCCL needs a build with feature `cuda` and Burn's CUDA backend")]
    NcclNotBuilt,
    /// NCCL asked for with ZeRO stage 1 or 2, which need a reduce-scatter and an all-gather
    /// over blocks of different sizes (one per owner), which NCCL lacks.
    #[error(
        "ZeRO stage {0} runs over the host (TCP ring) in this version; use the automatic or host gradient transport (distributed.gradient_sync = \"auto\" or \"host\"), or ZeRO stage 0 for NCCL"
    )]
    NcclWithZero(u8),
}

impl GradientTransport {
    /// What `Auto` means for a training device that is (`cuda`) or is not a CUDA device of
    /// Burn's CUDA backend, and `world_size` ranks: NCCL with CUDA and several ranks, else the
    /// host. `Host` and `Nccl` stay as they are (whether they can run is
    /// [`check_device`](Self::check_device)'s question).
    pub fn resolve(self, cuda: bool, world_size: usize) -> Self {
        match self {
            Self::Auto if cuda && world_size > 1 => Self::Nccl,
            Self::Auto => Self::Host,
            explicit => explicit,
        }
    }

    /// NCCL needs a CUDA device: refuses `Nccl` where the training device is not one
    /// (`cuda` false). `Auto` and `Host` run anywhere.
    pub fn check_device(self, cuda: bool) -> Result<(), TransportError> {
        if self == Self::Nccl && !cuda {
            return Err(TransportError::NcclNeedsCuda);
        }
        Ok(())
    }

    /// The transport a job of `world_size` ranks at ZeRO stage `zero` uses on a device that is
    /// (`cuda`) or is not a CUDA device: never `Auto`. Stages 1 and 2 run over the host, so
    /// `Auto` falls back to it there; an explicit `Nccl` is refused with them, in a build
    /// without feature `cuda`, and off CUDA.
    pub fn choose(
        self,
        zero: ZeroStage,
        cuda: bool,
        world_size: usize,
    ) -> Result<Self, TransportError> {
        let resolved = self.resolve(cuda, world_size);
        if resolved != Self::Nccl {
            return Ok(resolved);
        }
        if zero.shards_optimizer_state() {
            return match self {
                Self::Nccl => Err(TransportError::NcclWithZero(zero.into())),
                _ => Ok(Self::Host),
            };
        }
        if !cfg!(feature = "cuda") {
            return Err(TransportError::NcclNotBuilt);
        }
        self.check_device(cuda)?;
        Ok(Self::Nccl)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use GradientTransport::{Auto, Host, Nccl};

    #[test]
    fn auto_means_nccl_only_for_cuda_with_several_ranks() {
        // (asked, cuda, world) -> resolved
        let table = [
            (Auto, true, 2, Nccl),
            (Auto, true, 1, Host),
            (Auto, false, 4, Host),
            (Auto, false, 1, Host),
            (Host, true, 2, Host),
            (Host, false, 2, Host),
            (Nccl, true, 1, Nccl),
            (Nccl, false, 2, Nccl),
        ];
        for (asked, cuda, world, resolved) in table {
            assert_eq!(
                asked.resolve(cuda, world),
                resolved,
                "{asked:?} cuda={cuda} world={world}"
            );
        }
    }

    #[test]
    fn nccl_needs_a_cuda_device() {
        assert_eq!(Nccl.check_device(false), Err(TransportError::NcclNeedsCuda));
        for ok in [(Nccl, true), (Auto, false), (Auto, true), (Host, false)] {
            assert_eq!(ok.0.check_device(ok.1), Ok(()), "{ok:?}");
        }
    }

    #[test]
    fn the_choice_falls_back_to_the_host_for_zero_stages_1_and_2_and_refuses_what_cannot_run() {
        let (off, stage1, stage2) = (
            ZeroStage::Off,
            ZeroStage::OptimizerState,
            ZeroStage::Gradients,
        );
        // The host whenever `Auto` does not mean NCCL, whatever the build.
        assert_eq!(Auto.choose(off, false, 4), Ok(Host));
        assert_eq!(Auto.choose(off, true, 1), Ok(Host));
        assert_eq!(Host.choose(stage1, true, 2), Ok(Host));
        // Stage 1 runs over the host: `Auto` falls back, an explicit `Nccl` is refused.
        assert_eq!(Auto.choose(stage1, true, 2), Ok(Host));
        assert_eq!(
            Nccl.choose(stage1, true, 2),
            Err(TransportError::NcclWithZero(1))
        );
        assert_eq!(Auto.choose(stage2, true, 4), Ok(Host));
        assert_eq!(
            Nccl.choose(stage2, true, 2),
            Err(TransportError::NcclWithZero(2))
        );
        // NCCL itself: the build, then the device.
        let built = |then: Result<GradientTransport, TransportError>| {
            if cfg!(feature = "cuda") {
                then
            } else {
                Err(TransportError::NcclNotBuilt)
            }
        };
        assert_eq!(Auto.choose(off, true, 2), built(Ok(Nccl)));
        assert_eq!(Nccl.choose(off, true, 1), built(Ok(Nccl)));
        assert_eq!(
            Nccl.choose(off, false, 2),
            built(Err(TransportError::NcclNeedsCuda))
        );
    }
}
