#!/usr/bin/env bash
# Issue 20 (the paged sampler) on one GPU, in calls of under 10 minutes each. Run from the repo root on
# the GPU machine with .whl and .bench_data carried; results land in $OUT.
#   gen7b   Qwen2.5-7B seed-shaped generation, dense then paged engine (one process each, same GPU)
#   gen8b   Qwen3-8B and Llama-3.1-8B seed-shaped generation on the paged engine at the default config
#   e2e     the seed-shaped GRPO step for qwen3_1p7b and llama3p2_3b at the default config
#   warm_gen   1.5B seed-shaped generation alone with an empty compilation cache, then again in a new process
#           with it warm; logs every program's trace, lowering and compile (or cache load) time
#   long    64 prompts x 5 with responses to 16,384 tokens (1.5B, paged)
#   warm_long  the 1.5B seed-shaped GRPO step with an empty compilation cache, then again with it warm;
#           then the long-response generation
source "$(dirname "$0")/common.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
E2E="--sections e2e --remat auto --token_budget 16384 --steps 2"
case "${1:?phase}" in
  gen7b)
    run gen7b "${T1:-560}" python3 -m jaxrl_llm.bench --sections gen --presets qwen2p5_7b --engines dense,paged --repeats 2
    ;;
  gen8b)
    run gen8b "${T1:-560}" python3 -m jaxrl_llm.bench --sections gen --presets qwen3_8b,llama3p1_8b --engines paged --repeats 1
    ;;
  e2e)
    run e2e_qwen3_1p7b "${T1:-290}" python3 -m jaxrl_llm.bench $E2E --train_presets qwen3_1p7b
    run e2e_llama3p2_3b "${T2:-290}" python3 -m jaxrl_llm.bench $E2E --train_presets llama3p2_3b
    ;;
  warm_long)
    rm -rf /tmp/cc_p
    E15="--sections e2e --train_presets qwen2p5_1p5b --remat auto --token_budget 16384 --steps 2"
    run e2e_1p5b_cold "${T1:-200}" python3 -m jaxrl_llm.bench $E15 --compile_cache /tmp/cc_p
    run e2e_1p5b_warm "${T2:-120}" python3 -m jaxrl_llm.bench $E15 --compile_cache /tmp/cc_p
    run long_1p5b "${T3:-240}" python3 -m jaxrl_llm.bench --sections long --presets qwen2p5_1p5b --repeats 0
    ;;
  warm_gen)
    rm -rf /tmp/cc_g /tmp/cc_e
    G15="--sections gen --presets ${PRESET:-qwen2p5_1p5b} --engines paged --repeats 1 --compile_cache /tmp/cc_g"
    run gen_cold "${T1:-300}" python3 -m jaxrl_llm.bench $G15 --log_compiles
    cp /tmp/out_gen_cold/*/jaxlog_*.txt "$OUT/" 2>/dev/null; for f in "$OUT"/jaxlog_*.txt; do mv "$f" "${f%.txt}_cold.txt"; done
    run gen_warm "${T2:-200}" python3 -m jaxrl_llm.bench $G15 --log_compiles
    cp /tmp/out_gen_warm/*/jaxlog_*.txt "$OUT/" 2>/dev/null
    du -sh /tmp/cc_g; ls /tmp/cc_g | wc -l
    if [ -n "${E2E_TOO:-}" ]; then
      E15="--sections e2e --train_presets qwen2p5_1p5b --remat auto --token_budget 16384 --steps 2"
      run e2e_1p5b_cold "${T3:-240}" python3 -m jaxrl_llm.bench $E15 --compile_cache /tmp/cc_e
      run e2e_1p5b_warm "${T4:-150}" python3 -m jaxrl_llm.bench $E15 --compile_cache /tmp/cc_e
    fi
    ;;
  long)
    run long_1p5b "${T1:-560}" python3 -m jaxrl_llm.bench --sections long --presets qwen2p5_1p5b --repeats 0
    ;;
esac
