//! `--pytorch PYTHON`: PyTorch DDP (gloo) on the same links, in the same run, as the side-by-side
//! figure. The program it runs is `pytorch_ddp.py` (embedded, written to the run's scratch
//! directory): the workload's model in PyTorch, DDP with its defaults (a 1 MiB first bucket,
//! overlap with backward) and the config's `bucket_cap_mb`, and PyTorch's own bf16 / fp16
//! compression hooks; it times
//! steps with gradient sync and as many under `no_sync()` (the local work), and rank 0 prints
//! one JSON line, read by [`parse_result`].

use std::path::Path;
use std::process::Command;

use anyhow::Context;

use super::net::Network;

/// The PyTorch side (module docs).
pub const SCRIPT: &str = include_str!("pytorch_ddp.py");

/// The rendezvous port of PyTorch's process group on node 0 (the trainer's store uses
/// `STORE_PORT`; a port of its own keeps a lingering socket of one run out of the other's way).
const TORCH_PORT: u16 = 29501;

/// What one PyTorch run measured (rank 0's clock).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TorchMeasured {
    pub samples_per_sec: f64,
    /// Seconds per step with gradient sync.
    pub step_s: f64,
    /// Seconds per step under `no_sync()`: data, forward, backward and optimizer, no
    /// communication.
    pub work_s: f64,
}

/// The run's JSON line (the last line of rank 0's standard output that parses).
pub fn parse_result(stdout: &str) -> anyhow::Result<TorchMeasured> {
    let line = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .context("the PyTorch run printed no result line")?;
    let field = |name: &str| {
        line[name]
            .as_f64()
            .filter(|v| v.is_finite() && *v > 0.0)
            .with_context(|| format!("the PyTorch result has no positive {name}: {line}"))
    };
    Ok(TorchMeasured {
        samples_per_sec: field("samples_per_sec")?,
        step_s: field("step_s")?,
        work_s: field("work_s")?,
    })
}

/// What every PyTorch run of a bench-link session shares.
pub struct TorchJob<'a> {
    /// A Python with `torch` (the `--pytorch` value).
    pub python: &'a Path,
    /// [`SCRIPT`], written out.
    pub script: &'a Path,
    /// The workload's config.
    pub config: &'a Path,
    pub steps: usize,
    pub timeout_secs: u64,
}

impl TorchJob<'_> {
    /// `python pytorch_ddp.py ...` as rank `r` of the PyTorch job with `compression`, in node
    /// `r`'s namespace: gloo over the node's link (`GLOO_SOCKET_IFNAME`), one compute thread.
    pub fn node_command(&self, network: &Network, r: usize, compression: &str) -> Command {
        let nodes = network.nodes();
        let mut cmd = network.command(r, self.python);
        cmd.arg(self.script)
            .arg("--config")
            .arg(self.config)
            .args(["--compression", compression])
            .args(["--steps", &self.steps.to_string()])
            .args(["--timeout-secs", &self.timeout_secs.to_string()])
            .env("MASTER_ADDR", &nodes[0].addr)
            .env("MASTER_PORT", TORCH_PORT.to_string())
            .env("RANK", r.to_string())
            .env("WORLD_SIZE", nodes.len().to_string())
            .env("GLOO_SOCKET_IFNAME", &nodes[r].ifname)
            .env("OMP_NUM_THREADS", "1");
        cmd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_result_line_is_read_and_checked() {
        let out = "warming up\n{\"samples_per_sec\": 2000.5, \"step_s\": 0.064, \"work_s\": 0.016, \"params\": 10}\n";
        let m = parse_result(out).unwrap();
        assert_eq!(m.samples_per_sec, 2000.5);
        assert_eq!((m.step_s, m.work_s), (0.064, 0.016));
        assert!(parse_result("no json here").is_err());
        assert!(parse_result("{\"samples_per_sec\": 0, \"step_s\": 1, \"work_s\": 1}").is_err());
    }

    #[test]
    fn the_script_knows_the_options_the_command_passes() {
        for option in ["--config", "--compression", "--steps", "--timeout-secs"] {
            assert!(SCRIPT.contains(&format!("\"{option}\"")), "{option}");
        }
    }
}
