#!/usr/bin/env bash
# Qwen2.5-1.5B seed-shaped GRPO steps on all GPUs of the machine: one process with a cold compilation
# cache, the same in one process per GPU (metrics must match), then one process again with the warm
# cache (its first step should compile almost nothing). Results (JSON rows and logs) land in $OUT.
source "$(dirname "$0")/common.sh"
N=$(nvidia-smi -L | wc -l)
ARGS="--sections e2e --train_presets ${PRESET:-qwen2p5_1p5b} --remat auto --token_budget 16384 --compile_cache /tmp/cc"
run single_cold "${T1:-200}" python3 -m jaxrl_llm.bench $ARGS --steps 3
run multi "${T2:-200}" python3 -m jaxrl_llm.launch --num_processes "$N" --gpus_per_process 1 --module jaxrl_llm.bench -- $ARGS --steps 3
run single_warm "${T3:-110}" python3 -m jaxrl_llm.bench $ARGS --steps 2
