#!/usr/bin/env bash
# Issue 21 (LoRA) on one GPU, in calls of under 10 minutes each. Run from the repo root on the GPU machine
# with .whl and .bench_data carried; results land in $OUT.
#   e2e7b    the Qwen2.5-7B seed-shaped GRPO step with rank-32 adapters on every linear layer (full fine-tuning
#            cannot fit one GPU)
#   e2e1p5b  Qwen2.5-1.5B full fine-tuning, then rank-32 LoRA, same machine
source "$(dirname "$0")/common.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
E2E="--sections e2e --remat auto --token_budget 16384 --steps ${STEPS:-2}"
case "${1:?phase}" in
  e2e7b)
    run e2e_7b_lora32 "${T1:-560}" python3 -m jaxrl_llm.bench $E2E --train_presets qwen2p5_7b --lora_rank 32
    ;;
  e2e1p5b)
    run e2e_1p5b_full "${T1:-280}" python3 -m jaxrl_llm.bench $E2E --train_presets qwen2p5_1p5b
    run e2e_1p5b_lora32 "${T2:-280}" python3 -m jaxrl_llm.bench $E2E --train_presets qwen2p5_1p5b --lora_rank 32
    ;;
esac
