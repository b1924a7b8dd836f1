//! [`CommThread`]: the thread that sums gradient buckets while backward goes on — PyTorch's
//! reducer hands buckets to its process group's worker the same way.
//!
//! It owns a TCP process group of its own, formed beside the job's (under the store prefix
//! `…/overlap`), so that the job's group stays free for the engine's collectives and every
//! rank sums the buckets in one order, whatever the timing: buckets are queued in plan order
//! and summed one after the other, first in, first out.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::backend::tensor::FloatTensor;
use burn::backend::Dispatch;
use burn::tensor::Shape;

use crate::ddp::buckets::comm::{bucket_means, HostStaging};
use crate::ddp::buckets::finite::FiniteScan;
use crate::ddp::options::groups::ProcessGroupRole;
use crate::error::DdpError;
use crate::group::{TcpGroupOptions, TcpProcessGroup};
use crate::kernels::HalfFormat;
use crate::store::Store;

/// One bucket to average: [`bucket_means`]' arguments.
pub struct Job {
    pub grads: Vec<FloatTensor<Dispatch>>,
    pub shapes: Vec<Shape>,
    /// ZeRO stage 2: the rank that keeps each gradient's mean (`None`: every rank keeps all).
    pub owners: Option<Vec<usize>>,
    pub compression: Option<HalfFormat>,
    pub scale: f32,
    pub check_finite: bool,
    /// When it was queued (for the step's bucket timeline).
    pub queued: Instant,
}

/// A bucket averaged (or the error that aborted the group), with how long the thread was at it:
/// each gradient's mean, `None` for those another rank owns (ZeRO stage 2).
pub struct Done {
    pub result: Result<Vec<Option<FloatTensor<Dispatch>>>, DdpError>,
    pub nonfinite: bool,
    /// When it was queued, when the thread took it up and when it was done.
    pub queued: Instant,
    pub started: Instant,
    pub finished: Instant,
}

impl Done {
    /// How long the thread was at it.
    pub fn busy(&self) -> Duration {
        self.finished.duration_since(self.started)
    }
}

/// The communication thread of one rank (module docs).
pub struct CommThread {
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    handle: Option<JoinHandle<()>>,
    /// How long to wait for one bucket: the group's deadline, plus a margin for the thread to
    /// report it.
    deadline: Duration,
}

impl CommThread {
    /// Forms the overlap group and starts the thread. Collective: every rank calls it at the
    /// same point, with the job group's options (deadline: `options.timeout`; rings:
    /// [`ProcessGroupRole::Overlap`]).
    pub fn start(
        store: Arc<dyn Store>,
        rank: usize,
        world_size: usize,
        options: TcpGroupOptions,
    ) -> Result<Self, DdpError> {
        let options = ProcessGroupRole::Overlap.options(&options);
        let deadline = options.timeout + Duration::from_secs(30);
        let mut group = TcpProcessGroup::new(store, rank, world_size, options)?;
        let (jobs, inbox) = mpsc::channel::<Job>();
        let (outbox, done) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name(format!("ddp-overlap-{rank}"))
            .spawn(move || {
                for job in inbox {
                    let start = Instant::now();
                    let mut scan = FiniteScan::new(job.check_finite);
                    let result = bucket_means(
                        &mut HostStaging(&mut group),
                        job.grads,
                        &job.shapes,
                        job.owners.as_deref(),
                        job.compression,
                        job.scale,
                        &mut scan,
                    );
                    let done = Done {
                        result,
                        nonfinite: scan.found_nonfinite(),
                        queued: job.queued,
                        started: start,
                        finished: Instant::now(),
                    };
                    if outbox.send(done).is_err() {
                        return;
                    }
                }
            })
            .map_err(|e| DdpError::Overlap(format!("starting the communication thread: {e}")))?;
        Ok(Self {
            jobs: Some(jobs),
            done,
            handle: Some(handle),
            deadline,
        })
    }

    /// A handle that queues buckets (from the marker's backward).
    pub fn queue(&self) -> Option<Sender<Job>> {
        self.jobs.clone()
    }

    /// Queues one bucket.
    pub fn send(&self, job: Job) -> Result<(), DdpError> {
        self.jobs
            .as_ref()
            .and_then(|jobs| jobs.send(job).ok())
            .ok_or_else(|| DdpError::Overlap("the communication thread has stopped".into()))
    }

    /// The next bucket's result, in queue order; fails after the group's deadline (plus a
    /// margin) or when the thread has stopped.
    pub fn next(&self) -> Result<Done, DdpError> {
        self.done.recv_timeout(self.deadline).map_err(|e| match e {
            RecvTimeoutError::Timeout => DdpError::Overlap(format!(
                "no gradient bucket came back from the communication thread within {:?}",
                self.deadline
            )),
            RecvTimeoutError::Disconnected => {
                DdpError::Overlap("the communication thread has stopped".into())
            }
        })
    }
}

impl Drop for CommThread {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it has finished its bucket (each has the
        // group's deadline).
        self.jobs = None;
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}
