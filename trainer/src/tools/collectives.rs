//! Tools that exercise the collective layer without a model: a self-test that checks every
//! collective's result on deterministic data (used by the integration tests and useful to check
//! a cluster's network), and an all-reduce benchmark in the format of nccl-tests.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use burn_ddp::group::Element;
use burn_ddp::{Distributed, ProcessGroup, ReduceOp, TcpGroupOptions};
use clap::Args;

use crate::error::UsageError;
use crate::launcher::launch_plan::LaunchArgs;

#[derive(Args, Debug, Clone)]
pub struct CollectiveArgs {
    #[command(flatten)]
    pub launch: LaunchArgs,
    /// all_reduce, broadcast, all_gather, reduce_scatter, barrier, or all.
    #[arg(long, default_value = "all")]
    pub op: String,
    /// i64, f32 or f64.
    #[arg(long, default_value = "i64")]
    pub dtype: String,
    /// Elements per rank.
    #[arg(long, default_value_t = 7)]
    pub len: usize,
    /// Root of broadcast.
    #[arg(long, default_value_t = 0)]
    pub root: usize,
    /// Repeat every operation this many times.
    #[arg(long, default_value_t = 1)]
    pub iters: usize,
    /// Deadline of set-up and of each collective, in seconds.
    #[arg(long, default_value_t = 120)]
    pub timeout_secs: u64,
    /// For fault tests: `RANK=LEN` gives one rank another length.
    #[arg(long)]
    pub len_for_rank: Vec<String>,
    /// For fault tests: `RANK=OP` makes one rank call another operation.
    #[arg(long)]
    pub op_for_rank: Vec<String>,
}

/// The value rank `rank` contributes at index `i`: small integers, so sums are exact in f32.
fn value<T: FromI64>(rank: usize, i: usize) -> T {
    T::from_i64(((rank + 1) * 1000 + i % 997) as i64)
}

/// Conversion of the test pattern into each element type.
pub trait FromI64: Element {
    fn from_i64(v: i64) -> Self;
}
impl FromI64 for i64 {
    fn from_i64(v: i64) -> Self {
        v
    }
}
impl FromI64 for f32 {
    fn from_i64(v: i64) -> Self {
        v as f32
    }
}
impl FromI64 for f64 {
    fn from_i64(v: i64) -> Self {
        v as f64
    }
}

fn per_rank<'a>(
    overrides: &'a [String],
    rank: usize,
    flag: &str,
) -> anyhow::Result<Option<&'a str>> {
    for o in overrides {
        let Some((r, v)) = o.split_once('=') else {
            bail!(UsageError(format!(
                "--{flag} expects RANK=VALUE, got {o:?}"
            )));
        };
        if r.trim().parse::<usize>().ok() == Some(rank) {
            return Ok(Some(v.trim()));
        }
    }
    Ok(None)
}

/// `trainer collectives`: runs the chosen collectives and checks every element.
pub fn collectives(args: &CollectiveArgs) -> anyhow::Result<ExitCode> {
    let options = TcpGroupOptions {
        timeout: Duration::from_secs(args.timeout_secs),
        ..Default::default()
    };
    let mut dist = Distributed::from_env_or_standalone(options)?;
    let rank = dist.group.rank();
    let len = match per_rank(&args.len_for_rank, rank, "len-for-rank")? {
        Some(v) => v
            .parse()
            .map_err(|_| UsageError(format!("bad length {v:?}")))?,
        None => args.len,
    };
    let op = per_rank(&args.op_for_rank, rank, "op-for-rank")?.unwrap_or(&args.op);
    let ops: Vec<&str> = if op == "all" {
        vec![
            "all_reduce",
            "broadcast",
            "all_gather",
            "reduce_scatter",
            "barrier",
        ]
    } else {
        vec![op]
    };
    for _ in 0..args.iters {
        for &op in &ops {
            match args.dtype.as_str() {
                "i64" => check_op::<i64>(&mut dist.group, op, len, args.root)?,
                "f32" => check_op::<f32>(&mut dist.group, op, len, args.root)?,
                "f64" => check_op::<f64>(&mut dist.group, op, len, args.root)?,
                other => bail!(UsageError(format!(
                    "--dtype must be i64, f32 or f64, not {other:?}"
                ))),
            }
        }
    }
    // Keep rank 0 (which may host the store) alive until every rank is done.
    dist.group.barrier()?;
    println!(
        "rank {rank}: {} {} len {len}: all results correct",
        ops.join(","),
        args.dtype
    );
    Ok(ExitCode::SUCCESS)
}

fn check_op<T: FromI64>(
    group: &mut impl ProcessGroup,
    op: &str,
    len: usize,
    root: usize,
) -> anyhow::Result<()> {
    let (rank, world) = (group.rank(), group.world_size());
    let mine: Vec<T> = (0..len).map(|i| value(rank, i)).collect();
    let (got, expected): (Vec<T>, Vec<T>) = match op {
        "all_reduce" => {
            let mut buf = mine.clone();
            group.all_reduce(&mut buf, ReduceOp::Sum)?;
            let exp = (0..len)
                .map(|i| T::from_i64((0..world).map(|r| value::<i64>(r, i)).sum()))
                .collect();
            (buf, exp)
        }
        "broadcast" => {
            let mut buf = mine.clone();
            group.broadcast(&mut buf, root)?;
            (buf, (0..len).map(|i| value(root, i)).collect())
        }
        "all_gather" => {
            let mut out = vec![T::from_i64(-1); len * world];
            group.all_gather(&mine, &mut out)?;
            (out, (0..world).flat_map(|r| (0..len).map(move |i| value(r, i))).collect())
        }
        "reduce_scatter" => {
            let input: Vec<T> = (0..len * world).map(|i| value(rank, i)).collect();
            let mut out = vec![T::from_i64(0); len];
            group.reduce_scatter(&input, &mut out, ReduceOp::Sum)?;
            let exp = (0..len)
                .map(|i| T::from_i64((0..world).map(|r| value::<i64>(r, rank * len + i)).sum()))
                .collect();
            (out, exp)
        }
        "barrier" => {
            group.barrier()?;
            (Vec::new(), Vec::new())
        }
        other => bail!(UsageError(format!(
            "unknown operation {other:?} (all_reduce, broadcast, all_gather, reduce_scatter, barrier, all)"
        ))),
    };
    if let Some(i) = (0..got.len()).find(|&i| got[i] != expected[i]) {
        bail!(
            "rank {rank}: {op} gave a wrong result at element {i}: {:?}, expected {:?}",
            got[i],
            expected[i]
        );
    }
    Ok(())
}

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub launch: LaunchArgs,
    /// Smallest message in bytes.
    #[arg(long, default_value_t = 4 << 10)]
    pub min_bytes: usize,
    /// Largest message in bytes.
    #[arg(long, default_value_t = 128 << 20)]
    pub max_bytes: usize,
    /// Pipelined piece size of the ring in KiB.
    #[arg(long, default_value_t = 1024)]
    pub piece_kib: usize,
}

/// `trainer bench-allreduce`: nccl-tests-style table of f32 sum all-reduce.
pub fn bench_allreduce(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let options = TcpGroupOptions {
        piece_bytes: args.piece_kib.max(1) << 10,
        ..Default::default()
    };
    let mut dist = Distributed::from_env_or_standalone(options)?;
    let group = &mut dist.group;
    let (rank, world) = (group.rank(), group.world_size());
    if rank == 0 {
        // Measured while the other ranks wait in the barrier below (asleep in poll(2)).
        let memcpy = memcpy_bandwidth();
        let tcp = loopback_tcp_bandwidth().context("loopback TCP measurement failed")?;
        println!("# machine ceilings, measured now: memcpy {:.2} GB/s, one-stream loopback TCP {:.2} GB/s", memcpy / 1e9, tcp / 1e9);
        println!("# all_reduce f32 sum, {world} ranks, ring with {} KiB pieces; busbw = algbw x 2(n-1)/n", args.piece_kib);
        println!("# ranks on one host exchange data through shared memory (BURN_DDP_SHM=0: TCP)");
        println!(
            "{:>12} {:>10} {:>12} {:>10} {:>10} {:>11} {:>14}",
            "size(B)", "count", "time(us)", "algbw", "busbw", "busbw/tcp", "busbw/memcpy"
        );
        let _ = std::io::stdout().flush();
        group.barrier()?;
        run_table(group, args, Some([tcp, memcpy]))?;
    } else {
        group.barrier()?;
        run_table(group, args, None)?;
    }
    group.barrier()?;
    Ok(ExitCode::SUCCESS)
}

fn run_table(
    group: &mut impl ProcessGroup,
    args: &BenchArgs,
    ceilings: Option<[f64; 2]>,
) -> anyhow::Result<()> {
    let world = group.world_size();
    let mut size = args.min_bytes.max(4);
    while size <= args.max_bytes {
        let count = size / 4;
        let mut buf = vec![1.0f32; count];
        let iters = ((256usize << 20) / size).clamp(5, 200);
        for _ in 0..2 {
            group.all_reduce(&mut buf, ReduceOp::Sum)?;
        }
        group.barrier()?;
        let start = Instant::now();
        for _ in 0..iters {
            group.all_reduce(&mut buf, ReduceOp::Sum)?;
        }
        let mut elapsed = [start.elapsed().as_secs_f64() / iters as f64];
        group.all_reduce(&mut elapsed, ReduceOp::Max)?; // the slowest rank sets the time
        if let Some([tcp, memcpy]) = ceilings {
            let t = elapsed[0];
            let algbw = size as f64 / t;
            let busbw = algbw * 2.0 * (world as f64 - 1.0) / world as f64;
            println!(
                "{:>12} {:>10} {:>12.1} {:>10.3} {:>10.3} {:>11.2} {:>14.2}",
                size,
                count,
                t * 1e6,
                algbw / 1e9,
                busbw / 1e9,
                busbw / tcp,
                busbw / memcpy
            );
            let _ = std::io::stdout().flush();
        }
        size *= 2;
    }
    Ok(())
}

/// Bytes per second of a large `copy_from_slice` (one core).
pub(crate) fn memcpy_bandwidth() -> f64 {
    let n = 64 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src); // fault the pages in first
    let reps = 8;
    let start = Instant::now();
    for _ in 0..reps {
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
    }
    (n * reps) as f64 / start.elapsed().as_secs_f64()
}

/// Bytes per second through one loopback TCP connection between two threads: the ceiling of
/// any TCP-based collective on this machine.
fn loopback_tcp_bandwidth() -> std::io::Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let total: usize = 2 << 30;
    let receiver = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 4 << 20];
        let mut got = 0;
        while got < total {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            got += n;
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr)?;
    let chunk = vec![7u8; 4 << 20];
    let start = Instant::now();
    let mut sent = 0;
    while sent < total {
        s.write_all(&chunk)?;
        sent += chunk.len();
    }
    drop(s);
    receiver
        .join()
        .map_err(|_| std::io::Error::other("receiver thread panicked"))??;
    Ok(total as f64 / start.elapsed().as_secs_f64())
}
