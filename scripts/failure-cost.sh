#!/usr/bin/env bash
# What a rank's death costs, measured in one go on this machine: an MLP on the digits
# (HIDDEN, default 1024,1024 as in the torchft measurement of docs/fault-tolerance.md; per-rank
# batch 16, Adam, 200 steps, a checkpoint every 50 steps) at world 3, three runs of the same
# config: no failure; rank 1 killed in the middle of step 140 with
# `[fault_tolerance] on_rank_failure = "continue"` (the survivors re-form and train on); and
# the same kill under torchrun's model (`--max-restarts 1`: every rank restarts from the
# checkpoint of step 100); and the survivors' run again with `--max-restarts 1`, where the
# launcher starts rank 1 again and it joins the others (it says when its first step in the
# job ended, counted from its process start). Prints
# each run's wall time and the failure's cost against the first.
# Usage: [HIDDEN=32] [DETECTION=1.0] scripts/failure-cost.sh [path/to/trainer]
set -euo pipefail
trainer="${1:-target/release/trainer}"
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap '[ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT

config() { # NAME ON_RANK_FAILURE
  cat > "$work/$1.toml" <<TOML
[model]
name = "mlp"
hidden = [${HIDDEN:-1024,1024}]
[data]
source = "digits"
path = "$root/data/digits.csv.gz"
[optimizer]
name = "adam"
learning_rate = 0.003
[training]
epochs = 10
batch_size = 16
seed = 7
log_every = 10
max_steps = 200
[checkpoint]
dir = "$work/$1-ckpt"
every_steps = 50
every_epochs = 0
[fault_tolerance]
on_rank_failure = "$2"
detection_secs = ${DETECTION:-1.0}
[output]
dir = "$work/$1-out"
plots = false
TOML
}

timed() { # NAME ARGS... -> seconds of wall time
  local name="$1"; shift
  local start end
  start=$(date +%s.%N)
  "$@" > "$work/$name.log" 2>&1 || { echo "$name failed:"; tail -n 20 "$work/$name.log"; exit 1; }
  end=$(date +%s.%N)
  echo "$end - $start" | bc
}

config plain restart
config survivors continue
config restarted restart
config rejoined continue
plain=$(timed plain "$trainer" --config "$work/plain.toml" --nproc-per-node 3)
survivors=$(TRAINER_CRASH_IN_STEP=140 TRAINER_CRASH_RANK=1 \
  timed survivors "$trainer" --config "$work/survivors.toml" --nproc-per-node 3)
restarted=$(TRAINER_CRASH_IN_STEP=140 TRAINER_CRASH_RANK=1 \
  timed restarted "$trainer" --config "$work/restarted.toml" --nproc-per-node 3 --max-restarts 1)
rejoined=$(TRAINER_CRASH_IN_STEP=140 TRAINER_CRASH_RANK=1 \
  timed rejoined "$trainer" --config "$work/rejoined.toml" --nproc-per-node 3 --max-restarts 1)
regroup=$(grep '"kind":"regroup"' "$work/survivors-out/metrics.jsonl" | head -n 1)
join=$(grep '"kind":"regroup"' "$work/rejoined-out/metrics.jsonl" | sed -n 2p)
joiner=$(grep 'trained its first step' "$work/rejoined.log" | sed -e 's/^/    /')
printf 'no failure:                       %6.2f s\n' "$plain"
printf 'rank 1 killed, survivors go on:   %6.2f s (+%.2f s)\n  %s\n' "$survivors" \
  "$(echo "$survivors - $plain" | bc)" "$regroup"
printf 'rank 1 killed, --max-restarts 1:  %6.2f s (+%.2f s; steps 101-139 trained again)\n' \
  "$restarted" "$(echo "$restarted - $plain" | bc)"
printf 'rank 1 killed, survivors go on, --max-restarts 1 (it rejoins): %6.2f s (+%.2f s)\n  %s\n%s\n' \
  "$rejoined" "$(echo "$rejoined - $plain" | bc)" "$join" "$joiner"
