#!/usr/bin/env bash
# Issue 13 on one GPU, in calls of under 10 minutes each (the device tool's limit). Run from the repo
# root on the GPU machine with .whl and .bench_data carried; results land in $OUT.
#   decode_sync  the seed-shaped 7B generation with XLA's and the Pallas decode attention, then the
#                7B weights checkpoint (Orbax defaults against weights_io) in /tmp and /dev/shm
#   e2e          the 1.5B seed-shaped GRPO step, 3 steps with an empty compilation cache (XLA
#                attention), then 3 with the Pallas decode attention and the cache the first filled
#   e2e_warm     the 1.5B step with an empty cache, then the identical run again (cold and warm)
source "$(dirname "$0")/common.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
df -h /tmp /dev/shm | tee -a "$OUT/gpus.txt"
E2E="--sections e2e --train_presets qwen2p5_1p5b --remat auto --token_budget 16384 --steps 3"
case "${1:?phase}" in
  decode_sync)
    run seed_gen_7b "${T1:-300}" python3 -m jaxrl_llm.bench --sections seed_gen --presets qwen2p5_7b \
      --schedules every64 --attentions xla,pallas --no_profile
    run sync_7b "${T2:-240}" python3 -m jaxrl_llm.bench --sections sync --presets qwen2p5_7b --dirs /tmp,/dev/shm
    ;;
  e2e)
    run e2e_xla_cold "${T1:-280}" python3 -m jaxrl_llm.bench $E2E --compile_cache /tmp/cc
    run e2e_pallas "${T2:-250}" python3 -m jaxrl_llm.bench $E2E --compile_cache /tmp/cc --decode_attention pallas
    ;;
  e2e_warm)
    rm -rf /tmp/cc_w
    run e2e_cold "${T1:-280}" python3 -m jaxrl_llm.bench $E2E --compile_cache /tmp/cc_w
    run e2e_warm "${T2:-250}" python3 -m jaxrl_llm.bench $E2E --compile_cache /tmp/cc_w
    ;;
esac
