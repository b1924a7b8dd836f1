//! Model registry: `[model] name = "..."` -> options type -> model.

use burn::module::{ModuleVisitor, Param};
use burn::prelude::*;

use crate::{Classifier, CnnOptions, InputShape, MlpOptions, ModelError, ModelOptions, ModelTask};

/// Declares the registry: one `"name" => OptionsType` line per model.
///
/// Expands to [`MODEL_NAMES`] and to `dispatch`, a `match name` with one arm
/// per line, so the list of names and the match cannot disagree.
macro_rules! registry {
    ($($name:literal => $options:ty),+ $(,)?) => {
        /// Names accepted by [`with_model`] and [`validate`], in registry order.
        pub const MODEL_NAMES: &[&str] = &[$($name),+];

        /// Calls `visitor` with the options type registered under `name`.
        fn dispatch<V: Visitor>(name: &str, visitor: V) -> Result<V::Output, ModelError> {
            match name {
                $($name => visitor.visit::<$options>($name),)+
                _ => Err(ModelError::UnknownModel {
                    name: name.to_owned(),
                    known: MODEL_NAMES,
                }),
            }
        }
    };
}

registry! {
    "mlp" => MlpOptions,
    "cnn" => CnnOptions,
}

/// Something done with the options type of the selected model.
trait Visitor {
    type Output;
    fn visit<O: ModelOptions>(self, name: &'static str) -> Result<Self::Output, ModelError>;
}

/// Builds the model `name` with `options` for `input` on `device` and runs
/// `task` with it.
///
/// - `options` is the `[model]` table of the user's TOML without its `name`
///   key (a `name` key still present is ignored). Every key is optional; an
///   unknown, wrongly typed or out-of-range key is an error naming it.
/// - The model is initialised from the device's RNG only: call
///   `device.seed(seed)` first for identical models on every rank. Burn
///   draws parameters lazily, on first use; every parameter is drawn here, in
///   declaration order, before `task` gets the model, so the values depend
///   only on the seed and not on what the task touches first.
///
/// # Errors
///
/// [`ModelError::UnknownModel`], [`ModelError::InvalidOptions`] or
/// [`ModelError::IncompatibleInput`], exactly as [`validate`] reports them;
/// nothing is allocated on `device` in that case.
pub fn with_model<T: ModelTask>(
    name: &str,
    options: &toml::Table,
    input: &InputShape,
    device: &Device,
    task: T,
) -> Result<T::Output, ModelError> {
    struct Build<'a, T> {
        options: &'a toml::Table,
        input: &'a InputShape,
        device: &'a Device,
        task: T,
    }

    impl<T: ModelTask> Visitor for Build<'_, T> {
        type Output = T::Output;

        fn visit<O: ModelOptions>(self, name: &'static str) -> Result<T::Output, ModelError> {
            let options = parse::<O>(name, self.options, self.input)?;
            let task = Materialized(self.task);
            Ok(options.build(self.input, self.device, task))
        }
    }

    dispatch(
        name,
        Build {
            options,
            input,
            device,
            task,
        },
    )
}

/// Checks that `name` is a registered model and that `options` (the `[model]`
/// table without `name`, as for [`with_model`]) are valid for it and for
/// `input`, without building anything. The trainer calls this before
/// starting any process, so that configuration mistakes fail fast.
///
/// # Errors
///
/// The same errors [`with_model`] would return.
pub fn validate(name: &str, options: &toml::Table, input: &InputShape) -> Result<(), ModelError> {
    struct Check<'a> {
        options: &'a toml::Table,
        input: &'a InputShape,
    }

    impl Visitor for Check<'_> {
        type Output = ();

        fn visit<O: ModelOptions>(self, name: &'static str) -> Result<(), ModelError> {
            parse::<O>(name, self.options, self.input).map(drop)
        }
    }

    dispatch(name, Check { options, input })
}

/// Wraps a task so that the model's parameters are all drawn, in declaration
/// order, before the task sees the model (see [`with_model`]).
struct Materialized<T>(T);

impl<T: ModelTask> ModelTask for Materialized<T> {
    type Output = T::Output;

    fn run<M: Classifier + 'static>(self, model: M) -> T::Output {
        draw_params(&model);
        self.0.run(model)
    }
}

/// Draws every parameter of `model` that is still uninitialised, in
/// declaration order (Burn runs a parameter's initialiser on first use; after
/// this the values depend only on the device's RNG state before the model
/// was built, not on which parameter is used first).
pub(crate) fn draw_params<M: Module>(model: &M) {
    struct DrawParams;

    impl ModuleVisitor for DrawParams {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            // `val` runs the lazy initialiser once and caches the tensor.
            drop(param.val());
        }
        fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
            drop(param.val());
        }
        fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
            drop(param.val());
        }
    }

    model.visit(&mut DrawParams);
}

/// Deserializes and checks the options of model `model`: the input shape
/// every model relies on, then the keys (unknown or wrongly typed keys named),
/// then [`ModelOptions::check`].
pub(crate) fn parse<O: ModelOptions>(
    model: &str,
    options: &toml::Table,
    input: &InputShape,
) -> Result<O, ModelError> {
    check_input_shape(model, input)?;
    let parsed = deserialize::<O>(model, options)?;
    parsed
        .check(input)
        .map_err(|error| error.into_model_error(model))?;
    Ok(parsed)
}

/// Checks what every model relies on: a non-empty input and output, and an
/// image shape consistent with the feature count.
fn check_input_shape(model: &str, input: &InputShape) -> Result<(), ModelError> {
    let reason = if input.features == 0 || input.classes == 0 {
        format!(
            "it needs at least one feature and one class, but got {} features and {} classes",
            input.features, input.classes
        )
    } else if let Some((height, width)) = input.image.filter(|&(h, w)| h * w != input.features) {
        format!(
            "the image shape {height}x{width} does not match the {} features per sample",
            input.features
        )
    } else {
        return Ok(());
    };
    Err(ModelError::IncompatibleInput {
        model: model.to_owned(),
        reason,
    })
}

/// Deserializes `O` from the `[model]` table, ignoring a `name` key.
///
/// serde names an unknown key in its message, but a `toml::Value` carries no
/// position, so a type error ("invalid type: string, expected usize") would
/// not say which key holds the value. On error each key is therefore tried
/// alone (every field has a default) to find the one at fault.
fn deserialize<O: ModelOptions>(model: &str, options: &toml::Table) -> Result<O, ModelError> {
    let options: toml::Table = options
        .iter()
        .filter(|(key, _)| key.as_str() != "name")
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    let error = match toml::Value::Table(options.clone()).try_into::<O>() {
        Ok(parsed) => return Ok(parsed),
        Err(error) => error,
    };
    let culprit = options.iter().find_map(|(key, value)| {
        let alone = toml::Table::from_iter([(key.clone(), value.clone())]);
        toml::Value::Table(alone)
            .try_into::<O>()
            .err()
            .map(|error| (key.clone(), error))
    });
    let (field, error) = match culprit {
        Some(found) => found,
        None => (
            options.keys().cloned().collect::<Vec<_>>().join(", "),
            error,
        ),
    };
    Err(ModelError::InvalidOptions {
        model: model.to_owned(),
        field,
        message: error.message().trim().to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{autodiff_device, digits, table, ForwardShapes};

    fn build(
        name: &str,
        options: &str,
        input: &InputShape,
    ) -> Result<([usize; 2], [usize; 2]), ModelError> {
        let task = ForwardShapes {
            batch: 3,
            features: input.features,
        };
        with_model(name, &table(options), input, &autodiff_device(), task)
    }

    #[test]
    fn every_registered_model_builds_on_digits_with_defaults() {
        for name in MODEL_NAMES {
            validate(name, &toml::Table::new(), &digits()).expect("defaults are valid");
            let shapes = build(name, "", &digits()).expect("builds");
            assert_eq!(shapes, ([3, 10], [3, 10]), "{name}");
        }
    }

    /// Returns whether every parameter was drawn before the task got the model.
    struct AllDrawn;

    impl ModelTask for AllDrawn {
        type Output = (usize, usize);

        fn run<M: Classifier + 'static>(self, model: M) -> (usize, usize) {
            struct Count(usize, usize);

            impl ModuleVisitor for Count {
                fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                    self.0 += 1;
                    self.1 += usize::from(param.is_initialized());
                }
            }

            let mut count = Count(0, 0);
            model.visit(&mut count);
            (count.0, count.1)
        }
    }

    #[test]
    fn parameters_are_drawn_before_the_task_runs() {
        for name in MODEL_NAMES {
            let device = autodiff_device();
            let (params, drawn) =
                with_model(name, &toml::Table::new(), &digits(), &device, AllDrawn)
                    .expect("builds");
            assert!(params > 0, "{name}");
            assert_eq!(drawn, params, "{name}");
        }
    }

    /// What the options change: the shape of every float parameter, in visit order, and
    /// whether two training-mode forward passes of the same input differ (dropout).
    struct Structure {
        features: usize,
    }

    impl ModelTask for Structure {
        type Output = (Vec<Vec<usize>>, bool);

        fn run<M: Classifier + 'static>(self, model: M) -> (Vec<Vec<usize>>, bool) {
            struct Shapes(Vec<Vec<usize>>);

            impl ModuleVisitor for Shapes {
                fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                    self.0.push(param.val().dims().to_vec());
                }
            }

            let mut shapes = Shapes(Vec::new());
            model.visit(&mut shapes);
            let device = autodiff_device();
            // Many different rows: with one repeated row, a random initialisation that leaves
            // every unit of the last hidden layer inactive for it makes the output the bias
            // whatever dropout does, and the passes equal by chance.
            let inputs = Tensor::<2>::random(
                [64, self.features],
                burn::tensor::Distribution::Uniform(-1.0, 1.0),
                &device,
            );
            let a = model.forward(inputs.clone()).into_data();
            let b = model.forward(inputs).into_data();
            (shapes.0, a != b)
        }
    }

    fn structure(name: &str, options: &str, input: &InputShape) -> (Vec<Vec<usize>>, bool) {
        with_model(
            name,
            &table(options),
            input,
            &autodiff_device(),
            Structure {
                features: input.features,
            },
        )
        .expect("builds")
    }

    #[test]
    fn options_are_applied() {
        // The shapes of the logits do not depend on the options; the layers do.
        let shapes = build(
            "mlp",
            "hidden = [8, 4]\ndropout = 0.5",
            &InputShape::flat(5, 2),
        );
        assert_eq!(shapes, Ok(([3, 2], [3, 2])));
        let flat = InputShape::flat(5, 2);
        let (layers, dropout) = structure("mlp", "hidden = [8, 4]\ndropout = 0.5", &flat);
        assert_eq!(
            layers,
            vec![
                vec![5, 8],
                vec![8],
                vec![8, 4],
                vec![4],
                vec![4, 2],
                vec![2]
            ],
            "hidden = [8, 4]: two hidden layers of 8 and 4"
        );
        assert!(dropout, "dropout = 0.5: training-mode passes differ");
        let (layers, dropout) = structure("mlp", "", &flat);
        assert_eq!(
            layers,
            vec![vec![5, 128], vec![128], vec![128, 2], vec![2]],
            "the default: one hidden layer of 128"
        );
        assert!(!dropout, "no dropout by default: passes are equal");

        let shapes = build(
            "cnn",
            "channels = [2, 3]\nhidden = 4\ndropout = 0.1",
            &digits(),
        );
        assert_eq!(shapes, Ok(([3, 10], [3, 10])));
        let (small, dropout) = structure(
            "cnn",
            "channels = [2, 3]\nhidden = 4\ndropout = 0.1",
            &digits(),
        );
        let (default, no_dropout) = structure("cnn", "", &digits());
        // Conv kernels are [out, in, kh, kw]; the first fully connected layer ends in `hidden`.
        let outs = |layers: &[Vec<usize>]| -> Vec<usize> {
            layers
                .iter()
                .filter(|s| s.len() == 4)
                .map(|s| s[0])
                .collect()
        };
        assert_eq!(outs(&small), vec![2, 3], "channels = [2, 3]: {small:?}");
        assert_eq!(
            outs(&default),
            vec![16, 32],
            "default channels: {default:?}"
        );
        let hidden = |layers: &[Vec<usize>]| -> Vec<usize> {
            layers
                .iter()
                .filter(|s| s.len() == 2 && s[1] != 10)
                .map(|s| s[1])
                .collect()
        };
        assert_eq!(hidden(&small), vec![4], "hidden = 4: {small:?}");
        assert_eq!(hidden(&default), vec![64], "default hidden: {default:?}");
        assert!(dropout && !no_dropout, "cnn dropout = 0.1 only when set");
    }

    #[test]
    fn name_key_is_ignored() {
        assert_eq!(validate("mlp", &table("name = \"mlp\""), &digits()), Ok(()));
    }

    #[test]
    fn unknown_model_lists_known_names() {
        let error = validate("resnet", &toml::Table::new(), &digits()).unwrap_err();
        assert!(matches!(error, ModelError::UnknownModel { .. }));
        let message = error.to_string();
        assert!(message.contains("'resnet'"), "{message}");
        assert!(message.contains("mlp, cnn"), "{message}");
        let built = build("resnet", "", &digits());
        assert!(matches!(built, Err(ModelError::UnknownModel { .. })));
    }

    #[test]
    fn unknown_key_is_named() {
        let error = build("mlp", "hidden = [8]\nhiden_layers = 3", &digits()).unwrap_err();
        let ModelError::InvalidOptions { model, field, .. } = &error else {
            panic!("expected InvalidOptions, got {error:?}");
        };
        assert_eq!((model.as_str(), field.as_str()), ("mlp", "hiden_layers"));
        let message = error.to_string();
        assert!(message.contains("`hiden_layers`"), "{message}");
        assert!(
            message.contains("expected `hidden` or `dropout`"),
            "{message}"
        );
    }

    #[test]
    fn wrongly_typed_key_is_named() {
        for (name, options, key) in [
            ("mlp", "hidden = \"128\"", "hidden"),
            ("mlp", "dropout = [0.1]", "dropout"),
            ("mlp", "hidden = [64, -1]", "hidden"),
            ("cnn", "channels = [16]", "channels"),
            ("cnn", "hidden = 1.5\ndropout = 0.2", "hidden"),
        ] {
            let error = validate(name, &table(options), &digits()).unwrap_err();
            let ModelError::InvalidOptions { field, message, .. } = &error else {
                panic!("expected InvalidOptions for {options:?}, got {error:?}");
            };
            assert_eq!(field, key, "{options:?}: {error}");
            assert!(!message.is_empty());
            assert!(error.to_string().contains(&format!("`{key}`")), "{error}");
        }
    }

    #[test]
    fn out_of_range_values_are_named() {
        let error = validate("cnn", &table("dropout = 1.0"), &digits()).unwrap_err();
        assert!(
            matches!(&error, ModelError::InvalidOptions { field, .. } if field == "dropout"),
            "{error:?}"
        );
        assert!(error.to_string().contains("found 1"), "{error}");
    }

    #[test]
    fn cnn_on_flat_input_is_incompatible() {
        let error = build("cnn", "", &InputShape::flat(64, 10)).unwrap_err();
        assert!(
            matches!(error, ModelError::IncompatibleInput { .. }),
            "{error:?}"
        );
        let message = error.to_string();
        assert!(
            message.contains("'cnn'") && message.contains("image"),
            "{message}"
        );
        // The MLP takes the same data.
        assert_eq!(
            validate("mlp", &toml::Table::new(), &InputShape::flat(64, 10)),
            Ok(())
        );
    }

    #[test]
    fn inconsistent_input_shape_is_incompatible() {
        let bad_image = InputShape {
            features: 64,
            classes: 10,
            image: Some((8, 7)),
        };
        let empty = InputShape::flat(0, 10);
        for input in [bad_image, empty] {
            for name in MODEL_NAMES {
                let error = validate(name, &toml::Table::new(), &input).unwrap_err();
                assert!(
                    matches!(error, ModelError::IncompatibleInput { .. }),
                    "{error:?}"
                );
            }
        }
    }
}
