//! Tensor data read back to the host, as a `Vec` of its elements, whatever the alignment of
//! its bytes. Burn's `TensorData::to_vec` / `as_slice` reinterpret the bytes in place and
//! refuse bytes that are not aligned for the element type — and a GPU backend's readback can
//! hand back such bytes (seen with CUDA on an H200). Every read of values in this crate goes
//! through [`host_values`] or [`copy_host_values`]; none may skip or zero data silently.

use burn::backend::Flex;
use burn::tensor::{DataError, Element, Tensor, TensorData};

/// The elements of `data` converted to `E` (`f32`, `u32`, `f64`, ...): the data's own
/// allocation where it can be taken over, else a copy, read unaligned where the bytes are not
/// aligned for `E`.
///
/// # Errors
/// Burn's [`DataError`] when `data` cannot be converted to `E` (quantized data, say).
pub fn host_values<E: Element + bytemuck::Pod>(data: TensorData) -> Result<Vec<E>, DataError> {
    let data = data.try_cast_as::<E>()?;
    match data.as_slice::<E>() {
        // The data's own allocation where Burn can give it up (no copy), else a copy.
        Ok(_) => data.try_into_vec::<E>(),
        Err(DataError::InvalidRepresentation(cast)) => {
            read_unaligned(data.as_bytes()).ok_or(DataError::InvalidRepresentation(cast))
        }
        Err(other) => Err(other),
    }
}

/// `bytes` as `E`s read one by one at any alignment; `None` if their length is not a multiple
/// of `E`'s size.
fn read_unaligned<E: bytemuck::Pod>(bytes: &[u8]) -> Option<Vec<E>> {
    bytes.len().is_multiple_of(size_of::<E>()).then(|| {
        bytes
            .chunks_exact(size_of::<E>())
            .map(bytemuck::pod_read_unaligned)
            .collect()
    })
}

/// A float tensor's `out.len()` values copied into `out`, as `f32`, without a copy of its own
/// in between where that can be avoided: on Burn's CPU backend the values are read where
/// they lie (a thread that reads every block's shards would otherwise keep those copies'
/// memory in its own malloc arena: measured 7 MiB of a rank's RSS at ZeRO stage 3); on other
/// backends, through one read-back.
///
/// # Errors
/// The values' count when it is not `out.len()`, or Burn's [`DataError`] as text.
pub fn copy_host_values<const D: usize>(tensor: &Tensor<D>, out: &mut [f32]) -> Result<(), String> {
    let tensor = tensor.clone().inner();
    if let Ok(flex) = tensor.clone().try_into_primitive::<Flex>() {
        if let Some(values) = flex.as_slice::<f32>() {
            return copy_exact(values, out);
        }
    }
    copy_data(tensor.into_data(), out)
}

fn copy_data(data: TensorData, out: &mut [f32]) -> Result<(), String> {
    match data.as_slice::<f32>() {
        Ok(values) => copy_exact(values, out),
        Err(_) => copy_exact(
            &host_values::<f32>(data).map_err(|e| format!("{e:?}"))?,
            out,
        ),
    }
}

fn copy_exact(values: &[f32], out: &mut [f32]) -> Result<(), String> {
    if values.len() != out.len() {
        return Err(format!(
            "{} values where {} were expected",
            values.len(),
            out.len()
        ));
    }
    out.copy_from_slice(values);
    Ok(())
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Device, Tensor, TensorData};

    use super::*;

    #[test]
    fn aligned_and_unaligned_bytes_give_the_same_values() {
        let values = [1.5f32, -2.0, 3.25, f32::MAX];
        let aligned = TensorData::new(values.to_vec(), [4]);
        assert_eq!(host_values::<f32>(aligned.clone()).unwrap(), values);

        // The same bytes one byte into a buffer: at most one of the two slices is aligned.
        let mut buffer = [0u8; 18];
        buffer[1..17].copy_from_slice(aligned.as_bytes());
        buffer[2..18].copy_from_slice(aligned.as_bytes());
        assert_eq!(read_unaligned::<f32>(&buffer[2..18]).unwrap(), values);
        buffer[1..17].copy_from_slice(aligned.as_bytes());
        assert_eq!(read_unaligned::<f32>(&buffer[1..17]).unwrap(), values);
        assert_eq!(read_unaligned::<f32>(&buffer[1..16]), None, "15 bytes");
    }

    #[test]
    fn a_tensors_values_are_copied_into_a_slice_of_their_length_only() {
        let values = [1.5f32, -2.0, 3.25, 4.0, 5.0, 6.0];
        for device in [Device::flex(), Device::flex().autodiff()] {
            let whole = Tensor::<2>::from_data(TensorData::new(values.to_vec(), [2, 3]), &device);
            let mut out = [0.0f32; 6];
            copy_host_values(&whole, &mut out).unwrap();
            assert_eq!(out, values);

            // A view that is not its storage's start (a narrowed row) reads its own values.
            let row = whole.clone().narrow(0, 1, 1);
            let mut out = [0.0f32; 3];
            copy_host_values(&row, &mut out).unwrap();
            assert_eq!(out, values[3..]);

            let mut short = [0.0f32; 5];
            let error = copy_host_values(&whole, &mut short).unwrap_err();
            assert_eq!(error, "6 values where 5 were expected");
        }
    }

    #[test]
    fn converts_other_element_types() {
        let data = TensorData::new(vec![1.0f64, 2.0], [2]);
        assert_eq!(host_values::<f32>(data).unwrap(), [1.0f32, 2.0]);
    }
}
