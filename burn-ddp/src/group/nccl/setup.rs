//! Steps 3 and 4 of forming the group (module docs of [`super`]): the NCCL unique id from rank
//! 0 through the rendezvous, then the non-blocking communicator, polled until it is ready.

use std::ffi::c_char;
use std::time::Instant;

use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::fault::Fault;
use super::ffi::{nccl_error_text, nccl_state, nonblocking_config};
use super::group::NcclProcessGroup;
use super::shutdown::abort_comm;
use super::watchdog::{Clock, Waiting};
use crate::error::CollectiveError;
use crate::group::rendezvous::Rendezvous;

impl NcclProcessGroup {
    /// A set-up failure of this rank.
    fn setup_error(&self, message: String) -> CollectiveError {
        CollectiveError::Setup {
            rank: self.member.rank,
            message,
        }
    }

    /// Step 3 of the set-up: the rendezvous, then the unique id from rank 0 (module docs of
    /// [`super`]).
    pub(super) fn exchange_unique_id(
        &self,
        rdv: &Rendezvous,
    ) -> Result<nccl_sys::ncclUniqueId, CollectiveError> {
        rdv.join()?;
        rdv.wait_joined()?;
        if self.member.rank == 0 {
            let id = nccl::get_uniqueid().map_err(|e| {
                self.setup_error(format!("ncclGetUniqueId failed: {}", nccl_error_text(e.0)))
            })?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            rdv.publish("unique_id", &bytes)?;
            return Ok(id);
        }
        let value = rdv.published("unique_id", 0)?;
        let mut id = nccl_sys::ncclUniqueId { internal: [0; 128] };
        if value.len() != id.internal.len() {
            return Err(self.setup_error(format!(
                "the NCCL unique id under {:?} has {} bytes, expected {}: is another program using this store?",
                rdv.store().full_key("unique_id/0"),
                value.len(),
                id.internal.len()
            )));
        }
        for (dst, &src) in id.internal.iter_mut().zip(&value) {
            *dst = src as c_char;
        }
        Ok(id)
    }

    /// Step 4 of the set-up: non-blocking communicator init, polled until ready (module docs
    /// of [`super`]).
    pub(super) fn init_comm(
        &mut self,
        id: nccl_sys::ncclUniqueId,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let mut config = nonblocking_config();
        let mut comm: nccl_sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` are valid, writable locals for the whole call, and `config`
        // is initialised as NCCL_CONFIG_INITIALIZER would (see `nonblocking_config`). NCCL picks
        // the device from the calling thread's current context, which is this group's device
        // (bound in `form`). Rank and world size were checked to fit in an i32.
        let started = unsafe {
            nccl::comm_init_rank_config(
                &mut comm,
                self.member.world_size as i32,
                id,
                self.member.rank as i32,
                &mut config,
            )
        };
        if let Err(e) = started {
            let text = nccl_error_text(e.0);
            abort_comm(comm);
            return Err(self.setup_error(format!("ncclCommInitRankConfig failed: {text}")));
        }
        if comm.is_null() {
            return Err(self.setup_error("ncclCommInitRankConfig returned no communicator".into()));
        }
        let clock = Clock::until(deadline);
        match self.poll(&clock, Waiting::Init, || nccl_state(comm)) {
            Ok(()) => {
                self.comm = Some(comm);
                Ok(())
            }
            Err(fault) => {
                abort_comm(comm);
                Err(self.setup_error(match fault {
                    Fault::Timeout { waiting_on } => format!(
                        "NCCL communicator set-up timed out after {:?}: {waiting_on}",
                        self.options.timeout
                    ),
                    other => format!("NCCL communicator set-up failed: {}", other.describe()),
                }))
            }
        }
    }
}
