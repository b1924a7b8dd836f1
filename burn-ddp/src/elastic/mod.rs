//! Elastic membership: a job that goes on when ranks leave or die, as torchft's replicas do,
//! instead of every rank restarting from a checkpoint (torchrun's model).
//!
//! | file | owns |
//! |---|---|
//! | [`survivors`] | pure: which ranks carry on after a failure and at which step, from what each survivor announced; the announcement and the decision as store values |
//! | [`agreement`] | the survivors' agreement through the job's rendezvous store: one rank decides, every survivor reads the same decision |
//!
//! The re-formed groups themselves are [`DataParallel::regroup`](crate::DataParallel::regroup)
//! and [`DataParallel::regroup_after_failure`](crate::DataParallel::regroup_after_failure)
//! (`data_parallel/regroup.rs`).

pub mod agreement;
pub mod survivors;

pub use agreement::{agree_on_survivors, AgreementOptions};
pub use survivors::{collective_failed_peers, failed_peers, Survivors};
