//! Faults: dead and stalled ranks, restarts, crashes mid-checkpoint, damaged checkpoints,
//! strangers on the store port, concurrent jobs, and signals to the launcher.

use std::io::Write;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;

/// A collectives job of 2 ranks: `iters` all-reduces of `len` elements.
fn all_reduce_job(len: usize, iters: usize, extra: &[&str]) -> Command {
    let mut cmd = trainer();
    cmd.args(["collectives", "--nproc-per-node", "2", "--op", "all_reduce"])
        .args(["--len", &len.to_string(), "--iters", &iters.to_string()])
        .args(extra);
    cmd
}

/// A collectives job long enough to be hit while it runs.
fn long_job(extra: &[&str]) -> Command {
    all_reduce_job(65536, 100_000, extra)
}

/// The rank process of `ranks` (pids) started with `RANK=rank`.
fn pid_of_rank(ranks: &[u32], rank: usize, launcher: &mut Proc) -> u32 {
    match ranks.iter().copied().find(|&p| rank_of(p) == Some(rank)) {
        Some(pid) => pid,
        None => launcher.fail(&format!("no rank {rank} among {ranks:?}")),
    }
}

#[test]
fn a_killed_rank_stops_the_job_and_is_named() {
    let mut launcher = spawn(&mut long_job(&["--timeout-secs", "60"]));
    launcher.wait_for_line("ring connected");
    let ranks = children_of(launcher.id());
    assert_eq!(ranks.len(), 2, "{}", launcher.log());
    let victim = pid_of_rank(&ranks, 1, &mut launcher);
    signal(victim, libc::SIGKILL);
    let detected = launcher.wait_within(WATCHDOG);
    let out = launcher.finish();
    assert_ne!(out.code, Some(0), "{}", out.all());
    assert_says(&out.stderr, &["rank 1 failed: killed by signal 9"], &out);
    assert!(ranks.iter().all(|&p| !alive(p)), "no rank left behind");
    eprintln!("kill -9 of rank 1: launcher exited {detected:?} later");
}

/// Four ranks started by hand with plain RANK/WORLD_SIZE/MASTER_* variables (ring
/// 0 → 1 → 2 → 3 → 0; rank 0 hosts the store), each logging the address its peers know it by.
fn four_ranks_by_hand() -> (Vec<Proc>, Vec<String>) {
    const WORLD: usize = 4;
    let (mut ranks, _port) = start_by_hand(|port| {
        (0..WORLD)
            .map(|rank| {
                let mut cmd = trainer();
                cmd.args(["collectives", "--op", "all_reduce", "--len", "65536"])
                    .args(["--iters", "100000000", "--timeout-secs", "600"])
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", WORLD.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .env("RUST_LOG", "info");
                cmd
            })
            .collect()
    });
    // "ring connected ... listen=127.0.0.1:PORT ...": the address its peers know it by.
    let mut listen = Vec::new();
    for rank in &mut ranks {
        let line = rank.wait_for_line("ring connected");
        let addr = line
            .split("listen=")
            .nth(1)
            .and_then(|rest| rest.split([' ', ',']).next())
            .unwrap_or_else(|| panic!("no listen= in {line:?}"))
            .to_string();
        listen.push(addr);
    }
    (ranks, listen)
}

/// SIGKILLs rank `victim` of [`four_ranks_by_hand`] and checks that every survivor exits
/// non-zero within 60 s (long before the collective's timeout, 600 s, could be what stops it)
/// with an error that passes `names(rank, its stderr, every rank's address)`. Returns how long
/// each took.
fn kill_9_and_check_every_survivor(
    victim: usize,
    names: impl Fn(usize, &str, &[String]) -> bool,
) -> Vec<Duration> {
    const BOUND: Duration = Duration::from_secs(60);
    let (mut ranks, listen) = four_ranks_by_hand();
    signal(ranks[victim].id(), libc::SIGKILL);
    let killed_at = Instant::now();
    let dead = ranks.remove(victim);
    let mut took = Vec::new();
    for (i, rank) in ranks.iter_mut().enumerate() {
        let r = if i < victim { i } else { i + 1 };
        rank.wait_within(BOUND.saturating_sub(killed_at.elapsed()));
        took.push(killed_at.elapsed());
        let status = rank.try_wait().expect("exited");
        assert!(
            status.code().is_some_and(|c| c != 0),
            "rank {r} must fail on its own ({status:?}):\n{}",
            rank.log()
        );
        let err = rank.stderr.join("\n");
        assert!(names(r, &err, &listen), "rank {r}:\n{}", rank.log());
    }
    drop(dead);
    took
}

/// Under torchrun, srun or mpirun there is no launcher of ours to stop the survivors of a
/// crash: each must notice on its own. Rank 1 is SIGKILLed as soon as every ring is connected
/// (during the first barrier, while shared-memory links cannot yet see a dead peer, or just
/// after). Every survivor must name the dead rank and its address — not only rank 2, which waits
/// on its data, but also ranks 0 and 3, whose closed links came from a messenger: the ranks'
/// failure reports in the store converge on the one rank that never reported.
#[test]
fn without_a_launcher_every_survivor_of_a_kill_9_fails_naming_the_dead_rank() {
    let took = kill_9_and_check_every_survivor(1, |_, err, listen| {
        // Every survivor names rank 1, at the address it logged, as the rank that is gone.
        let named = format!("rank 1 ({})", listen[1]);
        listen[1].starts_with("127.0.0.1:") && err.contains(&format!("{named} is gone"))
    });
    eprintln!("kill -9 of rank 1: survivors 0, 2, 3 exited after {took:?}");
}
/// The same when the rank killed is rank 0, which also hosts the store: the survivors cannot
/// compare reports, but none may hang. Its neighbours name rank 0 and its address; the rank
/// beyond them, which lost a messenger, says the store (and so, probably, its host) is gone.
#[test]
fn without_a_launcher_every_survivor_of_a_kill_9_of_the_store_host_fails() {
    let took = kill_9_and_check_every_survivor(0, |_, err, listen| {
        err.contains(&format!("rank 0 ({})", listen[0]))
            || err.contains("The rendezvous store cannot tell which rank failed first")
    });
    eprintln!("kill -9 of rank 0 (the store's host): survivors 1, 2, 3 exited after {took:?}");
}

#[test]
fn a_stalled_rank_times_out_naming_the_peer() {
    let mut launcher = spawn(&mut long_job(&["--timeout-secs", "3"]));
    launcher.wait_for_line("ring connected");
    let ranks = children_of(launcher.id());
    assert_eq!(ranks.len(), 2, "{}", launcher.log());
    let victim = pid_of_rank(&ranks, 1, &mut launcher);
    signal(victim, libc::SIGSTOP);
    let out = launcher.finish();
    assert_ne!(out.code, Some(0), "{}", out.all());
    assert_says(&out.stderr, &["timed out after", "rank 1 (127.0.0.1"], &out);
    assert!(
        ranks.iter().all(|&p| !alive(p)),
        "the stopped rank was killed too"
    );
}

#[test]
fn strangers_on_the_store_port_are_refused_and_the_job_goes_on() {
    // The ranks wait for `go` before they use the store, so the job is still there when the
    // strangers call, whatever the machine's load.
    let dir = scratch("strangers");
    let go = dir.join("go");
    let mut launcher = spawn(
        trainer()
            .args(["launch", "--nproc-per-node", "2", "--", "sh", "-c"])
            .arg(
                r#"while [ ! -e "$GO" ]; do sleep 0.05; done
                   exec "$0" collectives --op all_reduce --len 4096 --iters 20"#,
            )
            .arg(trainer().get_program())
            .env("GO", &go),
    );
    let line = launcher.wait_for_line("store at ");
    let addr = line
        .split("store at ")
        .nth(1)
        .unwrap()
        .split(|c: char| c == ',' || c.is_whitespace())
        .next()
        .unwrap()
        .to_string();
    // Garbage, then a well-formed hello with a wrong token.
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.write_all(b"\x05\x00\x00\x00garbage and more garbage")
        .unwrap();
    let mut hello = vec![0u8; 4];
    hello.push(1); // hello
    hello.extend_from_slice(&0x4444_5053u32.to_le_bytes());
    hello.extend_from_slice(&5u32.to_le_bytes());
    hello.extend_from_slice(b"guess");
    let len = (hello.len() - 4) as u32;
    hello[..4].copy_from_slice(&len.to_le_bytes());
    let mut t = std::net::TcpStream::connect(&addr).unwrap();
    t.write_all(&hello).unwrap();
    launcher.wait_for_lines("refused connection from", 2);
    std::fs::write(&go, "").unwrap();
    let out = launcher.finish();
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_eq!(
        out.stdout.matches("all results correct").count(),
        2,
        "both ranks used the store after the strangers:\n{}",
        out.all()
    );
    let log = out.all();
    assert_eq!(log.matches("refused connection from").count(), 2, "{log}");
    assert!(log.contains("wrong job token"), "{log}");
}

#[test]
fn two_jobs_at_once_and_sigint_leaves_no_process_behind() {
    let mut a = trainer();
    a.args([
        "collectives",
        "--nproc-per-node",
        "2",
        "--len",
        "1000",
        "--iters",
        "200",
    ]);
    let mut b = trainer();
    b.args([
        "collectives",
        "--nproc-per-node",
        "2",
        "--len",
        "1000",
        "--iters",
        "200",
    ]);
    let (a, b) = (spawn(&mut a), spawn(&mut b));
    let (a, b) = (finish(a), finish(b));
    assert_eq!(a.code, Some(0), "{}", a.all());
    assert_eq!(b.code, Some(0), "{}", b.all());
    signal_stops_every_rank(libc::SIGINT);
}

/// `sig` to a launcher in the middle of a job: every rank stopped, exit code 128 + `sig`.
fn signal_stops_every_rank(sig: i32) {
    let mut launcher = spawn(&mut long_job(&[]));
    launcher.wait_for_line("ring connected");
    let ranks = children_of(launcher.id());
    assert_eq!(ranks.len(), 2, "{}", launcher.log());
    signal(launcher.id(), sig);
    let out = launcher.finish();
    assert_eq!(out.code, Some(128 + sig), "{}", out.all());
    assert!(
        out.stderr
            .contains(&format!("stopped every rank on signal {sig}")),
        "{}",
        out.all()
    );
    assert!(
        ranks.iter().all(|&p| !alive(p)),
        "ranks left behind: {ranks:?}"
    );
}

#[test]
fn sigterm_to_the_launcher_stops_every_rank() {
    signal_stops_every_rank(libc::SIGTERM);
}

/// A launcher killed with SIGKILL cannot stop its ranks: the kernel does
/// (`PR_SET_PDEATHSIG`). The ranks here would sleep for 10 minutes otherwise.
#[test]
fn ranks_die_with_a_killed_launcher() {
    let mut launcher = spawn(trainer().args([
        "launch",
        "--nproc-per-node",
        "2",
        "--",
        "sh",
        "-c",
        r#"echo "rank $RANK up"; exec sleep 600"#,
    ]));
    launcher.wait_for_lines(" up", 2);
    kill_launcher_and_expect_its_ranks_gone(&mut launcher);
    let out = launcher.finish();
    assert_eq!(out.signal, Some(libc::SIGKILL), "{}", out.all());
}

/// The digits run of these tests: Adam, 30 steps, a checkpoint every 10, the last 3 kept.
fn digits(name: &str, dir: &std::path::Path) -> std::path::PathBuf {
    let body = digits_config(ADAM, 8, "max_steps = 30").replace(
        "every_epochs = 0",
        "every_epochs = 0\nevery_steps = 10\nkeep_last = 3",
    );
    write_config(dir, name, &body)
}

fn train2(config: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = trainer();
    cmd.arg("--config")
        .arg(config)
        .args(["--nproc-per-node", "2"])
        .args(extra);
    for (k, v) in env {
        cmd.env(k, v);
    }
    run(&mut cmd)
}

#[test]
fn with_max_restarts_a_killed_rank_costs_nothing_but_time() {
    let dir = scratch("restart");
    let straight = digits("straight", &dir);
    let restarted = digits("restarted", &dir);
    assert_eq!(train2(&straight, &[], &[]).code, Some(0));
    let out = train2(
        &restarted,
        &["--max-restarts", "1"],
        &[
            ("TRAINER_CRASH_AFTER_STEP", "15"),
            ("TRAINER_CRASH_RANK", "0"),
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_says(
        &out.stderr,
        &[
            "rank 0 failed: killed by signal 9",
            "restarting every rank (1 of 1",
        ],
        &out,
    );
    assert_resumed_at(&out, 10);
    assert_same_weights(&dir, "straight", "restarted", 1e-6);
}

#[test]
fn a_crash_mid_checkpoint_resumes_from_the_previous_one() {
    let dir = scratch("crash-in-checkpoint");
    let straight = digits("straight", &dir);
    let crashed = digits("crashed", &dir);
    assert_eq!(train2(&straight, &[], &[]).code, Some(0));
    let out = train2(&crashed, &[], &[("TRAINER_CRASH_IN_CHECKPOINT", "20")]);
    assert_ne!(out.code, Some(0), "{}", out.all());
    let root = dir.join("crashed-ckpt");
    assert!(
        newest_checkpoint(&root).ends_with("step-00000010"),
        "the half-written checkpoint is not a checkpoint"
    );
    let out = train2(&crashed, &[], &[]);
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_says(&out.stderr, &["step 10", "interrupted checkpoint"], &out);
    assert!(!std::fs::read_dir(&root).unwrap().any(|e| e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .starts_with(".tmp")));
    assert_same_weights(&dir, "straight", "crashed", 1e-6);
}

#[test]
fn damaged_checkpoints_are_detected_and_skipped() {
    let dir = scratch("damaged");
    let config = digits("run", &dir);
    assert_eq!(train2(&config, &[], &[]).code, Some(0));
    let root = dir.join("run-ckpt");
    // Flip one byte in the newest weights, truncate the optimizer state of the one before.
    let newest = root.join("step-00000030/model.safetensors");
    let mut bytes = std::fs::read(&newest).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&newest, bytes).unwrap();
    let previous = root.join("step-00000020/optimizer.bpk");
    let bytes = std::fs::read(&previous).unwrap();
    std::fs::write(&previous, &bytes[..bytes.len() / 3]).unwrap();

    let out = run(trainer()
        .arg("eval")
        .arg("--config")
        .arg(&config)
        .arg("--checkpoint")
        .arg(&root));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(
        out.stdout.contains("step 10"),
        "falls back to the last good one:\n{}",
        out.all()
    );
    assert_says(
        &out.stderr,
        &["step-00000030: model.safetensors is corrupted"],
        &out,
    );
    assert_says(
        &out.stderr,
        &["step-00000020: optimizer.bpk is corrupted"],
        &out,
    );

    // Pointing at the damaged one directly is a clear error, not a panic.
    let out = run(trainer()
        .arg("eval")
        .arg("--config")
        .arg(&config)
        .arg("--checkpoint")
        .arg(root.join("step-00000030")));
    assert_ne!(out.code, Some(0));
    assert!(
        out.stderr.contains("corrupted") && !out.stderr.contains("panicked"),
        "{}",
        out.all()
    );
}

/// A checkpoint another build wrote (another format version: the Burn 0.21 build's, seen from
/// the next one) is refused with exit code 2 naming the version and the way out — never
/// skipped, which would start over and rotate the user's checkpoints out.
#[test]
fn a_checkpoint_of_another_format_version_is_refused_not_skipped() {
    let dir = scratch("other-format");
    let config = digits("run", &dir);
    assert_eq!(train2(&config, &[], &[]).code, Some(0));
    let root = dir.join("run-ckpt");
    let manifest = root.join("step-00000030/manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    assert!(text.contains("\"burn_version\": \"0.22.1\""), "{text}");
    // What a build on Burn 0.21 wrote (format 2, MessagePack records).
    let older = text
        .replace("\"format_version\": 3", "\"format_version\": 2")
        .replace(
            "\"burn_version\": \"0.22.1\"",
            "\"burn_version\": \"0.21.0\"",
        );
    assert_ne!(older, text);
    std::fs::write(&manifest, &older).unwrap();
    let before = checkpoint_steps(&root);

    let out = train2(&config, &[], &[]);
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_says(
        &out.stderr,
        &["format version 2", "Burn 0.21.0", "--no-resume"],
        &out,
    );
    assert_eq!(checkpoint_steps(&root), before, "nothing written or pruned");
    assert_eq!(std::fs::read_to_string(&manifest).unwrap(), older);

    let out = run(trainer()
        .arg("eval")
        .arg("--config")
        .arg(&config)
        .arg("--checkpoint")
        .arg(&root));
    assert_eq!(out.code, Some(2), "{}", out.all());
}

#[test]
fn ranks_with_different_configs_refuse_to_start() {
    let dir = scratch("config-mismatch");
    let a = digits("a", &dir);
    let b = write_config(
        &dir,
        "b",
        &std::fs::read_to_string(&a)
            .unwrap()
            .replace("seed = 7", "seed = 8"),
    );
    let (ranks, _port) = start_by_hand(|port| {
        [(&a, "0"), (&b, "1")]
            .into_iter()
            .map(|(config, rank)| {
                let mut cmd = trainer();
                cmd.arg("--config")
                    .arg(config)
                    .env("RANK", rank)
                    .env("WORLD_SIZE", "2")
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string());
                cmd
            })
            .collect()
    });
    let mut outs = ranks.into_iter().map(finish);
    let (r0, r1) = (outs.next().unwrap(), outs.next().unwrap());
    assert_eq!(r1.code, Some(2), "{}", r1.all());
    assert!(
        r1.stderr.contains("rank 1's config differs from rank 0's"),
        "{}",
        r1.all()
    );
    assert_ne!(
        r0.code,
        Some(0),
        "rank 0 does not train alone:\n{}",
        r0.all()
    );
}

/// The 4 KiB pages the files under `root` take on a tmpfs.
fn pages_under(root: &std::path::Path) -> u64 {
    let mut pages = 0;
    for entry in std::fs::read_dir(root).unwrap().filter_map(Result::ok) {
        let meta = entry.metadata().unwrap();
        if meta.is_dir() {
            pages += pages_under(&entry.path());
        } else {
            pages += meta.len().div_ceil(4096);
        }
    }
    pages
}

#[test]
fn a_full_disk_leaves_the_previous_checkpoint_intact() {
    let dir = scratch("full-disk");
    // Room for one checkpoint of this model, not two: one and a half, as measured here.
    let one = std::fs::read_to_string(digits("one", &dir))
        .unwrap()
        .replace("max_steps = 30", "max_steps = 10");
    let one = write_config(&dir, "one", &one);
    assert_eq!(train2(&one, &[], &[]).code, Some(0));
    assert_eq!(checkpoint_steps(&dir.join("one-ckpt")), ["step-00000010"]);
    let pages = pages_under(&dir.join("one-ckpt"));
    let size = format!("{}k", (pages + pages.div_ceil(2)) * 4);
    let Some(disk) = SmallDisk::mount(&dir.join("disk"), &size) else {
        return;
    };
    let ckpt = disk.0.join("ckpt");
    let body = std::fs::read_to_string(digits("run", &dir))
        .unwrap()
        .replace(
            &dir.join("run-ckpt").display().to_string(),
            &ckpt.display().to_string(),
        );
    let config = write_config(&dir, "run", &body);
    let out = train2(&config, &[], &[]);
    assert_ne!(out.code, Some(0), "{}", out.all());
    assert_says(&out.stderr, &["No space left on device"], &out);
    assert_says(
        &out.stderr,
        &["was not written (the previous checkpoints are intact)"],
        &out,
    );
    assert!(newest_checkpoint(&ckpt).ends_with("step-00000010"));
    let leftovers: Vec<_> = std::fs::read_dir(&ckpt)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        leftovers.len(),
        1,
        "no half-written directory: {leftovers:?}"
    );
    let eval = run(trainer()
        .arg("eval")
        .arg("--config")
        .arg(&config)
        .arg("--checkpoint")
        .arg(&ckpt));
    assert_eq!(
        eval.code,
        Some(0),
        "the previous checkpoint still loads:\n{}",
        eval.all()
    );
}

/// `digits` with the optimizer line of Adam's learning rate replaced by `lr` and `extra`
/// training keys, under the name `name` (so the same checkpoint directory for the same name).
fn digits_with(
    name: &str,
    dir: &std::path::Path,
    lr: &str,
    max_steps: usize,
    extra: &str,
) -> std::path::PathBuf {
    let body = std::fs::read_to_string(digits(name, dir))
        .unwrap()
        .replace("learning_rate = 0.003", &format!("learning_rate = {lr}"))
        .replace(
            "max_steps = 30",
            &format!("max_steps = {max_steps}\n{extra}"),
        );
    write_config(dir, name, &body)
}

/// The step directories under a checkpoint root, oldest first.
fn checkpoint_steps(root: &std::path::Path) -> Vec<String> {
    let mut steps: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    steps.sort();
    steps
}

#[test]
fn a_diverging_run_stops_naming_the_step_and_keeps_every_good_checkpoint() {
    let dir = scratch("diverging");
    let root = dir.join("run-ckpt");
    // 20 good steps: checkpoints at 10 and 20.
    let good = digits_with("run", &dir, "0.003", 20, "");
    assert_eq!(train2(&good, &[], &[]).code, Some(0));
    assert_eq!(checkpoint_steps(&root), ["step-00000010", "step-00000020"]);

    // Resumed with a learning rate of 1e30: the weights blow up after one step, the next
    // step's gradients are NaN, and the run must stop there — with keep_last = 3 and a
    // checkpoint due at step 30, a run that went on would rotate step 10 out.
    let diverging = digits_with("run", &dir, "1e30", 40, "");
    let out = train2(&diverging, &[], &[]);
    assert_ne!(out.code, Some(0), "{}", out.all());
    let line = out
        .stderr
        .lines()
        .find(|l| l.contains("non-finite gradients (NaN or Inf) at optimizer step"))
        .unwrap_or_else(|| panic!("no non-finite report:\n{}", out.all()));
    let step: usize = line
        .split("at optimizer step ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no step in: {line}"));
    assert!((21..=23).contains(&step), "diverged at step {step}: {line}");
    assert!(line.contains("first on rank(s) [0, 1]"), "{line}");
    assert!(
        line.contains("the newest checkpoint, of step 20, is kept"),
        "{line}"
    );
    assert_eq!(
        checkpoint_steps(&root),
        ["step-00000010", "step-00000020"],
        "no checkpoint written or deleted"
    );
    for step in ["step-00000010", "step-00000020"] {
        let weights = read_weights(&root.join(step).join("model.safetensors"));
        assert!(weights.values().flatten().all(|x| x.is_finite()), "{step}");
    }
    // And the newest one still loads: resumed with a sane rate, the run finishes exactly as a
    // run that never diverged.
    let out = train2(&digits_with("run", &dir, "0.003", 30, ""), &[], &[]);
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_resumed_at(&out, 20);
    let straight = digits_with("straight", &dir, "0.003", 30, "");
    assert_eq!(train2(&straight, &[], &[]).code, Some(0));
    assert_same_weights(&dir, "straight", "run", 1e-6);
}

/// With plain DDP and at ZeRO stage 3 (where each rank checks its shards of the
/// reduce-scattered gradients and the ranks agree one verdict).
#[test]
fn on_nonfinite_skip_finishes_and_counts_the_skipped_steps() {
    for stage in [0, 3] {
        check_nonfinite_skip(stage);
    }
}

fn check_nonfinite_skip(stage: u8) {
    let dir = scratch(&format!("nonfinite-skip-{stage}"));
    let config = digits_with("run", &dir, "1e30", 12, "on_nonfinite = \"skip\"");
    let body = std::fs::read_to_string(&config).unwrap()
        + &format!("\n[distributed]\nzero_stage = {stage}\n");
    let config = write_config(&dir, "run", &body);
    let out = train2(&config, &[], &[]);
    assert_eq!(out.code, Some(0), "{}", out.all());
    let skipped = skipped_steps(&out);
    // Step 1 is finite (it is what blows the weights up); from then on every step is NaN.
    assert!(
        (9..=11).contains(&skipped),
        "skipped {skipped}:\n{}",
        out.all()
    );
    assert_says(
        &out.stdout,
        &["optimizer steps with non-finite gradients"],
        &out,
    );
    assert_says(
        &out.stderr,
        &["skipped on every rank (training.on_nonfinite = \"skip\")"],
        &out,
    );
}

#[test]
fn a_model_too_big_for_memory_is_refused_before_any_rank_starts() {
    let dir = scratch("too-big");
    let body = std::fs::read_to_string(digits("big", &dir))
        .unwrap()
        .replace("hidden = [32]", "hidden = [100000000]");
    let config = write_config(&dir, "big", &body);
    let out = train2(&config, &[], &[]);
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_says(
        &out.stderr,
        &[
            "7,500,000,010 parameters need at least",
            "is available (",
            "2 ranks on this machine need",
        ],
        &out,
    );
    assert_no_rank_started(&out);
}

#[test]
fn a_straggler_is_named_in_the_stall_warning_of_a_live_job() {
    let dir = scratch("stall-warning");
    let body = std::fs::read_to_string(digits("run", &dir))
        .unwrap()
        .replace(
            "[output]",
            "[distributed]\nstall_warning_secs = 1\n\n[output]",
        );
    let config = write_config(&dir, "run", &body);
    let out = train2(
        &config,
        &[],
        &[
            ("TRAINER_STALL_AFTER_STEP", "3:4"),
            ("TRAINER_STALL_RANK", "1"),
        ],
    );
    assert_eq!(
        out.code,
        Some(0),
        "a straggler is only slow:\n{}",
        out.all()
    );
    let warning = out
        .all()
        .lines()
        .find(|l| l.starts_with("[rank 0]") && l.contains("has made no progress"))
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("rank 0 never warned:\n{}", out.all()));
    assert!(
        warning.contains("waiting for rank 1") && warning.contains("not seen in it: [1]"),
        "{warning}"
    );
}

#[test]
fn an_allocation_failure_is_a_clear_error_not_an_abort() {
    let dir = scratch("allocation-failure");
    // 225 M parameters: 2.7 GB for weights, gradients and a bucket, so the pre-flight (which
    // sees this machine's free memory) lets it start; a 4 GB address-space limit then makes
    // an allocation fail partway (Adam's state alone is another 1.8 GB).
    let body = std::fs::read_to_string(digits("big", &dir))
        .unwrap()
        .replace("hidden = [32]", "hidden = [3000000]");
    let config = write_config(&dir, "big", &body);
    let mut cmd = Command::new("sh");
    cmd.current_dir(env!("CARGO_MANIFEST_DIR").to_string() + "/..")
        .arg("-c")
        .arg("ulimit -v 4000000 && exec \"$0\" --config \"$1\"")
        .arg(trainer().get_program())
        .arg(&config);
    let out = run(&mut cmd);
    assert_eq!(out.code, Some(1), "{}", out.all());
    assert_says(
        &out.stderr,
        &["error: out of memory: allocating ", " bytes failed;"],
        &out,
    );
    assert!(!out.stderr.contains("panicked"), "{}", out.all());
}

#[test]
fn no_validation_set_is_said_so_and_a_file_as_checkpoint_dir_is_bad_input() {
    let dir = scratch("bad-inputs");
    let body = std::fs::read_to_string(digits("novalid", &dir))
        .unwrap()
        .replace(
            "source = \"digits\"",
            "source = \"digits\"\nvalidation_fraction = 0.0",
        );
    let config = write_config(&dir, "novalid", &body);
    let out = train2(&config, &[], &[]);
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert!(
        out.stdout.contains("no validation set") && !out.stdout.contains("Accuracy"),
        "{}",
        out.all()
    );

    let file = dir.join("not-a-dir");
    std::fs::write(&file, "x").unwrap();
    let body = std::fs::read_to_string(digits("filedir", &dir)).unwrap();
    let ckpt = dir.join("filedir-ckpt").display().to_string();
    let config = write_config(
        &dir,
        "filedir",
        &body.replace(&ckpt, &file.display().to_string()),
    );
    let out = train2(&config, &[], &[]);
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_says(
        &out.stderr,
        &["checkpoint.dir = ", "is a file, not a directory"],
        &out,
    );
    assert_no_rank_started(&out);
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        "x",
        "the file is untouched"
    );
}
