//! Tools beside training, on the same binary.
//!
//! | module | owns |
//! |---|---|
//! | `doctor` | `trainer doctor`: can this machine and config run a job, and what to fix |
//! | `collectives` | the collectives self-test and the all-reduce benchmark (nccl-tests' format) |
//! | `bench` | the engine's overhead and scaling benchmark, ZeRO stages and peak memory |
//! | `bench_link` | training between network namespaces on a shaped link, against the link's bounds |

pub(crate) mod bench;
pub(crate) mod bench_link;
pub(crate) mod collectives;
pub(crate) mod doctor;
