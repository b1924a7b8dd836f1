//! Tensor data read back to the host, as a `Vec` of its elements, whatever the alignment of
//! its bytes. Burn's `TensorData::to_vec` / `as_slice` reinterpret the bytes in place and
//! refuse bytes that are not aligned for the element type — and a GPU backend's readback can
//! hand back such bytes (seen with CUDA on an H200). Every read of values in this crate goes
//! through [`host_values`]; none may skip or zero data silently.

use burn::tensor::{DataError, Element, TensorData};

/// The elements of `data` converted to `E` (`f32`, `u32`, `f64`, ...): a copy, read unaligned
/// where the bytes are not aligned for `E`.
///
/// # Errors
/// Burn's [`DataError`] when `data` cannot be converted to `E` (quantized data, say).
pub fn host_values<E: Element + bytemuck::Pod>(data: TensorData) -> Result<Vec<E>, DataError> {
    let data = data.try_cast_as::<E>()?;
    match data.as_slice::<E>() {
        Ok(values) => Ok(values.to_vec()),
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

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;

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
    fn converts_other_element_types() {
        let data = TensorData::new(vec![1.0f64, 2.0], [2]);
        assert_eq!(host_values::<f32>(data).unwrap(), [1.0f32, 2.0]);
    }
}
