//! `cnn`: a small convolutional network for single-channel images.

use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{MaxPool2d, MaxPool2dConfig};
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig, PaddingConfig2d, Relu};
use burn::prelude::*;
use burn_ddp::mark_block;
use serde::Deserialize;

use crate::norm::Norm;
use crate::{check_dropout, CheckError, Classifier, InputShape, ModelOptions, ModelTask};

/// Options of the `cnn` model (keys of the `[model]` table).
///
/// ```toml
/// [model]
/// name = "cnn"
/// channels = [16, 32]   # output channels of the two 3x3 convolutions
/// hidden = 64           # width of the fully connected hidden layer
/// dropout = 0.1         # before each fully connected layer, training only
/// batch_norm = true     # BatchNorm after each convolution (running statistics: buffers)
/// sync_batch_norm = false  # true: its statistics over every rank's samples (SyncBatchNorm)
/// ```
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CnnOptions {
    /// Output channels of the first and second convolution. Default `[16, 32]`.
    pub channels: [usize; 2],
    /// Width of the fully connected hidden layer. Default `64`.
    pub hidden: usize,
    /// Dropout probability before each fully connected layer, `0 <= p < 1`;
    /// `0` (the default) adds no dropout layer.
    pub dropout: f64,
    /// A `BatchNorm` after each convolution, before its ReLU. Default `false`. Its running
    /// mean and variance are buffers: kept equal across ranks as
    /// `distributed.sync_buffers` says.
    pub batch_norm: bool,
    /// With `batch_norm`: normalise with the statistics of the global batch, every rank's
    /// samples (burn-ddp's `SyncBatchNorm`, PyTorch's `SyncBatchNorm`), instead of each rank's
    /// own. Default `false`. The same weights and record keys as plain BatchNorm; training
    /// then all-reduces per-channel statistics in every forward and backward.
    pub sync_batch_norm: bool,
}

impl Default for CnnOptions {
    fn default() -> Self {
        Self {
            channels: [16, 32],
            hidden: 64,
            dropout: 0.0,
            batch_norm: false,
            sync_batch_norm: false,
        }
    }
}

/// Side of the square max-pooling window (and its stride).
const POOL: usize = 2;

impl CnnOptions {
    /// Initialises a [`Cnn`] for the `input.image` shape on `device`, drawing
    /// the weights from the device's RNG (Burn's default Kaiming-uniform
    /// initialisation).
    ///
    /// # Panics
    ///
    /// If the options or the input do not pass [`ModelOptions::check`] (for
    /// example on non-image input); the registry always checks first.
    pub fn init(&self, input: &InputShape, device: &Device) -> Cnn {
        let Some((height, width)) = input.image else {
            panic!("CnnOptions::init needs image input, got {input:?} (call check first)");
        };
        let [c1, c2] = self.channels;
        let conv = |channels_in, channels_out| {
            Conv2dConfig::new([channels_in, channels_out], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(device)
        };
        let flat = c2 * (height / POOL) * (width / POOL);
        let dropout = (self.dropout > 0.0).then(|| DropoutConfig::new(self.dropout).init());
        let norm = |channels| {
            self.batch_norm
                .then(|| Norm::new(channels, self.sync_batch_norm, device))
        };
        Cnn {
            image: [height, width],
            conv1: conv(1, c1),
            conv2: conv(c1, c2),
            norm1: norm(c1),
            norm2: norm(c2),
            pool: MaxPool2dConfig::new([POOL, POOL]).init(),
            fc1: LinearConfig::new(flat, self.hidden).init(device),
            fc2: LinearConfig::new(self.hidden, input.classes).init(device),
            activation: Relu::new(),
            dropout,
        }
    }
}

impl ModelOptions for CnnOptions {
    fn check(&self, input: &InputShape) -> Result<(), CheckError> {
        let Some((height, width)) = input.image else {
            return Err(CheckError::input(format!(
                "it needs single-channel image data (an image shape height x width), \
                 but got flat data with {} features and no image shape",
                input.features
            )));
        };
        if height < POOL || width < POOL {
            return Err(CheckError::input(format!(
                "it needs images of at least {POOL}x{POOL} pixels for its {POOL}x{POOL} max \
                 pooling, but got {height}x{width}"
            )));
        }
        if let Some(index) = self.channels.iter().position(|&c| c == 0) {
            return Err(CheckError::option(
                "channels",
                format!("channel counts must be positive, found 0 at index {index}"),
            ));
        }
        if self.hidden == 0 {
            return Err(CheckError::option(
                "hidden",
                "the hidden layer width must be positive, found 0",
            ));
        }
        if self.sync_batch_norm && !self.batch_norm {
            return Err(CheckError::option(
                "sync_batch_norm",
                "sync_batch_norm = true synchronises the BatchNorm layers, which need batch_norm = true",
            ));
        }
        check_dropout(self.dropout)
    }

    fn build<T: ModelTask>(&self, input: &InputShape, device: &Device, task: T) -> T::Output {
        task.run(self.init(input, device))
    }
}

/// Small CNN for single-channel images given as flat row-major features:
///
/// `[batch, h*w] -> [batch, 1, h, w] -> Conv2d(3x3, same) [-> BatchNorm] -> ReLU
///  -> Conv2d(3x3, same) [-> BatchNorm] -> ReLU -> MaxPool2d(2x2) -> flatten [-> Dropout]
///  -> Linear -> ReLU [-> Dropout] -> Linear`.
///
/// On the 8x8 digits the pooled map is `channels[1] x 4 x 4`. Built by
/// [`CnnOptions::init`]. Output logits `[batch, classes]`.
#[derive(Module, Debug)]
pub struct Cnn {
    /// `[height, width]` of the input images.
    image: [usize; 2],
    conv1: Conv2d,
    conv2: Conv2d,
    /// Present with `batch_norm = true` (synchronised with `sync_batch_norm = true`).
    norm1: Option<Norm>,
    norm2: Option<Norm>,
    pool: MaxPool2d,
    fc1: Linear,
    fc2: Linear,
    activation: Relu,
    /// Present when `dropout > 0`.
    dropout: Option<Dropout>,
}

impl Cnn {
    fn dropout<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match &self.dropout {
            Some(dropout) => dropout.forward(x),
            None => x,
        }
    }

    fn norm(norm: &Option<Norm>, x: Tensor<4>) -> Tensor<4> {
        match norm {
            Some(norm) => norm.forward(x),
            None => x,
        }
    }
}

impl Classifier for Cnn {
    fn forward(&self, inputs: Tensor<2>) -> Tensor<2> {
        let [batch, _features] = inputs.dims();
        let [height, width] = self.image;
        let x = inputs.reshape([batch, 1, height, width]);
        // The convolutions and the dense layers are blocks for gradient overlap (identities
        // outside it); the norms' few parameters are summed after backward.
        let x = mark_block(&x, &self.conv1).forward(x);
        let x = self.activation.forward(Self::norm(&self.norm1, x));
        let x = mark_block(&x, &self.conv2).forward(x);
        let x = self.activation.forward(Self::norm(&self.norm2, x));
        let x: Tensor<2> = self.pool.forward(x).flatten(1, 3);
        let x = self.dropout(x);
        let x = self
            .activation
            .forward(mark_block(&x, &self.fc1).forward(x));
        let x = self.dropout(x);
        mark_block(&x, &self.fc2).forward(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{autodiff_device, device, digits};

    #[test]
    fn forward_shape() {
        let device = device();
        let model = CnnOptions::default().init(&digits(), &device);
        let logits = model.forward(Tensor::zeros([3, 64], &device));
        assert_eq!(logits.dims(), [3, 10]);
    }

    #[test]
    fn forward_shape_autodiff_odd_image_with_dropout() {
        let device = autodiff_device();
        let options = CnnOptions {
            channels: [4, 6],
            hidden: 8,
            dropout: 0.25,
            batch_norm: true,
            sync_batch_norm: false,
        };
        let input = InputShape::image(5, 7, 3);
        options.check(&input).expect("valid");
        let model = options.init(&input, &device);
        let logits = model.forward(Tensor::ones([2, 35], &device));
        assert_eq!(logits.dims(), [2, 3]);
    }

    /// `sync_batch_norm` changes no record key: each variant's checkpoint loads into the other.
    #[test]
    fn sync_batch_norm_keeps_the_record() {
        let device = device();
        let input = digits();
        let options = |sync_batch_norm| CnnOptions {
            batch_norm: true,
            sync_batch_norm,
            ..CnnOptions::default()
        };
        let local = options(false).init(&input, &device);
        let sync = options(true)
            .init(&input, &device)
            .load_record(local.clone().into_record());
        let x = Tensor::random([2, 64], burn::tensor::Distribution::Default, &device);
        let diff = local
            .forward(x.clone())
            .sub(sync.clone().forward(x))
            .abs()
            .max()
            .into_scalar::<f32>();
        assert_eq!(diff, 0.0);
        let _ = options(false)
            .init(&input, &device)
            .load_record(sync.into_record());
    }

    #[test]
    fn parameter_count() {
        let model = CnnOptions::default().init(&digits(), &device());
        let conv1 = 16 * 9 + 16;
        let conv2 = 32 * 16 * 9 + 32;
        let fc1 = 32 * 4 * 4 * 64 + 64;
        let fc2 = 64 * 10 + 10;
        assert_eq!(model.num_params(), conv1 + conv2 + fc1 + fc2);
    }

    #[test]
    fn check_rejects_flat_and_tiny_images() {
        let options = CnnOptions::default();
        match options.check(&InputShape::flat(64, 10)) {
            Err(CheckError::Input(reason)) => {
                assert!(reason.contains("image"), "{reason}");
                assert!(reason.contains("64 features"), "{reason}");
            }
            other => panic!("expected an input error, got {other:?}"),
        }
        assert!(matches!(
            options.check(&InputShape::image(1, 8, 10)),
            Err(CheckError::Input(_))
        ));
    }

    #[test]
    fn check_rejects_bad_options() {
        let input = digits();
        let zero_channels = CnnOptions {
            channels: [0, 8],
            ..CnnOptions::default()
        };
        assert!(matches!(
            zero_channels.check(&input),
            Err(CheckError::Option {
                field: "channels",
                ..
            })
        ));
        let sync_without_batch_norm = CnnOptions {
            sync_batch_norm: true,
            ..CnnOptions::default()
        };
        assert!(matches!(
            sync_without_batch_norm.check(&input),
            Err(CheckError::Option {
                field: "sync_batch_norm",
                ..
            })
        ));
        let zero_hidden = CnnOptions {
            hidden: 0,
            ..CnnOptions::default()
        };
        assert!(matches!(
            zero_hidden.check(&input),
            Err(CheckError::Option {
                field: "hidden",
                ..
            })
        ));
    }
}
