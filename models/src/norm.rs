//! [`Norm`]: the CNN's BatchNorm layer, per-rank (Burn's `BatchNorm`) or synchronised across
//! the ranks (burn-ddp's `SyncBatchNorm`), with the same record either way.
//!
//! A derived enum module would put the variant's name in every record key
//! (`norm1.Local.gamma`); this one is transparent, so `norm1.gamma` names the same tensor
//! under both variants and checkpoints of either load into the other.

use burn::module::ModuleVisitor;
use burn::module::{Content, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper};
use burn::nn::{BatchNorm, BatchNormConfig};
use burn::tensor::{Device, Tensor};
use burn_ddp::ddp::{SyncBatchNorm, SyncBatchNormConfig};

/// One BatchNorm layer over `[batch, channels, h, w]`.
#[derive(Clone, Debug)]
pub enum Norm {
    /// Statistics of this rank's samples.
    Local(BatchNorm),
    /// Statistics of the global batch (collective in training mode: see `SyncBatchNorm`).
    Sync(SyncBatchNorm),
}

impl Norm {
    /// A layer over `channels` channels with Burn's default epsilon and momentum.
    pub fn new(channels: usize, sync: bool, device: &Device) -> Self {
        match sync {
            true => Self::Sync(SyncBatchNormConfig::new(channels).init(device)),
            false => Self::Local(BatchNormConfig::new(channels).init(device)),
        }
    }

    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        match self {
            Self::Local(norm) => norm.forward(x),
            Self::Sync(norm) => norm.forward(x),
        }
    }
}

/// Every method goes to the variant, without entering a module of its own (the module docs).
macro_rules! each {
    ($self:expr, $norm:ident => $body:expr) => {
        match $self {
            Norm::Local($norm) => $body,
            Norm::Sync($norm) => $body,
        }
    };
    ($self:expr, $norm:ident => wrap $body:expr) => {
        match $self {
            Norm::Local($norm) => Norm::Local($body),
            Norm::Sync($norm) => Norm::Sync($body),
        }
    };
}

impl Module for Norm {
    fn collect_devices(&self, devices: Vec<Device>) -> Vec<Device> {
        each!(self, norm => norm.collect_devices(devices))
    }

    fn fork(self, device: &Device) -> Self {
        each!(self, norm => wrap norm.fork(device))
    }

    fn to_device(self, device: &Device) -> Self {
        each!(self, norm => wrap norm.to_device(device))
    }

    fn train(self) -> Self {
        each!(self, norm => wrap norm.train())
    }

    fn valid(&self) -> Self {
        each!(self, norm => wrap norm.valid())
    }

    fn materialize(self) -> Self {
        each!(self, norm => wrap norm.materialize())
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        each!(self, norm => norm.visit(visitor))
    }

    fn map<M: ModuleMapper>(self, mapper: &mut M) -> Self {
        each!(self, norm => wrap norm.map(mapper))
    }
}

impl ModuleDisplayDefault for Norm {
    fn content(&self, content: Content) -> Option<Content> {
        each!(self, norm => content.add_single(norm).optional())
    }
}

impl ModuleDisplay for Norm {}
