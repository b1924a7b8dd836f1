use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use models::*;

type B = Autodiff<Flex>;

struct Train { x: Vec<Vec<f32>>, y: Vec<i64>, epochs: usize }

impl<B: AutodiffBackend> ModelTask<B> for Train {
    type Output = f64;
    fn run<M>(self, mut model: M) -> f64
    where M: Classifier<B> + AutodiffModule<B> + 'static, M::InnerModule: Classifier<B::InnerBackend> {
        let device = Default::default();
        let n = self.x.len();
        let ntrain = n * 8 / 10;
        let mut opt = AdamConfig::new().init::<B, M>();
        let loss_fn = CrossEntropyLossConfig::new().init(&device);
        let batch = |idx: &[usize]| {
            let xs: Vec<f32> = idx.iter().flat_map(|&i| self.x[i].clone()).collect();
            let ys: Vec<i64> = idx.iter().map(|&i| self.y[i]).collect();
            (TensorData::new(xs, [idx.len(), 64]), TensorData::new(ys, [idx.len()]))
        };
        let t = std::time::Instant::now();
        let mut order: Vec<usize> = (0..ntrain).collect();
        let mut s = 7u64;
        for epoch in 0..self.epochs {
            for i in (1..order.len()).rev() { s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); let j = ((s >> 33) as usize) % (i + 1); order.swap(i, j); }
            for chunk in order.chunks(32) {
                let (x, y) = batch(chunk);
                let logits = model.forward(Tensor::from_data(x, &device));
                let loss = loss_fn.forward(logits, Tensor::from_data(y, &device));
                let grads = GradientsParams::from_grads(loss.backward(), &model);
                model = opt.step(1e-3, model, grads);
            }
            let valid = model.valid();
            let idx: Vec<usize> = (ntrain..n).collect();
            let (x, y) = batch(&idx);
            let pred = valid.forward(Tensor::from_data(x, &device)).argmax(1).flatten::<1>(0, 1);
            let correct: i64 = pred.equal(Tensor::from_data(y, &device)).int().sum().into_scalar().elem();
            println!("epoch {epoch}: acc {:.4} ({:.1}s)", correct as f64 / (n - ntrain) as f64, t.elapsed().as_secs_f64());
        }
        0.0
    }
}

#[test]
fn digits() {
    let text = std::fs::read_to_string("/tmp/digits.csv").unwrap();
    let mut rows: Vec<(Vec<f32>, i64)> = text.lines().map(|l| { let v: Vec<f32> = l.split(',').map(|t| t.parse().unwrap()).collect(); (v[..64].iter().map(|p| p / 16.0).collect(), v[64] as i64) }).collect();
    let mut s = 42u64;
    for i in (1..rows.len()).rev() { s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); let j = ((s >> 33) as usize) % (i + 1); rows.swap(i, j); }
    let (x, y): (Vec<_>, Vec<_>) = rows.into_iter().unzip();
    for name in ["mlp", "cnn"] {
        <B as burn::tensor::backend::Backend>::seed(&Default::default(), 1);
        println!("{name}");
        with_model::<B, _>(name, &toml::Table::new(), &InputShape::image(8, 8, 10), &Default::default(), Train { x: x.clone(), y: y.clone(), epochs: 5 }).unwrap();
    }
}
