//! [`GatheredBytes`]: how many bytes of whole parameters ZeRO stage 3 holds at once — the
//! part of a rank's model memory that its counted shards leave out.
//!
//! Every whole parameter stage 3 makes is counted while its values are in memory: one
//! gathered on the spot or again for a backward's recompute lives in a [`GatheredValues`],
//! from its creation until the last tensor that uses its memory is dropped; a block gathered
//! ahead lives in a block's storage ([`super::block_storage`]), counted until the block is
//! evicted after its forward, and again while it is gathered back for its backward. The values
//! become the tensor's storage as they are (a [`Bytes`] over them, no copy, on Burn's CPU
//! backend), so whatever keeps the tensor — the forward's ops, the backward's saved inputs, a
//! view — keeps them counted. A backend that copies the values to a device releases them at
//! once (its own memory is not seen here). A collective's receive buffer counts while it
//! lives too.
//!
//! The peak is taken over training forwards and backwards only
//! ([`begin_window`](GatheredBytes::begin_window) … [`end_window`](GatheredBytes::end_window)):
//! the whole model gathered for validation or a save is not part of a step.

use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use burn::tensor::{Bytes, DType, Shape, TensorData};
use burn_std::{AccessError, AccessPolicy, AllocationController, AllocationProperty};

/// Live and peak bytes of gathered whole parameters on one rank (module docs). Shared by the
/// training thread, the prefetch thread and every [`GatheredValues`].
#[derive(Debug, Default)]
pub struct GatheredBytes {
    live: AtomicU64,
    /// The highest `live` since the current window began.
    window_peak: AtomicU64,
    /// The highest `window_peak` of the windows ended so far.
    training_peak: AtomicU64,
}

impl GatheredBytes {
    /// Bytes of whole parameters alive now.
    pub(crate) fn live(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }

    /// The most bytes of whole parameters alive at once during a training forward and
    /// backward, over the windows ended so far.
    pub fn training_peak(&self) -> u64 {
        self.training_peak.load(Ordering::Relaxed)
    }

    /// A training forward and backward begins: its peak starts from what is alive now.
    pub(crate) fn begin_window(&self) {
        self.window_peak.store(self.live(), Ordering::Relaxed);
    }

    /// The forward and backward begun last have ended.
    pub(crate) fn end_window(&self) {
        let peak = self.window_peak.load(Ordering::Relaxed);
        self.training_peak.fetch_max(peak, Ordering::Relaxed);
    }

    /// `bytes` held until the returned guard is dropped.
    pub(crate) fn hold(self: &Arc<Self>, bytes: u64) -> Held {
        self.add(bytes);
        Held {
            gauge: self.clone(),
            bytes,
        }
    }

    fn add(&self, bytes: u64) {
        let now = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.window_peak.fetch_max(now, Ordering::Relaxed);
    }

    fn release(&self, bytes: u64) {
        self.live.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// Bytes counted in a [`GatheredBytes`] until dropped.
pub(crate) struct Held {
    gauge: Arc<GatheredBytes>,
    bytes: u64,
}

impl Held {
    /// `bytes` of them given back early.
    pub fn shrink(&mut self, bytes: u64) {
        let bytes = bytes.min(self.bytes);
        self.bytes -= bytes;
        self.gauge.release(bytes);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.gauge.release(self.bytes);
    }
}

/// A whole parameter's `f32` values, counted while they live (module docs). (A block gathered
/// ahead keeps its values in a block's storage instead, [`super::block_storage`].)
pub(crate) struct GatheredValues {
    values: Vec<f32>,
    _held: Held,
}

impl GatheredValues {
    pub fn new(values: Vec<f32>, gauge: &Arc<GatheredBytes>) -> Self {
        let held = gauge.hold(std::mem::size_of_val(values.as_slice()) as u64);
        Self {
            values,
            _held: held,
        }
    }

    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// The values as tensor data of `shape` (`f32`), still counted: they are its storage.
    pub fn into_tensor_data(self, shape: Shape) -> TensorData {
        as_tensor_data(self, shape)
    }
}

impl StorageValues for GatheredValues {
    fn values_for_access(&self) -> (*mut f32, usize) {
        // A `Vec` that is never resized: its values stay where they are.
        (self.values.as_ptr().cast_mut(), self.values.len())
    }
}

/// `f32` values on the host that a tensor may use as its storage as they are (no copy).
pub(crate) trait StorageValues: Send + 'static {
    /// Where the values are, and how many, for an access by the tensor (a block's storage
    /// first makes sure they are in memory).
    ///
    /// The values must stay initialised and in place, and unwritten by others, while the
    /// access may last (until the next call or the drop).
    fn values_for_access(&self) -> (*mut f32, usize);
}

/// `values` as tensor data of `shape` (`f32`): the tensor's storage.
pub(crate) fn as_tensor_data<V: StorageValues>(values: V, shape: Shape) -> TensorData {
    let len = std::mem::size_of::<f32>() * values.values_for_access().1;
    // SAFETY: the controller's memory is the values, `len` bytes, all initialised.
    let bytes = unsafe { Bytes::from_controller(Box::new(AsStorage(values)), len) };
    TensorData::from_bytes(bytes, shape, DType::F32)
}

/// A tensor's storage that is [`StorageValues`].
struct AsStorage<V>(V);

impl<V: StorageValues> AllocationController for AsStorage<V> {
    fn alloc_align(&self) -> usize {
        std::mem::align_of::<f32>()
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Native
    }

    unsafe fn memory_mut(
        &mut self,
        _policy: AccessPolicy,
    ) -> Result<&mut [MaybeUninit<u8>], AccessError> {
        let (values, len) = self.0.values_for_access();
        // SAFETY: initialised `f32`s viewed as their bytes, in place while borrowed
        // (`StorageValues`' contract); the caller writes only initialised bytes (the trait's
        // contract), and any bytes are a valid `f32`.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(values.cast(), len * std::mem::size_of::<f32>())
        })
    }

    fn memory(&self, _policy: AccessPolicy) -> Result<&[MaybeUninit<u8>], AccessError> {
        let (values, len) = self.0.values_for_access();
        // SAFETY: as in `memory_mut`, read only.
        Ok(unsafe { std::slice::from_raw_parts(values.cast(), len * std::mem::size_of::<f32>()) })
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor};

    use super::*;

    #[test]
    fn gathered_values_count_until_the_last_tensor_using_them_is_dropped() {
        let gauge = Arc::new(GatheredBytes::default());
        gauge.begin_window();
        let values = GatheredValues::new(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &gauge);
        assert_eq!(gauge.live(), 24);
        let device = Device::flex();
        let tensor = Tensor::<2>::from_data(values.into_tensor_data(Shape::new([2, 3])), &device);
        assert_eq!(gauge.live(), 24, "the tensor's storage is the values");
        let view = tensor.clone().reshape([3, 2]);
        drop(tensor);
        assert_eq!(gauge.live(), 24, "a view keeps them");
        let doubled = (view.clone() * 2.0)
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        assert_eq!(doubled, vec![2.0, 4.0, 6.0, 8.0, 10.0, 12.0]);
        drop(view);
        assert_eq!(gauge.live(), 0);
        let buffer = gauge.hold(100);
        assert_eq!(gauge.live(), 100);
        drop(buffer);
        gauge.end_window();
        assert_eq!(gauge.training_peak(), 100);
        // Outside a window (validation) nothing reaches the training peak.
        gauge.begin_window();
        drop(gauge.hold(10));
        gauge.begin_window();
        gauge.end_window();
        assert_eq!(gauge.training_peak(), 100);
    }
}
