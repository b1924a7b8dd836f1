//! A model is a function of the device seed alone.
//!
//! Kept as the only test of its binary: `Flex`'s RNG is process-global, so a
//! test drawing random numbers on another thread would interleave with it.

use burn::module::{ModuleVisitor, Param};
use burn::prelude::*;
use models::{with_model, Classifier, InputShape, ModelTask, MODEL_NAMES};

/// Returns every float parameter's values, in visiting order.
struct ParamValues;

impl ModelTask for ParamValues {
    type Output = Vec<Vec<f32>>;

    fn run<M: Classifier + 'static>(self, model: M) -> Self::Output {
        struct Collect(Vec<Vec<f32>>);

        impl ModuleVisitor for Collect {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let values = param.val().into_data().try_to_vec::<f32>();
                self.0.push(values.expect("float parameters hold f32"));
            }
        }

        let mut collect = Collect(Vec::new());
        model.visit(&mut collect);
        collect.0
    }
}

fn params(name: &str, seed: u64) -> Vec<Vec<f32>> {
    let device = Device::flex().autodiff();
    device.seed(seed);
    let input = InputShape::image(8, 8, 10);
    with_model(name, &toml::Table::new(), &input, &device, ParamValues)
        .expect("default options are valid")
}

#[test]
fn same_seed_same_parameters() {
    for name in MODEL_NAMES {
        let first = params(name, 7);
        assert!(!first.is_empty(), "{name} has parameters");
        assert_eq!(first, params(name, 7), "{name}: same seed");
        assert_ne!(first, params(name, 8), "{name}: different seed");
    }
}
