use super::*;
use crate::ddp::ZeroStage;

/// Stage 3 is refused where the options are given, as a usage error, before joining (no
/// job is formed: this process has no launcher's variables to join with).
#[test]
fn zero_stage_3_is_refused_by_from_env_with_as_a_usage_error() {
    let options = DdpOptions::default().with_zero_stage(ZeroStage::Parameters);
    let error = match DdpStrategy::from_env_with(options) {
        Ok(_) => panic!("stage 3 accepted"),
        Err(e) => e,
    };
    assert!(matches!(error, DdpError::Options(_)), "{error}");
    assert!(error.is_usage());
    assert!(
        error.to_string().contains("ZeRO stage 3 is not available"),
        "{error}"
    );
}
