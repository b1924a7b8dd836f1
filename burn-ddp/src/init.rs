//! Forming the job's process group from the environment: the equivalent of
//! `torch.distributed.init_process_group(backend, init_method="env://")`.

use std::net::{IpAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use crate::env::DistEnv;
use crate::error::CollectiveError;
use crate::group::{TcpGroupOptions, TcpProcessGroup};
use crate::store::{MemoryStore, Store, TcpStore, TcpStoreServer};

/// Environment variable with the job's token (the launcher generates one per job; on several
/// machines set the same value on every node). Peers without it are refused.
pub const TOKEN_VAR: &str = "BURN_DDP_TOKEN";
/// Set by a launcher that hosts the store itself (torchrun's agent store), so rank 0 does not.
pub const AGENT_STORE_VAR: &str = "BURN_DDP_USE_AGENT_STORE";

/// A formed group and the store it was formed through; rank 0 may also host the store server,
/// which lives as long as this value.
pub struct Distributed {
    pub env: DistEnv,
    pub group: TcpProcessGroup,
    pub store: Arc<dyn Store>,
    _server: Option<TcpStoreServer>,
}

impl Distributed {
    /// Hosts the store on rank 0 (unless a launcher does), connects every rank to it, and forms
    /// the TCP ring. Collective: every rank of `env` calls it. `options.token` is taken from
    /// [`TOKEN_VAR`] when empty; `options.advertise_ip` defaults to the address this rank uses to
    /// reach the store; `options.shared_memory`, when `None`, is on unless
    /// [`crate::env::SHM_VAR`] is `0` (the one place the environment decides it).
    pub fn init(env: DistEnv, mut options: TcpGroupOptions) -> Result<Self, CollectiveError> {
        let setup = |message: String| CollectiveError::Setup {
            rank: env.rank,
            message,
        };
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
        let agent_store = std::env::var_os(AGENT_STORE_VAR).is_some_and(|v| v == "1");
        let server = if env.rank == 0 && !agent_store {
            // Listen on loopback when rank 0's address is a loopback one (every rank is local):
            // nothing outside this machine can reach the store then.
            let bind_ip = if is_loopback(&endpoint) {
                "127.0.0.1"
            } else {
                "0.0.0.0"
            };
            let bind = format!("{bind_ip}:{}", env.master_port);
            Some(
                TcpStoreServer::bind(&bind, &options.token).map_err(|source| {
                    CollectiveError::Store {
                        rank: env.rank,
                        source,
                    }
                })?,
            )
        } else {
            None
        };
        let store =
            TcpStore::connect(&endpoint, &options.token, options.timeout).map_err(|source| {
                CollectiveError::Store {
                    rank: env.rank,
                    source,
                }
            })?;
        if options.advertise_ip.is_none() {
            options.advertise_ip = store.local_ip();
        }
        let store = Arc::new(store);
        if options.advertise_ip.is_none() {
            return Err(setup(format!(
                "cannot tell which local address reaches {endpoint}"
            )));
        }
        let store: Arc<dyn Store> = store;
        let group = TcpProcessGroup::new(store.clone(), env.rank, env.world_size, options)?;
        Ok(Self {
            env,
            group,
            store,
            _server: server,
        })
    }

    /// [`Distributed::init`] when a launcher's variables are present ([`DistEnv::is_present`]),
    /// else [`Distributed::standalone`]: a plain `trainer --config` run is a job of one.
    pub fn from_env_or_standalone(options: TcpGroupOptions) -> Result<Self, crate::DdpError> {
        if DistEnv::is_present() {
            let env = DistEnv::from_env()?;
            Ok(Self::init(env, options)?)
        } else {
            Ok(Self::standalone())
        }
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
        };
        // World size 1 never touches the store or the network, so this cannot fail.
        let group = match TcpProcessGroup::new(store.clone(), 0, 1, TcpGroupOptions::default()) {
            Ok(g) => g,
            Err(e) => unreachable!("a group of one cannot fail to form: {e}"),
        };
        Self {
            env,
            group,
            store,
            _server: None,
        }
    }
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
