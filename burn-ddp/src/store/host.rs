//! [`StoreHost`]: who hosts the job's rendezvous store, and in which protocol — decided from
//! the launcher's variables alone (pure, so every rank decides the same).
//!
//! | variables | host | protocol |
//! |---|---|---|
//! | `BURN_DDP_USE_AGENT_STORE=1` | our launcher (`trainer --nproc-per-node`, node 0) | ours ([`super::TcpStore`]) |
//! | `BURN_DDP_USE_AGENT_STORE` set to anything else | rank 0 | ours |
//! | else `TORCHELASTIC_USE_AGENT_STORE=True` | torchrun's agent | PyTorch's c10d ([`super::C10dStore`]) |
//! | neither | rank 0 | ours |
//!
//! Our own variable wins, because our launcher sets it on every rank and says exactly who hosts
//! (a rank of ours may inherit torchrun's variables from an outer job). The value `True` is
//! compared as torch compares it (`os.environ[...] == str(True)`). Like torch's workers, every
//! rank then assumes the agent serves at `MASTER_ADDR:MASTER_PORT`, which torchrun exports with
//! the flag.

use crate::error::InitError;

/// Set to `1` by our launcher when it hosts a store of our protocol itself (see the module docs).
pub const AGENT_STORE_VAR: &str = "BURN_DDP_USE_AGENT_STORE";
/// Set to `True` by torchrun when its agent hosts a c10d `TCPStore` at `MASTER_ADDR:MASTER_PORT`.
pub const TORCH_AGENT_STORE_VAR: &str = "TORCHELASTIC_USE_AGENT_STORE";
/// torchrun's restart count: `0` for the first attempt, one more after each `--max-restarts`
/// restart.
pub const TORCH_RESTART_COUNT_VAR: &str = "TORCHELASTIC_RESTART_COUNT";

/// Who hosts the job's store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreHost {
    /// Rank 0 hosts a [`super::TcpStoreServer`] on `MASTER_PORT`.
    Rank0,
    /// The launcher hosts a [`super::TcpStoreServer`] at `MASTER_ADDR:MASTER_PORT`; no rank
    /// hosts.
    Launcher,
    /// torchrun's agent hosts a c10d `TCPStore` at `MASTER_ADDR:MASTER_PORT`; no rank hosts.
    /// The store outlives restarts, so each attempt keeps to its own namespace
    /// ([`StoreHost::namespace`]).
    TorchAgent { restart_count: u64 },
}

impl StoreHost {
    /// Decides from the launcher's variables; `lookup` reads one (`std::env::var(..).ok()`).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, InitError> {
        if let Some(ours) = lookup(AGENT_STORE_VAR).filter(|v| !v.trim().is_empty()) {
            return Ok(if ours.trim() == "1" {
                Self::Launcher
            } else {
                Self::Rank0
            });
        }
        if lookup(TORCH_AGENT_STORE_VAR).as_deref() != Some("True") {
            return Ok(Self::Rank0);
        }
        let restart_count = match lookup(TORCH_RESTART_COUNT_VAR) {
            None => 0,
            Some(v) => v.trim().parse().map_err(|e| InitError::Invalid {
                name: TORCH_RESTART_COUNT_VAR,
                value: v.clone(),
                reason: format!("not a restart count: {e}"),
            })?,
        };
        Ok(Self::TorchAgent { restart_count })
    }

    /// [`StoreHost::from_lookup`] on this process's environment.
    pub fn from_env() -> Result<Self, InitError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Whether rank 0 hosts the store (and binds `MASTER_PORT`).
    pub fn rank0_hosts(&self) -> bool {
        matches!(self, Self::Rank0)
    }

    /// The job's namespace in a store that outlives an attempt (a [`super::PrefixStore`]
    /// prefix), so a restarted attempt never reads the keys of the last one — as torch's own
    /// workers do. `None` where the store lives for one attempt only.
    pub fn namespace(&self) -> Option<String> {
        match self {
            Self::TorchAgent { restart_count } => Some(format!("burn-ddp/attempt-{restart_count}")),
            Self::Rank0 | Self::Launcher => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(vars: &[(&str, &str)]) -> Result<StoreHost, InitError> {
        StoreHost::from_lookup(|k| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn torchrun_agent_store_with_its_attempt() {
        let h = host(&[
            (TORCH_AGENT_STORE_VAR, "True"),
            (TORCH_RESTART_COUNT_VAR, "2"),
        ])
        .unwrap();
        assert_eq!(h, StoreHost::TorchAgent { restart_count: 2 });
        assert!(!h.rank0_hosts());
        assert_eq!(h.namespace().as_deref(), Some("burn-ddp/attempt-2"));
        assert_eq!(
            host(&[(TORCH_AGENT_STORE_VAR, "True")]).unwrap(),
            StoreHost::TorchAgent { restart_count: 0 }
        );
    }

    #[test]
    fn only_true_as_torch_writes_it_means_the_agent() {
        for v in ["False", "true", "1", ""] {
            assert_eq!(
                host(&[(TORCH_AGENT_STORE_VAR, v)]).unwrap(),
                StoreHost::Rank0,
                "{v}"
            );
        }
        assert_eq!(host(&[]).unwrap(), StoreHost::Rank0);
    }

    #[test]
    fn our_variable_wins() {
        let torch = (TORCH_AGENT_STORE_VAR, "True");
        assert_eq!(
            host(&[(AGENT_STORE_VAR, "1"), torch]).unwrap(),
            StoreHost::Launcher
        );
        assert_eq!(
            host(&[(AGENT_STORE_VAR, "0"), torch]).unwrap(),
            StoreHost::Rank0
        );
        assert_eq!(host(&[(AGENT_STORE_VAR, "1")]).unwrap().namespace(), None);
    }

    #[test]
    fn a_bad_restart_count_is_named() {
        let err = host(&[
            (TORCH_AGENT_STORE_VAR, "True"),
            (TORCH_RESTART_COUNT_VAR, "x"),
        ])
        .unwrap_err();
        assert!(err.to_string().contains(TORCH_RESTART_COUNT_VAR), "{err}");
    }
}
