#!/usr/bin/env bash
# Issue 20 (the paged sampler) on one GPU, in calls of under 10 minutes each. Run from the repo root on
# the GPU machine with .whl and .bench_data carried; results land in $OUT.
#   gen7b   Qwen2.5-7B seed-shaped generation, dense then paged engine (one process each, same GPU)
#   gen8b   Qwen3-8B and Llama-3.1-8B seed-shaped generation on the paged engine at the default config
#   e2e     the seed-shaped GRPO step for qwen3_1p7b and llama3p2_3b at the default config
#   long    64 prompts x 5 with responses to 16,384 tokens (1.5B, paged)
#   warm_long  the 1.5B seed-shaped GRPO step with an empty compilation cache, then again with it warm;
#           then the long-response generation
source "$(dirname "$0")/common.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
E2E="--sections e2e --remat auto --token_budget 16384 --steps 2"
case "${1:?phase}" in
  gen7b)
    run gen7b "${T1:-560}" python3 scripts/bench_paged.py --presets qwen2p5_7b --engines dense,paged --repeats 2
    ;;
  gen8b)
    run gen8b "${T1:-560}" python3 scripts/bench_paged.py --presets qwen3_8b,llama3p1_8b --engines paged --repeats 1
    ;;
  e2e)
    run e2e_qwen3_1p7b "${T1:-290}" python3 scripts/bench.py $E2E --train_presets qwen3_1p7b
    run e2e_llama3p2_3b "${T2:-290}" python3 scripts/bench.py $E2E --train_presets llama3p2_3b
    ;;
  warm_long)
    rm -rf /tmp/cc_p
    E15="--sections e2e --train_presets qwen2p5_1p5b --remat auto --token_budget 16384 --steps 2"
    run e2e_1p5b_cold "${T1:-200}" python3 scripts/bench.py $E15 --compile_cache /tmp/cc_p
    run e2e_1p5b_warm "${T2:-120}" python3 scripts/bench.py $E15 --compile_cache /tmp/cc_p
    run long_1p5b "${T3:-240}" python3 scripts/bench_paged.py --sections long --presets qwen2p5_1p5b --repeats 0
    ;;
  long)
    run long_1p5b "${T1:-560}" python3 scripts/bench_paged.py --sections long --presets qwen2p5_1p5b --repeats 0
    ;;
esac
