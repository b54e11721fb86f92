#!/usr/bin/env bash
# Issue 43 (Qwen3.5) on one GPU, in calls of under 10 minutes each. Run from the repo root with .whl and .bench_data
# carried; results land in $OUT.
#   kernels   the Pallas kernels of the linear layers compiled on the GPU against their jnp references at
#             Qwen3.5-9B's shapes (kernels/gdn_decode.py's decode step; the chunked kernel's gpu tests if present)
#   gen       generation at the seed's per-GPU share (128 prompts x 5, GSM8K lengths), Qwen3.5-9B then
#             Qwen2.5-7B, paged engine, one measured repeat each (PRESETS overrides)
#   e2e       the GRPO step at the seed's share with LoRA r32, Qwen3.5-9B then Qwen2.5-7B (PRESETS overrides)
#   moe       the LoRA step of Qwen3.5-35B-A3B and Qwen3-30B-A3B at 128 prompts x 5 (an H200)
#   gdn       the chunked kernel's tokens/s against the attention layers' (bench section gated_delta)
source "$(dirname "$0")/common.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
CACHE=/tmp/issue43_xla_cache
for phase in ${PHASES:-kernels gen}; do
  case $phase in
    kernels)
      echo "=== kernels"
      files=$(ls tests/kernels/test_gdn_decode.py tests/kernels/test_gated_delta.py 2>/dev/null)
      timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu $files > "$OUT/kernels.log" 2>&1
      echo "rc=$?"; grep -E "passed|failed|Error|^E " "$OUT/kernels.log" | head -20 | cut -c1-300 ;;
    gen)
      for p in ${PRESETS:-qwen3_5_9b qwen2p5_7b}; do
        run "gen_$p" "${T_GEN:-280}" python3 -m jaxrl_llm.bench --sections gen --presets "$p" --engines paged \
          --repeats 1 --compile_cache "$CACHE"
      done ;;
    e2e)
      for p in ${PRESETS:-qwen3_5_9b qwen2p5_7b}; do
        run "e2e_${p}_lora32" "${T_E2E:-280}" python3 -m jaxrl_llm.bench --sections e2e --train_presets "$p" \
          --lora_rank 32 --remat auto --token_budget 16384 --steps 2 --compile_cache "$CACHE"
      done ;;
    moe)
      for p in ${PRESETS:-qwen3_5_35b_a3b qwen3_30b_a3b}; do
        run "e2e_${p}_lora32" "${T_E2E:-280}" python3 -m jaxrl_llm.bench --sections e2e --train_presets "$p" \
          --lora_rank 32 --remat auto --token_budget 16384 --steps 2 --compile_cache "$CACHE"
      done ;;
    gdn)
      run gated_delta "${T_GDN:-200}" python3 -m jaxrl_llm.bench --sections gated_delta --compile_cache "$CACHE" ;;
  esac
done
# diag (not in the default phases): the decode program's memory at the 9B's shapes, compiled, with XLA's buffer dump
if [[ " ${PHASES:-} " == *" diag "* ]]; then
  echo "=== diag"
  XLA_FLAGS="--xla_dump_to=/tmp/xd" timeout 300 python3 benchmarks/diag/decode_memory.py ${DIAG_SLOTS:-256 1024} \
    > "$OUT/diag.log" 2>&1
  echo "rc=$?"; grep -vE "cuda_timer|^W1" "$OUT/diag.log" | tail -40 | cut -c1-200
fi
