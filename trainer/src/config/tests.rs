use std::path::Path;

use burn_ddp::ddp::BufferSync;
use burn_ddp::kernels::HalfFormat;
use burn_ddp::pipeline::PipelineSchedule;
use burn_ddp::{GradientTransport, ZeroStage};
use serde::{Deserialize, Serialize};

use super::*;

/// A stand-in for an app's tables.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Model {
    hidden: Vec<usize>,
}
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Data {
    source: String,
}
type TestConfig = Config<Model, Data>;

const MINIMAL: &str = r#"
[model]
hidden = [32]
[data]
source = "digits"
[training]
epochs = 1
batch_size = 8
seed = 1
"#;

fn parse(text: &str) -> Result<TestConfig, ConfigError> {
    Config::parse(text, Path::new("test.toml"))
}

#[test]
fn minimal_config_gets_defaults() {
    let c = parse(MINIMAL).unwrap();
    assert_eq!(c.model.hidden, vec![32]);
    assert_eq!(c.training.accumulation_steps, 1);
    assert_eq!(c.distributed.bucket_cap_mb, 25.0);
    assert_eq!(c.checkpoint.dir, None);
}

#[test]
fn one_default_per_field_with_or_without_its_section() {
    let without = parse("[model]\nhidden = []\n[data]\nsource = \"x\"\n").unwrap();
    let with = parse(
        "[model]\nhidden = []\n[data]\nsource = \"x\"\n[training]\n[optimizer]\n[checkpoint]\n[distributed]\n[output]\n",
    )
    .unwrap();
    assert_eq!(without, with);
    assert_eq!(without.training, TrainingConfig::default());
    assert_eq!(without.optimizer, OptimizerConfig::default());
    let partial = parse(&MINIMAL.replace("epochs = 1\n", "")).unwrap();
    assert_eq!(partial.training.epochs, TrainingConfig::default().epochs);
}

#[test]
fn errors_name_the_field() {
    let err = parse(&format!("{MINIMAL}\n[distributed]\nbucket_cap = 3\n"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("bucket_cap") && err.contains("test.toml"),
        "{err}"
    );
    let err = parse(&MINIMAL.replace("epochs = 1", "epochs = \"one\""))
        .unwrap_err()
        .to_string();
    assert!(err.contains("epochs"), "{err}");
    let err = parse(&MINIMAL.replace("batch_size = 8", "batch_size = 0"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("training.batch_size"), "{err}");
    // The app's own table: an unknown key is named.
    let err = parse(&MINIMAL.replace("hidden = [32]", "hidden = [32]\nhiden = 3"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("hiden"), "{err}");
}

#[test]
fn gradient_sync_defaults_to_auto_and_nccl_needs_cuda() {
    // What "auto" means is burn-ddp's (`GradientTransport::resolve`, tested there).
    let c = parse(MINIMAL).unwrap();
    assert_eq!(c.distributed.gradient_sync, GradientTransport::Auto);
    let with = |sync: &str, device: &str| {
        parse(&format!(
            "{MINIMAL}\n[distributed]\ngradient_sync = \"{sync}\"\n[output]\ndevice = \"{device}\"\n"
        ))
    };
    assert_eq!(
        with("nccl", "cuda").unwrap().distributed.gradient_sync,
        GradientTransport::Nccl
    );
    assert_eq!(
        with("host", "cuda").unwrap().distributed.gradient_sync,
        GradientTransport::Host
    );
    assert_eq!(
        with("auto", "wgpu").unwrap().distributed.gradient_sync,
        GradientTransport::Auto
    );
    let err = with("nccl", "cpu").unwrap_err();
    assert!(matches!(err, ConfigError::Invalid { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("distributed.gradient_sync") && msg.contains("cpu"),
        "{msg}"
    );
    assert_eq!(
        msg,
        "config file test.toml: distributed.gradient_sync = \"nccl\" needs output.device = \"cuda\" (got \"cpu\"); use \"auto\" or \"host\""
    );
    let err = with("gloo", "cpu").unwrap_err().to_string();
    assert!(err.contains("gloo"), "{err}");
    assert!(
        err.contains("expected one of `auto`, `host`, `nccl`"),
        "{err}"
    );
}

#[test]
fn gradient_compression_names() {
    let with = |value: &str| {
        parse(&format!(
            "{MINIMAL}\n[distributed]\ngradient_compression = \"{value}\"\n"
        ))
        .map(|c| c.distributed.gradient_compression)
    };
    assert_eq!(with("none").unwrap(), None);
    assert_eq!(with("bf16").unwrap(), Some(HalfFormat::Bf16));
    assert_eq!(with("fp16").unwrap(), Some(HalfFormat::F16));
    let err = with("fp8").unwrap_err().to_string();
    assert!(err.contains("fp8") && err.contains("bf16"), "{err}");
    let default = parse(MINIMAL).unwrap();
    assert_eq!(default.distributed.gradient_compression, None);
}

#[test]
fn zero_stage_is_0_to_3_and_another_is_refused_naming_the_key() {
    let with = |stage: &str| parse(&format!("{MINIMAL}\n[distributed]\nzero_stage = {stage}\n"));
    assert_eq!(
        parse(MINIMAL).unwrap().distributed.zero_stage,
        ZeroStage::Off
    );
    assert_eq!(with("0").unwrap().distributed.zero_stage, ZeroStage::Off);
    assert_eq!(
        with("1").unwrap().distributed.zero_stage,
        ZeroStage::OptimizerState
    );
    assert_eq!(
        with("2").unwrap().distributed.zero_stage,
        ZeroStage::Gradients
    );
    assert_eq!(
        with("3").unwrap().distributed.zero_stage,
        ZeroStage::Parameters
    );
    let err = parse(&format!(
        "{MINIMAL}\n[distributed]\nzero_stage = 3\npipeline_stages = 2\n"
    ))
    .unwrap_err()
    .to_string();
    assert!(err.contains("pipeline_stages = 2"), "{err}");
    for stage in [4, 5] {
        let err = with(&stage.to_string()).unwrap_err();
        assert!(matches!(err, ConfigError::Parse { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!(
                "distributed.zero_stage must be 0 (plain DDP), 1 (sharded optimizer state), 2 (sharded gradients and optimizer state) or 3 (sharded parameters, gradients and optimizer state), got {stage}"
            )) && msg.contains("test.toml"),
            "{msg}"
        );
    }
    let err = with("-1").unwrap_err().to_string();
    assert!(err.contains("zero_stage = -1"), "{err}");
}

#[test]
fn buffer_rules_and_pipeline_schedules_by_name() {
    let with = |key: &str, value: &str| {
        parse(&format!("{MINIMAL}\n[distributed]\n{key} = \"{value}\"\n")).map(|c| c.distributed)
    };
    let rule = |value| with("sync_buffers", value).map(|d| d.sync_buffers);
    assert_eq!(
        rule("broadcast").unwrap(),
        Some(BufferSync::Broadcast { root: 0 })
    );
    assert_eq!(rule("average").unwrap(), Some(BufferSync::Average));
    assert_eq!(rule("off").unwrap(), None);
    let err = rule("mean").unwrap_err().to_string();
    assert!(err.contains("mean") && err.contains("average"), "{err}");
    let schedule = |value| with("pipeline_schedule", value).map(|d| d.pipeline_schedule);
    assert_eq!(schedule("gpipe").unwrap(), PipelineSchedule::GPipe);
    assert_eq!(
        schedule("1f1b").unwrap(),
        PipelineSchedule::OneForwardOneBackward
    );
    let err = schedule("zb").unwrap_err().to_string();
    assert!(err.contains("zb") && err.contains("1f1b"), "{err}");
    let err = parse(&format!("{MINIMAL}\n[distributed]\npipeline_stages = 0\n"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("distributed.pipeline_stages must be at least 1"),
        "{err}"
    );
}

#[test]
fn distributed_spellings_are_stable_both_ways() {
    // The JSON of the fingerprint: the names of every value, as configs write them.
    let default = DistributedConfig::default();
    assert_eq!(
        serde_json::to_string(&default).unwrap(),
        r#"{"bucket_cap_mb":25.0,"timeout_secs":300,"stall_warning_secs":60,"gradient_sync":"auto","gradient_compression":"none","gradient_overlap":true,"zero_stage":0,"sync_buffers":"broadcast","pipeline_stages":1,"pipeline_schedule":"gpipe"}"#
    );
    let other = DistributedConfig {
        gradient_sync: GradientTransport::Nccl,
        gradient_compression: Some(HalfFormat::F16),
        gradient_overlap: false,
        zero_stage: ZeroStage::Gradients,
        sync_buffers: None,
        pipeline_stages: 2,
        pipeline_schedule: PipelineSchedule::OneForwardOneBackward,
        ..default
    };
    let text = toml::to_string(&other).unwrap();
    for line in [
        "gradient_sync = \"nccl\"",
        "gradient_compression = \"fp16\"",
        "gradient_overlap = false",
        "zero_stage = 2",
        "sync_buffers = \"off\"",
        "pipeline_schedule = \"1f1b\"",
    ] {
        assert!(text.contains(line), "{line} in {text}");
    }
    assert_eq!(toml::from_str::<DistributedConfig>(&text).unwrap(), other);
}

#[test]
fn learning_rate_schedule() {
    let mut o = OptimizerConfig {
        learning_rate: 0.1,
        lr_scaling: LrScaling::Linear,
        warmup_steps: 4,
        schedule: LrSchedule::Cosine,
        ..Default::default()
    };
    assert!((o.learning_rate(2, 0, 100) - 0.05).abs() < 1e-12);
    assert!((o.learning_rate(2, 4, 100) - 0.2).abs() < 1e-12);
    assert!(o.learning_rate(2, 100, 100).abs() < 1e-12);
    o.lr_scaling = LrScaling::Sqrt;
    o.schedule = LrSchedule::Constant;
    assert!((o.learning_rate(4, 50, 100) - 0.2).abs() < 1e-12);
}

#[test]
fn fingerprint_tracks_training_settings_only() {
    let a = parse(MINIMAL).unwrap();
    let mut b = a.clone();
    b.output.dir = "elsewhere".into();
    assert_eq!(a.fingerprint(), b.fingerprint());
    b.training.seed = 2;
    assert_ne!(a.fingerprint(), b.fingerprint());
    assert_eq!(a.model_fingerprint(), b.model_fingerprint());
    b.model.hidden = vec![];
    assert_ne!(a.model_fingerprint(), b.model_fingerprint());
}

#[test]
fn survivors_continue_at_zero_stage_0_only_and_never_with_pipeline_stages() {
    let with = |extra: &str| parse(&format!("{MINIMAL}\n{extra}\n"));
    let plain = parse(MINIMAL).unwrap();
    assert_eq!(plain.fault_tolerance, FaultToleranceConfig::default());
    assert!(!plain.fault_tolerance.survivors_continue(&plain.distributed));
    let ft = "[fault_tolerance]\non_rank_failure = \"continue\"";
    let on = with(ft).unwrap();
    assert!(on.fault_tolerance.survivors_continue(&on.distributed));
    // A sharded state is whole only in the checkpoint: a failure restarts every rank.
    let sharded = with(&format!("{ft}\n[distributed]\nzero_stage = 1")).unwrap();
    assert!(!sharded
        .fault_tolerance
        .survivors_continue(&sharded.distributed));
    let err = with(&format!("{ft}\n[distributed]\npipeline_stages = 2"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("fault_tolerance.on_rank_failure") && err.contains("pipeline_stages = 2"),
        "{err}"
    );
    let err = with(&format!("{ft}\nmin_world_size = 0"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("fault_tolerance.min_world_size"), "{err}");
    let err = with(&format!("{ft}\ndetection_secs = 0"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("fault_tolerance.detection_secs"), "{err}");
    let err = with("[fault_tolerance]\non_rank_failure = \"pray\"")
        .unwrap_err()
        .to_string();
    assert!(err.contains("on_rank_failure"), "{err}");
}
