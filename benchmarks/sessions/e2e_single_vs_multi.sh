#!/usr/bin/env bash
# The seed-shaped 7B GRPO step in one process (all GPUs), then in NPROC processes (one per GPU,
# through the launcher), with the same config and a shared persistent compilation cache.
# Run from the repo root on the GPU machine with .whl and .bench_data carried; results land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L | tee "$OUT/gpus.txt"
STEPS=${STEPS:-4}
ARGS="--sections e2e --train_presets ${PRESET:-qwen2p5_7b} --steps $STEPS --remat auto --token_budget ${BUDGET:-16384} --compile_cache /tmp/xla_cache"
timeout "${T_SINGLE:-280}" python3 -m jaxrl_llm.bench $ARGS --out "$OUT/single" 2>&1 | grep -v "^I1\|^W1" | tee "$OUT/single.log" | grep -E '"e2e"|Error|error' | cut -c1-600
timeout "${T_MULTI:-280}" python3 -m jaxrl_llm.launch --num_processes ${NPROC:-4} --gpus_per_process 1 --module jaxrl_llm.bench -- $ARGS --out "$OUT/multi" 2>&1 | grep -v "^I1\|^W1" | tee "$OUT/multi.log" | grep -E '"e2e"|Error|error' | cut -c1-600
