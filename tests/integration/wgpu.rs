//! Data parallelism on Burn's wgpu backend (feature `wgpu`; Mesa's lavapipe in CI): gradients
//! are packed (and compressed) by the CubeCL kernels on the device, staged through the host and
//! summed by the TCP ring — the path of every GPU without NCCL.

use crate::common::*;
use crate::zero::consolidate;

/// `digits_config` on the wgpu device.
fn on_wgpu(config: String) -> String {
    let with_device = config.replace("[output]\n", "[output]\ndevice = \"wgpu\"\n");
    assert_ne!(with_device, config, "digits_config has an [output] table");
    with_device
}

/// The DDP property on wgpu (2 ranks × 8 end where 1 rank × 16 ends), bf16 buckets (the
/// compress kernel) within rounding, and ZeRO stage 3 (weights sharded) where 2 ranks end. (Not compared with the CPU run: each backend draws its own
/// initial weights from the seed.)
#[test]
fn wgpu_ranks_match_one_rank_with_the_global_batch() {
    let dir = scratch("wgpu");
    let steps = "max_steps = 25";
    train(
        &write_config(&dir, "two", &on_wgpu(digits_config(SGD, 8, steps))),
        2,
    );
    train(
        &write_config(&dir, "one", &on_wgpu(digits_config(SGD, 16, steps))),
        1,
    );
    let bf16 = on_wgpu(digits_config(SGD, 8, steps))
        + "\n[distributed]\ngradient_compression = \"bf16\"\n";
    train(&write_config(&dir, "bf16", &bf16), 2);
    // ZeRO stage 3 on the device: the shards gathered through the host into device tensors.
    let zero3 = on_wgpu(digits_config(SGD, 8, steps)) + "\n[distributed]\nzero_stage = 3\n";
    train(&write_config(&dir, "zero3", &zero3), 2);
    consolidate(&dir, "zero3");

    let two = final_weights(&dir, "two");
    for (other, tolerance) in [("one", 1e-5f32), ("bf16", 1e-3), ("zero3", 1e-5)] {
        let diff = max_abs_diff(&two, &final_weights(&dir, other));
        eprintln!("wgpu, 2 ranks vs {other}: max |Δw| = {diff:e}");
        assert!(
            diff < tolerance,
            "{other}: max |Δw| = {diff:e} >= {tolerance:e}"
        );
        if other == "bf16" {
            assert!(diff > 0.0, "bf16 buckets must round something");
        }
    }
    assert_eq!(2 * bytes_reduced(&dir, "bf16"), bytes_reduced(&dir, "two"));
}
