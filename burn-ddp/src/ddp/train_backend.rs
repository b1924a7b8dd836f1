//! [`TrainBackend`]: what the DDP step needs of the backend a model trains on, beyond
//! autodiff — the bucket kernels (or their fallback) on its inner backend, and whether its
//! gradients can be summed by NCCL in place. Implemented for Burn's CPU backend (`Flex`) and,
//! with the features of the same name, for `burn::backend::Wgpu` and `burn::backend::Cuda`.

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
#[cfg(feature = "cuda")]
use {
    super::{GradientCheck, Reducer},
    crate::error::DdpError,
    crate::group::nccl::NcclProcessGroup,
    burn::module::AutodiffModule,
    burn::optim::GradientsParams,
};

use crate::kernels::BucketOps;

/// A backend the DDP step can train on (see the module docs). Every backend averages through
/// the host; only CUDA overrides the NCCL members (feature `cuda`).
pub trait TrainBackend: AutodiffBackend<InnerBackend: BucketOps> {
    /// Whether this is Burn's CUDA backend (plain or fused): where
    /// [`GradientTransport::Auto`](super::GradientTransport::Auto) means NCCL.
    const CUDA: bool = false;

    /// Averages `grads` over `group` without leaving the GPU. The DDP step calls it only
    /// where [`CUDA`](TrainBackend::CUDA) is `true`; this default fails instead of guessing.
    #[cfg(feature = "cuda")]
    fn sync_with_nccl<M: AutodiffModule<Self>>(
        reducer: &mut Reducer,
        group: &mut NcclProcessGroup,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<GradientCheck, DdpError> {
        let _ = (reducer, group, model, grads);
        Err(DdpError::Options(
            "gradient transport NCCL needs Burn's CUDA backend".into(),
        ))
    }
}

impl TrainBackend for Autodiff<Flex> {}

#[cfg(feature = "wgpu")]
impl TrainBackend for Autodiff<burn::backend::Wgpu> {}

/// Whichever type `burn::backend::Cuda` is in this build (plain, or fused with Burn's default
/// features): [`super::NcclBackend`] hands its buckets to NCCL.
#[cfg(feature = "cuda")]
impl TrainBackend for Autodiff<burn::backend::Cuda> {
    const CUDA: bool = true;

    fn sync_with_nccl<M: AutodiffModule<Self>>(
        reducer: &mut Reducer,
        group: &mut NcclProcessGroup,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<GradientCheck, DdpError> {
        <burn::backend::Cuda as super::NcclBackend>::sync_nccl::<Self, M>(
            reducer, group, model, grads,
        )
    }
}
