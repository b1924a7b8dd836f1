//! The vocabulary of one collective call — its operation, element type, kind and sequence
//! number — as every group checks it across ranks, encodes it on the wire and names it in
//! errors. Pure data; it imports nothing else of the crate, so errors and groups both build on it.

use std::fmt;

/// How values from different ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the world size (integer division for integer types).
    Avg,
    Max,
    Min,
}

/// The element type of a buffer, carried in every collective's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataType {
    F32,
    F64,
    I32,
    I64,
    U8,
    /// bfloat16 ([`half::bf16`]): compressed gradient buckets.
    BF16,
    /// IEEE half precision ([`half::f16`]): compressed gradient buckets.
    F16,
}

impl DataType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Self::U8 => 1,
            Self::BF16 | Self::F16 => 2,
            Self::F32 | Self::I32 => 4,
            Self::F64 | Self::I64 => 8,
        }
    }

    /// Every data type, for tests and tables.
    pub const ALL: [DataType; 7] = [
        Self::F32,
        Self::F64,
        Self::I32,
        Self::I64,
        Self::U8,
        Self::BF16,
        Self::F16,
    ];
}

/// Which collective, with the arguments that must agree across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollectiveKind {
    AllReduce(ReduceOp),
    Broadcast {
        root: usize,
    },
    AllGather,
    ReduceScatter(ReduceOp),
    /// Blocks of different sizes; `layout` is a fingerprint of the block sizes, which must
    /// agree across ranks like the length does.
    ReduceScatterV {
        op: ReduceOp,
        layout: u32,
    },
    AllGatherV {
        layout: u32,
    },
    Barrier,
}

/// One call of a collective, as checked across ranks and named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CollectiveDesc {
    /// The call's number in this group, counted from 0 on every rank.
    pub seq: u64,
    pub kind: CollectiveKind,
    pub dtype: DataType,
    /// Elements per rank (the output length of reduce-scatter, the input of all-gather).
    pub len: u64,
}

impl fmt::Display for CollectiveDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dtype = format!("{:?}", self.dtype).to_lowercase();
        match self.kind {
            CollectiveKind::AllReduce(op) => write!(f, "all_reduce({op:?}, ")?,
            CollectiveKind::Broadcast { root } => write!(f, "broadcast(root {root}, ")?,
            CollectiveKind::AllGather => write!(f, "all_gather(")?,
            CollectiveKind::ReduceScatter(op) => write!(f, "reduce_scatter({op:?}, ")?,
            CollectiveKind::ReduceScatterV { op, layout } => {
                write!(f, "reduce_scatter_v({op:?}, blocks {layout:08x}, ")?
            }
            CollectiveKind::AllGatherV { layout } => {
                write!(f, "all_gather_v(blocks {layout:08x}, ")?
            }
            CollectiveKind::Barrier => return write!(f, "barrier #{}", self.seq),
        }
        write!(f, "{dtype}, {} elements) #{}", self.len, self.seq)
    }
}
