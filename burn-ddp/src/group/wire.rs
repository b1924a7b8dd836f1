//! The ring's wire format (pure): the hello that opens a ring connection and the header that
//! opens every collective in each direction.
//!
//! Data pieces that follow a header are raw little-endian elements; their lengths come from the
//! plan both sides compute from the (checked) header, so they need no framing of their own.

use crate::call::{CollectiveDesc, CollectiveKind, DataType, ReduceOp};
use crate::error::WireError;

/// "DDPR": the first bytes of a ring hello.
pub const RING_MAGIC: u32 = 0x4444_5052;
/// "DDPC": the first bytes of a collective header.
pub const HEADER_MAGIC: u32 = 0x4444_5043;
/// Size of an encoded [`CollectiveDesc`].
pub const HEADER_LEN: usize = 32;
/// Longest token accepted in a hello.
pub const MAX_TOKEN_LEN: usize = 1024;

/// Sent by the connecting rank on a new ring connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingHello {
    pub rank: u32,
    pub world_size: u32,
    pub token: String,
}

/// Fixed part of a hello: magic, rank, world size, token length.
pub const HELLO_FIXED_LEN: usize = 16;

pub fn encode_hello(h: &RingHello) -> Vec<u8> {
    let mut out = Vec::with_capacity(HELLO_FIXED_LEN + h.token.len());
    out.extend_from_slice(&RING_MAGIC.to_le_bytes());
    out.extend_from_slice(&h.rank.to_le_bytes());
    out.extend_from_slice(&h.world_size.to_le_bytes());
    out.extend_from_slice(&(h.token.len() as u32).to_le_bytes());
    out.extend_from_slice(h.token.as_bytes());
    out
}

/// Decodes the fixed part; returns (rank, world size, token length to read next).
pub fn decode_hello_fixed(b: &[u8; HELLO_FIXED_LEN]) -> Result<(u32, u32, usize), WireError> {
    let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    if word(0) != RING_MAGIC {
        return Err(WireError::BadMagic {
            found: word(0),
            expected: RING_MAGIC,
        });
    }
    let token_len = word(12) as usize;
    if token_len > MAX_TOKEN_LEN {
        return Err(WireError::TooLarge {
            len: token_len,
            max: MAX_TOKEN_LEN,
        });
    }
    Ok((word(4), word(8), token_len))
}

fn op_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
    }
}

fn op_from(code: u8) -> Result<ReduceOp, WireError> {
    Ok(match code {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Avg,
        2 => ReduceOp::Max,
        3 => ReduceOp::Min,
        code => {
            return Err(WireError::UnknownCode {
                what: "reduce op",
                code,
            })
        }
    })
}

fn dtype_code(d: DataType) -> u8 {
    match d {
        DataType::F32 => 0,
        DataType::F64 => 1,
        DataType::I32 => 2,
        DataType::I64 => 3,
        DataType::U8 => 4,
        DataType::BF16 => 5,
        DataType::F16 => 6,
    }
}

fn dtype_from(code: u8) -> Result<DataType, WireError> {
    Ok(match code {
        0 => DataType::F32,
        1 => DataType::F64,
        2 => DataType::I32,
        3 => DataType::I64,
        4 => DataType::U8,
        5 => DataType::BF16,
        6 => DataType::F16,
        code => {
            return Err(WireError::UnknownCode {
                what: "data type",
                code,
            })
        }
    })
}

/// Layout: magic u32 | seq u64 | kind u8 | op u8 | dtype u8 | pad u8 | root u32 | len u64 | pad u32.
pub fn encode_header(d: &CollectiveDesc) -> [u8; HEADER_LEN] {
    let (kind, op, root) = match d.kind {
        CollectiveKind::AllReduce(op) => (0u8, op_code(op), 0u32),
        CollectiveKind::Broadcast { root } => (1, 0, root as u32),
        CollectiveKind::AllGather => (2, 0, 0),
        CollectiveKind::ReduceScatter(op) => (3, op_code(op), 0),
        CollectiveKind::Barrier => (4, 0, 0),
        // The block layout's fingerprint travels in the root field, which these do not use.
        CollectiveKind::ReduceScatterV { op, layout } => (5, op_code(op), layout),
        CollectiveKind::AllGatherV { layout } => (6, 0, layout),
    };
    let mut b = [0u8; HEADER_LEN];
    b[0..4].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
    b[4..12].copy_from_slice(&d.seq.to_le_bytes());
    b[12] = kind;
    b[13] = op;
    b[14] = dtype_code(d.dtype);
    b[16..20].copy_from_slice(&root.to_le_bytes());
    b[20..28].copy_from_slice(&d.len.to_le_bytes());
    b
}

pub fn decode_header(b: &[u8; HEADER_LEN]) -> Result<CollectiveDesc, WireError> {
    let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    if magic != HEADER_MAGIC {
        return Err(WireError::BadMagic {
            found: magic,
            expected: HEADER_MAGIC,
        });
    }
    let mut seq = [0u8; 8];
    seq.copy_from_slice(&b[4..12]);
    let mut len = [0u8; 8];
    len.copy_from_slice(&b[20..28]);
    let root = u32::from_le_bytes([b[16], b[17], b[18], b[19]]) as usize;
    let kind = match b[12] {
        0 => CollectiveKind::AllReduce(op_from(b[13])?),
        1 => CollectiveKind::Broadcast { root },
        2 => CollectiveKind::AllGather,
        3 => CollectiveKind::ReduceScatter(op_from(b[13])?),
        4 => CollectiveKind::Barrier,
        5 => CollectiveKind::ReduceScatterV {
            op: op_from(b[13])?,
            layout: root as u32,
        },
        6 => CollectiveKind::AllGatherV {
            layout: root as u32,
        },
        code => {
            return Err(WireError::UnknownCode {
                what: "collective",
                code,
            })
        }
    };
    Ok(CollectiveDesc {
        seq: u64::from_le_bytes(seq),
        kind,
        dtype: dtype_from(b[14])?,
        len: u64::from_le_bytes(len),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        for dtype in DataType::ALL {
            let d = CollectiveDesc {
                seq: 7,
                kind: CollectiveKind::AllReduce(ReduceOp::Sum),
                dtype,
                len: 3,
            };
            assert_eq!(decode_header(&encode_header(&d)).unwrap(), d);
        }
        for kind in [
            CollectiveKind::AllReduce(ReduceOp::Avg),
            CollectiveKind::Broadcast { root: 3 },
            CollectiveKind::AllGather,
            CollectiveKind::ReduceScatter(ReduceOp::Max),
            CollectiveKind::Barrier,
            CollectiveKind::ReduceScatterV {
                op: ReduceOp::Avg,
                layout: 0xdead_beef,
            },
            CollectiveKind::AllGatherV { layout: 7 },
        ] {
            let d = CollectiveDesc {
                seq: 42,
                kind,
                dtype: DataType::I64,
                len: 1 << 40,
            };
            assert_eq!(decode_header(&encode_header(&d)).unwrap(), d);
        }
    }

    #[test]
    fn hello_round_trip_and_refusals() {
        let h = RingHello {
            rank: 2,
            world_size: 4,
            token: "abc".into(),
        };
        let bytes = encode_hello(&h);
        let fixed: [u8; HELLO_FIXED_LEN] = bytes[..HELLO_FIXED_LEN].try_into().unwrap();
        assert_eq!(decode_hello_fixed(&fixed).unwrap(), (2, 4, 3));
        let garbage = *b"GET / HTTP/1.1\r\n";
        assert!(matches!(
            decode_hello_fixed(&garbage),
            Err(WireError::BadMagic { .. })
        ));
        let mut big = fixed;
        big[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode_hello_fixed(&big),
            Err(WireError::TooLarge { .. })
        ));
    }

    #[test]
    fn random_headers_never_panic() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..50_000 {
            let mut b = [0u8; HEADER_LEN];
            for x in b.iter_mut() {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                *x = (state >> 56) as u8;
            }
            // Keep the magic sometimes so the decoder gets past the first check.
            if state & 1 == 0 {
                b[0..4].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
            }
            let _ = decode_header(&b);
            let fixed: [u8; HELLO_FIXED_LEN] = b[..HELLO_FIXED_LEN].try_into().unwrap();
            let _ = decode_hello_fixed(&fixed);
        }
    }
}
