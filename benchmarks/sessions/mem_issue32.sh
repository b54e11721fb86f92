#!/usr/bin/env bash
# Issue 32 on one GPU (nvidia-h100-x1; the H200 the same), in calls of under 10 minutes each. Run from the repo
# root with .whl and .bench_data carried; results land in $OUT.
#   check       scripts/gpu_check.py, its default configs while 540 s last (7B LoRA step, 1.5B step, MoE
#               update, Qwen3-1.7B step, Qwen3-8B generation); the ones left are reported "not run"
#   check_rest  CONFIGS (default: the last two) alone, for a second call; `gpu_check.py --merge` joins the two
#   matrix      the memory section (the memory check's verdict, before any work) for MATRIX_PRESETS x full/LoRA
#               x remat full/dots/auto; MATRIX_PRESETS defaults to the 1.5B and 7B, the rest in a second call
#   runs        one GRPO step of matrix cells the check passes and BENCHMARKS.md has not run yet (the 14B on an
#               int8 base with remat auto); a refused cell stops before work, a run one must not die mid-step
source "$(dirname "$0")/common.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
CACHE=/tmp/issue32_xla_cache  # one persistent compilation cache for every call on this warm machine
case "${1:?phase}" in
  check)
    python3 scripts/gpu_check.py --budget_s "${BUDGET_S:-540}" --compile_cache "$CACHE" ${RECORD:+--record} \
      --out_dir "$OUT" 2>&1 | tee "$OUT/gpu_check.log" | grep -E '^gpu_check|"report"' | cut -c1-400
    ;;
  check_rest)
    python3 scripts/gpu_check.py --configs "${CONFIGS:-e2e_qwen3_1p7b,gen_qwen3_8b}" --budget_s "${BUDGET_S:-540}" \
      --compile_cache "$CACHE" ${RECORD:+--record} --out_dir "$OUT" 2>&1 | tee "$OUT/gpu_check_rest.log" \
      | grep -E '^gpu_check|"report"' | cut -c1-400
    ;;
  matrix)
    run memory_matrix "${T1:-570}" python3 -m jaxrl_llm.bench --sections memory --compile_cache "$CACHE" \
      --train_presets "${MATRIX_PRESETS:-qwen2p5_1p5b,qwen2p5_7b}"
    ;;
  runs)
    run e2e_14b_lora32_int8_auto "${T1:-400}" python3 -m jaxrl_llm.bench --sections e2e --train_presets qwen2p5_14b \
      --lora_rank 32 --base_quantization int8 --remat auto --token_budget 16384 --steps 1 --compile_cache "$CACHE"
    ;;
esac
