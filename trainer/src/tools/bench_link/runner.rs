//! The runs of `trainer bench-link`: node processes started in the network's namespaces
//! (`trainer bench-allreduce`, `trainer` training with a patched config, PyTorch DDP) and
//! supervised (a deadline, the signals, every node stopped on every exit path), and what their
//! outputs say (the metrics file's step times, the summary's bucket timeline).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::bounds;
use super::net::Network;
use super::pytorch::{self, TorchJob, TorchMeasured};

/// What one training run measured.
#[derive(Debug, Clone)]
pub(super) struct Measured {
    pub(super) samples_per_sec: f64,
    pub(super) work_s: f64,
    pub(super) sync_s: f64,
    pub(super) wire_bytes_per_step: f64,
    /// Rank 0's bucket timeline of its last step, as its summary printed it (empty without).
    pub(super) timeline: String,
}

/// Starts node processes in the namespaces and supervises them.
pub(super) struct Runner {
    pub(super) exe: PathBuf,
    pub(super) scratch: PathBuf,
    pub(super) timeout: Duration,
    /// The signal number once SIGINT / SIGTERM / SIGHUP arrived.
    pub(super) interrupted: Arc<AtomicUsize>,
}

/// The store's port on node 0: its namespace is new, so the port is free.
const STORE_PORT: u16 = 29500;

impl Runner {
    /// `trainer bench-allreduce` across the nodes at `bytes`: the link's all-reduce bus
    /// bandwidth, bytes/s.
    pub(super) fn measure_busbw(&self, network: &Network, bytes: usize) -> anyhow::Result<f64> {
        let bytes = bytes.to_string();
        let outputs = self.run_nodes(network, "bench-allreduce", |r| {
            let mut cmd = self.trainer_node(network, r);
            cmd.args([
                "bench-allreduce",
                "--min-bytes",
                &bytes,
                "--max-bytes",
                &bytes,
            ]);
            self.as_node(cmd, network, r)
        })?;
        // Rank 0's table: size, count, time (us), algbw, busbw, ...
        let table = std::fs::read_to_string(&outputs[0].stdout)?;
        let row = table
            .lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let cols: Vec<f64> = l
                    .split_whitespace()
                    .filter_map(|c| c.parse().ok())
                    .collect();
                (cols.len() >= 3).then(|| (cols[0], cols[2]))
            })
            .with_context(|| format!("bench-allreduce printed no result:\n{table}"))?;
        let (size, micros) = row;
        Ok(bounds::busbw(size, micros * 1e-6, network.nodes().len()))
    }

    /// One training run of `config` with `compression`, one rank per node.
    pub(super) fn train(
        &self,
        network: &Network,
        config: &Path,
        compression: &str,
        steps: usize,
        round: usize,
    ) -> anyhow::Result<Measured> {
        let out_dir = self.scratch.join(format!("{compression}-{round}"));
        let _ = std::fs::remove_dir_all(&out_dir);
        std::fs::create_dir_all(&out_dir)?;
        let patched = patch_config(config, &out_dir, compression, steps)?;
        let nodes = network.nodes().len();
        let before = (0..nodes)
            .map(|n| network.tx_bytes(n))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let patched = patched.display().to_string();
        let outputs = self.run_nodes(network, "train", |r| {
            let mut cmd = self.trainer_node(network, r);
            cmd.args(["--config", &patched]);
            self.as_node(cmd, network, r)
        })?;
        let mut sent = 0u64;
        for (n, b) in before.iter().enumerate() {
            sent += network.tx_bytes(n)?.saturating_sub(*b);
        }
        let metrics = std::fs::read_to_string(out_dir.join("metrics.jsonl"))
            .context("the run wrote no metrics.jsonl")?;
        let (samples_per_sec, work_s, sync_s) = parse_metrics(&metrics)?;
        let summary = std::fs::read_to_string(&outputs[0].stdout).unwrap_or_default();
        Ok(Measured {
            samples_per_sec,
            work_s,
            sync_s,
            wire_bytes_per_step: sent as f64 / nodes as f64 / steps as f64,
            timeline: timeline_of(&summary),
        })
    }

    /// One PyTorch DDP run of `torch`'s workload with `compression`, one process per node.
    pub(super) fn train_pytorch(
        &self,
        network: &Network,
        torch: &TorchJob<'_>,
        compression: &str,
    ) -> anyhow::Result<TorchMeasured> {
        let outputs = self.run_nodes(network, "pytorch", |r| {
            torch.node_command(network, r, compression)
        })?;
        pytorch::parse_result(&std::fs::read_to_string(&outputs[0].stdout)?)
    }

    /// The trainer in node `r`'s namespace: the caller adds its command and arguments, then
    /// [`as_node`](Self::as_node) the job's.
    fn trainer_node(&self, network: &Network, r: usize) -> Command {
        network.command(r, &self.exe)
    }

    /// `cmd` (the trainer, in node `r`'s namespace) as rank `r` of the job of one rank per
    /// node: `--nproc-per-node 1 --nnodes N --node-rank R --master-addr ...`, one compute
    /// thread.
    fn as_node(&self, mut cmd: Command, network: &Network, r: usize) -> Command {
        let nodes = network.nodes();
        cmd.args([
            "--nproc-per-node",
            "1",
            "--nnodes",
            &nodes.len().to_string(),
        ])
        .args([
            "--node-rank",
            &r.to_string(),
            "--master-addr",
            &nodes[0].addr,
        ])
        .args(["--master-port", &STORE_PORT.to_string()])
        .env("BURN_DDP_TOKEN", "bench-link")
        .env("RAYON_NUM_THREADS", "1");
        cmd
    }

    /// Runs `node(r)` (a command in node `r`'s namespace) for every node and waits for all of
    /// them, within the deadline. The first failure, the deadline or a signal stops every
    /// node. Returns each node's output files.
    fn run_nodes(
        &self,
        network: &Network,
        what: &str,
        node: impl Fn(usize) -> Command,
    ) -> anyhow::Result<Vec<NodeOutput>> {
        let mut children: Vec<(Child, NodeOutput)> = Vec::new();
        let mut guard = Stopper(Vec::new());
        for r in 0..network.nodes().len() {
            let out = NodeOutput {
                stdout: self.scratch.join(format!("{what}-node{r}.out")),
                stderr: self.scratch.join(format!("{what}-node{r}.err")),
            };
            let mut cmd = node(r);
            cmd.stdin(Stdio::null())
                .stdout(File::create(&out.stdout)?)
                .stderr(File::create(&out.stderr)?);
            // A process group of its own: a stop reaches the node's ranks too.
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
            let child = cmd
                .spawn()
                .with_context(|| format!("cannot start node {r}"))?;
            guard.0.push(child.id());
            children.push((child, out));
        }
        let deadline = Instant::now() + self.timeout;
        let mut done = vec![false; children.len()];
        while done.iter().any(|d| !d) {
            let sig = self.interrupted.load(Ordering::Relaxed);
            if sig != 0 {
                bail!("interrupted by signal {sig}: stopped the nodes, removing the namespaces");
            }
            if Instant::now() > deadline {
                bail!(
                    "{what} did not finish within {:?} (--timeout-secs)",
                    self.timeout
                );
            }
            for (r, (child, out)) in children.iter_mut().enumerate() {
                if done[r] {
                    continue;
                }
                if let Some(status) = child.try_wait()? {
                    done[r] = true;
                    if !status.success() {
                        let err = std::fs::read_to_string(&out.stderr).unwrap_or_default();
                        let tail: Vec<&str> = err.lines().rev().take(15).collect();
                        let tail: Vec<&str> = tail.into_iter().rev().collect();
                        bail!("{what} on node {r} failed ({status}):\n{}", tail.join("\n"));
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        guard.0.clear();
        Ok(children.into_iter().map(|(_, out)| out).collect())
    }
}

/// Where a node's output went.
struct NodeOutput {
    stdout: PathBuf,
    stderr: PathBuf,
}

/// Stops the process groups of nodes still running when dropped (an error or a signal left
/// them): SIGTERM, then SIGKILL after 5 s.
struct Stopper(Vec<u32>);

impl Drop for Stopper {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        // SAFETY: kill(2) with signal 0 only asks whether the process group exists; it touches
        // no memory.
        let alive = |pid: u32| unsafe { libc::kill(-(pid as i32), 0) == 0 };
        for &pid in &self.0 {
            // SAFETY: kill(2) on process groups this process created.
            unsafe { libc::kill(-(pid as i32), libc::SIGTERM) };
        }
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until && self.0.iter().any(|&p| alive(p)) {
            reap(&self.0);
            std::thread::sleep(Duration::from_millis(50));
        }
        for &pid in &self.0 {
            // SAFETY: as above.
            unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
        }
        reap(&self.0);
    }
}

/// Collects the exit status of the given children without blocking.
fn reap(pids: &[u32]) {
    for &pid in pids {
        // SAFETY: waitpid on this process's own children, non-blocking.
        unsafe { libc::waitpid(pid as i32, std::ptr::null_mut(), libc::WNOHANG) };
    }
}

/// The workload's config with its own output directory, no checkpoints, no charts, the
/// given gradient compression and number of steps; written next to the outputs.
fn patch_config(
    config: &Path,
    out_dir: &Path,
    compression: &str,
    steps: usize,
) -> anyhow::Result<PathBuf> {
    let text = std::fs::read_to_string(config)?;
    let mut table: toml::Table = toml::from_str(&text)?;
    table.remove("checkpoint");
    let mut output = toml::Table::new();
    output.insert("dir".into(), out_dir.display().to_string().into());
    output.insert("plots".into(), false.into());
    table.insert("output".into(), output.into());
    let distributed = table
        .entry("distributed")
        .or_insert_with(|| toml::Table::new().into());
    if let Some(d) = distributed.as_table_mut() {
        d.insert("gradient_compression".into(), compression.into());
    }
    if let Some(training) = table.get_mut("training").and_then(|t| t.as_table_mut()) {
        training.insert("max_steps".into(), (steps as i64).into());
    }
    let patched = out_dir.join("bench-link.toml");
    std::fs::write(&patched, toml::to_string(&table)?)?;
    Ok(patched)
}

/// Samples/s, seconds of local work per step (data + compute + optimizer medians over ranks)
/// and of gradient sync, each the mean over the train records after the first (warm-up).
/// The bucket timeline of a run's summary (rank 0's standard output): its heading and the
/// indented lines under it; empty without one.
fn timeline_of(summary: &str) -> String {
    let mut lines = summary
        .lines()
        .skip_while(|l| !l.starts_with(crate::engine::fit::TIMELINE_HEADING));
    let Some(heading) = lines.next() else {
        return String::new();
    };
    let mut out = format!("{heading}\n");
    for line in lines.take_while(|l| l.starts_with("  ")) {
        out.push_str(line);
        out.push('\n');
    }
    out
}

fn parse_metrics(metrics: &str) -> anyhow::Result<(f64, f64, f64)> {
    let records: Vec<serde_json::Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "train")
        .skip(1)
        .collect();
    let mut rates = Vec::new();
    let mut work = Vec::new();
    let mut sync = Vec::new();
    for r in &records {
        rates.extend(r["samples_per_sec"].as_f64());
        let t = &r["time"];
        let phases = ["data", "compute", "optimizer"].map(|p| t[p]["median"].as_f64());
        if let [Some(d), Some(c), Some(o)] = phases {
            work.push(d + c + o);
        }
        sync.extend(t["sync"]["median"].as_f64());
    }
    if rates.is_empty() || work.is_empty() {
        bail!(
            "no throughput or step-time records after the warm-up window: raise the steps \
             above 2 x training.log_every"
        );
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let sync = if sync.is_empty() {
        f64::NAN
    } else {
        mean(&sync)
    };
    Ok((mean(&rates), mean(&work), sync))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bucket_timeline_is_found_in_a_runs_summary() {
        let summary = "finished: 30 optimizer steps\n\
                       bucket timeline of the last step on rank 0 (ms): backward done at 9.0\n\
                       \x20 bucket 0: 0.04 MB, queued at 8.1, summed 8.1-8.3\n\
                       \x20 bucket 1: 2.10 MB, queued at 8.9, summed 8.9-25.0\n\
                       done\n";
        let timeline = timeline_of(summary);
        assert!(
            timeline.starts_with("bucket timeline of the last step"),
            "{timeline}"
        );
        assert_eq!(timeline.lines().count(), 3, "{timeline}");
        assert!(timeline.ends_with("8.9-25.0\n"), "{timeline}");
        assert_eq!(timeline_of("finished: 30 optimizer steps\n"), "");
    }

    #[test]
    fn metrics_skip_the_warm_up_and_sum_the_local_phases() {
        let rec = |rate: f64, compute: f64| {
            format!(
                r#"{{"kind":"train","samples_per_sec":{rate},"time":{{"data":{{"median":0.001}},"compute":{{"median":{compute}}},"sync":{{"median":0.05}},"optimizer":{{"median":0.002}}}}}}"#
            )
        };
        let text = [
            rec(10.0, 0.5),
            rec(100.0, 0.010),
            r#"{"kind":"valid","samples_per_sec":5}"#.to_string(),
            rec(200.0, 0.020),
        ]
        .join("\n");
        let (rate, work, sync) = parse_metrics(&text).unwrap();
        assert_eq!(rate, 150.0);
        assert!((work - 0.018).abs() < 1e-12, "{work}");
        assert_eq!(sync, 0.05);
        assert!(parse_metrics(&rec(1.0, 1.0)).is_err());
    }
}
