//! Which rank runs which pipeline stage, and which layers each stage holds (pure). The one
//! home of the two rules of a pipeline's shape: the stages divide the world
//! ([`PipelineLayout::new`]) and the model has a layer for every stage ([`check_layers`]).
//!
//! `world = stages × replicas`, and **a pipeline's stages are consecutive ranks**:
//! `rank = replica × stages + stage`. Stage neighbours are then adjacent ranks, on the same
//! machine whenever `--nproc-per-node` is a multiple of the stage count (activations cross
//! loopback, not the network), and the replicas of one stage, which average their
//! gradients with the DDP step, are `stages` ranks apart.

use thiserror::Error;

/// A world size, or a model, that cannot be cut into the asked number of stages.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    #[error("pipeline_stages = 0: a pipeline needs at least one stage")]
    NoStages,
    #[error(
        "the world size {world} is not a multiple of pipeline_stages = {stages}: every replica \
         of the pipeline needs all {stages} stages (use a world size of {stages} × replicas)"
    )]
    NotAMultiple { world: usize, stages: usize },
    #[error(
        "{layers} layers cannot be cut into {stages} pipeline stages: each stage needs at least \
         one layer"
    )]
    TooFewLayers { layers: usize, stages: usize },
}

/// The stages × replicas grid of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineLayout {
    stages: usize,
    replicas: usize,
}

/// Where one rank sits in the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagePosition {
    /// The stage this rank holds, `0..stages`.
    pub stage: usize,
    /// The pipeline replica this rank belongs to, `0..replicas`.
    pub replica: usize,
}

impl PipelineLayout {
    /// Whether `stages` can be a stage count: at least 1 (1 is plain data parallelism).
    pub fn check_stages(stages: usize) -> Result<(), LayoutError> {
        if stages == 0 {
            return Err(LayoutError::NoStages);
        }
        Ok(())
    }

    /// The layout of `world` ranks cut into `stages` stages: `world` must be a multiple of
    /// `stages` (every replica of the pipeline needs all of them).
    pub fn new(world: usize, stages: usize) -> Result<Self, LayoutError> {
        Self::check_stages(stages)?;
        if world == 0 || !world.is_multiple_of(stages) {
            return Err(LayoutError::NotAMultiple { world, stages });
        }
        Ok(Self {
            stages,
            replicas: world / stages,
        })
    }

    pub fn stages(&self) -> usize {
        self.stages
    }

    pub fn replicas(&self) -> usize {
        self.replicas
    }

    pub fn world_size(&self) -> usize {
        self.stages * self.replicas
    }

    /// Where `rank` sits. `rank` must be below the world size.
    pub fn position(&self, rank: usize) -> StagePosition {
        debug_assert!(rank < self.world_size());
        StagePosition {
            stage: rank % self.stages,
            replica: rank / self.stages,
        }
    }

    /// The rank holding `stage` of `replica`.
    pub fn rank_of(&self, position: StagePosition) -> usize {
        position.replica * self.stages + position.stage
    }

    /// The rank `rank` sends activations to (the next stage of its replica), if any.
    pub fn next_stage(&self, rank: usize) -> Option<usize> {
        let p = self.position(rank);
        (p.stage + 1 < self.stages).then(|| rank + 1)
    }

    /// The rank `rank` receives activations from (the previous stage of its replica), if any.
    pub fn previous_stage(&self, rank: usize) -> Option<usize> {
        let p = self.position(rank);
        (p.stage > 0).then(|| rank - 1)
    }

    /// The ranks that hold the same stage as `rank` (its data-parallel group), in replica
    /// order. Their gradients are averaged with the DDP step.
    pub fn replica_group(&self, rank: usize) -> Vec<usize> {
        let stage = self.position(rank).stage;
        (0..self.replicas)
            .map(|replica| self.rank_of(StagePosition { stage, replica }))
            .collect()
    }
}

/// Whether `layers` consecutive layers can be cut into `stages` stages as [`stage_layers`]
/// cuts them, every stage with at least one layer.
pub fn check_layers(layers: usize, stages: usize) -> Result<(), LayoutError> {
    PipelineLayout::check_stages(stages)?;
    if layers < stages {
        return Err(LayoutError::TooFewLayers { layers, stages });
    }
    Ok(())
}

/// The layers of stage `stage` when `layers` consecutive layers are cut into `stages` stages:
/// as equal as possible, the first `layers % stages` stages one layer more (a transformer's
/// blocks, a perceptron's hidden layers). Pure; a stage gets no layer when `layers < stages`
/// (what [`check_layers`] refuses).
pub fn stage_layers(layers: usize, stages: usize, stage: usize) -> std::ops::Range<usize> {
    let stages = stages.max(1);
    let (base, extra) = (layers / stages, layers % stages);
    let start = stage * base + stage.min(extra);
    let len = base + usize::from(stage < extra);
    start.min(layers)..(start + len).min(layers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_has_one_place_and_neighbours_are_its_pipelines() {
        let layout = PipelineLayout::new(6, 3).unwrap();
        assert_eq!((layout.stages(), layout.replicas()), (3, 2));
        let mut seen = std::collections::BTreeSet::new();
        for rank in 0..6 {
            let p = layout.position(rank);
            assert_eq!(layout.rank_of(p), rank);
            assert!(seen.insert((p.stage, p.replica)));
            if let Some(next) = layout.next_stage(rank) {
                assert_eq!(layout.position(next).replica, p.replica);
                assert_eq!(layout.position(next).stage, p.stage + 1);
                assert_eq!(layout.previous_stage(next), Some(rank));
            } else {
                assert_eq!(p.stage, 2);
            }
        }
        assert_eq!(
            layout.previous_stage(3),
            None,
            "rank 3 is stage 0 of replica 1"
        );
        assert_eq!(layout.replica_group(4), vec![1, 4]);
        assert_eq!(layout.replica_group(2), vec![2, 5]);
    }

    #[test]
    fn a_world_that_does_not_divide_is_refused_naming_both_numbers() {
        let e = PipelineLayout::new(6, 4).unwrap_err();
        assert_eq!(
            e,
            LayoutError::NotAMultiple {
                world: 6,
                stages: 4
            }
        );
        assert!(e.to_string().contains("6") && e.to_string().contains("= 4"));
        assert_eq!(
            PipelineLayout::new(4, 0).unwrap_err(),
            LayoutError::NoStages
        );
        let one = PipelineLayout::new(3, 1).unwrap();
        assert_eq!((one.next_stage(1), one.previous_stage(1)), (None, None));
        assert_eq!(one.replica_group(1), vec![0, 1, 2]);
    }

    #[test]
    fn a_model_needs_a_layer_for_every_stage() {
        assert_eq!(check_layers(3, 3), Ok(()));
        assert_eq!(check_layers(7, 1), Ok(()));
        assert_eq!(
            check_layers(3, 4),
            Err(LayoutError::TooFewLayers {
                layers: 3,
                stages: 4
            })
        );
        assert_eq!(check_layers(3, 0), Err(LayoutError::NoStages));
        assert_eq!(PipelineLayout::check_stages(0), Err(LayoutError::NoStages));
        assert_eq!(PipelineLayout::check_stages(1), Ok(()));
        // Exactly where every stage of `stage_layers` is non-empty.
        for layers in 0..8 {
            for stages in 1..8 {
                let every_stage_has_one =
                    (0..stages).all(|s| !stage_layers(layers, stages, s).is_empty());
                assert_eq!(
                    check_layers(layers, stages).is_ok(),
                    every_stage_has_one,
                    "{layers} layers, {stages} stages"
                );
            }
        }
    }

    #[test]
    fn layers_are_cut_in_order_as_equal_as_possible() {
        let cut = |layers, stages| {
            (0..stages)
                .map(|s| stage_layers(layers, stages, s))
                .collect::<Vec<_>>()
        };
        assert_eq!(cut(4, 2), vec![0..2, 2..4]);
        assert_eq!(cut(5, 3), vec![0..2, 2..4, 4..5]);
        assert_eq!(cut(2, 3), vec![0..1, 1..2, 2..2]);
        for (layers, stages) in [(7, 3), (1, 1), (12, 5)] {
            let ranges = cut(layers, stages);
            assert_eq!(ranges.first().map(|r| r.start), Some(0));
            assert_eq!(ranges.last().map(|r| r.end), Some(layers));
            assert!(ranges.windows(2).all(|w| w[0].end == w[1].start));
        }
    }
}
