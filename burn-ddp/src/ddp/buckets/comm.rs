//! [`BucketComm`]: how the [`Reducer`](crate::ddp::Reducer) sums a packed gradient bucket across
//! ranks — the seam between the DDP layer and a process group.
//!
//! | implementation | where the bucket goes | devices |
//! |---|---|---|
//! | [`HostStaging`] (any [`ProcessGroup`]) | read to host memory, reduced by the group (the TCP ring), written back | every backend: CPU, wgpu, CUDA without NCCL |
//! | `NcclBuckets` (`device.rs`, feature `cuda`) | stays on the GPU; NCCL reduces it in place | Burn's CUDA backend |
//!
//! The reducer packs gradients on the device first ([`BucketOps`]), so host staging reads one
//! buffer per bucket (half the bytes when compressed), not one per gradient.

use burn::backend::ops::{FloatTensorOps, IntTensorOps};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Dispatch, TensorMetadata};
use burn::tensor::{DType, Int, Shape, Tensor};

use crate::ddp::buckets::finite::FiniteScan;
use crate::ddp::buckets::host_pieces::{
    host_slice, read_error, read_float, F32Pieces, HalfPieces, HostBucket,
};
use crate::ddp::buckets::scatter;
use crate::error::DdpError;
use crate::group::{ProcessGroup, ReduceOp};
use crate::kernels::{host16, host_memory, BucketOps, BucketOpsError, HalfFormat};

/// Sums packed gradient buckets across the ranks of a group.
///
/// Both methods are **collective**: every rank calls them in the same order with buckets of the
/// same length (and format), and gets back the elementwise sum over all ranks, identical on every
/// rank. They block until the sum is complete (the result may be read or overwritten by the
/// next device operation at once) or until the group's timeout, and an error aborts the group as
/// its collectives do.
pub trait BucketComm {
    /// Number of ranks whose buckets are summed.
    fn world_size(&self) -> usize;

    /// Whether a job of one rank still sends every bucket through this communicator. `false`
    /// (the default) lets the reducer return at once, as summing over one rank changes nothing;
    /// the NCCL one says `true` so that a machine with one GPU exercises its whole path.
    fn reduces_alone(&self) -> bool {
        false
    }

    /// Sums a 1-D `f32` bucket. `scan` looks at this rank's values before they are sent
    /// (where they already pass: the host copy, or a device reduction).
    fn all_reduce_f32(
        &mut self,
        bucket: FloatTensor<Dispatch>,
        scan: &mut FiniteScan,
    ) -> Result<FloatTensor<Dispatch>, DdpError>;

    /// Sums a 1-D `f32` bucket like [`all_reduce_f32`](Self::all_reduce_f32) and multiplies
    /// each sum by `scale` (one `f32` multiply: the `1 / world` of the mean). The default
    /// multiplies on the device after the sum; [`HostStaging`] on its host copy, in the pass
    /// that writes the bucket back. Same bits either way.
    fn all_reduce_f32_scaled(
        &mut self,
        bucket: FloatTensor<Dispatch>,
        scale: f32,
        scan: &mut FiniteScan,
    ) -> Result<FloatTensor<Dispatch>, DdpError> {
        let sum = self.all_reduce_f32(bucket, scan)?;
        Ok(Dispatch::float_mul_scalar(sum, scale.into()))
    }

    /// Sums a compressed bucket: `len` values of `format` packed two per `u32` word (the layout
    /// of [`wire16`](crate::kernels::wire16)), reduced as 16-bit floats. `scan` as above.
    fn all_reduce_half(
        &mut self,
        words: IntTensor<Dispatch>,
        len: usize,
        format: HalfFormat,
        scan: &mut FiniteScan,
    ) -> Result<IntTensor<Dispatch>, DdpError>;

    /// Sums a 1-D `f32` bucket in `format` and returns the sum widened to a new 1-D `f32`
    /// tensor: each value multiplied by `scale` and rounded
    /// ([`BucketOps::compress_bucket`]), the 16-bit values summed
    /// ([`all_reduce_half`](Self::all_reduce_half)), the sums widened
    /// ([`BucketOps::decompress_bucket`]). `scan` sees this rank's 16-bit values.
    ///
    /// The default runs exactly those three steps; an implementation may fuse them (the host
    /// path on a host backend, [`HostStaging`]) but must give the same bits.
    fn all_reduce_compressed(
        &mut self,
        bucket: FloatTensor<Dispatch>,
        format: HalfFormat,
        scale: f32,
        scan: &mut FiniteScan,
    ) -> Result<FloatTensor<Dispatch>, DdpError> {
        compressed_in_steps(self, bucket, format, scale, scan)
    }

    /// Tells every rank which ranks found non-finite gradients: one byte per rank gathered
    /// over the group, once per synchronisation. Collective.
    fn gather_flags(&mut self, local: bool) -> Result<Vec<bool>, DdpError>;

    /// Averages one bucket of gradients over the ranks: the reducer's unit of work. `grads`
    /// (non-empty, on one device) come back as tensors of `shapes`, in order, each value the
    /// mean over the ranks: summed in `f32` and multiplied by `scale` (`1 / world`), or, with
    /// `compression`, multiplied by `scale`, rounded to 16 bits, summed in 16 bits and widened.
    /// Collective, like the methods it is made of.
    ///
    /// The default packs on the device ([`BucketOps::pack_bucket`]), sums with the methods
    /// above and unpacks ([`BucketOps::unpack_bucket`]). [`HostStaging`] on a backend in host
    /// memory does the same operations piece by piece inside the ring instead, while other
    /// pieces are on the wire (`host_pieces.rs`); same bits.
    fn mean_of_bucket(
        &mut self,
        grads: Vec<FloatTensor<Dispatch>>,
        shapes: &[Shape],
        compression: Option<HalfFormat>,
        scale: f32,
        scan: &mut FiniteScan,
    ) -> Result<Vec<FloatTensor<Dispatch>>, DdpError> {
        mean_by_packing(self, grads, shapes, compression, scale, scan)
    }

    /// ZeRO stage 2's unit of work: averages one bucket like
    /// [`mean_of_bucket`](Self::mean_of_bucket), but gradient `i`'s mean reaches only rank
    /// `owners[i]` (a reduce-scatter: half an all-reduce's bytes), and this rank gets `None`
    /// for the gradients it does not own. Collective; `owners` must be the same on every rank.
    ///
    /// The default refuses: only the host path runs it ([`HostStaging`]).
    fn mean_to_owners(
        &mut self,
        grads: Vec<FloatTensor<Dispatch>>,
        shapes: &[Shape],
        owners: &[usize],
        compression: Option<HalfFormat>,
        scale: f32,
        scan: &mut FiniteScan,
    ) -> Result<Vec<Option<FloatTensor<Dispatch>>>, DdpError> {
        let _ = (grads, shapes, owners, compression, scale, scan);
        Err(DdpError::Unsupported(
            "ZeRO stage 2 reduces gradients through the host transport only".into(),
        ))
    }
}

/// One bucket's means: for every rank (`owners` `None`: [`BucketComm::mean_of_bucket`]), or
/// each gradient's for its owner only ([`BucketComm::mean_to_owners`], ZeRO stage 2). The
/// one place the reducer and the communication thread choose between them. Collective.
pub(crate) fn bucket_means<C: BucketComm + ?Sized>(
    comm: &mut C,
    grads: Vec<FloatTensor<Dispatch>>,
    shapes: &[Shape],
    owners: Option<&[usize]>,
    compression: Option<HalfFormat>,
    scale: f32,
    scan: &mut FiniteScan,
) -> Result<Vec<Option<FloatTensor<Dispatch>>>, DdpError> {
    match owners {
        None => Ok(comm
            .mean_of_bucket(grads, shapes, compression, scale, scan)?
            .into_iter()
            .map(Some)
            .collect()),
        Some(owners) => comm.mean_to_owners(grads, shapes, owners, compression, scale, scan),
    }
}

/// [`BucketComm::mean_of_bucket`] as device steps: pack, sum (compressed or not), unpack.
fn mean_by_packing<C: BucketComm + ?Sized>(
    comm: &mut C,
    grads: Vec<FloatTensor<Dispatch>>,
    shapes: &[Shape],
    compression: Option<HalfFormat>,
    scale: f32,
    scan: &mut FiniteScan,
) -> Result<Vec<FloatTensor<Dispatch>>, DdpError> {
    let Some(first) = grads.first() else {
        return Ok(Vec::new());
    };
    let device = first.device();
    let packed = Dispatch::pack_bucket(grads, &device);
    Ok(match compression {
        // In host memory the 1/world multiply rides on the pass that writes the sum back; on a
        // device it is fused into the unpack kernel.
        None if host_memory(&device) => {
            let mean = comm.all_reduce_f32_scaled(packed, scale, scan)?;
            Dispatch::unpack_bucket(mean, shapes, 1.0)
        }
        None => {
            let sum = comm.all_reduce_f32(packed, scan)?;
            Dispatch::unpack_bucket(sum, shapes, scale)
        }
        Some(format) => {
            let mean = comm.all_reduce_compressed(packed, format, scale, scan)?;
            Dispatch::unpack_bucket(mean, shapes, 1.0)
        }
    })
}

/// [`BucketComm::all_reduce_compressed`] as three steps on the device and the communicator.
fn compressed_in_steps<C: BucketComm + ?Sized>(
    comm: &mut C,
    bucket: FloatTensor<Dispatch>,
    format: HalfFormat,
    scale: f32,
    scan: &mut FiniteScan,
) -> Result<FloatTensor<Dispatch>, DdpError> {
    let len = bucket.shape().num_elements();
    let words = Dispatch::compress_bucket(bucket, format, scale).map_err(device_error)?;
    let words = comm.all_reduce_half(words, len, format, scan)?;
    Dispatch::decompress_bucket(words, len, format).map_err(device_error)
}

fn device_error(e: BucketOpsError) -> DdpError {
    DdpError::Device(e.to_string())
}

/// Stages buckets through host memory and sums them with a host [`ProcessGroup`] (the TCP
/// ring): the path of every device without a device-side collective. Per bucket: one read from
/// the device, the ring, one write back.
#[derive(Debug)]
pub struct HostStaging<'a, G>(pub &'a mut G);

impl<G: ProcessGroup> BucketComm for HostStaging<'_, G> {
    fn world_size(&self) -> usize {
        self.0.world_size()
    }

    /// Each gradient read to the host, the bucket laid out owner by owner and
    /// reduce-scattered (`buckets/scatter.rs`).
    fn mean_to_owners(
        &mut self,
        grads: Vec<FloatTensor<Dispatch>>,
        shapes: &[Shape],
        owners: &[usize],
        compression: Option<HalfFormat>,
        scale: f32,
        scan: &mut FiniteScan,
    ) -> Result<Vec<Option<FloatTensor<Dispatch>>>, DdpError> {
        scatter::mean_to_owners(self.0, grads, shapes, owners, compression, scale, scan)
    }

    fn all_reduce_f32(
        &mut self,
        bucket: FloatTensor<Dispatch>,
        scan: &mut FiniteScan,
    ) -> Result<FloatTensor<Dispatch>, DdpError> {
        self.sum_f32_on_host(bucket, None, scan)
    }

    fn all_reduce_f32_scaled(
        &mut self,
        bucket: FloatTensor<Dispatch>,
        scale: f32,
        scan: &mut FiniteScan,
    ) -> Result<FloatTensor<Dispatch>, DdpError> {
        self.sum_f32_on_host(bucket, Some(scale), scan)
    }

    fn all_reduce_half(
        &mut self,
        words: IntTensor<Dispatch>,
        len: usize,
        format: HalfFormat,
        scan: &mut FiniteScan,
    ) -> Result<IntTensor<Dispatch>, DdpError> {
        let device = words.device();
        let mut data = Tensor::<1, Int>::from_dispatch(words)
            .try_into_data()
            .map_err(read_error)?;
        let words = host_slice::<u32>(&mut data)?;
        // The words are `len` 16-bit floats in memory order (then one 0 of padding when `len`
        // is odd, which is left alone).
        let halves: &mut [u16] = bytemuck::cast_slice_mut(words);
        let Some(values) = halves.get_mut(..len) else {
            return Err(DdpError::Unsupported(format!(
                "a compressed bucket of {} words cannot hold {len} values",
                halves.len() / 2
            )));
        };
        scan.host_half(values, format);
        sum_halves(self.0, values, format)?;
        Ok(Dispatch::int_from_data(data, &device))
    }

    /// On a backend in host memory ([`host_memory`]: Burn's CPU backend) the three
    /// steps run on one host copy of the bucket: read it once, round it
    /// ([`host16::round_scaled`], the rounding of `compress_bucket`), sum the 16-bit values
    /// with the group, widen them back in place ([`host16::widen`]), write it once — instead of
    /// a read and a write around each step. Same bits. Other backends round on the device
    /// (half the bytes to read) in the three steps of the default.
    fn all_reduce_compressed(
        &mut self,
        bucket: FloatTensor<Dispatch>,
        format: HalfFormat,
        scale: f32,
        scan: &mut FiniteScan,
    ) -> Result<FloatTensor<Dispatch>, DdpError> {
        if !host_memory(&bucket.device()) {
            return compressed_in_steps::<Self>(self, bucket, format, scale, scan);
        }
        let (device, mut data) = read_float(bucket)?;
        let values = host_slice::<f32>(&mut data)?;
        let mut halves = vec![0u16; values.len()];
        host16::round_scaled(format, values, scale, &mut halves);
        scan.host_half(&halves, format);
        sum_halves(self.0, &mut halves, format)?;
        host16::widen(format, &halves, values);
        Ok(Dispatch::float_from_data(data, &device))
    }

    fn gather_flags(&mut self, local: bool) -> Result<Vec<bool>, DdpError> {
        gather_flags(self.0, local)
    }

    /// On a backend in host memory ([`host_memory`]) with `f32` gradients: no
    /// packed copy on the device. Each gradient is read as it is (Burn's CPU backend hands over
    /// its buffer), the ring's pieces are filled from them and drained back into them
    /// ([`ProcessGroup::all_reduce_staged`]), so the copies, roundings, checks and multiplies
    /// run while other pieces are on the wire. Same bits as the packed path, which every other
    /// case takes.
    fn mean_of_bucket(
        &mut self,
        grads: Vec<FloatTensor<Dispatch>>,
        shapes: &[Shape],
        compression: Option<HalfFormat>,
        scale: f32,
        scan: &mut FiniteScan,
    ) -> Result<Vec<FloatTensor<Dispatch>>, DdpError> {
        let all_f32 = grads.iter().all(|g| g.dtype() == DType::F32);
        let Some(first) = grads
            .first()
            .filter(|g| all_f32 && host_memory(&g.device()))
        else {
            return mean_by_packing::<Self>(self, grads, shapes, compression, scale, scan);
        };
        let device = first.device();
        let mut datas = grads
            .into_iter()
            .map(|g| read_float(g).map(|(_, data)| data))
            .collect::<Result<Vec<_>, _>>()?;
        let slices = datas
            .iter_mut()
            .map(host_slice::<f32>)
            .collect::<Result<Vec<_>, _>>()?;
        let bucket = HostBucket::new(slices, scale, scan);
        let len = bucket.len();
        match compression {
            None => {
                let mut staging = F32Pieces(bucket);
                let mut ring = vec![0f32; len];
                self.0
                    .all_reduce_staged(&mut ring, ReduceOp::Sum, &mut staging)?;
            }
            Some(format) => {
                let mut staging = HalfPieces { bucket, format };
                match format {
                    HalfFormat::Bf16 => {
                        let mut ring = vec![half::bf16::ZERO; len];
                        self.0
                            .all_reduce_staged(&mut ring, ReduceOp::Sum, &mut staging)?;
                    }
                    HalfFormat::F16 => {
                        let mut ring = vec![half::f16::ZERO; len];
                        self.0
                            .all_reduce_staged(&mut ring, ReduceOp::Sum, &mut staging)?;
                    }
                }
            }
        }
        Ok(datas
            .into_iter()
            .map(|data| Dispatch::float_from_data(data, &device))
            .collect())
    }
}

impl<G: ProcessGroup> HostStaging<'_, G> {
    /// Reads an `f32` bucket to the host, sums it with the group, multiplies it by `scale`
    /// (when given) on the same copy, and writes it back.
    fn sum_f32_on_host(
        &mut self,
        bucket: FloatTensor<Dispatch>,
        scale: Option<f32>,
        scan: &mut FiniteScan,
    ) -> Result<FloatTensor<Dispatch>, DdpError> {
        let (device, mut data) = read_float(bucket)?;
        let values = host_slice::<f32>(&mut data)?;
        // The copy just read is still in cache: the scan costs one pass at memory speed.
        scan.host_f32(values);
        self.0.all_reduce(values, ReduceOp::Sum)?;
        if let Some(scale) = scale {
            for x in values.iter_mut() {
                *x *= scale;
            }
        }
        Ok(Dispatch::float_from_data(data, &device))
    }
}

/// Sums 16-bit floats of `format` (their bits) over the group, in place. Collective.
fn sum_halves<G: ProcessGroup>(
    group: &mut G,
    halves: &mut [u16],
    format: HalfFormat,
) -> Result<(), DdpError> {
    match format {
        HalfFormat::Bf16 => group.all_reduce(
            bytemuck::cast_slice_mut::<u16, half::bf16>(halves),
            ReduceOp::Sum,
        )?,
        HalfFormat::F16 => group.all_reduce(
            bytemuck::cast_slice_mut::<u16, half::f16>(halves),
            ReduceOp::Sum,
        )?,
    }
    Ok(())
}

/// [`BucketComm::gather_flags`] over any process group.
pub(crate) fn gather_flags<G: ProcessGroup>(
    group: &mut G,
    local: bool,
) -> Result<Vec<bool>, DdpError> {
    let mut all = vec![0u8; group.world_size()];
    group.all_gather(&[u8::from(local)], &mut all)?;
    Ok(all.into_iter().map(|f| f != 0).collect())
}

#[cfg(test)]
mod tests {
    //! Real sockets on loopback, threads as ranks: the bucket round trip through the host.
    use std::sync::Arc;

    use burn::tensor::{Device, TensorData};

    use super::*;
    use crate::group::{TcpGroupOptions, TcpProcessGroup};
    use crate::kernels::wire16;
    use crate::store::{MemoryStore, Store};

    #[test]
    fn host_staging_sums_f32_and_16_bit_buckets() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mut group =
                        TcpProcessGroup::new(store, rank, 2, TcpGroupOptions::default()).unwrap();
                    let mut comm = HostStaging(&mut group);
                    let device = Device::flex().as_dispatch().clone();
                    let r = rank as f32;
                    let values: Vec<f32> = (0..5).map(|i| i as f32 + 10.0 * r).collect();
                    let bucket =
                        Dispatch::float_from_data(TensorData::new(values.clone(), [5]), &device);
                    let mut scan = FiniteScan::new(true);
                    let sum = BucketComm::all_reduce_f32(&mut comm, bucket, &mut scan).unwrap();
                    let sum = Tensor::<1>::from_dispatch(sum)
                        .into_data()
                        .try_to_vec::<f32>()
                        .unwrap();

                    let mut halves = Vec::new();
                    for format in [HalfFormat::Bf16, HalfFormat::F16] {
                        let words = wire16::compress(&values, format, 0.5);
                        let words = Dispatch::int_from_data(TensorData::new(words, [3]), &device);
                        let words =
                            BucketComm::all_reduce_half(&mut comm, words, 5, format, &mut scan)
                                .unwrap();
                        let words = Tensor::<1, Int>::from_dispatch(words)
                            .into_data()
                            .try_to_vec::<u32>()
                            .unwrap();
                        assert_eq!(words[2] >> 16, 0, "the padding stays 0");
                        halves.push(wire16::decompress(&words, 5, format));
                    }
                    assert!(!scan.found_nonfinite());
                    // Rank 1 says it saw a NaN: both ranks learn it, in rank order.
                    let flags = BucketComm::gather_flags(&mut comm, rank == 1).unwrap();
                    assert_eq!(flags, vec![false, true]);
                    (sum, halves)
                })
            })
            .collect();
        for handle in ranks {
            let (sum, halves) = handle.join().unwrap();
            let mean: Vec<f32> = (0..5).map(|i| i as f32 + 5.0).collect();
            assert_eq!(sum, mean.iter().map(|x| 2.0 * x).collect::<Vec<_>>());
            assert_eq!(halves, vec![mean.clone(), mean]);
        }
    }

    /// The staged bucket (gradients filled into the ring piece by piece and drained back, the
    /// path of a host-memory backend) gives the bits of the packed one, for f32, bf16 and fp16,
    /// with pieces that cut through gradients; its NaN check sees this rank's values.
    #[test]
    fn staged_bucket_means_equal_the_packed_ones() {
        use crate::kernels::fallback::conformance::{special_values, SplitMix64};
        let shapes: Vec<Shape> = vec![
            Shape::new([3, 5]),
            Shape::new([7]),
            Shape::new([1000, 3]),
            Shape::new([1]),
            Shape::new([257]),
        ];
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let ranks: Vec<_> = (0..3)
            .map(|rank| {
                let (store, shapes) = (store.clone(), shapes.clone());
                std::thread::spawn(move || {
                    let options = TcpGroupOptions {
                        piece_bytes: 1000, // 250 f32 / 500 16-bit values: pieces cut gradients
                        ..Default::default()
                    };
                    let mut group = TcpProcessGroup::new(store, rank, 3, options).unwrap();
                    let mut comm = HostStaging(&mut group);
                    let device = Device::flex().as_dispatch().clone();
                    let mut rng = SplitMix64::new(0x5eed_0040 + rank as u64);
                    let values: Vec<Vec<f32>> = shapes
                        .iter()
                        .map(|s| (0..s.num_elements()).map(|_| rng.symmetric_f32()).collect())
                        .collect();
                    let mut values = values;
                    let finite = special_values().into_iter().filter(|x| x.is_finite());
                    for (v, s) in values[2].iter_mut().zip(finite) {
                        *v = s;
                    }
                    if rank == 1 {
                        values[4][100] = f32::NAN;
                    }
                    let tensors = || -> Vec<FloatTensor<Dispatch>> {
                        values
                            .iter()
                            .zip(&shapes)
                            .map(|(v, s)| {
                                Dispatch::float_from_data(
                                    TensorData::new(v.clone(), s.clone()),
                                    &device,
                                )
                            })
                            .collect()
                    };
                    let mut results = Vec::new();
                    for format in [None, Some(HalfFormat::Bf16), Some(HalfFormat::F16)] {
                        let mut scan = FiniteScan::new(true);
                        let staged = BucketComm::mean_of_bucket(
                            &mut comm,
                            tensors(),
                            &shapes,
                            format,
                            1.0 / 3.0,
                            &mut scan,
                        )
                        .unwrap();
                        let staged_verdict = scan.found_nonfinite();
                        let mut scan = FiniteScan::new(true);
                        let packed = mean_by_packing::<_>(
                            &mut comm,
                            tensors(),
                            &shapes,
                            format,
                            1.0 / 3.0,
                            &mut scan,
                        )
                        .unwrap();
                        // (fp16 also finds the specials past its range, on every rank.)
                        assert_eq!(staged_verdict, scan.found_nonfinite(), "{format:?}");
                        if format.is_none() {
                            assert_eq!(staged_verdict, rank == 1);
                        }
                        for ((a, b), shape) in staged.into_iter().zip(packed).zip(&shapes) {
                            assert_eq!(a.shape(), *shape);
                            let (a, b) = (bits_of(a), bits_of(b));
                            assert_eq!(a, b, "{format:?} {shape:?} rank {rank}");
                            results.push(a);
                        }
                    }
                    results
                })
            })
            .collect();
        let results: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(results[0], results[1], "every rank gets the same means");
        assert_eq!(results[0], results[2]);
    }

    fn bits_of(t: FloatTensor<Dispatch>) -> Vec<u32> {
        Tensor::<1>::from_dispatch(t)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    /// The fused host paths give the bits of the steps they fuse: `all_reduce_compressed`
    /// (round, sum, widen) and `all_reduce_f32_scaled` (sum, multiply).
    #[test]
    fn fused_compressed_all_reduce_equals_the_three_steps() {
        use crate::kernels::fallback::conformance::{special_values, SplitMix64};
        fn bits(t: FloatTensor<Dispatch>) -> Vec<u32> {
            Tensor::<1>::from_dispatch(t)
                .into_data()
                .try_to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        }
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mut group =
                        TcpProcessGroup::new(store, rank, 2, TcpGroupOptions::default()).unwrap();
                    let mut comm = HostStaging(&mut group);
                    let device = Device::flex().as_dispatch().clone();
                    let mut rng = SplitMix64::new(0x5eed_0020 + rank as u64);
                    let mut results = Vec::new();
                    for len in [1usize, 7, 4099, 70_001] {
                        let mut values: Vec<f32> =
                            (0..len).map(|_| rng.symmetric_f32() * 1e-2).collect();
                        if len == 4099 {
                            // Finite specials only: a NaN would stop nothing here but differ in
                            // payload between two NaN sums.
                            let specials = special_values();
                            let finite = specials.iter().filter(|x| x.is_finite());
                            for (v, s) in values.iter_mut().zip(finite) {
                                *v = *s;
                            }
                        }
                        for format in [HalfFormat::Bf16, HalfFormat::F16] {
                            let tensor = || {
                                Dispatch::float_from_data(
                                    TensorData::new(values.clone(), [len]),
                                    &device,
                                )
                            };
                            let mut scan = FiniteScan::new(true);
                            let fused = BucketComm::all_reduce_compressed(
                                &mut comm,
                                tensor(),
                                format,
                                0.5,
                                &mut scan,
                            )
                            .unwrap();
                            let steps = compressed_in_steps::<_>(
                                &mut comm,
                                tensor(),
                                format,
                                0.5,
                                &mut scan,
                            )
                            .unwrap();
                            let (fused, steps) = (bits(fused), bits(steps));
                            assert_eq!(fused, steps, "{} len {len}", format.name());
                            results.push(fused);
                        }
                        // f32: the scaled sum is the sum, then one multiply per element.
                        let tensor = || {
                            Dispatch::float_from_data(
                                TensorData::new(values.clone(), [len]),
                                &device,
                            )
                        };
                        let mut scan = FiniteScan::new(true);
                        let scaled = BucketComm::all_reduce_f32_scaled(
                            &mut comm,
                            tensor(),
                            1.0 / 3.0,
                            &mut scan,
                        )
                        .unwrap();
                        let sum =
                            BucketComm::all_reduce_f32(&mut comm, tensor(), &mut scan).unwrap();
                        let want: Vec<u32> = Tensor::<1>::from_dispatch(sum)
                            .into_data()
                            .try_to_vec::<f32>()
                            .unwrap()
                            .iter()
                            .map(|x| (x * (1.0 / 3.0)).to_bits())
                            .collect();
                        assert_eq!(bits(scaled), want, "f32 len {len}");
                    }
                    results
                })
            })
            .collect();
        let results: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(results[0], results[1], "every rank gets the same sums");
    }
}
