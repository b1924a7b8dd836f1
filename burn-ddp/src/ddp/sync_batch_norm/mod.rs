//! Synchronised BatchNorm (PyTorch's `SyncBatchNorm`): BatchNorm with the statistics of the
//! global batch.
//!
//! - [`layer`]: [`SyncBatchNorm`](layer::SyncBatchNorm), the module.
//! - [`all_reduce_op`]: [`all_reduce_sum`](all_reduce_op::all_reduce_sum), the
//!   differentiable all-reduce under it (a backend extension with a backward of its own).
//! - [`sync_group`]: the process group it uses, installed process-wide by `DataParallel`.

pub mod all_reduce_op;
pub mod layer;
pub mod sync_group;
