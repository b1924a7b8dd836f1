//! `trainer launch [OPTIONS] -- PROGRAM [ARGS...]`: any program as supervised ranks, with the
//! same environment, failure reports and restarts as `trainer --nproc-per-node N`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::*;

/// `trainer launch <options> -- <program...>`.
fn launch(options: &[&str], program: &[&str]) -> Output {
    run(trainer()
        .arg("launch")
        .args(options)
        .arg("--")
        .args(program))
}

/// A program for ranks that leaves `started-<RANK>` in a fresh scratch directory: the
/// directory, and the `sh -c` script.
fn rank_marker(name: &str) -> (PathBuf, String) {
    let dir = scratch(name);
    let script = format!("touch {}/started-$RANK", dir.display());
    (dir, script)
}

/// The launch was refused as bad input, saying `needles`, and no rank left its marker in `dir`.
fn assert_refused_before_any_rank(out: &Output, needles: &[&str], dir: &Path) {
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_says(&out.stderr, needles, out);
    let started = std::fs::read_dir(dir).map_or(0, |d| d.count());
    assert_eq!(started, 0, "a rank started:\n{}", out.all());
}

#[test]
fn every_rank_gets_its_rank_the_world_size_and_the_store_port() {
    let out = launch(
        &["--nproc-per-node", "2"],
        &[
            "sh",
            "-c",
            r#"echo "rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK port=$MASTER_PORT""#,
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.all());
    let mut lines: Vec<&str> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("rank="))
        .collect();
    lines.sort();
    assert_eq!(lines.len(), 2, "one line per rank:\n{}", out.all());
    let field = |line: &str, key: &str| -> String {
        line.split(' ')
            .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key} in {line:?}"))
            .to_string()
    };
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(field(line, "rank"), i.to_string(), "{}", out.all());
        assert_eq!(field(line, "local"), i.to_string(), "{}", out.all());
        assert_eq!(field(line, "world"), "2", "{}", out.all());
    }
    // One store for the job, on the port the launcher bound (the OS picked it).
    let port = field(lines[0], "port");
    assert_eq!(port, field(lines[1], "port"), "{}", out.all());
    assert!(port.parse::<u16>().is_ok_and(|p| p != 0), "{}", out.all());
}

#[test]
fn a_failing_rank_fails_the_job_with_its_exit_code_and_is_named() {
    // Rank 1 gives up; rank 0 would run for a minute, so it must be stopped by the launcher.
    let out = launch(
        &["--nproc-per-node", "2"],
        &[
            "sh",
            "-c",
            r#"if [ "$RANK" = 1 ]; then echo "rank one gives up" >&2; exit 3; fi; exec sleep 60"#,
        ],
    );
    assert_eq!(out.code, Some(3), "{}", out.all());
    assert!(
        out.stderr.contains("rank 1 failed: exit code 3"),
        "the report names the rank and its exit code:\n{}",
        out.all()
    );
    assert!(
        out.stderr.contains("[rank 1] rank one gives up"),
        "the failing rank's own words are shown:\n{}",
        out.all()
    );
    assert!(!out.stderr.contains("rank 0 failed"), "{}", out.all());
}

#[test]
fn max_restarts_starts_every_rank_again_after_a_failure() {
    let out = launch(
        &["--nproc-per-node", "2", "--max-restarts", "1"],
        &[
            "sh",
            "-c",
            r#"if [ "$TRAINER_RESTART_COUNT" = 0 ]; then exit 1; fi; echo "rank $RANK ok on attempt $TRAINER_RESTART_COUNT""#,
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_says(&out.stderr, &["restarting every rank (1 of 1"], &out);
    for rank in 0..2 {
        assert!(
            out.stdout.contains(&format!("rank {rank} ok on attempt 1")),
            "{}",
            out.all()
        );
    }
}

#[test]
fn a_missing_program_is_bad_input_named_in_the_message() {
    let out = launch(
        &["--nproc-per-node", "2"],
        &["no-such-program-for-burn-ddp", "--flag"],
    );
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert!(
        out.stderr.contains("no-such-program-for-burn-ddp"),
        "the message names the program:\n{}",
        out.all()
    );
    // Not a launch: no rank was started, so no failure report.
    assert!(!out.stderr.contains("failed:"), "{}", out.all());
}

#[test]
fn a_job_beyond_the_machines_limits_is_refused_before_any_rank_starts() {
    // 100 ranks need the launcher to hold about 316 descriptors (the store's connections, the
    // ranks' pipes): under `ulimit -n 64` the job is refused before a process starts, instead
    // of a failed accept part-way. (The same check guards the kernel's task cap: a mistyped
    // `--nproc-per-node 100000` is refused at once rather than flooding the machine.)
    let (dir, marker) = rank_marker("launch-beyond-limits");
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg("ulimit -n 64 && exec \"$0\" launch --nproc-per-node 100 -- sh -c \"$1\"")
        .arg(trainer().get_program())
        .arg(&marker);
    without_launcher_identity(&mut cmd);
    let out = run(&mut cmd);
    assert_refused_before_any_rank(
        &out,
        &[
            "cannot start 100 local ranks",
            "no rank was started",
            "open files: ulimit -n 64",
            "needs about 316",
            "trainer doctor",
        ],
        &dir,
    );
}

#[test]
fn a_launcher_option_without_nproc_per_node_starts_one_supervised_rank() {
    // As torchrun's `--nproc-per-node` defaults to 1: `--log-dir` (or `--nnodes`,
    // `--max-restarts`, ...) alone is a launch of one rank, not an option a run of one process
    // silently ignores.
    let dir = scratch("launch-one-rank");
    let config = write_config(&dir, "one", &digits_config(SGD, 32, ""));
    let logs = dir.join("logs");
    let out = run(trainer()
        .arg("--config")
        .arg(&config)
        .arg("--log-dir")
        .arg(&logs));
    assert_eq!(out.code, Some(0), "{}", out.all());
    assert_says(&out.stderr, &["launching 1 rank(s) on node 0 of 1"], &out);
    let log = std::fs::read_to_string(logs.join("rank-0.log")).unwrap_or_default();
    assert!(
        log.contains("checkpoint written"),
        "rank 0's own log:\n{log}\n{}",
        out.all()
    );
}

#[test]
fn launching_from_inside_a_rank_of_another_launcher_is_refused() {
    // What `srun -n 2 trainer --nproc-per-node 2 ...` gives each task: Slurm's rank variables.
    // Each task would otherwise start its own job of 2 ranks, both writing the same output.
    let (dir, marker) = rank_marker("launch-nested");
    let out = run(trainer()
        .args(["launch", "--nproc-per-node", "2", "--", "sh", "-c", &marker])
        .env("SLURM_PROCID", "1")
        .env("SLURM_NTASKS", "2")
        .env("SLURM_LOCALID", "1")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", "29500"));
    assert_refused_before_any_rank(
        &out,
        &["already rank 1 of 2", "drop the launcher options"],
        &dir,
    );
}

#[test]
fn the_trainer_itself_trains_under_trainer_launch() {
    let dir = scratch("launch-trainer");
    let config = write_config(&dir, "launched", &digits_config(SGD, 8, "max_steps = 5"));
    let exe = trainer().get_program().to_owned();
    let out = run(trainer()
        .args(["launch", "--nproc-per-node", "2", "--"])
        .arg(exe)
        .arg("--config")
        .arg(&config));
    assert_eq!(
        out.code,
        Some(0),
        "2 ranks of `trainer --config` under `trainer launch`:\n{}",
        out.all()
    );
    newest_checkpoint(&dir.join("launched-ckpt"));
}

#[test]
fn bad_input_exit_2_is_never_restarted() {
    let out = launch(
        &["--nproc-per-node", "2", "--max-restarts", "3"],
        &[
            "sh",
            "-c",
            r#"echo "rank $RANK attempt $TRAINER_RESTART_COUNT"; exit 2"#,
        ],
    );
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert!(!out.stderr.contains("restarting"), "{}", out.all());
    assert_eq!(
        out.stdout.matches(" attempt ").count(),
        2,
        "one attempt of each rank:\n{}",
        out.all()
    );
}

#[test]
fn the_report_ends_with_the_failing_ranks_last_lines_and_every_line_is_tagged() {
    // Rank 0 speaks first (rank 1 waits for its file), then rank 1 fails.
    let dir = scratch("last-lines");
    let ready = dir.join("ready");
    let out = run(trainer()
        .args(["launch", "--nproc-per-node", "2", "--", "sh", "-c"])
        .arg(
            r#"if [ "$RANK" = 0 ]; then echo "rank zero is up" >&2; touch "$READY"; exec sleep 60; fi
               while [ ! -e "$READY" ]; do sleep 0.05; done
               echo "rank one: first words" >&2; echo "rank one: last words" >&2; exit 3"#,
        )
        .env("READY", &ready));
    assert_eq!(out.code, Some(3), "{}", out.all());
    assert_says(&out.stderr, &["[rank 0] rank zero is up"], &out);
    let lines: Vec<&str> = out.stderr.lines().collect();
    let report = lines
        .iter()
        .rposition(|l| l.contains("trainer launcher: rank 1 failed: exit code 3"))
        .unwrap_or_else(|| panic!("no report:\n{}", out.all()));
    assert_eq!(
        &lines[report + 1..],
        [
            "---- last lines of rank 1 ----",
            "[rank 1] rank one: first words",
            "[rank 1] rank one: last words",
        ],
        "{}",
        out.all()
    );
}

#[test]
fn every_line_of_every_rank_is_forwarded_on_success() {
    const LINES: usize = 20000;
    let out = launch(
        &["--nproc-per-node", "2"],
        &[
            "sh",
            "-c",
            &format!(
                r#"seq 1 {LINES} | sed "s/^/rank $RANK err /" >&2; echo "rank $RANK out done""#
            ),
        ],
    );
    assert_eq!(out.code, Some(0), "{}", out.all());
    for rank in 0..2 {
        let err = format!("[rank {rank}] rank {rank} err ");
        let got = out.stderr.lines().filter(|l| l.starts_with(&err)).count();
        assert_eq!(got, LINES, "stderr lines of rank {rank}");
        assert!(out.stderr.contains(&format!("{err}{LINES}\n")));
        // Ranks share the launcher's stdout (untagged, as under torchrun): whole short lines.
        assert!(
            out.stdout.contains(&format!("rank {rank} out done\n")),
            "{}",
            out.stdout
        );
    }
}
