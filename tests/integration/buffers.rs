//! Buffers (BatchNorm running statistics) across ranks: `distributed.sync_buffers`.

use std::collections::BTreeMap;

use crate::common::*;

/// The digits CNN with BatchNorm after each convolution.
fn cnn_config(batch: usize, training: &str, sync_buffers: &str) -> String {
    digits_config(ADAM, batch, training).replace(
        "name = \"mlp\"\nhidden = [32]",
        "name = \"cnn\"\nchannels = [4, 8]\nhidden = 16\nbatch_norm = true",
    ) + &format!("\n[distributed]\nsync_buffers = \"{sync_buffers}\"\n")
}

fn running_means(dir: &std::path::Path, name: &str) -> BTreeMap<String, Vec<f32>> {
    let means: BTreeMap<_, _> = final_weights(dir, name)
        .into_iter()
        .filter(|(k, _)| k.contains("running_mean"))
        .collect();
    assert_eq!(means.len(), 2, "two BatchNorm layers: {:?}", means.keys());
    means
}

#[test]
fn batchnorm_replicas_stay_bit_identical_only_with_synced_buffers() {
    let dir = scratch("buffers-replicas");
    let training = "max_steps = 50\ncheck_replicas_every = 1";
    for rule in ["broadcast", "average"] {
        let config = write_config(&dir, rule, &cnn_config(8, training, rule));
        train(&config, 2);
    }
    // Without the sync each rank's statistics follow its own data: the replica check (which
    // covers buffers) must catch it, so the two runs above really checked something.
    let config = write_config(&dir, "off", &cnn_config(8, training, "off"));
    let out = run(trainer()
        .arg("--config")
        .arg(&config)
        .args(["--nproc-per-node", "2"]));
    assert_ne!(out.code, Some(0), "{}", out.all());
    assert_says(&out.stderr, &["replica drift"], &out);
}

/// After one step from equal weights, "average" gives the running means one process with the
/// doubled batch computes (a moving average is linear in the batch means); "broadcast" gives
/// rank 0's, from half the batch.
#[test]
fn checkpointed_running_statistics_follow_the_rule() {
    let dir = scratch("buffers-rule");
    let one_step = "max_steps = 1";
    train(
        &write_config(&dir, "one", &cnn_config(16, one_step, "off")),
        1,
    );
    for rule in ["average", "broadcast"] {
        train(&write_config(&dir, rule, &cnn_config(8, one_step, rule)), 2);
    }
    let reference = running_means(&dir, "one");
    let average = max_abs_diff(&running_means(&dir, "average"), &reference);
    assert!(average < 1e-5, "average vs one process: {average:e}");
    let broadcast = max_abs_diff(&running_means(&dir, "broadcast"), &reference);
    assert!(
        broadcast > 1e-4,
        "rank 0's statistics of half the batch should differ from the global batch's: {broadcast:e}"
    );
}
