#!/usr/bin/env bash
# Issues 21 and 23 on one GPU: LoRA on the full Qwen3-30B-A3B (H200) and on an 8-bit Qwen2.5-14B base (H100).
# Run from the repo root with .whl and .bench_data carried; results land in $OUT. PHASES picks the parts:
#   moe30b   GRPO steps of the full Qwen3-30B-A3B (48 layers, 128 experts, top-8), LoRA rank 32 on the
#            attention ('all-linear' on a MoE), bf16 frozen base, at the seed's per-GPU share (one H200)
#   quant    the quant section: the frozen base's memory (bf16 / int8 / fp8), the log-prob gap against
#            the bf16 base over GSM8K prompts, and one LoRA update's time with each base
#   e2e14b   GRPO steps of Qwen2.5-14B, LoRA rank 32 all-linear, int8 frozen base, seed's per-GPU share
#   bf16_14b the same on a bf16 base, which does not fit an H100: it must fail before any work
source "$(dirname "$0")/common.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
for phase in ${PHASES:-moe30b}; do
  case $phase in
    moe30b)  # the engine copy (61 GB) beside the frozen base (61 GB): give XLA most of the 141 GB
      export XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.96}
      run e2e_30b_a3b_lora32 "${T1:-560}" python3 -m jaxrl_llm.bench --sections e2e --train_presets qwen3_30b_a3b \
        --lora_rank 32 --remat full --token_budget ${BUDGET:-16384} --steps ${STEPS:-2} --prompts_per_gpu ${PROMPTS:-128} ;;
    quant)
      echo "=== quant"
      timeout "${T2:-300}" python3 -m jaxrl_llm.bench --sections quant --presets ${QPRESETS:-qwen2p5_14b} \
        --kinds ${KINDS:-int8,fp8} --lora_rank 32 --prompts 64 --token_budget 16384 --out "$OUT/quant" > "$OUT/quant.log" 2>&1
      echo "rc=$?"; grep -E '^\{|Error' "$OUT/quant.log" | cut -c1-500 ;;
    e2e14b)
      run e2e_14b_lora32_int8 "${T3:-560}" python3 -m jaxrl_llm.bench --sections e2e --train_presets qwen2p5_14b \
        --lora_rank 32 --base_quantization int8 --remat auto --token_budget ${BUDGET:-16384} --steps ${STEPS:-2} ;;
    bf16_14b)  # the same run on a bf16 base: the memory pre-check refuses it before any work
      run e2e_14b_lora32_bf16 120 python3 -m jaxrl_llm.bench --sections e2e --train_presets qwen2p5_14b \
        --lora_rank 32 --remat auto --token_budget ${BUDGET:-16384} --steps 1 ;;
  esac
done
