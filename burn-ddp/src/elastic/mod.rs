//! Elastic membership: a job that goes on when ranks leave or die, as torchft's replicas do,
//! instead of every rank restarting from a checkpoint (torchrun's model), and that grows again
//! when processes join it.
//!
//! | file | owns |
//! |---|---|
//! | [`survivors`] | pure: which ranks carry on after a failure and at which step, from what each survivor announced; the announcement and the decision as store values |
//! | [`agreement`] | the survivors' agreement through the job's rendezvous store: one rank decides, every survivor reads the same decision |
//! | [`admission`] | pure: a planned join (after which step, which requests) and each joiner's place, as store values |
//! | [`join`] | joining through the store: a process asks and waits; at each step boundary rank 0 plans the waiting requests' join and every member reads the plan |
//! | [`fencing`] | a rank the job left out is ended by its launcher: each generation records its processes' identities, the decision names the lost ones in the store |
//!
//! The re-formed groups themselves are [`DataParallel::regroup`](crate::DataParallel::regroup),
//! [`DataParallel::regroup_after_failure`](crate::DataParallel::regroup_after_failure)
//! (`data_parallel/regroup.rs`) and [`DataParallel::admit_joiners`](crate::DataParallel::admit_joiners)
//! (`data_parallel/admission.rs`), with the joiner's side
//! [`Distributed::join`](crate::Distributed::join) / [`Distributed::ask_to_join`](crate::Distributed::ask_to_join)
//! (`joining.rs`).

pub mod admission;
pub mod agreement;
pub mod fencing;
pub mod join;
pub mod survivors;

pub use admission::{Admission, Admitted, PlannedJoin};
pub use agreement::{agree_on_survivors, AgreementOptions};
pub use join::{JoinRequest, JoinWatch};
pub use survivors::{collective_failed_peers, failed_peers, Survivors};
