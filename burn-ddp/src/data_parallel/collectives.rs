//! What a rank of a data-parallel job does with the others beyond the DDP step: its share of
//! the samples, exact sums and gathers of metrics, the replica check, rank 0's actions and the
//! barrier. Every method marked collective has the job group's deadline.

use std::time::Duration;

use burn::module::Module;

use crate::data_parallel::handle::DataParallel;
use crate::data_parallel::rank_zero;
use crate::error::DdpError;
use crate::group::{ProcessGroup, ReduceOp};
use crate::sampler::DistributedSampler;

impl DataParallel {
    /// This rank's data-set indices for `epoch`: its share of one global permutation seeded by
    /// `seed + epoch`, padded so every rank gets as many (PyTorch's `DistributedSampler`).
    /// Local; `len` and `seed` must agree across ranks.
    pub fn shard(&self, len: usize, seed: u64, epoch: usize) -> Vec<usize> {
        DistributedSampler::new(len, self.world_size(), self.rank())
            .with_seed(seed)
            .indices(epoch as u64, 0)
    }

    /// Element-wise sums over the ranks (exact global metrics from per-rank sums and counts).
    /// Collective.
    pub fn sum<const N: usize>(&mut self, values: [f64; N]) -> Result<[f64; N], DdpError> {
        let mut v = values;
        self.dist.group.all_reduce(&mut v, ReduceOp::Sum)?;
        Ok(v)
    }

    /// Every rank's `values`, concatenated in rank order (`world_size × values.len()`).
    /// Collective; every rank passes the same number of values.
    pub fn all_gather(&mut self, values: &[f64]) -> Result<Vec<f64>, DdpError> {
        let mut all = vec![0.0; values.len() * self.world_size()];
        self.dist.group.all_gather(values, &mut all)?;
        Ok(all)
    }

    /// Fails with [`DdpError::ReplicaDrift`] when the replicas' parameters are not
    /// bit-identical, naming the first rank that differs from rank 0. Collective.
    /// At ZeRO stage 3 the shards differ by rank: the parameters held whole are compared.
    pub fn check_replicas<M: Module>(&mut self, model: &M, step: usize) -> Result<(), DdpError> {
        let ours = self.sharding.replica_checksum(model) as i64;
        let mut all = vec![0i64; self.world_size()];
        self.dist.group.all_gather(&[ours], &mut all)?;
        if let Some(r) = all.iter().position(|&c| c != all[0]) {
            return Err(DdpError::ReplicaDrift(format!(
                "replica drift at step {step}: rank {r}'s parameters (checksum {:016x}) differ from rank 0's ({:016x})",
                all[r] as u64,
                all[0] as u64
            )));
        }
        Ok(())
    }

    /// Rank 0 runs `action` (writing a checkpoint, a report) while the others wait for its
    /// verdict through the store, up to `timeout` (chosen by the caller, so a slow disk never
    /// trips the collectives' deadline). `key` names this occurrence; it must be the same on
    /// every rank and new for each call. Collective. Rank 0 beats a counter in the store while
    /// `action` runs, so the others know a dead rank 0 within the options' failure detection
    /// ([`DdpError::RankZeroGone`]), not at `timeout`.
    ///
    /// Returns rank 0's own result to rank 0 (`Ok(Err(e))` when `action` failed); the other
    /// ranks get `Ok(Ok(()))`, or [`DdpError::RankZeroFailed`] carrying rank 0's message.
    pub fn run_on_rank_zero<E: std::fmt::Display>(
        &mut self,
        what: &str,
        key: &str,
        timeout: Duration,
        action: impl FnOnce() -> Result<(), E>,
    ) -> Result<Result<(), E>, DdpError> {
        let key = format!("burn-ddp/rank-zero/{key}");
        let beat_key = format!("{key}/beat");
        let detection = self.options.failure_detection;
        if self.rank() == 0 {
            let result = match self.world_size() {
                1 => action(),
                _ => crate::store::heartbeat::beat_while(
                    self.dist.store.as_ref(),
                    &beat_key,
                    crate::store::heartbeat::beat_period(detection),
                    action,
                ),
            };
            if self.world_size() > 1 {
                let status = match &result {
                    Ok(()) => "ok".to_string(),
                    Err(e) => format!("{e:#}"),
                };
                self.dist.store.set(&key, status.as_bytes())?;
            }
            return Ok(result);
        }
        let status = rank_zero::wait_for_verdict(
            self.dist.store.as_ref(),
            (&key, &beat_key),
            what,
            timeout,
            detection,
        )?;
        if status != b"ok" {
            return Err(DdpError::RankZeroFailed {
                what: what.to_string(),
                message: String::from_utf8_lossy(&status).into_owned(),
            });
        }
        Ok(Ok(()))
    }

    /// Rank 0's `value` on every rank. Collective.
    pub fn broadcast_from_rank_zero(&mut self, value: i64) -> Result<i64, DdpError> {
        let mut v = [value];
        self.dist.group.broadcast(&mut v, 0)?;
        Ok(v[0])
    }

    /// Waits for every rank. Call it last: rank 0 may host the rendezvous store, so ranks
    /// leave together. Collective.
    pub fn barrier(&mut self) -> Result<(), DdpError> {
        Ok(self.dist.group.barrier()?)
    }
}
