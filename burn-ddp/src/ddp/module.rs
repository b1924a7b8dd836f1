//! Making replicas equal before training: deterministic parameter ids and a broadcast of the
//! initial values from rank 0 (what PyTorch's `DistributedDataParallel` constructor does).

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::prelude::*;
use burn::tensor::{Bool, Int, TensorData};

use crate::error::DdpError;
use crate::group::ProcessGroup;

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
pub fn prepare_module<B: Backend, M: Module<B>, G: ProcessGroup>(
    module: M,
    group: &mut G,
    root: usize,
) -> Result<M, DdpError> {
    let module = module.map(&mut AssignIds { next: 1 });
    if group.world_size() == 1 {
        return Ok(module);
    }
    let mut collector = FloatCollector::default();
    module.visit(&mut collector);
    let mut flat = collector.values;
    group.broadcast(&mut flat, root)?;
    let mut writer = FloatWriter {
        values: &flat,
        offset: 0,
    };
    let module = module.map(&mut writer);
    Ok(module)
}

/// A checksum of every float parameter's bits, in visit order. Equal replicas have equal
/// checksums; compare them across ranks to detect drift.
pub fn param_checksum<B: Backend, M: Module<B>>(module: &M) -> u64 {
    let mut collector = FloatCollector::default();
    module.visit(&mut collector);
    // FNV-1a over the f32 bit patterns: cheap, order-sensitive, and exact (no float tolerance).
    collector
        .values
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
            (h ^ v.to_bits() as u64).wrapping_mul(0x0000_0100_0000_01b3)
        })
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

impl<B: Backend> ModuleMapper<B> for AssignIds {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (_, tensor, mapper) = param.consume();
        Param::from_mapped_value(self.id(), tensor, mapper)
    }
    fn map_int<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Int>>,
    ) -> Param<Tensor<B, D, Int>> {
        let (_, tensor, mapper) = param.consume();
        Param::from_mapped_value(self.id(), tensor, mapper)
    }
    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Bool>>,
    ) -> Param<Tensor<B, D, Bool>> {
        let (_, tensor, mapper) = param.consume();
        Param::from_mapped_value(self.id(), tensor, mapper)
    }
}

/// Every float parameter's values as f32, concatenated in visit order.
#[derive(Default)]
struct FloatCollector {
    values: Vec<f32>,
}

impl<B: Backend> ModuleVisitor<B> for FloatCollector {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let data = param.val().into_data().convert::<f32>();
        // `convert::<f32>` makes the element type f32, so the slice view cannot fail.
        if let Ok(values) = data.as_slice::<f32>() {
            self.values.extend_from_slice(values);
        }
    }
}

/// Replaces every float parameter's values with the next slice of `values`.
struct FloatWriter<'a> {
    values: &'a [f32],
    offset: usize,
}

impl<B: Backend> ModuleMapper<B> for FloatWriter<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let shape = tensor.shape();
        let n = shape.num_elements();
        let require_grad = tensor.is_require_grad();
        let dtype = tensor.dtype();
        let data = TensorData::new(self.values[self.offset..self.offset + n].to_vec(), shape)
            .convert_dtype(dtype);
        self.offset += n;
        let fresh =
            Tensor::<B, D>::from_data(data, &tensor.device()).set_require_grad(require_grad);
        Param::from_mapped_value(id, fresh, mapper)
    }
}
