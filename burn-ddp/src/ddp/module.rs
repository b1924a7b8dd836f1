//! Making replicas equal before training: deterministic parameter ids and a broadcast of the
//! initial values from rank 0 (what PyTorch's `DistributedDataParallel` constructor does).

use std::ops::Range;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use burn::tensor::{Bool, Int, TensorData};

use crate::error::DdpError;
use crate::group::ProcessGroup;
use crate::host_values::host_values;

/// Gives every parameter the id of its position in visit order, then copies `root`'s float
/// parameter values to every rank.
///
/// Collective (one broadcast when the world size is above 1). The model must have the same
/// architecture on every rank; a different parameter count shows up as a length mismatch
/// naming both ranks.
///
/// Why ids: Burn draws `ParamId`s at random per process, and optimizer state and gradients are
/// keyed by them. Ids from the visit order are the same on every rank and in every run, so a
/// checkpoint's optimizer state matches the model it is loaded into.
pub fn prepare_module<M: Module, G: ProcessGroup>(
    module: M,
    group: &mut G,
    root: usize,
) -> Result<M, DdpError> {
    let module = module.map(&mut AssignIds { next: 1 });
    if group.world_size() == 1 {
        return Ok(module);
    }
    let mut flat = Vec::new();
    read_floats(&module, &mut flat, in_order());
    group.broadcast(&mut flat, root)?;
    Ok(write_floats(module, &flat, in_order()))
}

/// The number of float parameter values of `model`, read from the shapes its parameters were
/// declared with. Burn initialises parameters lazily, so a model built but never used counts
/// its parameters without allocating them: what a memory pre-flight needs, which must not
/// allocate what it is about to refuse. Local; equal to Burn's `num_params` on a drawn model.
pub fn parameter_count<M: Module>(model: &M) -> u64 {
    struct Count(u64);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0 += param.lazy_shape().num_elements() as u64;
        }
    }
    let mut count = Count(0);
    model.visit(&mut count);
    count.0
}

/// A checksum of every float parameter's bits, in visit order. Equal replicas have equal
/// checksums; compare them across ranks to detect drift.
pub fn param_checksum<M: Module>(module: &M) -> u64 {
    param_checksum_where(module, |_| true)
}

/// [`param_checksum`] of the float parameters `keep` selects. Local.
pub fn param_checksum_where<M: Module>(module: &M, keep: impl Fn(ParamId) -> bool) -> u64 {
    let mut values = Vec::new();
    let mut next = 0;
    read_floats(module, &mut values, |id, _, n| {
        if !keep(id) {
            return None;
        }
        let range = next..next + n;
        next += n;
        Some(range)
    });
    // A hash of the f32 bit patterns: cheap, order-sensitive, and exact (no float tolerance).
    let mut hash = crate::hash::Fnv1a64::new();
    for v in &values {
        hash.write(&v.to_bits().to_le_bytes());
    }
    hash.finish()
}

struct AssignIds {
    next: u64,
}

impl AssignIds {
    fn id(&mut self) -> ParamId {
        let id = ParamId::from(self.next);
        self.next += 1;
        id
    }
}

impl ModuleMapper for AssignIds {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (_, tensor, mapper) = param.consume();
        Param::from_mapped_value(self.id(), tensor, mapper)
    }
    fn map_int<const D: usize>(&mut self, param: Param<Tensor<D, Int>>) -> Param<Tensor<D, Int>> {
        let (_, tensor, mapper) = param.consume();
        Param::from_mapped_value(self.id(), tensor, mapper)
    }
    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<D, Bool>>,
    ) -> Param<Tensor<D, Bool>> {
        let (_, tensor, mapper) = param.consume();
        Param::from_mapped_value(self.id(), tensor, mapper)
    }
}

/// Where a float parameter's values go in a flat `f32` buffer: given its id, whether it is
/// trained (requires a gradient; buffers such as BatchNorm statistics do not) and its element
/// count, the range it takes, or `None` to leave it out.
pub(crate) trait FloatSlot: FnMut(ParamId, bool, usize) -> Option<Range<usize>> {}
impl<F: FnMut(ParamId, bool, usize) -> Option<Range<usize>>> FloatSlot for F {}

/// Every float parameter in visit order, one after the other.
pub(crate) fn in_order() -> impl FloatSlot {
    let mut next = 0;
    move |_, _, n| {
        let range = next..next + n;
        next += n;
        Some(range)
    }
}

/// Copies the values of the float parameters `slot` places into `flat` (as f32; `flat` grows
/// to fit). Local.
///
/// # Panics
/// When a parameter's data cannot be converted to f32 (a quantized parameter).
pub(crate) fn read_floats<M: Module>(module: &M, flat: &mut Vec<f32>, slot: impl FloatSlot) {
    module.visit(&mut ReadFloats { flat, slot });
}

/// Replaces the values of the float parameters `slot` places with their range of `flat`,
/// keeping each one's id, dtype and whether it requires a gradient. Local.
pub(crate) fn write_floats<M: Module>(module: M, flat: &[f32], slot: impl FloatSlot) -> M {
    module.map(&mut WriteFloats { flat, slot })
}

struct ReadFloats<'a, F> {
    flat: &'a mut Vec<f32>,
    slot: F,
}

impl<F: FloatSlot> ModuleVisitor for ReadFloats<'_, F> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        let n = value.shape().num_elements();
        let Some(range) = (self.slot)(param.id, value.is_require_grad(), n) else {
            return;
        };
        if self.flat.len() < range.end {
            self.flat.resize(range.end, 0.0);
        }
        if range.is_empty() {
            // Nothing to copy (and an empty tensor cannot be read back on every backend).
            return;
        }
        // Never skipped: a parameter left at zero here would be broadcast or gathered as zero.
        match host_values::<f32>(value.into_data()) {
            Ok(values) => self.flat[range].copy_from_slice(&values),
            Err(e) => panic!(
                "burn-ddp reads float parameters as f32; parameter {} cannot be ({e:?}): \
                 quantized parameters are not supported",
                param.id
            ),
        }
    }
}

struct WriteFloats<'a, F> {
    flat: &'a [f32],
    slot: F,
}

impl<F: FloatSlot> ModuleMapper for WriteFloats<'_, F> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.shape();
        let require_grad = tensor.is_require_grad();
        let range = (self.slot)(id, require_grad, shape.num_elements());
        let Some(values) = range.and_then(|r| self.flat.get(r)) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let data = TensorData::new(values.to_vec(), shape).convert_dtype(tensor.dtype());
        let fresh = Tensor::<D>::from_data(data, &tensor.device()).set_require_grad(require_grad);
        Param::from_mapped_value(id, fresh, mapper)
    }
}
