//! Threads in one process, real sockets on loopback. The multi-process suite lives in the
//! workspace's `tests/`.
use super::*;
use crate::group::wire::{self, RingHello};
use crate::store::MemoryStore;
use std::net::TcpStream;
use std::time::Duration;

fn with_group<R: Send + 'static>(
    world: usize,
    options: TcpGroupOptions,
    body: impl Fn(&mut TcpProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let body = Arc::new(body);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (store, body, options) = (store.clone(), body.clone(), options.clone());
            std::thread::spawn(move || {
                let mut group = TcpProcessGroup::new(store, rank, world, options).unwrap();
                body(&mut group)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn collectives_on_threads() {
    let options = TcpGroupOptions {
        piece_bytes: 16, // many pieces, to exercise the pipeline
        ..Default::default()
    };
    let results = with_group(3, options, |g| {
        let r = g.rank() as i64;
        let mut a: Vec<i64> = (0..10).map(|i| i * 10 + r).collect();
        g.all_reduce(&mut a, ReduceOp::Sum).unwrap();
        let mut m = vec![r as f32; 5];
        g.all_reduce(&mut m, ReduceOp::Max).unwrap();
        let mut b = vec![r; 7];
        g.broadcast(&mut b, 1).unwrap();
        let mut gathered = vec![0i64; 6];
        g.all_gather(&[r, -r], &mut gathered).unwrap();
        let mut out = [0i64; 2];
        g.reduce_scatter(&[1, 2, 3, 4, 5, 6], &mut out, ReduceOp::Sum)
            .unwrap();
        g.barrier().unwrap();
        (a, m, b, gathered, out)
    });
    for (rank, (a, m, b, gathered, out)) in results.into_iter().enumerate() {
        assert_eq!(a, (0..10).map(|i| 30 * i + 3).collect::<Vec<i64>>());
        assert_eq!(m, vec![2.0; 5]);
        assert_eq!(b, vec![1; 7]);
        assert_eq!(gathered, vec![0, 0, 1, -1, 2, -2]);
        let r = rank as i64;
        assert_eq!(out, [3 * (2 * r + 1), 3 * (2 * r + 2)]);
    }
}

/// Uneven blocks (ZeRO's owner layout): each rank gets the mean of its own block, then
/// every rank gets every owner's block back; block sizes that differ across ranks fail as a
/// mismatch on every rank instead of exchanging wrong ranges.
#[test]
fn uneven_blocks_on_threads() {
    let options = TcpGroupOptions {
        piece_bytes: 8,
        ..Default::default()
    };
    const COUNTS: [usize; 3] = [5, 0, 9];
    let results = with_group(3, options, |g| {
        let r = g.rank();
        let mut grads: Vec<f32> = (0..14).map(|i| (i * 3 + r) as f32).collect();
        g.reduce_scatter_v(&mut grads, &COUNTS, ReduceOp::Avg)
            .unwrap();
        let own = ring::block_ranges(&COUNTS)[r].clone();
        let mean = grads[own.clone()].to_vec();
        let mut params = vec![-1.0f32; 14];
        params[own.clone()]
            .iter_mut()
            .for_each(|p| *p = 100.0 + r as f32);
        g.all_gather_v(&mut params, &COUNTS).unwrap();
        let wrong = if r == 2 { [5, 1, 8] } else { COUNTS };
        let mismatch = g.all_gather_v(&mut params.clone(), &wrong).unwrap_err();
        (own, mean, params, mismatch.to_string())
    });
    for (r, (own, mean, params, mismatch)) in results.into_iter().enumerate() {
        let expected: Vec<f32> = own.map(|i| (i * 3 + 1) as f32).collect();
        assert_eq!(mean, expected, "rank {r}");
        let mut gathered = vec![100.0; 5];
        gathered.extend([102.0; 9]);
        assert_eq!(params, gathered, "rank {r}");
        assert!(mismatch.contains("all_gather_v"), "rank {r}: {mismatch}");
    }
}

/// The staged reduce-scatter-v (ZeRO's gradients): every element filled once, only the
/// own block drained, each element once, with the bits of the plain reduce-scatter's sum.
#[test]
fn staged_uneven_reduce_scatter_drains_the_own_block() {
    struct Staging {
        input: Vec<f32>,
        fills: Vec<u8>,
        drained: Vec<(usize, f32)>,
    }
    impl PieceStaging<f32> for Staging {
        fn fill(&mut self, range: std::ops::Range<usize>, piece: &mut [f32]) {
            piece.copy_from_slice(&self.input[range.clone()]);
            self.fills[range].iter_mut().for_each(|c| *c += 1);
        }
        fn drain(&mut self, range: std::ops::Range<usize>, piece: &[f32]) {
            self.drained.extend(range.zip(piece.iter().copied()));
        }
    }
    const COUNTS: [usize; 4] = [37, 0, 90, 3];
    for piece_bytes in [8, 44, 1 << 20] {
        let options = TcpGroupOptions {
            piece_bytes,
            ..Default::default()
        };
        let results = with_group(4, options, |g| {
            let r = g.rank();
            let input: Vec<f32> = (0..130).map(|i| (i * 7 + r) as f32 * 0.1).collect();
            let mut plain = input.clone();
            g.reduce_scatter_v(&mut plain, &COUNTS, ReduceOp::Sum)
                .unwrap();
            let mut staging = Staging {
                input,
                fills: vec![0; 130],
                drained: Vec::new(),
            };
            let mut ring = vec![0.0f32; 130];
            g.reduce_scatter_v_staged(&mut ring, &COUNTS, ReduceOp::Sum, &mut staging)
                .unwrap();
            (plain, staging.fills, staging.drained)
        });
        for (r, (plain, fills, mut drained)) in results.into_iter().enumerate() {
            assert!(fills.iter().all(|&c| c == 1), "rank {r}: {fills:?}");
            drained.sort_by_key(|(i, _)| *i);
            let own = ring::block_ranges(&COUNTS)[r].clone();
            let want: Vec<(usize, u32)> = own.map(|i| (i, plain[i].to_bits())).collect();
            let got: Vec<(usize, u32)> = drained.iter().map(|(i, x)| (*i, x.to_bits())).collect();
            assert_eq!(got, want, "rank {r}, pieces of {piece_bytes} bytes");
        }
    }
}

/// 16-bit floats (compressed gradient buckets) travel at 2 bytes an element and reduce
/// through `f32`: sums of small integers are exact, and every rank gets the same bits.
#[test]
fn sixteen_bit_floats_on_threads() {
    use half::{bf16, f16};
    let options = TcpGroupOptions {
        piece_bytes: 6, // 3 elements a piece: pieces end mid-word of the packed layout
        ..Default::default()
    };
    let results = with_group(3, options, |g| {
        let r = g.rank() as f32;
        let mut a: Vec<bf16> = (0..11).map(|i| bf16::from_f32(i as f32 + r)).collect();
        g.all_reduce(&mut a, ReduceOp::Sum).unwrap();
        let mut b: Vec<f16> = (0..11).map(|i| f16::from_f32(-(i as f32) * r)).collect();
        g.all_reduce(&mut b, ReduceOp::Avg).unwrap();
        let mut c = vec![f16::from_f32(r); 4];
        g.all_reduce(&mut c, ReduceOp::Max).unwrap();
        (a, b, c)
    });
    for (a, b, c) in results {
        let a: Vec<f32> = a.iter().map(|x| x.to_f32()).collect();
        let b: Vec<f32> = b.iter().map(|x| x.to_f32()).collect();
        assert_eq!(a, (0..11).map(|i| 3.0 * i as f32 + 3.0).collect::<Vec<_>>());
        assert_eq!(b, (0..11).map(|i| -(i as f32)).collect::<Vec<_>>());
        assert_eq!(c, vec![f16::from_f32(2.0); 4]);
    }
}

#[test]
fn strangers_on_the_ring_port_are_refused_and_the_group_forms() {
    use std::io::Write as _;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let options = TcpGroupOptions {
        token: "job-token".into(),
        ..Default::default()
    };
    let spawn_rank = |rank: usize| {
        let (store, options) = (store.clone(), options.clone());
        std::thread::spawn(move || {
            let mut g = TcpProcessGroup::new(store, rank, 2, options).unwrap();
            let mut v = [rank as i64 + 1];
            g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            v[0]
        })
    };
    let rank0 = spawn_rank(0);
    let addr = String::from_utf8(
        store
            .get("pg/default/addr/0", Duration::from_secs(30))
            .unwrap(),
    )
    .unwrap();
    // Queued in rank 0's backlog before its real predecessor: garbage, then a wrong token.
    let mut garbage = TcpStream::connect(&addr).unwrap();
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut impostor = TcpStream::connect(&addr).unwrap();
    impostor
        .write_all(&wire::encode_hello(&RingHello {
            rank: 1,
            world_size: 2,
            token: "guess".into(),
        }))
        .unwrap();
    let rank1 = spawn_rank(1);
    assert_eq!(rank0.join().unwrap(), 3);
    assert_eq!(rank1.join().unwrap(), 3);
}

#[test]
fn mismatched_lengths_name_both_sides() {
    let results = with_group(2, TcpGroupOptions::default(), |g| {
        let mut buf = vec![0f32; 4 + g.rank()];
        let first = g
            .all_reduce(&mut buf, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        let second = g.barrier().unwrap_err();
        (first, second)
    });
    for (first, second) in results {
        assert!(
            first.contains("mismatch")
                && first.contains("4 elements")
                && first.contains("5 elements"),
            "{first}"
        );
        assert!(
            matches!(second, CollectiveError::Aborted { .. }),
            "{second}"
        );
    }
}
