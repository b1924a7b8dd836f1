//! Data-parallel training of an app, from the rank's start to its closing lines: [`start`]
//! joins the job (or, for a restarted rank, asks to join it), [`train`] runs the loop with the
//! data-parallel step kind ([`super::data_parallel_steps`]) and prints rank 0's summary.

use std::path::Path;
use std::process::ExitCode;

use anyhow::bail;
use burn::data::dataset::Dataset;
use burn::tensor::Device;
use burn_ddp::{DataParallel, DdpError, Distributed};

use super::data_parallel_steps::DataParallelSteps;
use super::sampler::EpochSampler;
use super::training_loop::{fit, Fitted, LoopSettings};
use crate::app::{App, AppConfig, AppError, Datasets};
use crate::engine::device::{pin_default_device, train_device};
use crate::engine::fault_injection;
use crate::engine::fit::rank_reporter::RankReporter;
use crate::engine::parallel;
use crate::engine::preflight::{preflight, Splitting};
use crate::engine::process_age::process_age_text;
use crate::launcher::worker_env::joining;
use crate::launcher::worker_env::world_size_bounds;

/// Everything one rank's training needs (steps 1 and 2 of the module docs of [`super`]): the
/// app, its config, the formed job, the data sets and the device; then [`train`] (data
/// parallel) or the program's pipeline split (pipeline stages) trains.
pub struct RankStart<A: App> {
    pub app: A,
    pub config: AppConfig<A>,
    pub dist: Distributed,
    pub data: Datasets<A::Item>,
    /// This rank's autodiff training device.
    pub device: Device,
    /// `--no-resume`: start over even where `checkpoint.resume` would resume.
    pub no_resume: bool,
    /// This rank joined a job that was training (the launcher restarted it): it starts from
    /// rank 0's state, handed over at its admission.
    pub joined: bool,
}

impl<A: App> RankStart<A> {
    /// The config tables the training loop reads.
    pub(crate) fn loop_settings(&self) -> LoopSettings {
        let ft = &self.config.fault_tolerance;
        LoopSettings {
            training: self.config.training.clone(),
            checkpoint: self.config.checkpoint.clone(),
            optimizer: self.config.optimizer.clone(),
            fault_tolerance: ft.clone(),
            survivors_continue: ft.survivors_continue(&self.config.distributed),
            joining: self.joined,
        }
    }
}

/// `--config FILE` as one rank (or the only process): the pre-flight (`splitting`: whether the
/// program gave a pipeline split), the data sets, the job (collective: every rank joins) and
/// the device.
pub fn start<A: App>(
    app: A,
    config_path: &Path,
    no_resume: bool,
    splitting: Splitting,
) -> anyhow::Result<RankStart<A>> {
    // Tests' faults, read once, before this rank joins the job.
    fault_injection::install();
    // This rank's share; the job's world size divides a ZeRO-sharded optimizer state.
    let world_size = burn_ddp::DistEnv::from_env().map_or(1, |env| env.world_size);
    let mut config = preflight(&app, config_path, 1, world_size, splitting)?;
    // A launcher's --nnodes MIN:MAX bounds the job's size within the config's.
    let (min, max) = world_size_bounds()?;
    config.fault_tolerance = config.fault_tolerance.clone().within(min, max);
    pin_default_device();
    let data = app.datasets(&config.data)?;
    if data.train.is_empty() {
        bail!(AppError(
            "data: the training set is empty (check the [data] table)".into()
        ));
    }
    let joined = joining();
    let dist = match joined {
        true => join_job::<A>(&config)?,
        false => Distributed::from_env_or_standalone(
            parallel::ddp_options(&config.distributed, &config.fault_tolerance).tcp_options(),
        )?,
    };
    // ZeRO stage 3 on a GPU trains with Burn's gradient checkpointing (burn-ddp's rule).
    let device = DataParallel::training_device(
        &parallel::ddp_options(&config.distributed, &config.fault_tolerance),
        train_device(config.output.device, dist.env.local_rank)?,
    );
    Ok(RankStart {
        app,
        config,
        dist,
        data,
        device,
        no_resume,
        joined,
    })
}

/// Whether `error` says that the job this process asked to join had ended (nothing to do:
/// not a failure).
pub fn job_ended(error: &anyhow::Error) -> bool {
    error
        .chain()
        .any(|c| matches!(c.downcast_ref::<DdpError>(), Some(DdpError::JobEnded)))
}

/// A joiner's exit when the job ended before it could join: success, said.
pub fn ended_before_joining() -> ExitCode {
    eprintln!("the job ended before this rank could join it: nothing left to train");
    ExitCode::SUCCESS
}

/// A rank that joins the job the environment describes while it trains: asks the job's store
/// to admit it and forms the grown group once it is (burn-ddp's `Distributed::ask_to_join` and
/// `PendingJoin::admitted`; at most `distributed.timeout_secs`).
fn join_job<A: App>(config: &AppConfig<A>) -> anyhow::Result<Distributed> {
    let env = burn_ddp::DistEnv::from_env()?;
    let options = parallel::ddp_options(&config.distributed, &config.fault_tolerance);
    tracing::info!(
        "rank {} joins the running job (restarted by its launcher)",
        env.rank
    );
    let pending = Distributed::ask_to_join(env, options.tcp_options(), &config.fingerprint())?;
    tracing::info!(
        "asked to join {} after this process started",
        process_age_text()
    );
    let (dist, admission) = pending.admitted()?;
    tracing::info!(
        "admitted after step {}: rank {} of {} ({} after this process started)",
        admission.step,
        admission.rank,
        admission.world,
        process_age_text()
    );
    Ok(dist)
}

/// Trains app `A` data-parallel as one rank of the formed job (steps 3 and 4 of the module
/// docs of [`super`]); rank 0 prints the closing lines. Collective.
pub fn train<A: App>(start: RankStart<A>) -> anyhow::Result<ExitCode> {
    let settings = start.loop_settings();
    let RankStart {
        app,
        config,
        dist,
        data,
        device,
        no_resume,
        joined,
    } = start;
    let mut ddp =
        parallel::data_parallel(dist, &config.distributed, &config.fault_tolerance, &device)?;
    if !joined {
        // A joiner's settings were checked by rank 0 as it admitted it.
        ddp.check_same(&config.fingerprint())?;
    }
    if settings.survivors_continue {
        // From now on a launcher whose node came back starts its ranks as joiners.
        ddp.open_to_joiners()?;
    }
    let (rank, world) = (ddp.rank(), ddp.world_size());
    device.seed(fault_injection::plan().init_seed(config.training.seed, rank));
    let model = app.model(&config.model, &config.data, &device)?;
    let sampler = EpochSampler::for_app(&app, &config.training, &*data.train, world, rank)?;
    let mut reporter = RankReporter::new(rank, &config.output);
    let mut steps = DataParallelSteps::new(app, config, ddp, data, device, no_resume);
    if config_restarts_instead::<A>(&steps.config) {
        tracing::warn!(
            "fault_tolerance.on_rank_failure = \"continue\" at ZeRO stage {}: a rank's shard of the training state is only whole in the checkpoint, so a failure restarts every rank from the newest checkpoint (the launcher's --max-restarts)",
            steps.config.distributed.zero_stage
        );
    }
    let summary = match fit(&mut steps, model, sampler, &settings, &mut reporter)? {
        Fitted::Done(_, summary) => summary,
        Fitted::Left { step } => {
            eprintln!("[rank {rank}] left the job after step {step}; the other ranks train on");
            if fault_injection::plan().join_after_step().is_none() {
                return Ok(ExitCode::SUCCESS);
            }
            // The scripted grow: this process joins again, as a restarted one would.
            let (app, config, ddp, data, device) = steps.into_parts();
            drop(ddp);
            return match join_job::<A>(&config) {
                Err(e) if job_ended(&e) => Ok(ended_before_joining()),
                dist => train(RankStart {
                    app,
                    config,
                    dist: dist?,
                    data,
                    device,
                    no_resume: true,
                    joined: true,
                }),
            };
        }
    };
    // The job may have re-formed: rank 0 is the new group's.
    let (rank, world) = (steps.ddp.rank(), steps.ddp.world_size());
    if rank == 0 {
        println!("{}", summary.line(world));
        if let Some(time) = &summary.time {
            println!("{time}");
        }
        if let Some(line) = overlap_line(&steps.ddp) {
            println!("{line}");
        }
        if let Some(timeline) = steps.ddp.overlap_timeline() {
            print!("{}", timeline_lines(timeline));
        }
        if let Some(comm) = steps.ddp.shard_comm() {
            println!(
                "ZeRO stage 3 on rank 0: {} blocks gathered ahead of their forward, {} gathered again for their backward, {} parameters gathered on the spot (their backward's recompute, validation), {} gradients reduce-scattered; at most {:.1} MiB of whole parameters held at once in a step",
                comm.prefetched_blocks(),
                comm.restored_blocks(),
                comm.gathers(),
                comm.reduce_scatters(),
                comm.gathered_bytes().training_peak() as f64 / (1 << 20) as f64
            );
        }
    }
    // Rank 0 may host the store: leave together.
    steps.ddp.barrier()?;
    Ok(ExitCode::SUCCESS)
}

/// Whether `[fault_tolerance]` asks the survivors to carry on where they cannot (ZeRO stages
/// 1 to 3): a failure then restarts every rank, as the warning says.
fn config_restarts_instead<A: App>(config: &AppConfig<A>) -> bool {
    config.fault_tolerance.on_rank_failure == crate::config::OnRankFailure::Continue
        && !config
            .fault_tolerance
            .survivors_continue(&config.distributed)
}

/// The summary's line on gradient overlap, for a run whose buckets followed marked blocks
/// (`None` otherwise): how much of the communication backward hid, on rank 0.
fn overlap_line(ddp: &DataParallel) -> Option<String> {
    let stats = ddp.overlap_stats();
    if stats.planned_steps == 0 {
        return None;
    }
    Some(if ddp.overlap_enabled() {
        // Queued during backward is not summed during it: on a machine whose cores backward
        // keeps busy, the thread may only get to the buckets after it. Both are said.
        format!(
            "gradient overlap: on; {} of {} buckets queued during backward; their communication took {:.2} s, {:.0}% of it under backward ({:.2} s waited for after backward)",
            stats.buckets_during_backward,
            stats.buckets,
            stats.communication.as_secs_f64(),
            100.0 * stats.hidden_fraction(),
            stats.exposed.as_secs_f64()
        )
    } else {
        format!(
            "gradient overlap: off (distributed.gradient_overlap = false); the marked blocks' {} buckets were summed after backward",
            stats.buckets
        )
    })
}

/// The first words of the summary's bucket timeline (`bench-link` finds it by them).
pub const TIMELINE_HEADING: &str = "bucket timeline";

/// The last overlapped step's buckets on rank 0, a line each: where an overlapped step's time
/// goes (the queue is first in, first out: a bucket starts when it is queued or when the one
/// before it is done, whichever is later).
fn timeline_lines(timeline: &burn_ddp::StepTimeline) -> String {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let mut out = format!(
        "{TIMELINE_HEADING} of the last step on rank 0 (ms after its forward began): backward done at {:.1}, every bucket summed at {:.1}\n",
        ms(timeline.sync_began),
        ms(timeline.all_done)
    );
    for (i, bucket) in timeline.buckets.iter().enumerate() {
        out.push_str(&format!(
            "  bucket {i}: {:.2} MB, queued at {:.1}, summed {:.1}-{:.1}\n",
            bucket.bytes as f64 / 1e6,
            ms(bucket.queued),
            ms(bucket.started),
            ms(bucket.finished)
        ));
    }
    out
}
