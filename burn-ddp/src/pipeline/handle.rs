//! [`PipelineParallel`]: the handle a pipeline-parallel program holds — its place in the
//! stages × replicas grid, the links to its neighbouring stages, and the DDP step over the
//! replicas of its stage.

use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};

use super::layout::{LayoutError, PipelineLayout, StagePosition};
use super::link::{LinkError, StageLinks};
use super::schedule::PipelineSchedule;
use super::stage::{
    pipeline_forward, pipeline_step_with_outputs, PipelineStage, StageError, StepPlan,
};
use crate::data_parallel::{DataParallel, StepOutcome};
use crate::ddp::{DdpOptions, GradientCheck};
use crate::error::DdpError;
use crate::group::{ProcessGroup, TcpGroupOptions, TcpProcessGroup};
use crate::init::Distributed;

/// How the model is pipelined: the same on every rank (checked when the links form).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineConfig {
    /// Stages the model is cut into; the world size must be a multiple.
    pub stages: usize,
    pub schedule: PipelineSchedule,
    /// Micro-batches per optimizer step (each replica's batch is cut into this many).
    pub micro_batches: usize,
}

impl PipelineConfig {
    /// The text every rank compares with its neighbours'.
    fn fingerprint(&self) -> String {
        format!(
            "pipeline_stages={} schedule={:?} micro_batches={}",
            self.stages, self.schedule, self.micro_batches
        )
    }
}

/// Why a pipeline could not form or step.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Stage(#[from] StageError),
    #[error(transparent)]
    Ddp(#[from] DdpError),
    #[error(
        "{micro_batches} micro-batches (with as many weights) were given, the pipeline was formed for {expected}"
    )]
    MicroBatches {
        micro_batches: usize,
        expected: usize,
    },
}

impl PipelineError {
    /// Whether this is an input to fix (exit code 2): a world size the stages do not divide,
    /// plans that differ between ranks, bad options.
    pub fn is_usage(&self) -> bool {
        match self {
            Self::Layout(_) | Self::MicroBatches { .. } => true,
            Self::Link(LinkError::PlanMismatch { .. }) => true,
            Self::Ddp(e) => e.is_usage(),
            _ => false,
        }
    }
}

/// What [`PipelineParallel::step`] gives back.
#[must_use = "a skipped step is the caller's to report or stop on"]
pub struct StageStep<S> {
    /// The stage after the step (stepped, or as it was when skipped).
    pub stage: S,
    /// Applied, or skipped on every rank of the job, naming the job's ranks whose gradients
    /// were not finite.
    pub outcome: StepOutcome,
    /// On the last stage, the mean of the micro-batches' losses; `None` elsewhere.
    pub loss: Option<f64>,
}

/// One rank's part of a pipeline-parallel job (module docs).
pub struct PipelineParallel {
    config: PipelineConfig,
    position: StagePosition,
    layout: PipelineLayout,
    rank: usize,
    links: StageLinks,
    replicas: DataParallel,
    /// The whole job (on rank 0 it hosts the store the links and sub-groups use): dropped last.
    world: Distributed,
}

impl PipelineParallel {
    /// Joins the job the environment describes (as [`DataParallel::from_env`]) and forms the
    /// pipeline. Collective over every rank.
    pub fn from_env(
        config: PipelineConfig,
        options: DdpOptions,
        device: &Device,
    ) -> Result<Self, PipelineError> {
        let world = Distributed::from_env_or_standalone(options.tcp_options())?;
        Self::new(world, config, options, device)
    }

    /// Forms the pipeline over an already formed job: this rank's stage and replica, the
    /// links to its neighbouring stages (the config is compared with theirs), and the DDP
    /// step over its stage's replicas (a sub-group). Collective over every rank; bounded by
    /// `options.timeout`.
    pub fn new(
        world: Distributed,
        config: PipelineConfig,
        options: DdpOptions,
        device: &Device,
    ) -> Result<Self, PipelineError> {
        let rank = world.env.rank;
        let layout = PipelineLayout::new(world.env.world_size, config.stages)?;
        let position = layout.position(rank);
        let tcp = options.tcp_options();
        let ip = tcp
            .advertise_ip
            .or_else(|| world.group.options().advertise_ip)
            .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
        let namespace = format!("{}/pipeline", world.group.options().store_prefix);
        // The job's token (resolved by the world's group) greets the neighbours.
        let links_options = TcpGroupOptions {
            advertise_ip: Some(ip),
            timeout: tcp.timeout,
            ..world.group.options().clone()
        };
        let links = StageLinks::connect(
            world.store.clone(),
            &namespace,
            &layout,
            rank,
            &config.fingerprint(),
            &links_options,
        )?;
        let members = layout.replica_group(rank);
        let sub = world
            .sub_group(&members, &format!("pipeline-stage-{}", position.stage))
            .map_err(DdpError::from)?;
        let replicas = DataParallel::new(sub, options, device)?;
        Ok(Self {
            config,
            position,
            layout,
            rank,
            links,
            replicas,
            world,
        })
    }

    /// The stage this rank holds, `0..stages`.
    pub fn stage(&self) -> usize {
        self.position.stage
    }

    pub fn stages(&self) -> usize {
        self.config.stages
    }

    /// The pipeline replica this rank belongs to, `0..replicas`.
    pub fn replica(&self) -> usize {
        self.position.replica
    }

    pub fn replicas(&self) -> usize {
        self.layout.replicas()
    }

    /// The rank in the whole job.
    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn is_last_stage(&self) -> bool {
        self.position.stage + 1 == self.config.stages
    }

    /// The DDP handle over this stage's replicas (replica `r` is its rank `r`): `prepare` the
    /// stage module with it, and use its `sum`, `barrier`, `run_on_rank_zero` among them.
    pub fn replica_group(&mut self) -> &mut DataParallel {
        &mut self.replicas
    }

    /// One optimizer step of this rank's `stage` over `micro_batches` (this replica's share of
    /// the global batch, cut into `config.micro_batches` equal parts): the pipeline's forward
    /// and backward passes, the gradients averaged over the stage's replicas (ZeRO stage 1:
    /// reduced to their owners), the verdict on non-finite gradients agreed by **every rank of
    /// the job** (no stage may step while another skips: the stages would no longer be parts
    /// of one model), then `optimize(stage, grads)` (your optimizer), ZeRO's gather and the
    /// buffer rule over the replicas — the order of [`DataParallel::step`], which this
    /// extends. Collective over the whole pipeline.
    pub fn step<S, const D: usize>(
        &mut self,
        stage: S,
        micro_batches: &[S::Batch],
        device: &Device,
        optimize: impl FnOnce(S, GradientsParams) -> S,
    ) -> Result<StageStep<S>, PipelineError>
    where
        S: PipelineStage<D>,
    {
        if micro_batches.len() != self.config.micro_batches {
            return Err(PipelineError::MicroBatches {
                micro_batches: micro_batches.len(),
                expected: self.config.micro_batches,
            });
        }
        let m = micro_batches.len();
        let weights = vec![1.0 / m as f64; m];
        self.step_with_outputs(
            stage,
            micro_batches,
            &weights,
            device,
            |_, _, _| {},
            optimize,
        )
    }

    /// [`step`](Self::step) with micro-batches of unequal size (`weights[i]` is micro-batch
    /// `i`'s share of this replica's samples in the step; they sum to 1; there may be fewer
    /// micro-batches than configured, an epoch's short last step, the same number on every
    /// stage), and on the last stage `on_output(i, output, loss)` for each micro-batch `i`
    /// right after its forward pass: the stage's output and the micro-batch's own mean loss,
    /// detached — for metrics (accuracy and the like), as PyTorch's pipeline schedules return
    /// the last stage's outputs. `on_output` is not called on the other stages, nor for
    /// micro-batches of a step that fails. Collective over the whole pipeline.
    pub fn step_with_outputs<S, const D: usize>(
        &mut self,
        stage: S,
        micro_batches: &[S::Batch],
        weights: &[f64],
        device: &Device,
        on_output: impl FnMut(usize, Tensor<D>, Tensor<1>),
        optimize: impl FnOnce(S, GradientsParams) -> S,
    ) -> Result<StageStep<S>, PipelineError>
    where
        S: PipelineStage<D>,
    {
        let m = micro_batches.len();
        if m == 0 || m > self.config.micro_batches || weights.len() != m {
            return Err(PipelineError::MicroBatches {
                micro_batches: m,
                expected: self.config.micro_batches,
            });
        }
        let plan = StepPlan {
            stage: self.position.stage,
            stages: self.config.stages,
            schedule: self.config.schedule,
        };
        let result = pipeline_step_with_outputs(
            &stage,
            plan,
            micro_batches,
            weights,
            &mut self.links,
            device,
            on_output,
        )?;
        let world_size = self.config.stages * self.layout.replicas();
        let (replicas, world) = (&mut self.replicas, &mut self.world.group);
        let replica = replicas.rank();
        let agreed = |check: GradientCheck| -> Result<Vec<usize>, DdpError> {
            // Each rank says whether its own gradients were not finite; all hear every rank.
            let ours = f64::from(u8::from(check.nonfinite_ranks.contains(&replica)));
            let mut flags = vec![0.0; world_size];
            world.all_gather(&[ours], &mut flags)?;
            Ok((0..world_size).filter(|&r| flags[r] > 0.0).collect())
        };
        let (stage, outcome) = replicas.step_with_verdict(stage, result.grads, agreed, optimize)?;
        Ok(StageStep {
            stage,
            outcome,
            loss: result.loss,
        })
    }

    /// Forward passes only of `micro_batches` through the pipeline (validation, inference):
    /// on the last stage, `on_output(i, output)` for each micro-batch; the schedule does not
    /// matter (no backward). Pass the stage and device without autodiff
    /// (`stage.valid()`, `device.clone().inner()`). Collective over the pipeline: every
    /// stage passes the same number of micro-batches.
    pub fn forward<S, const D: usize>(
        &mut self,
        stage: &S,
        micro_batches: &[S::Batch],
        device: &Device,
        on_output: impl FnMut(usize, Tensor<D>),
    ) -> Result<(), PipelineError>
    where
        S: PipelineStage<D>,
    {
        let plan = StepPlan {
            stage: self.position.stage,
            stages: self.config.stages,
            schedule: self.config.schedule,
        };
        Ok(pipeline_forward(
            stage,
            plan,
            micro_batches,
            &mut self.links,
            device,
            on_output,
        )?)
    }

    /// The TCP process group of the whole job (every stage of every replica): for the few
    /// collectives a program needs across stages (agreeing on a checkpoint, a barrier before
    /// leaving, since rank 0 may host the store).
    pub fn world_group(&mut self) -> &mut TcpProcessGroup {
        &mut self.world.group
    }
}
