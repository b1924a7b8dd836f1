//! The bytes of one message between neighbouring pipeline stages (pure): an activation going
//! forward or the gradient of one going back, for one micro-batch.
//!
//! `magic "PIPE" | flow u8 | micro-batch u32 | number of dims u8 | dims u64… | f32 values`,
//! little-endian. Each direction of a link carries one flow in micro-batch order, so the
//! receiver knows what must come next and a frame that is not it names a plan mismatch.

/// Which way a message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// A stage's output, to the next stage.
    Activation,
    /// The gradient of the loss with respect to a stage's input, to the previous stage.
    Gradient,
}

const MAGIC: [u8; 4] = *b"PIPE";
/// The fixed part of a header: magic, flow, micro-batch, number of dims.
pub const FIXED_LEN: usize = 4 + 1 + 4 + 1;

/// A whole frame: header and values. `values.len()` must be the product of `shape`.
pub fn encode(flow: Flow, micro_batch: usize, shape: &[usize], values: &[f32]) -> Vec<u8> {
    debug_assert_eq!(shape.iter().product::<usize>(), values.len());
    let mut out = Vec::with_capacity(FIXED_LEN + 8 * shape.len() + 4 * values.len());
    out.extend_from_slice(&MAGIC);
    out.push(match flow {
        Flow::Activation => 0,
        Flow::Gradient => 1,
    });
    out.extend_from_slice(&(micro_batch as u32).to_le_bytes());
    out.push(shape.len() as u8);
    for &d in shape {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// The fixed part of a header: its flow, micro-batch and number of dims, or why the bytes
/// are not a frame of this protocol.
pub fn decode_fixed(bytes: &[u8; FIXED_LEN]) -> Result<(Flow, usize, usize), String> {
    if bytes[..4] != MAGIC {
        return Err(format!(
            "not a pipeline frame (starts with {:02x?}): is the neighbour a rank of this run?",
            &bytes[..4]
        ));
    }
    let flow = match bytes[4] {
        0 => Flow::Activation,
        1 => Flow::Gradient,
        other => return Err(format!("unknown flow {other}")),
    };
    let micro = u32::from_le_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]) as usize;
    Ok((flow, micro, usize::from(bytes[9])))
}

/// The largest payload a receiver accepts (16 GiB): a frame that announces more is not one of
/// this protocol's, and must not make the receiver allocate it.
pub const MAX_PAYLOAD: usize = 1 << 34;

/// The payload bytes of a tensor of `shape`, or `None` past [`MAX_PAYLOAD`] (or overflowing).
pub fn payload_bytes(shape: &[usize]) -> Option<usize> {
    shape
        .iter()
        .try_fold(4usize, |bytes, &d| bytes.checked_mul(d))
        .filter(|&bytes| bytes <= MAX_PAYLOAD)
}

/// The dims that follow the fixed part.
pub fn decode_shape(bytes: &[u8]) -> Vec<usize> {
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as usize)
        .collect()
}

/// The values after the header.
pub fn decode_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_decodes_to_what_was_encoded() {
        let values = [1.5f32, -2.0, 0.25, 7.0, 8.0, 9.0];
        let bytes = encode(Flow::Gradient, 70_000, &[2, 3], &values);
        let fixed: [u8; FIXED_LEN] = bytes[..FIXED_LEN].try_into().unwrap();
        let (flow, micro, dims) = decode_fixed(&fixed).unwrap();
        assert_eq!((flow, micro, dims), (Flow::Gradient, 70_000, 2));
        let shape = decode_shape(&bytes[FIXED_LEN..FIXED_LEN + 8 * dims]);
        assert_eq!(shape, vec![2, 3]);
        assert_eq!(payload_bytes(&shape), Some(24));
        assert_eq!(decode_values(&bytes[FIXED_LEN + 16..]), values);
    }

    #[test]
    fn an_impossible_size_is_refused_not_allocated() {
        assert_eq!(payload_bytes(&[usize::MAX, 2]), None);
        assert_eq!(payload_bytes(&[1 << 20, 1 << 20]), None);
        assert_eq!(payload_bytes(&[]), Some(4));
    }

    #[test]
    fn foreign_bytes_are_refused() {
        let mut bytes = [0u8; FIXED_LEN];
        bytes[..4].copy_from_slice(b"HTTP");
        assert!(decode_fixed(&bytes)
            .unwrap_err()
            .contains("not a pipeline frame"));
        bytes[..4].copy_from_slice(&MAGIC);
        bytes[4] = 9;
        assert!(decode_fixed(&bytes).unwrap_err().contains("unknown flow 9"));
    }
}
