//! Helpers: run the trainer with a watchdog, scratch directories, configs, checkpoints.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Generous: these tests run on a loaded 2-core machine.
pub const WATCHDOG: Duration = Duration::from_secs(300);

pub fn trainer() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_trainer"));
    cmd.current_dir(env!("CARGO_MANIFEST_DIR").to_string() + "/..");
    // Never inherit a launcher's identity from the environment running the tests.
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TRAINER_WORKER",
        "BURN_DDP_TOKEN",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// A finished process: exit code (None when killed by a signal) and its output.
#[derive(Debug)]
pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn all(&self) -> String {
        format!("--- stdout\n{}\n--- stderr\n{}", self.stdout, self.stderr)
    }
}

/// Starts `cmd` with piped output.
pub fn spawn(cmd: &mut Command) -> Child {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot start trainer")
}

/// Waits for `child` under the watchdog; a child still running after it is killed and the test
/// fails, showing what it printed.
pub fn finish(mut child: Child) -> Output {
    let mut out = child.stdout.take().expect("piped");
    let mut err = child.stderr.take().expect("piped");
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + WATCHDOG;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let output = Output {
        code: status.and_then(|s| s.code()),
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    };
    assert!(
        status.is_some(),
        "the process hung past the {WATCHDOG:?} watchdog:\n{}",
        output.all()
    );
    output
}

pub fn run(cmd: &mut Command) -> Output {
    finish(spawn(cmd))
}

/// Trains with `config` on `nproc` local ranks and expects success.
pub fn train(config: &Path, nproc: usize) -> Output {
    let out = run(trainer()
        .arg("--config")
        .arg(config)
        .arg("--nproc-per-node")
        .arg(nproc.to_string()));
    assert_eq!(
        out.code,
        Some(0),
        "training with {nproc} rank(s) failed:\n{}",
        out.all()
    );
    out
}

/// `"bytes_reduced"` of the reducer statistics (rank 0) of the run written by
/// `write_config(dir, name, …)` (needs `output.log_samples`).
pub fn bytes_reduced(dir: &Path, name: &str) -> u64 {
    let stats = std::fs::read_to_string(dir.join(format!("{name}-out/reducer-stats.json")))
        .expect("reducer-stats.json");
    let value = stats
        .split("\"bytes_reduced\":")
        .nth(1)
        .and_then(|rest| rest.split([',', '}']).next())
        .and_then(|v| v.parse().ok());
    value.unwrap_or_else(|| panic!("no bytes_reduced in {stats}"))
}

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir()
        .join("burn-ddp-tests")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A port nobody listens on right now (bound, then released).
pub fn unused_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Writes a config into `dir/name.toml` and returns its path. `body` holds every section; the
/// checkpoint and output directories are placed under `dir`.
pub fn write_config(dir: &Path, name: &str, body: &str) -> PathBuf {
    let text = body
        .replace(
            "{ckpt}",
            &dir.join(format!("{name}-ckpt")).display().to_string(),
        )
        .replace(
            "{out}",
            &dir.join(format!("{name}-out")).display().to_string(),
        )
        .replace(
            "{data}",
            &(env!("CARGO_MANIFEST_DIR").to_string() + "/../data/digits.csv.gz"),
        );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// (index → times seen) over the non-padding samples of epoch 0 in `samples-rank*.txt`.
pub fn visits(out_dir: &Path, into: &mut BTreeMap<usize, usize>) {
    for entry in std::fs::read_dir(out_dir).unwrap().filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().to_string();
        if !name.starts_with("samples-rank") {
            continue;
        }
        for line in std::fs::read_to_string(entry.path()).unwrap().lines() {
            let f: Vec<usize> = line.split(' ').map(|x| x.parse().unwrap()).collect();
            if f[0] == 0 && f[2] == 0 {
                *into.entry(f[1]).or_default() += 1;
            }
        }
    }
}

/// Copies the newest checkpoint under `from` into the checkpoint root `to` (a run configured
/// with `to` then resumes from it).
pub fn copy_newest_checkpoint(from: &Path, to: &Path) {
    let src = newest_checkpoint(from);
    let dst = to.join(src.file_name().unwrap());
    std::fs::create_dir_all(&dst).unwrap();
    for f in std::fs::read_dir(&src).unwrap().filter_map(Result::ok) {
        std::fs::copy(f.path(), dst.join(f.file_name())).unwrap();
    }
}

/// Resumes the 2-rank run `dir/first-*` as run `resume<nproc>` with `nproc` ranks and `body`,
/// and checks that epoch 0, counted from `before` (the first run's visits), saw each of its
/// `len` samples exactly once. Returns the resumed run's output.
pub fn resume_visits_every_sample_once(
    dir: &Path,
    nproc: usize,
    body: &str,
    before: &BTreeMap<usize, usize>,
    len: usize,
) -> Output {
    let name = format!("resume{nproc}");
    copy_newest_checkpoint(&dir.join("first-ckpt"), &dir.join(format!("{name}-ckpt")));
    let config = write_config(dir, &name, body);
    let out = train(&config, nproc);
    assert!(
        out.stderr.contains("saved with world size 2"),
        "{}",
        out.all()
    );
    let mut seen = before.clone();
    visits(&dir.join(format!("{name}-out")), &mut seen);
    assert_eq!(
        seen.len(),
        len,
        "every sample of the epoch, with {nproc} rank(s) after resume"
    );
    let repeated: Vec<_> = seen.iter().filter(|(_, &c)| c != 1).collect();
    assert!(
        repeated.is_empty(),
        "samples seen more than once with {nproc} rank(s): {repeated:?}"
    );
    out
}

/// The newest checkpoint directory under `root`.
pub fn newest_checkpoint(root: &Path) -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .unwrap_or_else(|e| panic!("no checkpoints in {}: {e}", root.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
        })
        .collect();
    dirs.sort();
    dirs.pop()
        .unwrap_or_else(|| panic!("no checkpoints in {}", root.display()))
}

/// Every tensor of a safetensors file, as f32.
pub fn read_weights(path: &Path) -> BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, values)
        })
        .collect()
}

/// Largest absolute difference between two sets of weights with the same names and shapes.
pub fn max_abs_diff(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f32 {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "different tensors"
    );
    let mut worst = 0f32;
    for (name, x) in a {
        let y = &b[name];
        assert_eq!(x.len(), y.len(), "{name}");
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs());
        }
    }
    worst
}

/// The value of metric `name` on the engine's `final validation: Loss 0.07, Accuracy 97.77% (...)`
/// line.
pub fn final_metric(out: &Output, name: &str) -> f64 {
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("final validation:"))
        .unwrap_or_else(|| panic!("no final validation line:\n{}", out.all()));
    metric_on(line, name).unwrap_or_else(|| panic!("no {name} on: {line}"))
}

/// The number after `name ` on a line of `name value[unit]` pairs.
pub fn metric_on(line: &str, name: &str) -> Option<f64> {
    let rest = &line[line.find(&format!("{name} "))? + name.len() + 1..];
    let number: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || matches!(c, '.' | '-' | 'e' | 'N' | 'a'))
        .collect();
    number.parse().ok()
}

/// The validation accuracy (%) on the engine's final line.
pub fn final_accuracy(out: &Output) -> f64 {
    final_metric(out, "Accuracy")
}

/// A small, fast MLP run on the digits data; `{ckpt}`/`{out}` land in the test's scratch dir.
pub fn digits_config(optimizer: &str, batch: usize, extra_training: &str) -> String {
    format!(
        r#"
[model]
name = "mlp"
hidden = [32]

[data]
source = "digits"
path = "{{data}}"

[optimizer]
{optimizer}

[training]
epochs = 3
batch_size = {batch}
seed = 7
log_every = 5
{extra_training}

[checkpoint]
dir = "{{ckpt}}"
every_epochs = 0

[output]
dir = "{{out}}"
log_samples = true
"#
    )
}

pub const SGD: &str = "name = \"sgd\"\nlearning_rate = 0.05";
pub const ADAM: &str = "name = \"adam\"\nlearning_rate = 0.003";

/// The weights of the newest checkpoint of the run written by `write_config(dir, name, …)`.
pub fn final_weights(dir: &Path, name: &str) -> BTreeMap<String, Vec<f32>> {
    read_weights(&newest_checkpoint(&dir.join(format!("{name}-ckpt"))).join("model.safetensors"))
}
