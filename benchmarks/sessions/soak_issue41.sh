#!/usr/bin/env bash
# Issue 41's soak on one GPU: Qwen2.5-1.5B GRPO (random init, GSM8K prompts) at the seed run's per-GPU share
# (128 prompts x 5, mini-batches of 32), STEPS (100) steps with a checkpoint every 20, one `kill -9` at a random
# step past the first checkpoint, then the same command again (it resumes from its last checkpoint). Then
# `python -m jaxrl_llm.bench.soak` reads the run dir: peak memory flat (2% after each process's first 2 steps),
# throughput flat (5%), nothing compiled after a process's first step, and the killed run's steps after its
# checkpoint equal to their second run (RTOL, default 0: bit for bit). Run from the repo root with .whl and
# .bench_data carried; results land in $OUT. In calls of under 10 minutes:
#   start   starts the run and its watcher in the background (the watcher kills it at KILL_AT, default random,
#           and starts the same command again), then waits WAIT_S (default 540) printing progress
#   wait    waits WAIT_S more, printing progress, until the second run ends
#   check   the report ($OUT/soak_report.json), and the run's metrics, logs and plan in $OUT/soak_run.tgz
# The watcher runs in a session of its own (setsid): the device tool ends a command's processes when it returns,
# all but those, and empties $OUT before each command, so the runs log into RUN_DIR and `check` brings them back.
#   all     start, wait until the end, check (a machine without a time limit per call)
#   d2h     (after check, where device time is left; about 60 s) benchmarks/diag/d2h_copy.py on D2H_GB (16) of
#           leaves: where the checkpoint's device-to-host copy goes (pinned twice, pageable, serial)
# Knobs: STEPS, SAVE_FREQ (20), KILL_AT, MAX_RESPONSE (256: a random model runs every row to its cap; the seed's
# mean is 232), PRESET (qwen2p5_1p5b), PROMPTS (128), N (5), MINI (32), TOKEN_BUDGET (16384), KEEP (1: the
# checkpoints kept), RUN_DIR, DATA (.bench_data), EXTRA_GIN (more bindings, space-separated).
# KEEP is 1, not the trainer's 2: the 1.5B's state is 18.5 GB (fp32 weights and two moments), incompressible once
# the moments are nonzero, and the disk holds KEEP + 1 checkpoints while a save is in flight: 56 GB at 2, on the
# one-GPU machine's 64 GiB disk beside the image and the compilation cache.
source "$(dirname "$0")/common.sh"
RUN_DIR=${RUN_DIR:-/tmp/soak_issue41}
STEPS=${STEPS:-100}
SAVE_FREQ=${SAVE_FREQ:-20}
DATA=${DATA:-.bench_data}
CMD=(python3 -m jaxrl_llm.train --gin_file=gin/base.gin --gin_file=gin/algos/grpo.gin
  "--gin_param=model.preset='${PRESET:-qwen2p5_1p5b}'" "--gin_param=model.tokenizer_path='$DATA/qwen2_tokenizer'"
  "--gin_param=data.source='files'" "--gin_param=data.train_files=('$DATA/gsm8k_test.jsonl',)"
  "--gin_param=data.val_files=()" "--gin_param=data.train_batch_size=${PROMPTS:-128}"
  "--gin_param=data.max_prompt_length=512" "--gin_param=data.max_response_length=${MAX_RESPONSE:-256}"
  "--gin_param=rollout.n=${N:-5}" "--gin_param=actor.ppo_mini_batch_size=${MINI:-32}"
  "--gin_param=actor.ppo_max_token_len_per_gpu=${TOKEN_BUDGET:-16384}" "--gin_param=model.remat='auto'"
  "--gin_param=train.total_training_steps=$STEPS" "--gin_param=train.save_freq=$SAVE_FREQ"
  "--gin_param=train.max_checkpoints_to_keep=${KEEP:-1}"
  "--gin_param=train.test_freq=-1" "--gin_param=train.driver='inprocess'" "--gin_param=train.progress_bar=False"
  "--gin_param=train.logger=('console', 'jsonl')" "--gin_param=train.run_dir='$RUN_DIR'"
  "--gin_param=train.compilation_cache_dir='/tmp/soak_issue41_xla'")
read -r -a extra <<< "${EXTRA_GIN:-}"  # more bindings, space-separated (none may hold a space)
for binding in "${extra[@]}"; do CMD+=("--gin_param=$binding"); done

steps_logged() { cat "$RUN_DIR/metrics.jsonl" 2>/dev/null | wc -l; }

no_run() {  # a machine given back between calls (30 s idle) comes back bare: say so at once, not after WAIT_S
  [ -f "$RUN_DIR/soak_plan" ] && return 1
  echo "soak: no run on this machine ($RUN_DIR/soak_plan is missing): the machine was given back since 'start'" \
    "(it keeps a run only while warm). Run 'start' again." >&2
}

progress() {  # until the second run has ended or $1 seconds have passed, never past them (a call's limit)
  local t_end=$(( $(date +%s) + $1 )) left
  no_run && return 2
  while [ "$(date +%s)" -lt "$t_end" ]; do
    echo "[$(date +%H:%M:%S)] steps logged: $(steps_logged) of $STEPS; $(cat "$RUN_DIR/soak_state" 2>/dev/null)"
    grep -hE "Error|Traceback" "$RUN_DIR"/soak_run*.log 2>/dev/null | tail -2 | cut -c1-300
    grep -q "^run2 ended" "$RUN_DIR/soak_state" 2>/dev/null && return 0
    left=$(( t_end - $(date +%s) ))
    (( left > 0 )) && sleep $(( left < 30 ? left : 30 ))
  done
  return 1
}

start() {
  rm -rf "$RUN_DIR" && mkdir -p "$RUN_DIR"
  # A step past the first checkpoint and short of the last, so the resumed run redoes some steps.
  local kill_at=${KILL_AT:-$(( SAVE_FREQ + 1 + RANDOM % (STEPS - SAVE_FREQ - 2) ))}
  [ $(( kill_at % SAVE_FREQ )) = 0 ] && kill_at=$(( kill_at + 1 ))  # not at a checkpoint: some steps are redone
  echo "kill_at=$kill_at steps=$STEPS save_freq=$SAVE_FREQ" | tee "$RUN_DIR/soak_plan"
  nvidia-smi -L > "$RUN_DIR/gpus.txt" 2>/dev/null
  # The watcher: the run, a SIGKILL once kill_at steps are logged, then the same command again.
  setsid nohup bash -c '
    "$@" > "'"$RUN_DIR"'/soak_run1.log" 2>&1 & pid=$!
    echo "run1 pid $pid" > "'"$RUN_DIR"'/soak_state"
    while kill -0 $pid 2>/dev/null; do
      if [ "$(cat "'"$RUN_DIR"'/metrics.jsonl" 2>/dev/null | wc -l)" -ge '"$kill_at"' ]; then
        kill -9 $pid; echo "run1 killed at step '"$kill_at"'" > "'"$RUN_DIR"'/soak_state"; break
      fi
      sleep 1
    done
    wait $pid; rc1=$?
    echo "run2 started (run1 rc $rc1)" > "'"$RUN_DIR"'/soak_state"
    "$@" > "'"$RUN_DIR"'/soak_run2.log" 2>&1; rc2=$?
    echo "run2 ended rc $rc2" > "'"$RUN_DIR"'/soak_state"
  ' soak "${CMD[@]}" > "$RUN_DIR/watcher.log" 2>&1 &
  progress "${WAIT_S:-540}"
}

check() {
  no_run && return 2
  (cd "$RUN_DIR" && tar -czf "$OUT/soak_run.tgz" metrics*.jsonl soak_plan soak_state soak_run*.log gpus.txt \
    watcher.log 2>/dev/null)
  python3 -m jaxrl_llm.bench.soak "$RUN_DIR" --rtol "${RTOL:-0}" --out "$OUT/soak_report.json"
  echo "soak check rc=$?"
}

case "${1:?phase: start, wait, check, all or d2h}" in
  start) start ;;
  wait) progress "${WAIT_S:-540}"; rc=$?; [ $rc = 2 ] && exit 2 ;;
  check) check || exit $? ;;
  all) WAIT_S=100000 start; check ;;
  d2h) timeout 150 python3 benchmarks/diag/d2h_copy.py "${D2H_GB:-16}" > "$OUT/d2h.log" 2>&1; echo "rc=$?"
       grep -vE "^(W|I)[0-9]{4}" "$OUT/d2h.log" | tail -8 ;;
  *) echo "unknown phase $1" >&2; exit 2 ;;
esac
