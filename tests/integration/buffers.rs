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

/// `sync_batch_norm = true`: BatchNorm over the global batch (burn-ddp's `SyncBatchNorm`), so 2
/// ranks × 8 samples train the model, and keep the running statistics, of 1 rank × 16 — the
/// buffers left unsynchronised (`sync_buffers = "off"`), since the statistics are global already.
/// The control: plain per-rank BatchNorm on 2 × 8 differs from 1 × 16, so the test can fail.
#[test]
fn sync_batch_norm_trains_as_one_process_with_the_global_batch() {
    let dir = scratch("buffers-sync-bn");
    // SGD, not Adam: the convolutions' biases feed a BatchNorm, so their true gradient is 0 and
    // what they get is rounding noise, which Adam's normalised step turns into updates of up to
    // its learning rate whatever the noise's size (with Adam, those biases and the running means
    // they shift differed by ~6e-5 after 5 steps, every other tensor by < 1e-7).
    let config = |batch, sync_batch_norm| {
        cnn_config(batch, "max_steps = 5", "off")
            .replace(ADAM, SGD)
            .replace(
                "batch_norm = true",
                &format!("batch_norm = true\nsync_batch_norm = {sync_batch_norm}"),
            )
    };
    train(&write_config(&dir, "one", &config(16, true)), 1);
    train(&write_config(&dir, "sync", &config(8, true)), 2);
    train(&write_config(&dir, "local", &config(8, false)), 2);

    let reference = final_weights(&dir, "one");
    assert!(
        reference.keys().any(|k| k.contains("running_var")),
        "the checkpoint keeps the running statistics: {:?}",
        reference.keys()
    );
    let synced = max_abs_diff(&final_weights(&dir, "sync"), &reference);
    eprintln!("SyncBatchNorm 2 x 8 vs 1 x 16: max |dw| = {synced:e}");
    assert!(
        synced < 1e-5,
        "SyncBatchNorm 2 x 8 vs 1 x 16: max |dw| = {synced:e}"
    );
    let local = max_abs_diff(&final_weights(&dir, "local"), &reference);
    eprintln!("per-rank BatchNorm 2 x 8 vs 1 x 16: max |dw| = {local:e}");
    assert!(
        local > 1e-4,
        "per-rank statistics of half the batch should train another model: max |dw| = {local:e}"
    );
}
