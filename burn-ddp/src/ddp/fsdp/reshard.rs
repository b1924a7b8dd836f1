//! ZeRO stage 3's shards re-cut for another world size, or joined whole: what a sharded
//! checkpoint needs to resume at another world size (PyTorch's distributed checkpoint,
//! DeepSpeed's universal checkpoint) and to be consolidated into one file.
//!
//! A sharded tensor of `numel` values on `N` ranks is `N` flat pieces of
//! [`shard_len`]`(numel, N)` values, the last ones padded with zeros ([`shard_of`]). Joining
//! the pieces in rank order and dropping the padding gives the whole tensor; cutting that
//! again gives the pieces for another world size. Any tensor of the parameter's size is cut
//! alike (its weights, and its optimizer state: Adam's moments), so the re-cut state steps
//! the re-cut shards exactly as the old one stepped the old shards.
//!
//! Pure functions of the bytes: no group, no device. One tensor is held whole at a time.

use std::collections::{BTreeMap, HashMap};

use burn::module::ParamId;
use burn_pack::Bytes;

use crate::ddp::fsdp::shard_gather::shard_len;
use crate::ddp::zero::sharded_sync::StateParts;
use crate::error::DdpError;

/// How [`reshard_tensors`] leaves each sharded tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardTarget {
    /// Whole, in the parameter's full shape (a consolidated checkpoint, stages 0 to 2).
    Whole,
    /// Rank `rank`'s shard of `world`, shaped `[1, …, 1, len]` as
    /// [`shard_module`](super::sharded_module::shard_module) shapes it.
    Shard { rank: usize, world: usize },
}

/// `parts[r]` holds rank `r`'s tensors of a run of `parts.len()` ranks (one part: a whole
/// model or state). A tensor for which `full_shape` gives a shape is sharded: its pieces, one
/// per part under the same name, are joined and cut as `target` says. Every other tensor is
/// taken from part 0 (the ranks hold it whole and equal). Returns the tensors in part 0's
/// order.
///
/// # Errors
/// [`DdpError::State`] when a part lacks a sharded tensor or a piece has the wrong size.
pub fn reshard_tensors(
    parts: Vec<Vec<burn_pack::Tensor>>,
    full_shape: impl Fn(&burn_pack::Tensor) -> Option<Vec<usize>>,
    target: ShardTarget,
) -> Result<Vec<burn_pack::Tensor>, DdpError> {
    let from_world = parts.len();
    let mut parts = parts.into_iter();
    let Some(first) = parts.next() else {
        return Ok(Vec::new());
    };
    let mut others: Vec<BTreeMap<String, burn_pack::Tensor>> = parts
        .map(|part| part.into_iter().map(|t| (t.name.clone(), t)).collect())
        .collect();
    let mut out = Vec::with_capacity(first.len());
    for tensor in first {
        let Some(full) = full_shape(&tensor) else {
            out.push(tensor);
            continue;
        };
        let numel: usize = full.iter().product();
        let piece = shard_len(numel, from_world);
        // A tensor of another size (a per-parameter scalar state) is not cut.
        if tensor.shape.num_elements() != piece && from_world > 1 {
            out.push(tensor);
            continue;
        }
        if from_world == 1 && tensor.shape.num_elements() != numel {
            out.push(tensor);
            continue;
        }
        let (name, dtype, _, param_id, bytes) = tensor.into_parts().map_err(state_error)?;
        let size = dtype.size();
        let mut joined = bytes.to_vec();
        for (r, other) in others.iter_mut().enumerate() {
            let Some(piece_tensor) = other.remove(&name) else {
                return Err(DdpError::State(format!(
                    "rank {}'s shards have no {name}",
                    r + 1
                )));
            };
            let bytes = piece_tensor.into_bytes().map_err(state_error)?;
            if bytes.len() != piece * size {
                return Err(DdpError::State(format!(
                    "rank {}'s shard of {name} has {} bytes, not {}",
                    r + 1,
                    bytes.len(),
                    piece * size
                )));
            }
            joined.extend_from_slice(&bytes);
        }
        joined.truncate(numel * size);
        let (shape, bytes) = match target {
            ShardTarget::Whole => (full, joined),
            ShardTarget::Shard { rank, world } => {
                let len = shard_len(numel, world);
                let start = (rank * len).min(numel) * size;
                let end = ((rank + 1) * len).min(numel) * size;
                let mut cut = joined[start..end].to_vec();
                cut.resize(len * size, 0);
                let mut shape = vec![1; full.len().max(1)];
                if let Some(last) = shape.last_mut() {
                    *last = len;
                }
                (shape, cut)
            }
        };
        out.push(burn_pack::Tensor::new(
            name,
            dtype,
            shape,
            param_id,
            Bytes::from_bytes_vec(bytes),
        ));
    }
    Ok(out)
}

/// [`reshard_tensors`] of optimizer state: `parts[r]` is rank `r`'s state as
/// [`ModuleOptimizer::into_bytes`](burn::optim::ModuleOptimizer::into_bytes) wrote it (one
/// part: a whole state), `sharded` the full shape of each sharded parameter. Scalars and
/// metadata are merged (they are equal where ranks share them). The result loads with
/// `ModuleOptimizer::from_bytes` into the model the target describes.
///
/// # Errors
/// [`DdpError::State`] when a part is not burnpack optimizer state or the pieces do not fit.
pub fn reshard_state(
    parts: Vec<Bytes>,
    sharded: &HashMap<ParamId, Vec<usize>>,
    target: ShardTarget,
) -> Result<Bytes, DdpError> {
    let mut merged = StateParts::default();
    let mut tensors = Vec::with_capacity(parts.len());
    for (rank, bytes) in parts.into_iter().enumerate() {
        let mut part = StateParts::read(bytes, rank)?;
        tensors.push(std::mem::take(&mut part.tensors));
        merged.extend(part);
    }
    merged.tensors = reshard_tensors(
        tensors,
        |t| {
            let id = t
                .param_id
                .or_else(|| crate::ddp::zero::sharded_sync::key_id(&t.name))?;
            sharded.get(&ParamId::from(id)).cloned()
        },
        target,
    )?;
    merged.into_bytes()
}

fn state_error(e: burn_pack::Error) -> DdpError {
    DdpError::State(format!("cannot read a shard: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ddp::fsdp::shard_gather::shard_of;
    use burn::tensor::DType;

    fn tensor(name: &str, shape: Vec<usize>, values: &[f32]) -> burn_pack::Tensor {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        burn_pack::Tensor::new(
            name.into(),
            DType::F32,
            shape,
            None,
            Bytes::from_bytes_vec(bytes),
        )
    }

    fn values(t: burn_pack::Tensor) -> (Vec<usize>, Vec<f32>) {
        let shape = t.shape.to_vec();
        let bytes = t.into_bytes().unwrap();
        (
            shape,
            bytes
                .chunks(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    }

    /// A 2 x 5 weight sharded on `world` ranks, and a bias every rank holds whole.
    fn parts(world: usize) -> Vec<Vec<burn_pack::Tensor>> {
        let w: Vec<f32> = (0..10).map(|i| i as f32).collect();
        (0..world)
            .map(|r| {
                let shard = shard_of(&w, r, world);
                vec![
                    tensor("w", vec![1, shard.len()], &shard),
                    tensor("b", vec![3], &[7.0, 8.0, 9.0]),
                ]
            })
            .collect()
    }

    fn full(t: &burn_pack::Tensor) -> Option<Vec<usize>> {
        (t.name == "w").then(|| vec![2, 5])
    }

    #[test]
    fn shards_join_whole_and_recut_for_any_world_size() {
        let whole: Vec<f32> = (0..10).map(|i| i as f32).collect();
        for from in [1, 2, 3, 4, 11] {
            let joined = reshard_tensors(parts(from), full, ShardTarget::Whole).unwrap();
            let mut joined = joined.into_iter();
            assert_eq!(values(joined.next().unwrap()), (vec![2, 5], whole.clone()));
            assert_eq!(
                values(joined.next().unwrap()),
                (vec![3], vec![7.0, 8.0, 9.0])
            );
            for world in [1, 2, 3, 4, 11] {
                for rank in 0..world {
                    let target = ShardTarget::Shard { rank, world };
                    let cut = reshard_tensors(parts(from), full, target).unwrap();
                    let expected = shard_of(&whole, rank, world);
                    let (shape, got) = values(cut.into_iter().next().unwrap());
                    assert_eq!(shape, vec![1, expected.len()], "{from} -> {world}");
                    assert_eq!(got, expected, "{from} -> {rank} of {world}");
                }
            }
        }
    }

    #[test]
    fn a_missing_or_wrong_sized_piece_is_an_error() {
        let mut broken = parts(3);
        broken[2].remove(0);
        let e = reshard_tensors(broken, full, ShardTarget::Whole).unwrap_err();
        assert!(e.to_string().contains("rank 2's shards have no w"), "{e}");
        let mut short = parts(2);
        short[1][0] = tensor("w", vec![1, 4], &[0.0; 4]);
        let e = reshard_tensors(short, full, ShardTarget::Whole).unwrap_err();
        assert!(e.to_string().contains("has 16 bytes, not 20"), "{e}");
    }
}
