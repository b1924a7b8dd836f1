//! The models built outside the registry are functions of the device seed
//! alone too: `DigitsModel::from_options` gives exactly the parameters of
//! `with_model`, and `RegressionConfig::init` / `TextClassifierConfig::init`
//! draw every parameter eagerly.
//!
//! Kept as the only test of its binary: `Flex`'s RNG is process-global, so a
//! test drawing random numbers on another thread would interleave with it.

use burn::module::{ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::Distribution;
use models::{
    with_model, Classifier, DigitsModel, InputShape, ModelTask, RegressionConfig,
    TextClassifierConfig, MODEL_NAMES,
};

/// Every float parameter's values, in visiting order.
fn values<M: Module>(model: &M) -> Vec<Vec<f32>> {
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

struct ParamValues;

impl ModelTask for ParamValues {
    type Output = Vec<Vec<f32>>;

    fn run<M: Classifier + 'static>(self, model: M) -> Self::Output {
        values(&model)
    }
}

/// Seeds the (autodiff CPU) device, builds with `build`, and returns the parameters.
fn seeded(seed: u64, build: impl FnOnce(&Device) -> Vec<Vec<f32>>) -> Vec<Vec<f32>> {
    let device = Device::flex().autodiff();
    device.seed(seed);
    build(&device)
}

/// Draws unrelated random numbers, as a caller might between building a model
/// and first using it: a lazily initialised parameter would then differ.
fn interleave(device: &Device) {
    drop(Tensor::<1>::random([16], Distribution::Default, device));
}

#[test]
fn models_are_functions_of_the_seed() {
    let input = InputShape::image(8, 8, 10);
    let options = toml::Table::new();
    for name in MODEL_NAMES {
        let registry = |seed| {
            seeded(seed, |device| {
                with_model(name, &options, &input, device, ParamValues).expect("defaults are valid")
            })
        };
        let enum_model = |seed| {
            seeded(seed, |device| {
                let model = DigitsModel::from_options(name, &options, &input, device)
                    .expect("defaults are valid");
                interleave(device);
                values(&model)
            })
        };
        let expected = registry(7);
        assert!(!expected.is_empty(), "{name}");
        assert!(
            enum_model(7) == expected,
            "{name}: DigitsModel vs with_model"
        );
        assert!(enum_model(8) != expected, "{name}: different seed");
    }

    let regression = |seed, interleaved| {
        seeded(seed, |device| {
            let model = RegressionConfig::default().init(6, 2, device);
            if interleaved {
                interleave(device);
            }
            values(&model)
        })
    };
    let expected = regression(7, false);
    assert!(regression(7, true) == expected, "regression: same seed");
    assert!(
        regression(8, false) != expected,
        "regression: different seed"
    );

    let text = |seed, interleaved| {
        seeded(seed, |device| {
            let model = TextClassifierConfig::default().init(device);
            if interleaved {
                interleave(device);
            }
            values(&model)
        })
    };
    let expected = text(7, false);
    assert!(text(7, true) == expected, "text: same seed");
    assert!(text(8, false) != expected, "text: different seed");
}
