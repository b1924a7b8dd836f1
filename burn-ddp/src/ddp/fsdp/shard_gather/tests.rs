//! Ranks as threads over real loopback sockets, each with its own input, against one
//! process's gradients of the summed loss.
use std::sync::Arc;

use burn::tensor::{Device, Tensor, TensorData};

use super::*;
use crate::group::TcpGroupOptions;
use crate::store::{MemoryStore, Store};

const SHAPE: [usize; 2] = [2, 5];

/// The parameter's values (10: uneven shards at world 3 and 4).
fn weights() -> Vec<f32> {
    (0..10).map(|i| 0.05 * i as f32 - 0.2).collect()
}

/// Rank `rank`'s input: 3 rows of 2 features.
fn input(rank: usize, device: &Device) -> Tensor<2> {
    let values: Vec<f32> = (0..6).map(|i| 0.1 * (i + rank) as f32 - 0.3).collect();
    Tensor::from_data(TensorData::new(values, [3, 2]), device).require_grad()
}

fn loss(x: Tensor<2>, w: Tensor<2>) -> Tensor<1> {
    x.matmul(w).tanh().sum()
}

fn values(t: Tensor<1>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

/// The mean over the ranks of each rank's loss's gradient with respect to the whole
/// parameter, in one process.
fn reference_gradient(world: usize) -> Vec<f32> {
    let device = Device::flex().autodiff();
    let mut sum = [0.0f32; 10];
    for rank in 0..world {
        let w = Tensor::<1>::from_data(TensorData::new(weights(), [10]), &device).require_grad();
        let grads = loss(input(rank, &device), w.clone().reshape(SHAPE)).backward();
        for (s, g) in sum.iter_mut().zip(values(w.grad(&grads).unwrap())) {
            *s += g;
        }
    }
    sum.iter().map(|s| s / world as f32).collect()
}

struct Outcome {
    gathered: Vec<f32>,
    shard_grad: Vec<f32>,
    gathers: u64,
    reduce_scatters: u64,
    bytes: u64,
}

fn run(world: usize, device: fn() -> Device, compression: Option<HalfFormat>) -> Vec<Outcome> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let group =
                    TcpProcessGroup::new(store, rank, world, TcpGroupOptions::default()).unwrap();
                let comm = ShardComm::new(group, compression);
                let device = device();
                let own = shard_of(&weights(), rank, world);
                let len = own.len();
                let shard =
                    Tensor::<1>::from_data(TensorData::new(own, [len]), &device).require_grad();
                let w = gather_shard(shard.clone(), SHAPE, &comm);
                let gathered = values(w.clone().reshape([10]).detach());
                let grads = loss(input(rank, &device), w).backward();
                let shard_grad = values(shard.grad(&grads).unwrap());
                assert!(comm.take_error().is_none());
                Outcome {
                    gathered,
                    shard_grad,
                    gathers: comm.gathers(),
                    reduce_scatters: comm.reduce_scatters(),
                    bytes: comm.bytes(),
                }
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// The same on Burn's wgpu device (Mesa's lavapipe without a GPU), world 2, checkpointed.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_gathered_parameter_trains_like_a_whole_one() {
    fn wgpu() -> Device {
        Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)
            .autodiff()
            .gradient_checkpointing()
    }
    let want = reference_gradient(2);
    for (rank, out) in run(2, wgpu, None).into_iter().enumerate() {
        assert_eq!(out.gathered, weights(), "rank {rank}");
        let own = shard_of(&want, rank, 2);
        let worst = out
            .shard_grad
            .iter()
            .zip(&own)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "rank {rank}: {:?} vs {own:?}", out.shard_grad);
        assert_eq!((out.gathers, out.reduce_scatters), (2, 1), "rank {rank}");
    }
}

/// With gradient compression a gradient travels in 16 bits (half the reduce-scatter's
/// bytes), and each rank gets its block of the ranks' mean to the format's precision
/// (gradients that do not cancel, so that the precision is the values').
#[test]
fn a_compressed_gradient_is_reduce_scattered_in_16_bits_to_the_formats_precision() {
    let gradient = |rank: usize| -> Vec<f32> {
        (0..10)
            .map(|i| 0.37 * (i + 1) as f32 * (rank + 1) as f32)
            .collect()
    };
    for world in [2, 3] {
        let mean: Vec<f32> = (0..10)
            .map(|i| (0..world).map(|rank| gradient(rank)[i]).sum::<f32>() / world as f32)
            .collect();
        let padded = (shard_len(10, world) * world) as u64;
        for (format, precision) in [
            (None, 1e-6),
            (Some(HalfFormat::Bf16), 1e-2),
            (Some(HalfFormat::F16), 2e-3),
        ] {
            let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
            let ranks: Vec<_> = (0..world)
                .map(|rank| {
                    let store = store.clone();
                    std::thread::spawn(move || {
                        let group =
                            TcpProcessGroup::new(store, rank, world, TcpGroupOptions::default())
                                .unwrap();
                        let comm = ShardComm::new(group, format);
                        let shard = comm.reduce_scatter(gradient(rank));
                        assert!(comm.take_error().is_none());
                        (shard, comm.bytes())
                    })
                })
                .collect();
            for (rank, handle) in ranks.into_iter().enumerate() {
                let (shard, bytes) = handle.join().unwrap();
                let want = shard_of(&mean, rank, world);
                assert_eq!(shard.len(), want.len());
                for (got, want) in shard.iter().zip(&want) {
                    assert!(
                        (got - want).abs() <= precision * want.abs(),
                        "world {world} rank {rank} {format:?}: {shard:?} vs {want:?}"
                    );
                }
                let element = if format.is_some() { 2 } else { 4 };
                assert_eq!(bytes, element * padded, "world {world} {format:?}");
            }
        }
    }
}

#[test]
fn shards_are_even_and_padded_with_zeros() {
    assert_eq!(shard_len(10, 3), 4);
    assert_eq!(shard_len(10, 1), 10);
    let w = weights();
    assert_eq!(shard_of(&w, 2, 3), vec![w[8], w[9], 0.0, 0.0]);
    assert_eq!(shard_of(&w, 3, 4), vec![w[9], 0.0, 0.0]);
    assert_eq!(shard_of(&w[..2], 2, 3), vec![0.0], "a shard past the end");
    let joined: Vec<f32> = (0..4).flat_map(|r| shard_of(&w, r, 4)).collect();
    assert_eq!(
        &joined[..10],
        &w[..],
        "the shards in rank order are the parameter"
    );
}

/// The forward gives every rank the whole parameter, exactly; the backward gives each rank
/// its block of the mean gradient (< 1e-6 of one process's); the matmul that needs the
/// parameter for its input's gradient gathers it a second time in the backward instead of
/// keeping it, with and without Burn's gradient checkpointing on the device.
#[test]
fn a_gathered_parameter_trains_like_a_whole_one_and_is_gathered_again_for_its_backward() {
    fn plain() -> Device {
        Device::flex().autodiff()
    }
    fn checkpointed() -> Device {
        Device::flex().autodiff().gradient_checkpointing()
    }
    for world in [2, 3] {
        let want = reference_gradient(world);
        for (device, gathers) in [(plain as fn() -> Device, 2), (checkpointed, 2)] {
            for (rank, out) in run(world, device, None).into_iter().enumerate() {
                assert_eq!(out.gathered, weights(), "world {world} rank {rank}");
                let own = shard_of(&want, rank, world);
                for (got, want) in out.shard_grad.iter().zip(&own) {
                    assert!(
                        (got - want).abs() < 1e-6,
                        "world {world} rank {rank}: {:?} vs {own:?}",
                        out.shard_grad
                    );
                }
                assert_eq!(out.shard_grad.len(), own.len());
                assert_eq!(
                    (out.gathers, out.reduce_scatters),
                    (gathers, 1),
                    "world {world} rank {rank}: gathers and reduce-scatters"
                );
                let padded = (shard_len(10, world) * world) as u64;
                assert_eq!(out.bytes, (gathers + 1) * 4 * padded, "all in f32");
            }
        }
    }
}
