//! Non-finite gradients (NaN, ±Inf): found where the reducer already touches every value, so
//! that a diverging run stops — or skips the step — before the optimizer writes NaN into the
//! weights (what PyTorch's `GradScaler` does with its `found_inf` flag).
//!
//! Each rank checks **its own** gradients as they go to the wire (host staging scans the host
//! copy it has just read; a device path checks on the device), so the report names the rank(s)
//! where the values first went bad, not just "the sum is NaN". The ranks then agree with one
//! small all-gather of one byte per rank, once per optimizer step.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::Dispatch;
use burn::module::{ModuleVisitor, Param};
use burn::prelude::*;

use crate::error::DdpError;
use crate::kernels::HalfFormat;

/// What one gradient synchronisation found. Every rank gets the same value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GradientCheck {
    /// The ranks whose own gradients held a NaN or an infinity, ascending; empty when every
    /// gradient of every rank was finite (or the check is off).
    pub nonfinite_ranks: Vec<usize>,
}

impl GradientCheck {
    /// Whether every rank's gradients were finite.
    pub fn all_finite(&self) -> bool {
        self.nonfinite_ranks.is_empty()
    }
}

/// One rank's running verdict over the buckets of one synchronisation.
#[derive(Debug, Clone, Copy)]
pub struct FiniteScan {
    enabled: bool,
    nonfinite: bool,
}

impl FiniteScan {
    /// A fresh scan; `enabled = false` makes every method a no-op (and the verdict "finite").
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            nonfinite: false,
        }
    }

    /// Whether a non-finite value has been seen in this rank's gradients.
    pub fn found_nonfinite(&self) -> bool {
        self.nonfinite
    }

    /// Records a non-finite value seen elsewhere (a bucket scanned on the communication
    /// thread).
    pub fn mark_nonfinite(&mut self) {
        if self.enabled {
            self.nonfinite = true;
        }
    }

    fn needed(&self) -> bool {
        // Once one value is bad, the verdict is in: the other buckets need no look.
        self.enabled && !self.nonfinite
    }

    /// Scans `f32` values in host memory.
    pub fn host_f32(&mut self, values: &[f32]) {
        if self.needed() {
            self.nonfinite = !all_finite_f32(values);
        }
    }

    /// Scans 16-bit floats (`format`'s bits) in host memory.
    pub fn host_half(&mut self, bits: &[u16], format: HalfFormat) {
        if self.needed() {
            self.nonfinite = !all_finite_half(bits, format);
        }
    }

    /// Checks an `f32` tensor on its device: one reduction and a one-value read ([`probe`]).
    pub fn device_f32(&mut self, tensor: &FloatTensor<Dispatch>) -> Result<(), DdpError> {
        if self.needed() {
            let t = Tensor::<1>::from_dispatch(tensor.clone());
            self.device_probe(probe(t))?;
        }
        Ok(())
    }

    /// Reads a [`probe`] (or a sum of probes: one read for many tensors).
    pub fn device_probe(&mut self, probe: Tensor<1>) -> Result<(), DdpError> {
        if self.needed() {
            let value = probe.try_into_scalar::<f32>().map_err(|e| {
                DdpError::Device(format!("reading the gradient check failed: {e:?}"))
            })?;
            self.nonfinite = !value.is_finite();
        }
        Ok(())
    }

    /// Checks a compressed bucket on its device: `u32` words holding two 16-bit floats each
    /// (the layout of [`wire16`](crate::kernels::wire16); a padding word half is 0, finite).
    pub fn device_half(
        &mut self,
        words: &IntTensor<Dispatch>,
        format: HalfFormat,
    ) -> Result<(), DdpError> {
        if self.needed() {
            let t = Tensor::<1, Int>::from_dispatch(words.clone());
            let exponent = half_exponent_mask(format);
            // A 16-bit float is NaN or ±Inf exactly when its exponent bits are all ones; test
            // the low and the high half of every word. The masks fit in an i32 (bit 31 clear).
            let (low_mask, high_mask) = (exponent as i32, (exponent as i32) << 16);
            let low = t.clone().bitwise_and_scalar(low_mask);
            let high = t.bitwise_and_scalar(high_mask);
            let bad = low
                .equal_elem(low_mask)
                .bool_or(high.equal_elem(high_mask))
                .any()
                .try_into_scalar::<bool>()
                .map_err(|e| {
                    DdpError::Device(format!("reading the gradient check failed: {e:?}"))
                })?;
            self.nonfinite = bad;
        }
        Ok(())
    }
}

/// A one-value tensor that is finite when every value of `tensor` is finite and their sum
/// stays within `f32`'s range: the plain sum, one pass (a fifth of the cost of an exact
/// test on Burn's CPU backend, measured: 0.18 ms against 0.88 ms for 1.86 M values). Gradients
/// summing past 3.4e38 are flagged too: the run is diverging either way. Probes add up, so
/// many tensors cost one read.
pub fn probe<const D: usize>(tensor: Tensor<D>) -> Tensor<1> {
    tensor.sum()
}

/// An exact [`probe`]: the sum of `x * 0`, which is 0 for a finite `x` and NaN for NaN and
/// ±Inf, and cannot overflow.
fn exact_probe<const D: usize>(tensor: Tensor<D>) -> Tensor<1> {
    tensor.mul_scalar(0.0).sum()
}

/// Whether every float parameter of `module` is finite (exactly: huge finite weights pass):
/// one probe per parameter, one read in all. Local (replicas are identical, so every rank gets the same answer without a message).
pub fn module_is_finite<M: Module>(module: &M) -> Result<bool, DdpError> {
    struct Probes(Option<Tensor<1>>);
    impl ModuleVisitor for Probes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let p = exact_probe(param.val());
            self.0 = Some(match self.0.take() {
                Some(sum) => sum + p,
                None => p,
            });
        }
    }
    let mut probes = Probes(None);
    module.visit(&mut probes);
    let mut scan = FiniteScan::new(true);
    if let Some(sum) = probes.0 {
        scan.device_probe(sum)?;
    }
    Ok(!scan.found_nonfinite())
}

/// The exponent bits of a 16-bit float: all ones means NaN or ±Inf.
fn half_exponent_mask(format: HalfFormat) -> u16 {
    match format {
        HalfFormat::Bf16 => 0x7f80,
        HalfFormat::F16 => 0x7c00,
    }
}

/// Whether every value is finite. Eight independent accumulators of `x * 0` (0 for a finite
/// `x`, NaN otherwise) let the compiler vectorise the loop: one pass at memory speed.
pub fn all_finite_f32(values: &[f32]) -> bool {
    const LANES: usize = 8;
    let mut acc = [0.0f32; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (a, &x) in acc.iter_mut().zip(chunk) {
            *a += x * 0.0;
        }
    }
    let tail_ok = tail.iter().all(|x| x.is_finite());
    tail_ok && acc.iter().all(|a| *a == 0.0)
}

/// Whether every 16-bit float of `format` is finite (its exponent bits are not all ones).
pub fn all_finite_half(bits: &[u16], format: HalfFormat) -> bool {
    let mask = half_exponent_mask(format);
    // `fold` with `|`: branch-free, so it vectorises like the f32 scan.
    !bits
        .iter()
        .fold(false, |bad, &b| bad | ((b & mask) == mask))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Int, TensorData};

    use super::*;
    use crate::kernels::wire16;

    #[test]
    fn host_scans_find_nan_and_infinities_anywhere() {
        for len in [0usize, 1, 7, 8, 9, 1000] {
            let clean: Vec<f32> = (0..len).map(|i| i as f32 * 1e30 - 3.0).collect();
            assert!(all_finite_f32(&clean), "len {len}");
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                for at in [0, len / 2, len.saturating_sub(1)] {
                    if len == 0 {
                        continue;
                    }
                    let mut v = clean.clone();
                    v[at] = bad;
                    assert!(!all_finite_f32(&v), "{bad} at {at} of {len}");
                }
            }
        }
        // Checked against the `half` crate's own classification.
        for format in [HalfFormat::Bf16, HalfFormat::F16] {
            for bits in 0..=u16::MAX {
                let finite = match format {
                    HalfFormat::Bf16 => half::bf16::from_bits(bits).is_finite(),
                    HalfFormat::F16 => half::f16::from_bits(bits).is_finite(),
                };
                assert_eq!(all_finite_half(&[1, bits, 2], format), finite, "{bits:#x}");
            }
        }
    }

    #[test]
    fn device_checks_agree_with_the_host_scans() {
        let device = Device::flex();
        let cases: [&[f32]; 4] = [
            &[1.0, -2.0, 3.5],
            &[1.0, f32::NAN, 3.5],
            &[f32::INFINITY, 0.0],
            &[0.0, 1e38, -1e38, f32::NEG_INFINITY, 5.0],
        ];
        for values in cases {
            let t = Tensor::<1>::from_floats(values, &device).into_dispatch();
            let mut scan = FiniteScan::new(true);
            scan.device_f32(&t).unwrap();
            assert_eq!(
                scan.found_nonfinite(),
                !all_finite_f32(values),
                "{values:?}"
            );

            for format in [HalfFormat::Bf16, HalfFormat::F16] {
                let words = wire16::compress(values, format, 1.0);
                let halves: &[u16] = bytemuck::cast_slice(&words);
                let expected = !all_finite_half(&halves[..values.len()], format);
                let ints: Vec<i32> = words.iter().map(|&w| w as i32).collect();
                let t = Tensor::<1, Int>::from_data(TensorData::from(ints.as_slice()), &device)
                    .into_dispatch();
                let mut scan = FiniteScan::new(true);
                scan.device_half(&t, format).unwrap();
                assert_eq!(scan.found_nonfinite(), expected, "{format:?} {values:?}");
            }
        }
    }

    #[test]
    fn device_probes_also_flag_sums_past_the_f32_range_and_weights_are_checked_exactly() {
        let device = Device::flex();
        let huge = Tensor::<1>::from_floats([3e38, 3e38], &device);
        let mut scan = FiniteScan::new(true);
        scan.device_f32(&huge.clone().into_dispatch()).unwrap();
        assert!(scan.found_nonfinite(), "the sum overflows");

        #[derive(Module, Debug)]
        struct Weights {
            w: burn::module::Param<Tensor<1>>,
        }
        let weights = |t: Tensor<1>| Weights {
            w: burn::module::Param::from_tensor(t),
        };
        assert!(module_is_finite(&weights(huge)).unwrap());
        let nan = Tensor::<1>::from_floats([1.0, f32::NAN], &device);
        assert!(!module_is_finite(&weights(nan)).unwrap());
    }

    #[test]
    fn a_disabled_scan_sees_nothing() {
        let mut scan = FiniteScan::new(false);
        scan.host_f32(&[f32::NAN]);
        assert!(!scan.found_nonfinite());
    }
}
