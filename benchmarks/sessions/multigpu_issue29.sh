#!/usr/bin/env bash
# Issue 29 (each data-parallel shard its own engine) on every GPU of one host: run from the repo root with .whl and
# .bench_data carried; results land in $OUT. PHASES picks the phases (default: all, in this order):
#   check  0.5B (shards_check): every mesh of the machine's GPUs (fsdp, fsdp x tensor 2) against one GPU, greedy and sampled
#   gen    Qwen2.5-7B generation alone at the seed's per-GPU share (128 prompts x 5 a GPU, seed lengths), paged on
#          1 GPU and on all GPUs, then dense on all GPUs; 5 timed repeats after a warm one (SHARD_WORK=tiled: every
#          shard gets the 1-GPU run's prompt groups, so the K-GPU time compares like with like; DENSE=0 skips dense)
#   e2e    the 7B seed-share GRPO step, fsdp over all GPUs then fsdp/2 x tensor 2, paged and dense
source "$(dirname "$0")/common.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
K=$(nvidia-smi -L | wc -l)
CACHE=$XLA_CACHE  # common.sh's; jax's persistent cache: the 1-GPU run's engine programs serve the shards of the K-GPU run
for phase in ${PHASES:-check gen e2e}; do
  echo "=== $phase"
  case $phase in
    check)
      timeout "${T_CHECK:-300}" python3 -m jaxrl_llm.bench --sections shards_check --out /tmp/out_check \
        > "$OUT/check.log" 2>&1
      echo "rc=$?"; cut -c1-330 /tmp/out_check/rows.jsonl; cp /tmp/out_check/rows.jsonl "$OUT/check.jsonl" ;;
    gen)
      timeout "${T_GEN:-560}" python3 -m jaxrl_llm.bench --sections gen --presets qwen2p5_7b --engines paged \
        --devices "1,$K" --repeats "${REPEATS:-5}" ${SHARD_WORK:+--shard_work "$SHARD_WORK"} --compile_cache $CACHE \
        --out /tmp/out_gen > "$OUT/gen.log" 2>&1
      echo "rc=$?"
      [ "${DENSE:-1}" = 1 ] && timeout "${T_DENSE:-400}" python3 -m jaxrl_llm.bench --sections gen \
        --presets qwen2p5_7b --engines dense --devices "$K" --repeats "${REPEATS:-5}" --out /tmp/out_gen \
        >> "$OUT/gen.log" 2>&1
      echo "rc=$?"; python3 - <<'EOF'
import json
import glob
for line in (l for f in sorted(glob.glob("/tmp/out_gen/*/rows.jsonl")) for l in open(f)):
    r = json.loads(line)
    print({k: r.get(k) for k in ("engine", "devices", "rep", "seconds", "compile_s", "tokens_per_s", "kv_segments",
                                 "kv_shard_segments", "kv_plan_s", "kv_programs_compiled", "kv_programs_moved",
                                 "kv_programs_loaded", "error")})
EOF
      cat /tmp/out_gen/*/rows.jsonl > "$OUT/gen.jsonl" ;;
    e2e)
      for kv in ${KV:-paged dense}; do
        for tensor in ${TENSORS:-1 2}; do  # fsdp over the rest of the GPUs
          run "e2e_${kv}_fsdp$((K / tensor))_tensor$tensor" "${T_E2E:-420}" python3 -m jaxrl_llm.bench --sections e2e \
            --remat auto --token_budget 16384 --train_presets qwen2p5_7b --steps "${STEPS:-3}" --kv_cache "$kv" \
            --fsdp $((K / tensor)) --tensor "$tensor" --compile_cache $CACHE
        done
      done ;;
  esac
done
