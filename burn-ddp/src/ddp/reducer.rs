//! [`Reducer`]: averages gradients across ranks after backward, in buckets.
//!
//! ```text
//! loss.backward() ─▶ GradientsParams ─▶ take each gradient out, in visit order
//!                                    ─▶ pack into buckets (bucket.rs)
//!                                    ─▶ all_reduce(Avg) per bucket over the process group
//!                                    ─▶ unpack, register back ─▶ optimizer.step()
//! ```
//! The reduction is a **mean**: with a loss that is a mean over the per-rank batch and equal
//! per-rank batch sizes, the averaged gradient is exactly the gradient of the mean loss over the
//! global batch — what a single process with the global batch computes.
//!
//! Gradients travel through the host (this is the path for CPU backends and for devices without
//! a device-side collective). Parameters without a gradient are skipped; which parameters have
//! gradients must therefore be the same on every rank (a difference is reported as a length
//! mismatch, not a hang).

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, TensorData};

use super::bucket::plan_buckets;
use crate::error::DdpError;
use crate::group::{ProcessGroup, ReduceOp};

/// Counters a test or a metrics line can read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReducerStats {
    /// Gradient synchronisations (one per optimizer step, whatever the accumulation).
    pub syncs: u64,
    /// Bucket all-reduces issued.
    pub bucket_all_reduces: u64,
    /// Gradient bytes reduced (as f32).
    pub bytes_reduced: u64,
}

/// Averages gradients across the ranks of a process group. See the module docs.
#[derive(Debug, Clone)]
pub struct Reducer {
    bucket_cap_elems: usize,
    stats: ReducerStats,
}

impl Reducer {
    /// `bucket_cap_mb`: largest bucket in MiB of f32 gradients (PyTorch's default is 25).
    pub fn new(bucket_cap_mb: f64) -> Self {
        Self {
            bucket_cap_elems: super::bucket::cap_elements(bucket_cap_mb),
            stats: ReducerStats::default(),
        }
    }

    pub fn stats(&self) -> ReducerStats {
        self.stats
    }

    /// Replaces every gradient in `grads` with its mean over the ranks of `group`.
    ///
    /// Collective: every rank calls it once per optimizer step, with gradients of the same
    /// model. With a world size of 1 it returns at once and touches nothing.
    pub fn sync<B, M, G>(
        &mut self,
        group: &mut G,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<(), DdpError>
    where
        B: AutodiffBackend,
        M: AutodiffModule<B>,
        G: ProcessGroup,
    {
        self.stats.syncs += 1;
        if group.world_size() == 1 {
            return Ok(());
        }
        let mut taker = TakeGrads::<B> {
            grads,
            taken: Vec::new(),
        };
        model.visit(&mut taker);
        let mut taken = taker.taken;

        let numels: Vec<usize> = taken.iter().map(|g| g.data.num_elements()).collect();
        let mut bucket_buffer: Vec<f32> = Vec::new();
        for bucket in plan_buckets(&numels, self.bucket_cap_elems) {
            if let [param] = bucket.params[..] {
                // A bucket of one: reduce the gradient's own buffer, no packing copy.
                let values = f32_slice_mut(&mut taken[param].data)?;
                group.all_reduce(values, ReduceOp::Avg)?;
            } else {
                bucket_buffer.clear();
                bucket_buffer.resize(bucket.numel, 0.0);
                for (&p, range) in bucket.params.iter().zip(&bucket.ranges) {
                    bucket_buffer[range.clone()]
                        .copy_from_slice(f32_slice_mut(&mut taken[p].data)?);
                }
                group.all_reduce(&mut bucket_buffer, ReduceOp::Avg)?;
                for (&p, range) in bucket.params.iter().zip(&bucket.ranges) {
                    f32_slice_mut(&mut taken[p].data)?
                        .copy_from_slice(&bucket_buffer[range.clone()]);
                }
            }
            self.stats.bucket_all_reduces += 1;
            self.stats.bytes_reduced += bucket.numel as u64 * 4;
        }

        let mut putter = PutGrads::<B> {
            grads,
            taken: taken.into_iter().peekable(),
        };
        model.visit(&mut putter);
        Ok(())
    }
}

/// A gradient taken out of `GradientsParams`, as f32 host data.
struct TakenGrad<B: Backend> {
    id: ParamId,
    data: TensorData,
    dtype: DType,
    device: B::Device,
}

fn f32_slice_mut(data: &mut TensorData) -> Result<&mut [f32], DdpError> {
    data.as_mut_slice::<f32>()
        .map_err(|e| DdpError::Unsupported(format!("gradient is not f32 host data: {e:?}")))
}

/// Removes every float parameter's gradient, in visit order.
struct TakeGrads<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    taken: Vec<TakenGrad<B::InnerBackend>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for TakeGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            let dtype = grad.dtype();
            let device = grad.device();
            self.taken.push(TakenGrad {
                id: param.id,
                data: grad.into_data().convert::<f32>(),
                dtype,
                device,
            });
        }
    }
}

/// Puts the (averaged) gradients back, matching them to parameters by visit order.
struct PutGrads<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    taken: std::iter::Peekable<std::vec::IntoIter<TakenGrad<B::InnerBackend>>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for PutGrads<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if self.taken.peek().is_some_and(|g| g.id == param.id) {
            if let Some(g) = self.taken.next() {
                let tensor = Tensor::<B::InnerBackend, D>::from_data(
                    g.data.convert_dtype(g.dtype),
                    &g.device,
                );
                self.grads.register(param.id, tensor);
            }
        }
    }
}
