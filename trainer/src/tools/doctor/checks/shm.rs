//! `/dev/shm` against the shared-memory ring. Every rank of a job of several ranks reserves one
//! ring file there per process group it forms (burn-ddp's list for the job's options, with
//! each ring's size: the job's 4 MiB + 4 KiB, or 256 KiB + 4 KiB at ZeRO stages 2 and 3, the
//! overlap's and stage 3's side groups 1 MiB + 4 KiB); a rank that cannot falls back to loopback TCP,
//! silently and slower, so too little room is a failure of what the job asked for.

use burn_ddp::ddp::options::groups::PlannedGroup;
use burn_ddp::group::shm;
use burn_ddp::DdpOptions;

use super::units::{plural, size};
use crate::finding::Finding;

/// Free and total bytes of a file system (`statvfs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsSpace {
    pub free: u64,
    pub total: u64,
}

/// The process groups a rank forms, each with a ring file of its own: burn-ddp's list for
/// the job's options ([`DdpOptions::process_groups`]), less synchronised BatchNorm's, which
/// only a model with that layer forms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingGroups(Vec<PlannedGroup>);

impl RingGroups {
    pub fn of(options: &DdpOptions) -> Self {
        let groups = options.process_groups();
        Self(groups.into_iter().filter(|g| !g.on_first_use).collect())
    }

    /// Each group's ring file: what it is, and its bytes.
    fn files(&self) -> Vec<(&'static str, usize)> {
        self.0
            .iter()
            .map(|g| (g.role.name(), shm::file_bytes(g.ring_bytes)))
            .collect()
    }
}

/// `/dev/shm` bytes one rank reserves: a ring file per process group.
pub fn shm_per_rank(groups: &RingGroups) -> u64 {
    groups.files().iter().map(|&(_, bytes)| bytes as u64).sum()
}

/// `/dev/shm` bytes that `local_ranks` ranks of a job of `world_size` need: one ring file per
/// rank and process group, none for a job of one.
pub fn shm_need(local_ranks: usize, world_size: usize, groups: &RingGroups) -> u64 {
    if world_size <= 1 {
        0
    } else {
        local_ranks as u64 * shm_per_rank(groups)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmFacts {
    /// Shared memory is on (`BURN_DDP_SHM` is not `0`).
    pub enabled: bool,
    pub local_ranks: usize,
    pub world_size: usize,
    /// The process groups each rank forms besides the job's.
    pub groups: RingGroups,
    /// `statvfs("/dev/shm")`, or why it failed.
    pub space: Result<FsSpace, String>,
}

const SHM_ADVICE: &str = "enlarge it (`mount -o remount,size=1G /dev/shm`; Docker: `--shm-size=1g` or `--ipc=host`; Kubernetes: an emptyDir with `medium: Memory` on /dev/shm), or set BURN_DDP_SHM=0 to use loopback TCP on purpose (slower)";

/// `/dev/shm` against what the shared-memory ring needs.
pub fn dev_shm(f: &ShmFacts) -> Finding {
    const CHECK: &str = "/dev/shm";
    let need = shm_need(f.local_ranks, f.world_size, &f.groups);
    if !f.enabled {
        return Finding::ok(
            CHECK,
            "not used: BURN_DDP_SHM=0 sends same-host ring data over loopback TCP",
        );
    }
    match &f.space {
        Err(e) if need == 0 => Finding::ok(
            CHECK,
            format!("cannot be read ({e}), but a job of one rank does not use it"),
        ),
        Err(e) => Finding::fail(
            CHECK,
            format!(
                "cannot be used ({e}): the ranks would fall back to loopback TCP, silently and slower"
            ),
            format!("mount a tmpfs on /dev/shm; {SHM_ADVICE}"),
        ),
        Ok(space) if need == 0 => Finding::ok(
            CHECK,
            format!(
                "{} free of {}; a job of one rank does not use the shared-memory ring",
                size(space.free),
                size(space.total)
            ),
        ),
        Ok(space) if space.free < need => Finding::fail(
            CHECK,
            format!(
                "{} free of {}, but the shared-memory ring needs {} for {} ({}): the ranks would fall back to loopback TCP, silently and slower",
                size(space.free),
                size(space.total),
                size(need),
                plural(f.local_ranks, "local rank"),
                match &f.groups.files()[..] {
                    [_] => format!("{} each", size(shm_per_rank(&f.groups))),
                    [(first, _), rest @ ..] => format!(
                        "{} a rank: a ring for each of {first}{}",
                        size(shm_per_rank(&f.groups)),
                        rest.iter()
                            .enumerate()
                            .map(|(i, (name, _))| {
                                let and = if i + 1 == rest.len() { " and " } else { ", " };
                                format!("{and}{name}")
                            })
                            .collect::<String>()
                    ),
                    [] => String::new(),
                }
            ),
            SHM_ADVICE,
        ),
        Ok(space) => Finding::ok(
            CHECK,
            format!(
                "{} free of {}; the shared-memory ring needs {} for {}",
                size(space.free),
                size(space.total),
                size(need),
                plural(f.local_ranks, "local rank")
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_ddp::ZeroStage;

    use crate::finding::Status;

    const MIB: u64 = 1 << 20;

    fn groups(overlap: bool, zero_stage: ZeroStage) -> RingGroups {
        RingGroups::of(
            &DdpOptions::default()
                .with_overlap(overlap)
                .with_zero_stage(zero_stage),
        )
    }

    fn shm_facts(free: u64, ranks: usize) -> ShmFacts {
        ShmFacts {
            enabled: true,
            local_ranks: ranks,
            world_size: ranks,
            groups: groups(false, ZeroStage::Off),
            space: Ok(FsSpace {
                free,
                total: free.max(64 << 10),
            }),
        }
    }

    #[test]
    fn dev_shm_must_hold_one_ring_file_per_local_rank() {
        let (stage_0, stage_3) = (ZeroStage::Off, ZeroStage::Parameters);
        assert_eq!(
            shm_need(2, 2, &groups(false, stage_0)),
            2 * (4 * MIB + 4096)
        );
        assert_eq!(
            shm_need(2, 2, &groups(false, ZeroStage::OptimizerState)),
            2 * (4 * MIB + 4096)
        );
        assert_eq!(
            shm_need(2, 2, &groups(true, ZeroStage::Gradients)),
            2 * (MIB / 4 + 4096 + MIB / 4 + 4096),
            "stage 2 gives the job group and the overlap's smaller rings"
        );
        assert_eq!(
            shm_need(1, 1, &groups(true, stage_3)),
            0,
            "a job of one has no ring"
        );
        assert_eq!(
            shm_need(1, 4, &groups(false, stage_0)),
            4 * MIB + 4096,
            "one rank here, others elsewhere"
        );
        assert_eq!(
            shm_need(2, 2, &groups(true, stage_0)),
            2 * (4 * MIB + 4096 + MIB + 4096),
            "the overlap's group has smaller rings of its own"
        );
        assert_eq!(
            shm_need(2, 2, &groups(false, stage_3)),
            2 * (MIB / 4 + 4096 + 2 * (MIB + 4096)),
            "ZeRO stage 3 forms two groups more, with smaller rings of their own"
        );
        assert_eq!(
            shm_need(2, 2, &groups(true, stage_3)),
            shm_need(2, 2, &groups(false, stage_3)),
            "stage 3's gradients go through its own groups: no overlap group"
        );
        for (groups, free, says) in [
            (
                groups(true, stage_3),
                4 * MIB,
                "for 2 local ranks (2.3 MiB a rank: a ring for each of the job group, ZeRO stage 3's gather group and ZeRO stage 3's prefetch group)",
            ),
            (
                groups(true, stage_0),
                9 * MIB,
                "needs 10.0 MiB for 2 local ranks (5.0 MiB a rank: a ring for each of the job group and the gradient overlap's group)",
            ),
        ] {
            let short = dev_shm(&ShmFacts {
                groups,
                ..shm_facts(free, 2)
            });
            assert_eq!(short.status, Status::Fail, "{}", short.detail);
            assert!(short.detail.contains(says), "{}", short.detail);
        }

        let tiny = dev_shm(&shm_facts(64 << 10, 2));
        assert_eq!(tiny.status, Status::Fail);
        assert!(tiny.detail.contains("64 KiB free"), "{}", tiny.detail);
        assert!(
            tiny.detail.contains("needs 8.0 MiB for 2 local ranks"),
            "{}",
            tiny.detail
        );
        assert!(tiny.advice.unwrap().contains("--shm-size"));

        assert_eq!(dev_shm(&shm_facts(64 * MIB, 2)).status, Status::Ok);
        assert_eq!(
            dev_shm(&shm_facts(0, 1)).status,
            Status::Ok,
            "one rank needs none"
        );
        let off = ShmFacts {
            enabled: false,
            ..shm_facts(0, 2)
        };
        assert_eq!(dev_shm(&off).status, Status::Ok);
        let missing = ShmFacts {
            space: Err("No such file or directory".into()),
            ..shm_facts(0, 2)
        };
        assert_eq!(dev_shm(&missing).status, Status::Fail);
    }
}
