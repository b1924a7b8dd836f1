//! [`SyncBatchNorm`]: BatchNorm whose batch statistics are those of the global batch — the
//! samples of every rank — as PyTorch's `torch.nn.SyncBatchNorm`.
//!
//! With plain BatchNorm each rank normalises with the mean and variance of its own samples, so
//! N ranks × b samples train a different model than 1 rank × N·b (and small per-rank batches
//! give noisy statistics). Here, in training mode:
//!
//! ```text
//! 1. per channel, this rank's Σx and sample count n_r      ─┐ one all-reduce (sum):
//!                                                            ├ Σ_ranks Σx, n = Σ_ranks n_r
//! 2. mean = Σx / n                                          ─┘
//! 3. per channel, this rank's Σ(x − mean)²                 ── one all-reduce (sum)
//! 4. var = Σ(x − mean)² / n   (biased, as Burn's BatchNorm normalises and keeps running stats)
//! 5. y = (x − mean) / sqrt(var + ε) · γ + β
//! ```
//! Both all-reduces are [`all_reduce_sum`], whose backward all-reduces the incoming gradient,
//! so the gradients are those of the global batch too (PyTorch's SyncBatchNorm all-reduces the
//! same two per-channel sums in its backward). Ranks may hold different numbers of samples (a
//! last, short batch): the counts are summed with the statistics.
//!
//! The running statistics are updated as Burn's `BatchNorm` updates them, with the global mean
//! and the global *biased* variance (Burn keeps no Bessel correction; PyTorch does), so 2 ranks
//! × b samples leave the running statistics of 1 rank × 2b.
//!
//! The statistics travel on the synchronised-BatchNorm group ([`super::sync_group`]), which a
//! [`DataParallel`](crate::DataParallel) of more than one rank installs. Without one (world size
//! 1, or no `DataParallel` at all) the layer is exactly Burn's `BatchNorm` — except in a process
//! that the launcher's variables make a rank of a job of several ranks while no `DataParallel` of
//! this build of burn-ddp is alive (two builds of burn-ddp in one program): training there stops
//! with an error naming the cause, rather than using this rank's statistics alone.
//!
//! ## Contract
//! - **Collective in training mode**: every forward in training mode and every backward over it
//!   must happen on every rank, in the same order (same model everywhere, forward and backward
//!   in step). Two all-reduces in the forward, two in the backward, each with the group's
//!   deadline. Training mode is decided as Burn's `BatchNorm` decides it: an autodiff device
//!   and a layer that is not frozen.
//! - **What must match across ranks**: the number of channels (and so the model).
//! - **Eval mode**: the running statistics, no collective.
//! - **On failure or timeout** of a collective: the layer goes on with this rank's local
//!   statistics, and the next `DataParallel::step` returns the error
//!   ([`DdpError::SyncBatchNorm`](crate::DdpError::SyncBatchNorm)); see [`super::sync_group`].
//! - **Records**: the same fields, names and types as `burn::nn::BatchNorm`, so their records
//!   (checkpoints) are interchangeable.

use burn::config::Config;
use burn::module::{Flag, Module, Param, RunningState};
use burn::nn::Initializer;
use burn::tensor::DType;
use burn::tensor::{Device, Tensor};

use crate::ddp::sync_batch_norm::all_reduce_op::all_reduce_sum;
use crate::ddp::sync_batch_norm::sync_group;

/// The configuration of a [`SyncBatchNorm`]: that of Burn's `BatchNormConfig`.
#[derive(Config, Debug)]
pub struct SyncBatchNormConfig {
    /// The number of features (channels). Must be greater than zero.
    pub num_features: usize,
    /// A finite, positive value added to the variance for numerical stability. Default: 1e-5
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// A finite momentum in `[0, 1]` for the running statistics. Default: 0.1
    #[config(default = 0.1)]
    pub momentum: f64,
}

/// Batch normalisation over the global batch of a data-parallel job (module docs). Input
/// `[batch_size, channels, ...]`; `Y = norm(X) * γ + β`.
#[derive(Module, Debug)]
pub struct SyncBatchNorm {
    /// The learnable weight gamma.
    pub gamma: Param<Tensor<1>>,
    /// The learnable weight beta.
    pub beta: Param<Tensor<1>>,
    /// Whether training behaviour is enabled for this layer (as Burn's `BatchNorm`).
    pub training: Param<Flag>,
    /// The running mean.
    pub running_mean: RunningState<Tensor<1>>,
    /// The running variance (biased, as Burn's `BatchNorm`).
    pub running_var: RunningState<Tensor<1>>,
    /// Momentum used to update the running statistics.
    pub momentum: f64,
    /// A value required for numerical stability.
    pub epsilon: f64,
}

impl SyncBatchNormConfig {
    /// A new layer: γ = 1, β = 0, running mean 0, running variance 1.
    ///
    /// # Panics
    /// As Burn's `BatchNormConfig::init`: if `num_features` is zero, `epsilon` is not finite
    /// and positive, or `momentum` is not finite and within `[0, 1]` (a configuration bug).
    pub fn init(&self, device: &Device) -> SyncBatchNorm {
        assert!(
            self.num_features > 0,
            "num_features must be greater than zero."
        );
        assert!(
            self.epsilon.is_finite() && self.epsilon > 0.0,
            "epsilon must be finite and positive."
        );
        assert!(
            self.momentum.is_finite() && (0.0..=1.0).contains(&self.momentum),
            "momentum must be finite and within [0, 1]."
        );
        SyncBatchNorm {
            gamma: Initializer::Ones.init([self.num_features], device),
            beta: Initializer::Zeros.init([self.num_features], device),
            training: Param::from_bool(true),
            running_mean: RunningState::new(Tensor::zeros([self.num_features], device)),
            running_var: RunningState::new(Tensor::ones([self.num_features], device)),
            momentum: self.momentum,
            epsilon: self.epsilon,
        }
    }
}

impl SyncBatchNorm {
    /// Normalises `input` (`[batch_size, num_features, ...]`, rank ≥ 2) with the global batch's
    /// statistics in training mode, the running statistics in eval mode (module docs: this is
    /// collective in training mode).
    ///
    /// # Panics
    /// If the input has rank < 2 or its second axis is not `num_features` (a model bug, as in
    /// Burn's `BatchNorm`). In training mode, if this process is a rank of a job of more than
    /// one rank (the launcher's variables say so) but no `DataParallel` of this build of
    /// burn-ddp is alive, so there is no group to sum the statistics over (two builds of
    /// burn-ddp in one program; see [`super::sync_group`]).
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let [num_features] = self.gamma.shape().dims();
        let dims = input.dims();
        assert!(
            D >= 2 && dims[1] == num_features,
            "SyncBatchNorm expects input [batch, {num_features}, ...], got {dims:?}"
        );
        // The same rule as Burn's BatchNorm: a frozen layer on the training device keeps its
        // running statistics and takes no part in the backward.
        match input.device().is_autodiff() && self.training.is_enabled() {
            true if sync_group::is_active() => self.forward_global(input),
            true => {
                sync_group::check_local_statistics();
                self.forward_local(input)
            }
            false => burn::tensor::module::batch_norm(
                input.clone(),
                self.gamma.val(),
                self.beta.val(),
                self.running_mean.value().to_device(&input.device()),
                self.running_var.value().to_device(&input.device()),
                self.epsilon,
            ),
        }
    }

    /// Training without other ranks: exactly Burn's `BatchNorm`.
    fn forward_local<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let result = burn::tensor::module::batch_norm_train(
            input,
            self.gamma.val(),
            self.beta.val(),
            self.epsilon,
        );
        self.update_running(result.mean, result.variance);
        result.output
    }

    /// Training with the global batch's statistics (the numbered steps of the module docs).
    fn forward_global<const D: usize>(&self, input: Tensor<D>) -> Tensor<D> {
        let device = input.device();
        let dims = input.dims();
        let (batch, channels) = (dims[0], dims[1]);
        let per_sample = dims[2..].iter().product::<usize>();
        let x = input.reshape([batch, channels, per_sample]);

        // 1–2. Σx and the count travel in one all-reduce: [Σx_0 .. Σx_{C-1}, n], in f32 (a
        // count of 100 352 samples is infinite in f16).
        let dtype = x.dtype();
        let local_sum: Tensor<1> = x.clone().sum_dims_squeeze(&[0, 2]).cast(DType::F32);
        let local_count =
            Tensor::<1>::full([1], (batch * per_sample) as f64, &device).cast(DType::F32);
        let sums = all_reduce_sum(Tensor::cat(vec![local_sum, local_count], 0));
        let count = sums.clone().slice(channels..channels + 1);
        let mean = sums.slice(0..channels).div(count.clone()).cast(dtype);
        let count = count.cast(dtype);

        // 3–4. The biased variance around the global mean.
        let centered = x.sub(mean.clone().reshape([1, channels, 1]));
        let local_squares: Tensor<1> = centered.clone().square().sum_dims_squeeze(&[0, 2]);
        let variance = all_reduce_sum(local_squares).div(count);

        // 5.
        let inv_std = variance.clone().add_scalar(self.epsilon).sqrt().recip();
        let output = centered
            .mul(inv_std.reshape([1, channels, 1]))
            .mul(self.gamma.val().reshape([1, channels, 1]))
            .add(self.beta.val().reshape([1, channels, 1]));

        self.update_running(mean, variance);
        output.reshape(dims)
    }

    /// Burn's `BatchNorm` rule: `running ← (1 − momentum)·running + momentum·batch`.
    fn update_running(&self, mean: Tensor<1>, variance: Tensor<1>) {
        let device = mean.device();
        let update = |running: Tensor<1>, batch: Tensor<1>| {
            running
                .to_device(&device)
                .mul_scalar(1.0 - self.momentum)
                .add(batch.detach().mul_scalar(self.momentum))
                .detach()
        };
        self.running_mean
            .update(update(self.running_mean.value_sync(), mean));
        self.running_var
            .update(update(self.running_var.value_sync(), variance));
    }
}

#[cfg(test)]
mod tests {
    use burn::nn::{BatchNorm, BatchNormConfig};
    use burn::tensor::{Distribution, Tensor};

    use super::*;

    /// Without a group, SyncBatchNorm is Burn's BatchNorm: outputs, input gradients and running
    /// statistics in training mode, outputs in eval mode.
    #[test]
    fn without_a_group_it_is_burns_batch_norm() {
        // No other test's group may be installed meanwhile.
        let _alone = crate::ddp::sync_batch_norm::sync_group::TEST_LOCK
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let device = Device::flex().autodiff();
        let sync = SyncBatchNormConfig::new(3).init(&device);
        let plain = BatchNormConfig::new(3).init(&device);
        let input =
            Tensor::<4>::random([4, 3, 2, 2], Distribution::Default, &device).require_grad();

        let (ours, theirs) = (sync.forward(input.clone()), plain.forward(input.clone()));
        assert_eq!(values(ours.clone()), values(theirs.clone()));
        let (ours_grads, theirs_grads) = (ours.sum().backward(), theirs.sum().backward());
        let grad = |grads| input.grad(grads).map(values);
        assert_eq!(grad(&ours_grads), grad(&theirs_grads));
        assert_eq!(
            values(sync.running_var.value()),
            values(plain.running_var.value())
        );

        let (sync, plain) = (sync.valid(), plain.valid());
        let input = input.inner();
        assert_eq!(
            values(sync.forward(input.clone())),
            values(plain.forward(input))
        );
    }

    /// Checkpoints are interchangeable: a BatchNorm record loads into a SyncBatchNorm and back.
    #[test]
    fn records_are_burns_batch_norm_records() {
        let device = Device::flex();
        let gamma = Tensor::<1>::from_floats([2.0, 3.0], &device);
        let mut plain: BatchNorm = BatchNormConfig::new(2).init(&device);
        plain.gamma = Param::from_tensor(gamma.clone());
        let sync = SyncBatchNormConfig::new(2)
            .init(&device)
            .load_record(plain.clone().into_record());
        assert_eq!(values(sync.gamma.val()), values(gamma.clone()));
        let back = BatchNormConfig::new(2)
            .init(&device)
            .load_record(sync.into_record());
        assert_eq!(values(back.gamma.val()), values(gamma));
    }

    /// What a child process of the test below does: train `alone`, or with a `DataParallel`.
    const CHILD_MODE: &str = "BURN_DDP_TEST_SYNC_BATCH_NORM_CHILD";

    /// A rank of a job of two (as the launcher's variables say) whose `DataParallel` lives in
    /// another build of burn-ddp — here, nowhere — would silently train on this rank's
    /// statistics alone: its training forward stops, naming the cause. With a `DataParallel` of
    /// this build alive, of one rank (a pipeline stage without replicas), local statistics are
    /// right and it trains. Each case runs in a child process of this test binary, since the
    /// job is described by the process environment.
    #[test]
    fn in_a_job_of_several_training_needs_a_data_parallel_of_this_build() {
        if let Ok(mode) = std::env::var(CHILD_MODE) {
            return train_one_step_as_rank_1_of_2(&mode);
        }
        let run = |mode: &str| {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "ddp::sync_batch_norm::layer::tests::in_a_job_of_several_training_needs_a_data_parallel_of_this_build",
                    "--exact",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env_clear()
                .env(CHILD_MODE, mode)
                .env("RANK", "1")
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", "29500")
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            (out.status.success(), text)
        };
        let (trained, text) = run("alone");
        assert!(!trained, "trained on local statistics: {text}");
        assert!(
            text.contains("training on rank 1 of a job of 2 ranks, but no DataParallel of this build of burn-ddp is alive"),
            "{text}"
        );
        let (trained, text) = run("with a DataParallel of one rank");
        assert!(trained, "{text}");
    }

    /// The child's side of the test above: one training forward, with or without a
    /// `DataParallel` of this build alive.
    fn train_one_step_as_rank_1_of_2(mode: &str) {
        use crate::{DataParallel, DdpOptions, Distributed};

        let device = Device::flex().autodiff();
        let _ddp = (mode != "alone").then(|| {
            DataParallel::new(Distributed::standalone(), DdpOptions::default(), &device).unwrap()
        });
        let layer = SyncBatchNormConfig::new(2).init(&device);
        let output = layer.forward(Tensor::<2>::ones([4, 2], &device));
        assert_eq!(output.dims(), [4, 2]);
    }

    fn values<const D: usize>(tensor: Tensor<D>) -> Vec<f32> {
        tensor.into_data().try_to_vec().unwrap()
    }
}
