//! The memory pre-flight: refuse, before any rank allocates the model, a model that cannot fit
//! — with the numbers — instead of letting the allocator abort a rank mid-start.
//!
//! The estimate is a lower bound (parameters × 4 bytes × the copies every rank surely holds),
//! so a refusal is never wrong; activations and data come on top and are not guessed.

use burn_ddp::ZeroStage;

use crate::config::{OptimizerConfig, OptimizerName};
use crate::error::UsageError;
use crate::launcher::worker_env::MEMORY_AVAILABLE_VAR;

/// This process's peak resident memory so far (`VmHWM` in `/proc/self/status`), where the
/// system reports it (Linux); `None` elsewhere.
pub fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// What one rank holds per parameter, at least.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryEstimate {
    pub parameters: u64,
    /// Per-parameter `f32` tensors of optimizer state: 0 for plain SGD, 1 with momentum, 2
    /// for Adam / AdamW (first and second moments).
    pub optimizer_states: u64,
    /// The ZeRO stage, and the ranks it divides state among (1 at stage 0).
    pub stage: ZeroStage,
    pub state_shards: u64,
}

impl MemoryEstimate {
    pub fn new(parameters: u64, optimizer: &OptimizerConfig) -> Self {
        let optimizer_states = match optimizer.name {
            OptimizerName::Sgd if optimizer.momentum > 0.0 => 1,
            OptimizerName::Sgd => 0,
            OptimizerName::Adam | OptimizerName::AdamW => 2,
        };
        Self {
            parameters,
            optimizer_states,
            stage: ZeroStage::Off,
            state_shards: 1,
        }
    }

    /// With `distributed.zero_stage` on `world` ranks: stage 1 divides the optimizer state
    /// among the ranks, stage 2 the gradients too, stage 3 the weights too. A rank is counted
    /// with `1 / world` of what is divided, the average share (the rank with the most holds at
    /// least that, so the estimate stays a lower bound).
    pub fn with_zero_stage(mut self, stage: ZeroStage, world: usize) -> Self {
        self.stage = stage;
        self.state_shards = match stage {
            ZeroStage::Off => 1,
            _ => world.max(1) as u64,
        };
        self
    }

    /// `values` divided among the ranks the stage divides over.
    fn share(&self, values: u64) -> u64 {
        values.div_ceil(self.state_shards.max(1))
    }

    /// Bytes one rank needs at least: weights, gradients and the gradient bucket being
    /// averaged (three `f32` copies of the parameters), and the optimizer state; at stage 1
    /// its share of the state, at stage 2 the weights and its share of the gradients and
    /// state, at stage 3 its share of all three, and never less than the whole weights,
    /// which every rank builds once before it cuts its shards.
    pub fn per_rank_bytes(&self) -> u64 {
        // In f32 values, then bytes.
        let weights = self.parameters;
        let state = weights.saturating_mul(self.optimizer_states);
        let values = match self.stage {
            ZeroStage::Off => weights.saturating_mul(3).saturating_add(state),
            ZeroStage::OptimizerState => {
                weights.saturating_mul(3).saturating_add(self.share(state))
            }
            ZeroStage::Gradients => weights
                .saturating_add(self.share(weights))
                .saturating_add(self.share(state)),
            ZeroStage::Parameters => self
                .share(weights.saturating_mul(2).saturating_add(state))
                .max(weights),
        };
        values.saturating_mul(4)
    }

    /// What [`per_rank_bytes`](Self::per_rank_bytes) counts, in words.
    fn counted(&self) -> String {
        let state = match (self.optimizer_states, self.stage) {
            (0, _) => String::new(),
            (n, ZeroStage::Off) => format!(", + {n} of optimizer state"),
            (n, ZeroStage::Parameters) => format!(" and {n} of optimizer state"),
            (n, stage) => format!(
                ", + {n} of optimizer state divided among {} ranks (ZeRO stage {stage})",
                self.state_shards
            ),
        };
        match self.stage {
            ZeroStage::Off | ZeroStage::OptimizerState => format!(
                "parameters x 4 bytes x 3 copies: weights, gradients, the gradient bucket{state}"
            ),
            ZeroStage::Gradients => format!(
                "parameters x 4 bytes for the weights, + their gradients divided among the ranks (ZeRO stage 2){state}"
            ),
            ZeroStage::Parameters => format!(
                "parameters x 4 bytes for the weights and the gradients{state}, divided among {} ranks (ZeRO stage 3), and at least the whole weights once",
                self.state_shards
            ),
        }
    }

    /// Refuses when `ranks` ranks on this machine need more than `available` bytes (what
    /// `available_memory` found, and where).
    pub fn check(&self, ranks: usize, available: u64, source: &str) -> Result<(), UsageError> {
        let need = self.per_rank_bytes().saturating_mul(ranks as u64);
        if need <= available {
            return Ok(());
        }
        let per_rank = self.per_rank_bytes();
        let ranks_part = if ranks > 1 {
            format!(", and {ranks} ranks on this machine need {}", gib(need))
        } else {
            String::new()
        };
        Err(UsageError(format!(
            "the model does not fit in memory: {} parameters need at least {} per rank ({} bytes: {}){ranks_part}, but {} is available ({source}); make the model smaller in [model], or run fewer ranks per machine (--nproc-per-node){}",
            group_digits(self.parameters),
            gib(per_rank),
            group_digits(per_rank),
            self.counted(),
            gib(available),
            match self.stage {
                ZeroStage::Off => ", or divide the training state among the ranks ([distributed] zero_stage = 1 or 2, or zero_stage = 3 to divide the weights too), or cut the model into pipeline stages ([distributed] pipeline_stages)",
                ZeroStage::OptimizerState => ", or divide the gradients too ([distributed] zero_stage = 2) or the weights too (zero_stage = 3), or cut the model into pipeline stages ([distributed] pipeline_stages)",
                ZeroStage::Gradients => ", or divide the weights too ([distributed] zero_stage = 3), or cut the model into pipeline stages ([distributed] pipeline_stages)",
                ZeroStage::Parameters => ", or run more ranks, or cut the model into pipeline stages ([distributed] pipeline_stages)",
            },
        )))
    }
}

/// Memory this process may still use: the smaller of the kernel's `MemAvailable` and the
/// room left under a cgroup (v2) limit, with which one it was — or what
/// [`MEMORY_AVAILABLE_VAR`] says. `None` where none can be read (then the check is skipped).
pub fn available_memory() -> Option<(u64, &'static str)> {
    if let Some(bytes) = std::env::var(MEMORY_AVAILABLE_VAR)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        return Some((bytes, "TRAINER_MEMORY_AVAILABLE"));
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let available = meminfo.as_deref().and_then(mem_available);
    let cgroup = cgroup_room(
        std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok(),
        std::fs::read_to_string("/sys/fs/cgroup/memory.current").ok(),
    );
    match (available, cgroup) {
        (Some(a), Some(c)) if c < a => Some((c, "the cgroup's memory.max less memory.current")),
        (Some(a), _) => Some((a, "MemAvailable in /proc/meminfo")),
        (None, Some(c)) => Some((c, "the cgroup's memory.max less memory.current")),
        (None, None) => None,
    }
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Room under a cgroup v2 limit (`memory.max` is `max` when there is none).
fn cgroup_room(max: Option<String>, current: Option<String>) -> Option<u64> {
    let max: u64 = max?.trim().parse().ok()?;
    let current: u64 = current?.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// `1234567` as `1,234,567`.
fn group_digits(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn optimizer(name: &str, momentum: f64) -> OptimizerConfig {
        let mut o: OptimizerConfig = toml::from_str(&format!("name = \"{name}\"")).unwrap();
        o.momentum = momentum;
        o
    }

    #[test]
    fn copies_follow_the_optimizer() {
        let p = 1_000;
        assert_eq!(
            MemoryEstimate::new(p, &optimizer("sgd", 0.0)).per_rank_bytes(),
            12_000
        );
        assert_eq!(
            MemoryEstimate::new(p, &optimizer("sgd", 0.9)).per_rank_bytes(),
            16_000
        );
        assert_eq!(
            MemoryEstimate::new(p, &optimizer("adam", 0.0)).per_rank_bytes(),
            20_000
        );
        assert_eq!(
            MemoryEstimate::new(p, &optimizer("adamw", 0.0)).per_rank_bytes(),
            20_000
        );
    }

    #[test]
    fn zero_stage_1_divides_the_optimizer_state_among_the_ranks() {
        let adam = MemoryEstimate::new(1_000, &optimizer("adam", 0.0));
        assert_eq!(
            adam.with_zero_stage(ZeroStage::OptimizerState, 4)
                .per_rank_bytes(),
            12_000 + 2_000
        );
        assert_eq!(
            adam.with_zero_stage(ZeroStage::Off, 4).per_rank_bytes(),
            20_000
        );
        assert_eq!(
            adam.with_zero_stage(ZeroStage::OptimizerState, 1)
                .per_rank_bytes(),
            20_000
        );
        // 2,002 values of state on 3 ranks: at least 668 on the rank with the most.
        let odd = MemoryEstimate::new(1_001, &optimizer("adam", 0.0))
            .with_zero_stage(ZeroStage::OptimizerState, 3);
        assert_eq!(odd.per_rank_bytes(), 12_012 + 668 * 4);
        let err = MemoryEstimate::new(1_000_000_000, &optimizer("adam", 0.0))
            .check(1, 1 << 30, "test")
            .unwrap_err()
            .0;
        assert!(err.contains("2 of optimizer state"), "{err}");
        assert!(
            err.contains("zero_stage = 1"),
            "names ZeRO as a way out: {err}"
        );
        let err = MemoryEstimate::new(1_000_000_000, &optimizer("adam", 0.0))
            .with_zero_stage(ZeroStage::OptimizerState, 2)
            .check(1, 1 << 30, "test")
            .unwrap_err()
            .0;
        assert!(
            err.contains("divided among 2 ranks (ZeRO stage 1)"),
            "{err}"
        );
        assert!(err.contains("zero_stage = 2"), "{err}");
    }

    #[test]
    fn zero_stage_2_divides_the_gradients_too() {
        let adam = MemoryEstimate::new(1_000, &optimizer("adam", 0.0));
        // Weights 4,000 + own gradients 1,000 + own moments 2,000.
        assert_eq!(
            adam.with_zero_stage(ZeroStage::Gradients, 4)
                .per_rank_bytes(),
            4_000 + 1_000 + 2_000
        );
        let err = MemoryEstimate::new(1_000_000_000, &optimizer("adam", 0.0))
            .with_zero_stage(ZeroStage::Gradients, 2)
            .check(1, 1 << 30, "test")
            .unwrap_err()
            .0;
        assert!(err.contains("(ZeRO stage 2)"), "{err}");
        assert!(err.contains("zero_stage = 3"), "{err}");
    }

    #[test]
    fn zero_stage_3_divides_the_weights_too_but_counts_them_whole_once() {
        let adam = MemoryEstimate::new(1_000, &optimizer("adam", 0.0));
        // Weights 4,000, gradients 4,000 and moments 8,000, divided among 8 ranks: 2,000,
        // less than the whole weights every rank builds first.
        assert_eq!(
            adam.with_zero_stage(ZeroStage::Parameters, 8)
                .per_rank_bytes(),
            4_000
        );
        assert_eq!(
            adam.with_zero_stage(ZeroStage::Parameters, 2)
                .per_rank_bytes(),
            8_000
        );
        // Refused for one rank at stage 0 and at world 4 under stages 1 and 2, accepted
        // under stage 3.
        let big = MemoryEstimate::new(1_000_000, &optimizer("adam", 0.0));
        let available = 4 * 4_000_000 + 1;
        assert!(big.check(1, available, "test").is_err());
        for stage in [
            ZeroStage::Off,
            ZeroStage::OptimizerState,
            ZeroStage::Gradients,
        ] {
            let err = big
                .with_zero_stage(stage, 4)
                .check(4, available, "test")
                .unwrap_err()
                .0;
            assert!(err.contains("zero_stage = 3"), "{err}");
        }
        assert!(big
            .with_zero_stage(ZeroStage::Parameters, 4)
            .check(4, available, "test")
            .is_ok());
        let err = big
            .with_zero_stage(ZeroStage::Parameters, 4)
            .check(4, available / 2, "test")
            .unwrap_err()
            .0;
        assert!(
            err.contains("(ZeRO stage 3)") && err.contains("pipeline_stages"),
            "{err}"
        );
    }

    #[test]
    fn refusals_name_the_numbers_and_the_fix() {
        let e = MemoryEstimate::new(1_000_000_000, &optimizer("sgd", 0.0));
        assert!(e.check(1, 12_000_000_000, "test").is_ok());
        let err = e.check(2, 12_000_000_000, "MemAvailable").unwrap_err().0;
        assert!(err.contains("1,000,000,000 parameters"), "{err}");
        assert!(err.contains("12,000,000,000 bytes"), "{err}");
        assert!(
            err.contains("2 ranks on this machine need 22.4 GiB"),
            "{err}"
        );
        assert!(
            err.contains("11.2 GiB is available (MemAvailable)"),
            "{err}"
        );
        assert!(err.contains("--nproc-per-node"), "{err}");
    }

    #[test]
    fn available_memory_parsing() {
        let meminfo = "MemTotal:       24000000 kB\nMemFree: 1 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(mem_available(meminfo), Some(20_000_000 * 1024));
        assert_eq!(mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(cgroup_room(Some("max\n".into()), Some("5\n".into())), None);
        assert_eq!(
            cgroup_room(Some("100\n".into()), Some("30\n".into())),
            Some(70)
        );
        assert_eq!(group_digits(0), "0");
        assert_eq!(group_digits(999), "999");
        assert_eq!(group_digits(1000), "1,000");
        assert!(available_memory().is_some(), "Linux has /proc/meminfo");
    }
}
