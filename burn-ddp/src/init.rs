//! Forming the job's process group from the environment: the equivalent of
//! `torch.distributed.init_process_group(backend, init_method="env://")`.

use std::net::{IpAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use crate::env::DistEnv;
use crate::error::{CollectiveError, DdpError, StoreError};
use crate::group::{TcpGroupOptions, TcpProcessGroup};
use crate::store::{
    C10dStore, MemoryStore, PrefixStore, Store, StoreHost, TcpStore, TcpStoreServer,
};

/// Environment variable with the job's token (the launcher generates one per job; on several
/// machines set the same value on every node). Peers without it are refused.
pub const TOKEN_VAR: &str = "BURN_DDP_TOKEN";
/// Set to `1` by a launcher that hosts a store of our protocol itself, so rank 0 does not (see
/// [`StoreHost`] for torchrun's agent store).
pub use crate::store::host::AGENT_STORE_VAR;

/// The key under which rank 0 shares the job token in torchrun's agent store.
const SHARED_TOKEN_KEY: &str = "token";

/// A formed group and the store it was formed through; rank 0 may also host the store server,
/// which lives as long as this value.
pub struct Distributed {
    pub env: DistEnv,
    pub group: TcpProcessGroup,
    /// The store as this group sees it (the job's, or a namespace of it for a sub-group or a
    /// later generation).
    pub store: Arc<dyn Store>,
    /// The job's store itself: where later generations of the job and joining ranks meet.
    pub(crate) root: Arc<dyn Store>,
    /// How many times the job re-formed its group (0: as it started); generation `g > 0`
    /// lives under `gen-{g}/` in the job's store.
    pub(crate) generation: u64,
    /// The join requests dealt with when this process joined the job (0 for a founding
    /// member): where its [`crate::elastic::JoinWatch`] starts.
    pub(crate) joins_handled: u64,
    /// The settings fingerprint this process joined with (a founding member's is checked by
    /// [`check_same`](Self::check_same) instead).
    pub(crate) fingerprint: Option<String>,
    /// A joiner's request, whose heartbeat beats for as long as this process is in the job
    /// (see [`crate::joining`]).
    pub(crate) _join_request: Option<crate::elastic::JoinRequest>,
    _server: Option<TcpStoreServer>,
}

/// The job's store as a rank connects to it, before it forms a group.
pub(crate) struct Connected {
    pub store: Arc<dyn Store>,
    pub server: Option<TcpStoreServer>,
    pub options: TcpGroupOptions,
}

impl Distributed {
    /// Hosts the store on rank 0 (unless a launcher does, see [`StoreHost`]), connects every
    /// rank to it, and forms the TCP ring. Collective: every rank of `env` calls it.
    /// `options.token` is taken from [`TOKEN_VAR`] when empty; `options.advertise_ip` defaults to
    /// the address this rank uses to reach the store; `options.shared_memory`, when `None`, is on
    /// unless [`crate::env::SHM_VAR`] is `0` (the one place the environment decides it).
    ///
    /// Under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`) every rank is a client of the
    /// agent's c10d `TCPStore` at `MASTER_ADDR:MASTER_PORT`, and the job's keys live under
    /// `burn-ddp/attempt-{TORCHELASTIC_RESTART_COUNT}/`, so a restarted attempt never reads the
    /// last one's. That store has no token: anyone who reaches the agent's port can use it, as
    /// with torch's own workers. Without a token of its own ([`TOKEN_VAR`], or a caller's), rank 0
    /// then draws a random one per attempt and shares it through the store, so the ring still
    /// refuses peers of other jobs and of earlier attempts.
    pub fn init(env: DistEnv, options: TcpGroupOptions) -> Result<Self, CollectiveError> {
        let Connected {
            store,
            server,
            options,
        } = Self::connect(&env, options, true)?;
        // Recorded before the group forms: a rank that freezes once it formed is fenced too.
        register_for_fencing(store.as_ref(), &env)?;
        let group = TcpProcessGroup::new(store.clone(), env.rank, env.world_size, options)?;
        Ok(Self {
            env,
            group,
            root: store.clone(),
            store,
            generation: 0,
            joins_handled: 0,
            fingerprint: None,
            _join_request: None,
            _server: server,
        })
    }

    /// The job's store, connected as [`init`](Self::init) connects to it (rank 0 hosting it
    /// when `may_host` and nobody else does), with the options completed (token, address).
    pub(crate) fn connect(
        env: &DistEnv,
        mut options: TcpGroupOptions,
        may_host: bool,
    ) -> Result<Connected, CollectiveError> {
        let setup = |message: String| CollectiveError::Setup {
            rank: env.rank,
            message,
        };
        let explicit_token =
            !options.token.is_empty() || std::env::var(TOKEN_VAR).is_ok_and(|t| !t.is_empty());
        if options.token.is_empty() {
            // Without a token of its own, the job is known by its launcher's identity (Slurm's
            // job and step, Open MPI's job), so another job on the same port is refused.
            options.token = std::env::var(TOKEN_VAR)
                .ok()
                .filter(|t| !t.is_empty())
                .or_else(|| env.launcher_job.clone())
                .unwrap_or_default();
        }
        for how in &env.derived {
            tracing::info!(rank = env.rank, "derived {how}");
        }
        if options.shared_memory.is_none() {
            options.shared_memory = Some(crate::env::shared_memory_from(|k| std::env::var(k).ok()));
        }
        let endpoint = env.master_endpoint();
        let host = StoreHost::from_env().map_err(|e| setup(e.to_string()))?;
        let store_error = |source| CollectiveError::Store {
            rank: env.rank,
            source,
        };
        let server = if may_host && env.rank == 0 && host.rank0_hosts() {
            // Listen on loopback when rank 0's address is a loopback one (every rank is local):
            // nothing outside this machine can reach the store then.
            let bind_ip = if is_loopback(&endpoint) {
                "127.0.0.1"
            } else {
                "0.0.0.0"
            };
            let bind = format!("{bind_ip}:{}", env.master_port);
            Some(TcpStoreServer::bind(&bind, &options.token).map_err(store_error)?)
        } else {
            None
        };
        let (store, local_ip): (Arc<dyn Store>, _) = match host.namespace() {
            Some(namespace) => {
                let c10d = C10dStore::connect(&endpoint, options.timeout).map_err(store_error)?;
                tracing::info!(
                    rank = env.rank,
                    "rendezvous through torchrun's agent store at {endpoint}, keys under {namespace}/"
                );
                let local_ip = c10d.local_ip();
                let store: Arc<dyn Store> = Arc::new(PrefixStore::new(namespace, Arc::new(c10d)));
                if !explicit_token {
                    options.token = share_token(store.as_ref(), env.rank, options.timeout)
                        .map_err(store_error)?;
                }
                (store, local_ip)
            }
            None => {
                let store = TcpStore::connect(&endpoint, &options.token, options.timeout)
                    .map_err(store_error)?;
                let local_ip = store.local_ip();
                (Arc::new(store), local_ip)
            }
        };
        if options.advertise_ip.is_none() {
            options.advertise_ip = local_ip;
        }
        if options.advertise_ip.is_none() {
            return Err(setup(format!(
                "cannot tell which local address reaches {endpoint}"
            )));
        }
        Ok(Connected {
            store,
            server,
            options,
        })
    }

    /// [`Distributed::init`] when a launcher's variables are present ([`DistEnv::is_present`]),
    /// else [`Distributed::standalone`]: a plain `trainer --config` run is a job of one.
    pub fn from_env_or_standalone(
        options: TcpGroupOptions,
    ) -> Result<Self, crate::error::DdpError> {
        if DistEnv::is_present() {
            let env = DistEnv::from_env()?;
            Ok(Self::init(env, options)?)
        } else {
            Ok(Self::standalone())
        }
    }

    /// A sub-group of this job: the ranks `members` (global ranks, listed in the sub-group's
    /// rank order) form their own TCP ring, with this group's options, through the job's store
    /// seen under the namespace `sub/{name}/` — so everything the sub-group's users keep in the
    /// store (a `DataParallel`'s settings and rank-0 verdicts, an NCCL group, synchronised
    /// BatchNorm's group) is its own. In the sub-group's [`DistEnv`] the rank is the position
    /// in `members` and the world size its length; the local rank (the GPU) is unchanged. Use
    /// it as the `Distributed` of a [`crate::DataParallel`] whose gradients are averaged over
    /// some ranks only (the replicas of one pipeline stage).
    ///
    /// Collective over `members` only; every member passes the same `members` and `name`, and
    /// `name` differs between sub-groups of the job. Fails, naming this rank, if it is not a
    /// member or `members` names a rank twice or one outside the job; a member that does not
    /// arrive within the timeout is named. Keep `self` alive while the sub-group is used: on
    /// rank 0 it hosts the store.
    pub fn sub_group(&self, members: &[usize], name: &str) -> Result<Self, CollectiveError> {
        let rank = self.env.rank;
        let setup = |message: String| CollectiveError::Setup { rank, message };
        let world = self.env.world_size;
        if let Some(bad) = members.iter().find(|&&m| m >= world) {
            return Err(setup(format!(
                "the sub-group {name:?} names rank {bad}, but the job has {world} ranks"
            )));
        }
        let mut seen = std::collections::BTreeSet::new();
        if let Some(twice) = members.iter().find(|&&m| !seen.insert(m)) {
            return Err(setup(format!(
                "the sub-group {name:?} names rank {twice} twice ({members:?})"
            )));
        }
        let sub_rank = members.iter().position(|&m| m == rank).ok_or_else(|| {
            setup(format!(
                "rank {rank} is not a member of the sub-group {name:?} ({members:?})"
            ))
        })?;
        let store: Arc<dyn Store> = Arc::new(PrefixStore::new(
            format!("sub/{name}"),
            Arc::clone(&self.store),
        ));
        let options = self.group.options().clone();
        let group = TcpProcessGroup::new(Arc::clone(&store), sub_rank, members.len(), options)?;
        let env = DistEnv {
            rank: sub_rank,
            world_size: members.len(),
            ..self.env.clone()
        };
        Ok(Self {
            env,
            group,
            store,
            root: Arc::clone(&self.root),
            generation: self.generation,
            joins_handled: 0,
            fingerprint: None,
            _join_request: None,
            _server: None,
        })
    }

    /// Re-forms this job as its next generation, in which this process is rank `rank` of
    /// `world`: after ranks left or died (the ranks that carry on, in their old order), or
    /// when ranks join (the members first, in their order, then the joiners, which call
    /// [`join`](Self::join)). The group forms through the job's store under `gen-{g}/`, so
    /// nothing of an earlier generation is read; it then takes this one's place, and the store
    /// server this rank may host moves along. The old group's connections close. On an error
    /// `self` keeps its group, but the generation's number is spent: a second attempt forms
    /// the next one. Collective over the new generation's ranks only; the deadline is
    /// the group's timeout.
    pub fn regroup(&mut self, rank: usize, world: usize) -> Result<(), CollectiveError> {
        // Spent even when forming fails: its namespace holds the failed attempt's keys, so a
        // second attempt forms the one after it.
        self.generation += 1;
        let env = DistEnv {
            rank,
            world_size: world,
            ..self.env.clone()
        };
        let mut next = Self::form_generation(
            env,
            Arc::clone(&self.root),
            self.group.options().clone(),
            self.generation,
        )?;
        next._server = self._server.take();
        next._join_request = self._join_request.take();
        *self = next;
        Ok(())
    }

    /// Generation `generation`'s namespace of `root`, the job's store (generation 0 is the
    /// store itself).
    pub(crate) fn generation_store(root: &Arc<dyn Store>, generation: u64) -> Arc<dyn Store> {
        match generation {
            0 => Arc::clone(root),
            g => Arc::new(PrefixStore::new(format!("gen-{g}"), Arc::clone(root))),
        }
    }

    /// Generation `generation` of the job through `root`, the job's store.
    pub(crate) fn form_generation(
        env: DistEnv,
        root: Arc<dyn Store>,
        options: TcpGroupOptions,
        generation: u64,
    ) -> Result<Self, CollectiveError> {
        let store = Self::generation_store(&root, generation);
        register_for_fencing(store.as_ref(), &env)?;
        let group = TcpProcessGroup::new(Arc::clone(&store), env.rank, env.world_size, options)?;
        Ok(Self {
            env,
            group,
            store,
            root,
            generation,
            joins_handled: 0,
            fingerprint: None,
            _join_request: None,
            _server: None,
        })
    }

    /// A job whose group was formed by the caller (the tests' in-process worlds).
    #[cfg(test)]
    pub(crate) fn from_group(env: DistEnv, group: TcpProcessGroup, store: Arc<dyn Store>) -> Self {
        Self {
            env,
            group,
            root: Arc::clone(&store),
            store,
            generation: 0,
            joins_handled: 0,
            fingerprint: None,
            _join_request: None,
            _server: None,
        }
    }

    /// Fails with [`DdpError::Mismatch`] unless `fingerprint` (of this rank's settings) is
    /// rank 0's, naming both ranks. Not a collective: each rank publishes its own; rank 0 reads
    /// every other rank's and the others read rank 0's, each waiting at most `timeout` for a
    /// rank that has not published yet. A job's first check: ranks started with different
    /// settings fail at once (rank 0 and the odd one) instead of in mismatched collectives.
    /// Rank 0, which may host the store, waits (at most `timeout`) for an odd rank to have
    /// read its fingerprint before it fails, so that the odd rank reports the mismatch too
    /// rather than a store that went away.
    pub fn check_same(&self, fingerprint: &str, timeout: Duration) -> Result<(), DdpError> {
        if self.env.world_size == 1 {
            return Ok(());
        }
        let rank = self.env.rank;
        self.store
            .set(&settings_key(rank), fingerprint.as_bytes())?;
        let others: Vec<usize> = match rank {
            0 => (1..self.env.world_size).collect(),
            _ => vec![0],
        };
        for other in others {
            let theirs = self.store.get(&settings_key(other), timeout)?;
            if rank != 0 {
                // Rank 0 may close the store as soon as it sees this (on a mismatch), before
                // the reply: this rank's outcome is its own comparison, whatever the set says.
                let _ = self.store.set(&settings_read_key(rank), b"");
            } else if theirs != fingerprint.as_bytes() {
                // Its error is the mismatch below, whether or not the odd rank says so in time.
                let _ = self.store.get(&settings_read_key(other), timeout);
            }
            if theirs != fingerprint.as_bytes() {
                let (zero, odd, odd_print) = match rank {
                    0 => (
                        fingerprint.to_owned(),
                        other,
                        String::from_utf8_lossy(&theirs).into_owned(),
                    ),
                    _ => (
                        String::from_utf8_lossy(&theirs).into_owned(),
                        rank,
                        fingerprint.to_owned(),
                    ),
                };
                return Err(DdpError::Mismatch(format!(
                    "rank {odd}'s config differs from rank 0's (fingerprint {odd_print} vs {zero}): every rank must train with the same settings"
                )));
            }
        }
        Ok(())
    }

    /// A job of one process: world size 1, an in-process store, no sockets.
    pub fn standalone() -> Self {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let env = DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            derived: Vec::new(),
            launcher_job: None,
            fence_id: None,
        };
        // World size 1 never touches the store or the network, so this cannot fail.
        let group = match TcpProcessGroup::new(store.clone(), 0, 1, TcpGroupOptions::default()) {
            Ok(g) => g,
            Err(e) => unreachable!("a group of one cannot fail to form: {e}"),
        };
        Self {
            env,
            group,
            root: Arc::clone(&store),
            store,
            generation: 0,
            joins_handled: 0,
            fingerprint: None,
            _join_request: None,
            _server: None,
        }
    }
}

/// Records this process's identity for fencing ([`crate::elastic::fencing`]) as rank
/// `env.rank` of the generation whose namespace is `generation`, when its launcher gave one.
fn register_for_fencing(generation: &dyn Store, env: &DistEnv) -> Result<(), CollectiveError> {
    let Some(identity) = &env.fence_id else {
        return Ok(());
    };
    crate::elastic::fencing::register(generation, env.rank, identity).map_err(|source| {
        CollectiveError::Store {
            rank: env.rank,
            source,
        }
    })
}

/// The job token of this torchrun attempt: rank 0 draws it and publishes it in the attempt's
/// namespace; the others read it, waiting up to `timeout` for rank 0.
fn share_token(store: &dyn Store, rank: usize, timeout: Duration) -> Result<String, StoreError> {
    if rank == 0 {
        let token = random_token();
        store.set(SHARED_TOKEN_KEY, token.as_bytes())?;
        Ok(token)
    } else {
        let token = store.get(SHARED_TOKEN_KEY, timeout)?;
        Ok(String::from_utf8_lossy(&token).into_owned())
    }
}

/// 128 random bits as hex, from the OS; without `/dev/urandom`, the pid and the clock, which
/// still tell concurrent jobs apart.
fn random_token() -> String {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if read.is_err() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        bytes = (nanos ^ (u128::from(std::process::id()) << 64)).to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `endpoint` resolves to loopback addresses only.
fn is_loopback(endpoint: &str) -> bool {
    match endpoint.to_socket_addrs() {
        Ok(addrs) => {
            let ips: Vec<IpAddr> = addrs.map(|a| a.ip()).collect();
            !ips.is_empty() && ips.iter().all(|ip| ip.is_loopback())
        }
        Err(_) => false,
    }
}

/// A default connect timeout for tools that only talk to the store.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Rendezvous-store key under which rank `rank` publishes its settings' fingerprint.
fn settings_key(rank: usize) -> String {
    format!("burn-ddp/settings/{rank}")
}

/// Set by rank `rank` once it has read rank 0's settings.
fn settings_read_key(rank: usize) -> String {
    format!("burn-ddp/settings-read/{rank}")
}

#[cfg(test)]
mod tests {
    use super::Distributed;

    #[test]
    fn a_sub_group_that_names_a_rank_twice_or_outside_the_job_is_refused() {
        let job = Distributed::standalone();
        let twice = job.sub_group(&[0, 0], "twice").err().map(|e| e.to_string());
        assert!(twice.is_some_and(|e| e.contains("names rank 0 twice")));
        let outside = job
            .sub_group(&[0, 1], "outside")
            .err()
            .map(|e| e.to_string());
        assert!(outside.is_some_and(|e| e.contains("names rank 1, but the job has 1 ranks")));
        let alone = job
            .sub_group(&[0], "alone")
            .map(|g| (g.env.rank, g.env.world_size));
        assert_eq!(alone.ok(), Some((0, 1)));
    }
}
