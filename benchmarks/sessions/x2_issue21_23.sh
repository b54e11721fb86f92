#!/usr/bin/env bash
# Issues 21 and 23 on two GPUs of one host (nvidia-h100-x2), plus the LoRA sync timing on one of them.
# Run from the repo root with .whl and .bench_data carried; results land in $OUT.
#   moe_ep     the MoE actor update at Qwen3-30B-A3B's width, experts split over 2 GPUs (train.mesh_expert=2),
#              3 layers (one GPU's most) and more
#   lora_sync  the lora_sync section, JAX engine, Qwen2.5-3B rank 32 (7B runs out of memory: it keeps fp32 masters too): merge-at-sync vs a full sync,
#              and the decode cost of adapters beside the weights
#   lora_x2    the Qwen2.5-7B rank-32 GRPO step at the seed's per-GPU share, fsdp over 2 GPUs
source "$(dirname "$0")/common.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
for phase in ${PHASES:-moe_ep lora_sync}; do
  echo "=== $phase"
  case $phase in
    moe_ep)
      for l in ${MOE_LAYERS:-3 5}; do
        timeout 200 python3 -m jaxrl_llm.bench --sections moe_update --expert 2 --layers $l --out "$OUT/moe_ep_$l" \
          > "$OUT/moe_ep_$l.log" 2>&1
        echo "layers=$l rc=$?"; grep -E '"moe_update"|Error' "$OUT/moe_ep_$l.log" | cut -c1-400
      done ;;
    lora_sync)
      JAX_PLATFORMS= timeout 300 python3 -m jaxrl_llm.bench --sections lora_sync --engines jax --presets ${SYNC_PRESET:-qwen2p5_3b} --lora_rank 32 \
        --repeats 3 --out "$OUT" > "$OUT/lora_sync.log" 2>&1
      echo "rc=$?"; grep -E 'median|setup|Error' "$OUT/lora_sync.log" | cut -c1-300 ;;
    lora_x2)
      run e2e_7b_lora32_fsdp2 "${T1:-560}" python3 -m jaxrl_llm.bench --sections e2e --remat auto --token_budget 16384 \
        --steps 2 --train_presets qwen2p5_7b --lora_rank 32 --fsdp 2 ;;
  esac
done
