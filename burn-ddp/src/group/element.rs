//! What collectives move and reduce: the [`Element`] types.

use std::fmt;

use crate::call::{DataType, ReduceOp};

/// A type that collectives can move and reduce: plain old data with a reduction.
pub trait Element: bytemuck::Pod + Send + Sync + PartialOrd + fmt::Debug {
    const DTYPE: DataType;
    /// `self op other` for Sum/Avg (the division happens once, at the end), Max and Min.
    fn combine(self, other: Self, op: ReduceOp) -> Self;
    /// Divides by the world size (for [`ReduceOp::Avg`]).
    fn div_world(self, world_size: usize) -> Self;

    /// `dst[i] = dst[i] op src[i]`. The operation is matched once, outside the loop, so each
    /// loop body is a constant operation the compiler vectorises. The 16-bit floats sum through
    /// [`host16::sum_into`](crate::kernels::host16::sum_into): the same bits as `a + b` element
    /// by element, vectorised.
    fn reduce_into(dst: &mut [Self], src: &[Self], op: ReduceOp) {
        reduce_each(dst, src, op);
    }
}

/// [`Element::reduce_into`] one element at a time through [`Element::combine`].
#[inline(always)]
fn reduce_each<T: Element>(dst: &mut [T], src: &[T], op: ReduceOp) {
    #[inline(always)]
    fn each<T: Element>(dst: &mut [T], src: &[T], op: ReduceOp) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = d.combine(s, op);
        }
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => each(dst, src, ReduceOp::Sum),
        ReduceOp::Max => each(dst, src, ReduceOp::Max),
        ReduceOp::Min => each(dst, src, ReduceOp::Min),
    }
}

/// `Element` for `$t`: `$sum` combines two values for Sum/Avg, `$div` divides by the world size.
macro_rules! element {
    ($t:ty, $dtype:ident, sum: |$a:ident, $b:ident| $sum:expr, div: |$x:ident, $n:ident| $div:expr
     $(, sum_slices: $format:expr)?) => {
        impl Element for $t {
            const DTYPE: DataType = DataType::$dtype;
            #[inline(always)]
            fn combine(self, other: Self, op: ReduceOp) -> Self {
                let ($a, $b) = (self, other);
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => $sum,
                    ReduceOp::Max => $a.max($b),
                    ReduceOp::Min => $a.min($b),
                }
            }
            fn div_world(self, world_size: usize) -> Self {
                let ($x, $n) = (self, world_size);
                $div
            }
            $(
            fn reduce_into(dst: &mut [Self], src: &[Self], op: ReduceOp) {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => crate::kernels::host16::sum_into(
                        $format,
                        bytemuck::cast_slice_mut(dst),
                        bytemuck::cast_slice(src),
                    ),
                    ReduceOp::Max | ReduceOp::Min => reduce_each(dst, src, op),
                }
            }
            )?
        }
    };
}
element!(f32, F32, sum: |a, b| a + b, div: |x, n| x / n as f32);
element!(f64, F64, sum: |a, b| a + b, div: |x, n| x / n as f64);
element!(i32, I32, sum: |a, b| a.wrapping_add(b), div: |x, n| x / n as i32);
element!(i64, I64, sum: |a, b| a.wrapping_add(b), div: |x, n| x / n as i64);
element!(u8, U8, sum: |a, b| a.wrapping_add(b), div: |x, n| u8::try_from(n).map_or(0, |n| x / n));
// 16-bit floats (compressed gradient buckets) add through `f32` and round back after each
// step, as NCCL does: a sum over N ranks is rounded N - 1 times, once per ring step.
element!(half::bf16, BF16, sum: |a, b| a + b, div: |x, n| half::bf16::from_f32(x.to_f32() / n as f32),
    sum_slices: crate::kernels::HalfFormat::Bf16);
element!(half::f16, F16, sum: |a, b| a + b, div: |x, n| half::f16::from_f32(x.to_f32() / n as f32),
    sum_slices: crate::kernels::HalfFormat::F16);

#[cfg(test)]
mod tests {
    use super::*;

    /// The 16-bit sums of the ring (vectorised) give the bits of `a + b` element by element.
    #[test]
    fn half_reductions_equal_the_element_by_element_ones() {
        fn check<T: Element>(from_bits: impl Fn(u16) -> T) {
            let mut state = 0x5eed_0019u32;
            let mut next = move || {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                // Finite values of both formats, of similar magnitudes.
                from_bits((state >> 16) as u16 & 0x3fff | 0x2000 | (state as u16 & 0x8000))
            };
            let a: Vec<T> = (0..5000).map(|_| next()).collect();
            let b: Vec<T> = (0..5000).map(|_| next()).collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let (mut fast, mut each) = (a.clone(), a.clone());
                T::reduce_into(&mut fast, &b, op);
                reduce_each(&mut each, &b, op);
                assert_eq!(
                    bytemuck::cast_slice::<T, u16>(&fast),
                    bytemuck::cast_slice::<T, u16>(&each),
                    "{:?} {op:?}",
                    T::DTYPE
                );
            }
        }
        check(half::bf16::from_bits);
        check(half::f16::from_bits);
    }

    #[test]
    fn data_type_sizes_are_the_element_sizes() {
        fn of<T: Element>() -> (DataType, usize) {
            (T::DTYPE, std::mem::size_of::<T>())
        }
        let all = [
            of::<f32>(),
            of::<f64>(),
            of::<i32>(),
            of::<i64>(),
            of::<u8>(),
            of::<half::bf16>(),
            of::<half::f16>(),
        ];
        assert_eq!(all.len(), DataType::ALL.len());
        for (dtype, bytes) in all {
            assert_eq!(dtype.size(), bytes, "{dtype:?}");
        }
    }
}
