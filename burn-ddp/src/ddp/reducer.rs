//! [`Reducer`]: averages gradients across ranks after backward, in buckets.
//!
//! ```text
//! loss.backward() ─▶ GradientsParams ─▶ take each gradient out, in visit order (device tensors)
//!                                    ─▶ plan buckets (bucket.rs)
//!   for each bucket:
//!     pack        BucketOps::pack_bucket: one contiguous f32 buffer on the device
//!     [compress]  BucketOps::compress_bucket(bf16 | fp16, scale 1/world): half the bytes
//!     sum         BucketComm: the TCP ring through the host, or NCCL on the GPU
//!     [widen]     BucketOps::decompress_bucket
//!     unpack      BucketOps::unpack_bucket(scale 1/world, or 1 when compressed)
//!   (BucketComm::mean_of_bucket runs these steps for one bucket. On a backend in host
//!   memory, kernels::host_memory, the host communicator packs, compresses, checks, sums,
//!   widens, scales and unpacks piece by piece inside the ring instead, each piece while
//!   others are on the wire: ProcessGroup::all_reduce_staged; same bits)
//!   ─▶ register the averaged gradients back ─▶ optimizer.step()
//! ```
//! The reduction is a **mean**: with a loss that is a mean over the per-rank batch and equal
//! per-rank batch sizes, the averaged gradient is exactly the gradient of the mean loss over the
//! global batch — what a single process with the global batch computes. Without compression the
//! sum is `f32` arithmetic and the division is a multiply by `1 / world` fused into the unpack;
//! with compression each rank multiplies by `1 / world` *before* rounding to 16 bits (fused into
//! the compress kernel; PyTorch's `fp16_compress_hook` divides after casting, so a sum can
//! overflow fp16 there where the mean would not), and the sum is rounded to 16 bits at every
//! ring step.
//!
//! One code path serves every device and every world size; only the [`BucketComm`] differs
//! (`comm.rs`). Parameters without a gradient are skipped; which parameters have gradients must
//! therefore be the same on every rank (a difference is reported as a length mismatch by the
//! TCP ring, and by NCCL when its header check is on).

use std::time::{Duration, Instant};

use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::FloatTensor;
use burn::backend::Dispatch;
use burn::module::{ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::{DType, FloatDType};

use crate::ddp::buckets::comm::{bucket_means, BucketComm};
use crate::ddp::buckets::finite::{probe, FiniteScan, GradientCheck};
use crate::ddp::buckets::plan::{check_bucket_len, plan_buckets, Bucket};
pub use crate::ddp::buckets::stats::ReducerStats;
use crate::ddp::overlap::comm_thread::Job;
use crate::ddp::overlap::ready_buckets::{BucketTiming, Overlap, StepTimeline};
use crate::ddp::zero::shard_plan::ShardPlan;
use crate::error::DdpError;
use crate::kernels::HalfFormat;

/// Averages gradients across the ranks of a process group. See the module docs.
#[derive(Debug, Clone)]
pub struct Reducer {
    bucket_cap_elems: usize,
    compression: Option<HalfFormat>,
    check_finite: bool,
    stats: ReducerStats,
}

impl Reducer {
    /// `bucket_cap_mb`: largest bucket in MiB of f32 gradients (PyTorch's default is 25).
    /// `compression`: send buckets as bf16 / fp16 (`None`: as `f32`). Both must be the same on
    /// every rank.
    pub fn new(bucket_cap_mb: f64, compression: Option<HalfFormat>) -> Self {
        Self {
            bucket_cap_elems: crate::ddp::buckets::plan::cap_elements(bucket_cap_mb),
            compression,
            check_finite: true,
            stats: ReducerStats::default(),
        }
    }

    /// Whether [`sync`](Self::sync) looks for NaN and ±Inf in each rank's gradients (on by
    /// default; it rides on the pass that reads each bucket, plus one byte per rank gathered
    /// per step). Must be the same on every rank.
    pub fn with_finite_check(mut self, check: bool) -> Self {
        self.check_finite = check;
        self
    }

    pub fn stats(&self) -> ReducerStats {
        self.stats
    }

    /// The bucket cap in f32 elements.
    pub fn bucket_cap(&self) -> usize {
        self.bucket_cap_elems
    }

    /// Whether [`sync`](Self::sync) checks for NaN and ±Inf.
    pub fn checks_finite(&self) -> bool {
        self.check_finite
    }

    /// The wire format of the buckets (`None`: f32).
    pub fn compression(&self) -> Option<HalfFormat> {
        self.compression
    }

    /// Replaces every gradient in `grads` with its mean over the ranks of `comm`.
    ///
    /// Collective: every rank calls it once per optimizer step, with gradients of the same
    /// model, so that every rank sums the same buckets in the same order (the bucket plan is a
    /// function of the parameter sizes in visit order). With a world size of 1 it returns at once
    /// and touches nothing, unless `comm` [reduces alone](BucketComm::reduces_alone).
    ///
    /// Gradients come back with their shapes and dtypes, in new buffers, on their device.
    ///
    /// Returns which ranks' own gradients held a NaN or an infinity (the same answer on every
    /// rank, so all ranks can stop or skip the step together); the mean is then non-finite
    /// too, and the caller must not apply it.
    ///
    /// # Errors
    /// What `comm` reports (a collective failed or timed out: the group is then aborted), a
    /// device read that failed, or a parameter of more than 2^31 - 1 elements (the kernels
    /// index with 32 bits; found before anything is sent, on every rank alike). `grads` may then
    /// have lost gradients: stop training.
    pub fn sync<M, C>(
        &mut self,
        comm: &mut C,
        model: &M,
        grads: &mut GradientsParams,
    ) -> Result<GradientCheck, DdpError>
    where
        M: Module,
        C: BucketComm + ?Sized,
    {
        self.sync_with(comm, model, grads, None, None)
    }

    /// [`sync`](Self::sync), following `overlap`'s learnt bucket plan where it has one: the
    /// buckets queued during backward are waited for, the others queued on its thread (or,
    /// with overlap off, summed here in the same plan). With `owners` (ZeRO stage 2) each
    /// bucket is reduce-scattered to its parameters' owners instead of all-reduced, and
    /// `grads` keeps only this rank's own gradients. Collective as `sync`.
    pub(crate) fn sync_with<M, C>(
        &mut self,
        comm: &mut C,
        model: &M,
        grads: &mut GradientsParams,
        overlap: Option<&mut Overlap>,
        owners: Option<&ShardPlan>,
    ) -> Result<GradientCheck, DdpError>
    where
        M: Module,
        C: BucketComm + ?Sized,
    {
        self.stats.syncs += 1;
        let world = comm.world_size();
        let mut scan = FiniteScan::new(self.check_finite);
        if world == 1 && !comm.reduces_alone() {
            return self.check_alone(model, grads, scan);
        }
        let mut overlap = overlap;
        let mut taker = TakeGrads {
            grads,
            taken: Vec::new(),
            overlap: overlap.as_deref_mut(),
        };
        model.visit(&mut taker);
        let mut taken = taker.taken;

        let scale = 1.0 / world as f32;
        let numels: Vec<usize> = taken.iter().map(|g| g.shape.num_elements()).collect();
        let ids: Vec<ParamId> = taken.iter().map(|g| g.id).collect();
        let owners = owners.map(|plan| owner_of(plan, &ids)).transpose()?;
        let sums = Sums {
            owners: owners.as_deref(),
            scale,
        };
        match overlap {
            Some(overlap) if overlap.planned_buckets(&ids)?.is_some() => {
                self.reduce_planned(comm, overlap, &ids, &mut taken, sums, &mut scan)?;
            }
            _ => {
                for bucket in plan_buckets(&numels, self.bucket_cap_elems) {
                    self.reduce_bucket(comm, &bucket, &mut taken, sums, &mut scan)?;
                }
            }
        }

        let mut putter = PutGrads {
            grads,
            taken: taken.into_iter().peekable(),
        };
        model.visit(&mut putter);
        if !self.check_finite {
            return Ok(GradientCheck::default());
        }
        let flags = comm.gather_flags(scan.found_nonfinite())?;
        Ok(GradientCheck {
            nonfinite_ranks: (0..flags.len()).filter(|&r| flags[r]).collect(),
        })
    }

    /// World 1 with a communicator that has nothing to do alone: only the non-finite check.
    /// Nothing is sent, so there is no pass over the gradients to ride on, and a pass of its
    /// own costs ~5% of a CPU step (measured on the MLP benchmark). A NaN or Inf that comes
    /// through the loss reaches every gradient, so the smallest one tells (a bias, as a rule):
    /// one small reduction and one read. The weights are checked in full before every
    /// checkpoint.
    fn check_alone<M: Module>(
        &self,
        model: &M,
        grads: &GradientsParams,
        mut scan: FiniteScan,
    ) -> Result<GradientCheck, DdpError> {
        if self.check_finite {
            let mut sentinel = SmallestGrad {
                grads,
                smallest: None,
            };
            model.visit(&mut sentinel);
            if let Some((_, g)) = sentinel.smallest {
                scan.device_probe(probe(g))?;
            }
        }
        let nonfinite_ranks = if scan.found_nonfinite() {
            vec![0]
        } else {
            vec![]
        };
        Ok(GradientCheck { nonfinite_ranks })
    }

    /// The buckets of `overlap`'s plan: on its communication thread (those queued during
    /// backward, then the rest, in plan order), or here in the same order with overlap off.
    fn reduce_planned<C: BucketComm + ?Sized>(
        &mut self,
        comm: &mut C,
        overlap: &mut Overlap,
        ids: &[ParamId],
        taken: &mut [TakenGrad],
        sums: Sums<'_>,
        scan: &mut FiniteScan,
    ) -> Result<(), DdpError> {
        let buckets = overlap.planned_buckets(ids)?.unwrap_or_default().to_vec();
        let start = Instant::now();
        let Some((queued, armed_at, thread)) = overlap.in_flight() else {
            for bucket in &buckets {
                self.reduce_bucket(comm, bucket, taken, sums, scan)?;
            }
            let spent = start.elapsed();
            overlap.record(0, buckets.len(), (spent, spent), None);
            return Ok(());
        };
        for bucket in &buckets[queued..] {
            let grads = bucket
                .params
                .iter()
                .map(|&p| taken[p].tensor.take())
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| DdpError::Overlap("a parameter in two buckets".into()))?;
            thread.send(Job {
                grads,
                shapes: bucket
                    .params
                    .iter()
                    .map(|&p| taken[p].shape.clone())
                    .collect(),
                owners: sums.of(bucket),
                compression: self.compression,
                scale: sums.scale,
                check_finite: self.check_finite,
                queued: Instant::now(),
            })?;
        }
        let origin = armed_at.unwrap_or(start);
        let since = |at: Instant| at.saturating_duration_since(origin);
        let mut timeline = StepTimeline {
            sync_began: since(start),
            ..StepTimeline::default()
        };
        let mut busy = Duration::ZERO;
        for bucket in &buckets {
            let done = thread.next()?;
            busy += done.busy();
            timeline.buckets.push(BucketTiming {
                bytes: bucket.numel * self.element_bytes(),
                queued: since(done.queued),
                started: since(done.started),
                finished: since(done.finished),
            });
            if done.nonfinite {
                scan.mark_nonfinite();
            }
            for (&p, out) in bucket.params.iter().zip(done.result?) {
                taken[p].tensor = out.map(|out| cast_to(out, taken[p].dtype));
            }
            self.count_bucket(bucket);
        }
        timeline.all_done = since(Instant::now());
        overlap.record(
            queued,
            buckets.len(),
            (busy, start.elapsed()),
            Some(timeline),
        );
        Ok(())
    }

    /// Bytes per gradient element on the wire.
    fn element_bytes(&self) -> usize {
        if self.compression.is_some() {
            2
        } else {
            4
        }
    }

    fn count_bucket(&mut self, bucket: &Bucket) {
        self.stats.bucket_all_reduces += 1;
        self.stats.bytes_reduced += (bucket.numel * self.element_bytes()) as u64;
    }

    /// Replaces the gradients of `bucket`'s parameters in `taken` by their mean over the ranks
    /// (in their own dtype again; at ZeRO stage 2 only this rank's own, the others dropped).
    /// Collective.
    fn reduce_bucket<C: BucketComm + ?Sized>(
        &mut self,
        comm: &mut C,
        bucket: &Bucket,
        taken: &mut [TakenGrad],
        sums: Sums<'_>,
        scan: &mut FiniteScan,
    ) -> Result<(), DdpError> {
        check_bucket_len(bucket)?;
        let mut inputs = Vec::with_capacity(bucket.params.len());
        let mut shapes = Vec::with_capacity(bucket.params.len());
        for &p in &bucket.params {
            // Each parameter is in exactly one bucket (bucket.rs), so it is still here.
            let Some(tensor) = taken[p].tensor.take() else {
                unreachable!("parameter {p} planned into two buckets");
            };
            inputs.push(tensor);
            shapes.push(taken[p].shape.clone());
        }
        let owners = sums.of(bucket);
        let outputs = bucket_means(
            comm,
            inputs,
            &shapes,
            owners.as_deref(),
            self.compression,
            sums.scale,
            scan,
        )?;
        for (&p, out) in bucket.params.iter().zip(outputs) {
            taken[p].tensor = out.map(|out| cast_to(out, taken[p].dtype));
        }
        self.count_bucket(bucket);
        Ok(())
    }
}

/// How this sync's buckets are summed: the mean's `1 / world`, and at ZeRO stage 2 the owner
/// of each gradient (indexed like the taken gradients).
#[derive(Clone, Copy)]
struct Sums<'a> {
    owners: Option<&'a [usize]>,
    scale: f32,
}

impl Sums<'_> {
    /// The owners of `bucket`'s gradients, in its order (`None`: all-reduced).
    fn of(&self, bucket: &Bucket) -> Option<Vec<usize>> {
        self.owners
            .map(|owners| bucket.params.iter().map(|&p| owners[p]).collect())
    }
}

/// The owner of each of `ids` in `plan`; a parameter the plan does not know (the model
/// changed since it was made) fails on every rank alike.
fn owner_of(plan: &ShardPlan, ids: &[ParamId]) -> Result<Vec<usize>, DdpError> {
    ids.iter()
        .map(|&id| {
            plan.owner(id).ok_or_else(|| {
                DdpError::Mismatch(format!(
                    "parameter {id} has a gradient but no owner in the ZeRO plan: the model's parameters changed after the plan was made"
                ))
            })
        })
        .collect()
}

/// An averaged gradient (f32) in its parameter's dtype again.
fn cast_to(out: FloatTensor<Dispatch>, dtype: DType) -> FloatTensor<Dispatch> {
    if dtype == DType::F32 {
        out
    } else {
        Dispatch::float_cast(out, FloatDType::from(dtype))
    }
}

/// A gradient taken out of `GradientsParams`, still on its device.
/// The float gradient with the fewest elements in `grads` (flattened; nothing computed).
struct SmallestGrad<'a> {
    grads: &'a GradientsParams,
    smallest: Option<(usize, Tensor<1>)>,
}

impl ModuleVisitor for SmallestGrad<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Some(g) = self.grads.get::<D>(param.id) {
            let n = g.shape().num_elements();
            if self.smallest.as_ref().is_none_or(|(m, _)| n < *m) {
                self.smallest = Some((n, g.reshape([n])));
            }
        }
    }
}

/// A gradient taken out of `GradientsParams`, still on its device.
struct TakenGrad {
    id: ParamId,
    /// `None` only while its bucket is being reduced.
    tensor: Option<FloatTensor<Dispatch>>,
    shape: Shape,
    dtype: DType,
}

/// Removes every float parameter's gradient, in visit order; a gradient the overlap's backward
/// handed over is taken from the overlap instead (what `grads` holds for it then is only the
/// earlier micro-batches' sum, already in the handed one).
struct TakeGrads<'a> {
    grads: &'a mut GradientsParams,
    taken: Vec<TakenGrad>,
    overlap: Option<&'a mut Overlap>,
}

impl ModuleVisitor for TakeGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let ours = self.grads.remove::<D>(param.id);
        if let Some(handed) = self
            .overlap
            .as_deref_mut()
            .and_then(|o| o.take_handed(param.id))
        {
            self.taken.push(TakenGrad {
                id: param.id,
                tensor: handed.tensor,
                shape: handed.shape,
                dtype: handed.dtype,
            });
            return;
        }
        if let Some(grad) = ours {
            let shape = grad.shape();
            let dtype = grad.dtype();
            self.taken.push(TakenGrad {
                id: param.id,
                tensor: Some(grad.into_dispatch()),
                shape,
                dtype,
            });
        }
    }
}

/// Puts the (averaged) gradients back, matching them to parameters by visit order.
struct PutGrads<'a> {
    grads: &'a mut GradientsParams,
    taken: std::iter::Peekable<std::vec::IntoIter<TakenGrad>>,
}

impl ModuleVisitor for PutGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if self.taken.peek().is_some_and(|g| g.id == param.id) {
            if let Some(TakenGrad {
                tensor: Some(tensor),
                ..
            }) = self.taken.next()
            {
                let tensor = Tensor::<D>::from_dispatch(tensor);
                self.grads.register(param.id, tensor);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! Three ranks as threads over real loopback sockets, each with its own copy of a small
    //! network and its own input: the averaged gradients must equal the mean of the three
    //! ranks' gradients computed on the host.
    use std::sync::Arc;

    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::TensorData;

    use super::*;
    use crate::ddp::buckets::comm::HostStaging;
    use crate::group::{TcpGroupOptions, TcpProcessGroup};
    use crate::store::{MemoryStore, Store};

    #[derive(Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
    }

    /// The same weights on every rank (`seed`), an input that depends on the rank.
    fn gradients(rank: usize) -> (Net, GradientsParams, Vec<Vec<f32>>) {
        gradients_of(rank, 0.0)
    }

    /// As [`gradients`], with `poison` added to one input value (NaN or Inf poisons every
    /// gradient that depends on it; 0 changes nothing).
    fn gradients_of(rank: usize, poison: f32) -> (Net, GradientsParams, Vec<Vec<f32>>) {
        let device = Device::flex().autodiff();
        device.seed(7);
        let net = Net {
            a: LinearConfig::new(6, 40).init(&device),
            b: LinearConfig::new(40, 3).init(&device),
        };
        let x: Vec<f32> = (0..12)
            .map(|i| (i as f32 - 5.0) * (rank as f32 + 1.0) + if i == 0 { poison } else { 0.0 })
            .collect();
        let x = Tensor::<2>::from_data(TensorData::new(x, [2, 6]), &device);
        let y = net.b.forward(net.a.forward(x));
        let grads = GradientsParams::from_grads(y.powi_scalar(2).sum().backward(), &net);
        let values = read_all(&net, &grads);
        (net, grads, values)
    }

    fn read_all(net: &Net, grads: &GradientsParams) -> Vec<Vec<f32>> {
        let read = |g: Option<Tensor<2>>| g.unwrap().into_data().try_to_vec::<f32>().unwrap();
        let read1 = |g: Option<Tensor<1>>| g.unwrap().into_data().try_to_vec::<f32>().unwrap();
        vec![
            read(grads.get(net.a.weight.id)),
            read1(grads.get(net.a.bias.as_ref().unwrap().id)),
            read(grads.get(net.b.weight.id)),
            read1(grads.get(net.b.bias.as_ref().unwrap().id)),
        ]
    }

    /// Runs `sync` on three ranks; returns each rank's (before, after, stats).
    fn run(compression: Option<HalfFormat>, bucket_cap_mb: f64) -> Vec<Outcome> {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mut group =
                        TcpProcessGroup::new(store, rank, 3, TcpGroupOptions::default()).unwrap();
                    let (net, mut grads, before) = gradients(rank);
                    let mut reducer = Reducer::new(bucket_cap_mb, compression);
                    reducer
                        .sync(&mut HostStaging(&mut group), &net, &mut grads)
                        .unwrap();
                    (before, read_all(&net, &grads), reducer.stats())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    type Outcome = (Vec<Vec<f32>>, Vec<Vec<f32>>, ReducerStats);

    /// Runs `sync` on `world` ranks where rank `r` adds `poison[r]` to its input; returns each
    /// rank's verdict.
    fn checks(compression: Option<HalfFormat>, poison: Vec<f32>) -> Vec<GradientCheck> {
        let world = poison.len();
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (store, poison) = (store.clone(), poison[rank]);
                std::thread::spawn(move || {
                    let mut group =
                        TcpProcessGroup::new(store, rank, world, TcpGroupOptions::default())
                            .unwrap();
                    let (net, mut grads, _) = gradients_of(rank, poison);
                    Reducer::new(25.0, compression)
                        .sync(&mut HostStaging(&mut group), &net, &mut grads)
                        .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_learns_which_ranks_had_nonfinite_gradients() {
        for compression in [None, Some(HalfFormat::Bf16), Some(HalfFormat::F16)] {
            let found = checks(compression, vec![0.0, f32::NAN, 0.0]);
            assert!(found.iter().all(|c| c.nonfinite_ranks == [1]), "{found:?}");
            let found = checks(compression, vec![f32::INFINITY, 0.0, f32::NAN]);
            assert!(
                found.iter().all(|c| c.nonfinite_ranks == [0, 2]),
                "{found:?}"
            );
            let found = checks(compression, vec![0.0, 0.0, 0.0]);
            assert!(found.iter().all(GradientCheck::all_finite), "{found:?}");
        }
        // A job of one rank checks on the device.
        assert_eq!(checks(None, vec![f32::NAN])[0].nonfinite_ranks, [0]);
        assert!(checks(None, vec![1.0])[0].all_finite());
    }

    /// The mean over the ranks of `f` of each gradient element before the sync.
    fn mean_of(results: &[Outcome], f: impl Fn(f32) -> f32) -> Vec<Vec<f32>> {
        (0..4)
            .map(|t| {
                (0..results[0].0[t].len())
                    .map(|i| results.iter().map(|r| f(r.0[t][i])).sum::<f32>() / 3.0)
                    .collect()
            })
            .collect()
    }

    #[test]
    fn gradients_become_their_mean_over_the_ranks() {
        // 100 elements a bucket: the 240-element weight alone, the others packed together.
        let results = run(None, 100.0 * 4.0 / (1u64 << 20) as f64);
        let mean = mean_of(&results, |x| x);
        let magnitude = mean_of(&results, f32::abs);
        let numels = [240usize, 40, 120, 3];
        for (before, after, stats) in &results {
            assert_ne!(before, &mean, "ranks must start from different gradients");
            // f32 sums in another order, and a multiply by 1/3 instead of a division.
            for ((got, want), size) in after.iter().zip(&mean).zip(&magnitude) {
                for ((g, w), m) in got.iter().zip(want).zip(size) {
                    assert!((g - w).abs() <= 1e-6 * m, "{g} vs {w}");
                }
            }
            assert_eq!(stats.syncs, 1);
            assert_eq!(
                stats.bucket_all_reduces,
                plan_buckets(&numels, 100).len() as u64
            );
            assert_eq!(stats.bytes_reduced, 403 * 4);
        }
        assert!(
            results.windows(2).all(|w| w[0].1 == w[1].1),
            "identical on every rank"
        );
    }

    #[test]
    fn compressed_gradients_are_the_mean_within_16_bit_rounding() {
        // Three roundings (the pre-scaled value, then two ring steps) of at most half an ulp
        // of the magnitudes involved: bf16 keeps 8 significant bits, fp16 11.
        for (format, tolerance) in [
            (HalfFormat::Bf16, 1.0 / 64.0),
            (HalfFormat::F16, 1.0 / 512.0),
        ] {
            let results = run(Some(format), 25.0);
            let mean = mean_of(&results, |x| x);
            let magnitude = mean_of(&results, f32::abs);
            for (_, after, stats) in &results {
                for ((got, want), size) in after.iter().zip(&mean).zip(&magnitude) {
                    for ((g, w), m) in got.iter().zip(want).zip(size) {
                        assert!(
                            (g - w).abs() <= tolerance * m,
                            "{}: {g} vs {w}",
                            format.name()
                        );
                    }
                }
                assert_eq!(stats.bytes_reduced, 403 * 2, "{}", format.name());
            }
            assert_ne!(results[0].1, mean, "{}: rounding shows", format.name());
            assert!(
                results.windows(2).all(|w| w[0].1 == w[1].1),
                "identical on every rank"
            );
        }
    }

    #[test]
    fn a_job_of_one_touches_nothing() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let mut group = TcpProcessGroup::new(store, 0, 1, TcpGroupOptions::default()).unwrap();
        let (net, mut grads, before) = gradients(0);
        let mut reducer = Reducer::new(25.0, Some(HalfFormat::Bf16));
        reducer
            .sync(&mut HostStaging(&mut group), &net, &mut grads)
            .unwrap();
        assert_eq!(read_all(&net, &grads), before);
        assert_eq!(
            reducer.stats(),
            ReducerStats {
                syncs: 1,
                ..Default::default()
            }
        );
    }
}
