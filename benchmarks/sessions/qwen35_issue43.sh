#!/usr/bin/env bash
# Issue 43 (Qwen3.5) on one GPU, in calls of under 10 minutes each. Run from the repo root with .whl and .bench_data
# carried; results land in $OUT.
#   kernels   the Pallas kernels of the linear layers compiled on the GPU against their jnp references at
#             Qwen3.5-9B's shapes (kernels/gdn_decode.py's decode step; the chunked kernel's gpu tests if present)
#   gen       generation at the seed's per-GPU share (128 prompts x 5, GSM8K lengths), Qwen3.5-9B then
#             Qwen2.5-7B, paged engine, one measured repeat each (PRESETS overrides)
#   e2e       the GRPO step at the seed's share with LoRA r32, Qwen3.5-9B then Qwen2.5-7B (PRESETS overrides)
#   moe       the LoRA step of Qwen3.5-35B-A3B and Qwen3-30B-A3B at 128 prompts x 5 (an H200). The 35B's cold run
#             takes more than one call (its build alone passed 578 s at bf711fe, 2026-12-02): PRESETS=qwen3_5_35b_a3b
#             T_E2E=578 twice, the second call at once after the first (a machine stays lent 30 s), so that it
#             finds the first's compilation cache ($XLA_CACHE under /tmp) on the same machine
#   gdn       the chunked kernel's tokens/s against the attention layers' (bench section gated_delta)
#   train9b   (not in the defaults; about 570 s) the kernel's launch variants at 4096x4, then the 9B's LoRA r32 update
#             and log-prob passes at the seed's share with the chunked kernel (JAXRL_GDN_KERNEL=1) and in XLA's form
#             (=0), each with a kernel profile sorted by kind (bench section profile_update)
#   prefillmem (not in the defaults; about 90 s) the 9B's widest prefill programs compiled, not run: XLA's memory
#             with each linear layer's slot reads ordered after its input, and unordered (diag/prefill_memory.py)
#   check9b   (not in the defaults) the GPU check's 9B LoRA step alone (T_CHECK, 470 s by default)
#   profile9b (not in the defaults; one call of under 10 minutes on one H100, PROFILE_S = 560 s in all) the copy
#             program's compiled memory at the 9B's widest copies (benchmarks/diag/copy_memory.py: as built, each
#             linear layer's copy chained, against unchained); the 9B's generation at 256 rows with a kernel
#             profile (state_update scatter, one measured repeat); the same with state_update in_place and at the
#             default max_num_seqs (repeat 0 only: its seconds less phase_s.prepare are the warm figure's
#             estimate; gen_programs rows give each program's XLA memory: in place, whether XLA copied the pool).
#             Each run's timeout is what is left of the call less what the runs after it keep, so the last may be
#             cut: `run` copies the rows written so far.
#   seqs9b    (not in the defaults) the 9B's generation at the default max_num_seqs, one measured repeat, with
#             state_update scatter then in_place (what profile9b's last run may not have had the time for)
source "$(dirname "$0")/common.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
CACHE=$XLA_CACHE  # common.sh's: restored from .xla_cache where carried; `pack_cache` brings it back
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
    prefillmem)
      echo "=== prefill_memory"
      timeout 150 python3 benchmarks/diag/prefill_memory.py 64,128 32,256 > "$OUT/prefill_memory.log" 2>&1
      echo "rc=$?"; grep -E "^(pool|prefill)" "$OUT/prefill_memory.log" | cut -c1-200 ;;
    check9b)
      echo "=== gpu_check e2e_qwen3_5_9b_lora32"
      timeout -s TERM "${T_CHECK:-470}" python3 scripts/gpu_check.py --configs e2e_qwen3_5_9b_lora32 \
        --budget_s $(( ${T_CHECK:-470} - 10 )) --compile_cache "$CACHE" --out_dir "$OUT" > "$OUT/check9b.log" 2>&1
      echo "rc=$?"; tail -25 "$OUT/check9b.log" | cut -c1-300 ;;
    gdn)
      run gated_delta "${T_GDN:-200}" python3 -m jaxrl_llm.bench --sections gated_delta --compile_cache "$CACHE" ;;
    train9b)
      run gated_delta_launch 90 python3 -m jaxrl_llm.bench --sections gated_delta --gdn_shapes 4096x4 \
        --compile_cache "$CACHE"
      for kernel in 1 0; do
        JAXRL_GDN_KERNEL=$kernel run "profile_update_9b_lora32_kernel$kernel" "${T_TRAIN:-240}" python3 -m \
          jaxrl_llm.bench --sections profile_update --train_presets qwen3_5_9b --lora_rank 32 --remat auto \
          --token_budget 16384 --compile_cache "$CACHE"
      done ;;
    profile9b)
      t0=$SECONDS
      left() { local s=$(( ${PROFILE_S:-560} - (SECONDS - t0) - $1 )); echo $(( s > 30 ? s : 30 )); }
      echo "=== copy_memory"
      timeout 60 python3 benchmarks/diag/copy_memory.py 1024,707,27100 256,321,51453 > "$OUT/copy_memory.log" 2>&1
      echo "rc=$?"; grep -E "^copy" "$OUT/copy_memory.log" | cut -c1-200
      gen9b=(python3 -m jaxrl_llm.bench --sections gen --presets qwen3_5_9b --engines paged --compile_cache "$CACHE")
      run gen9b_seqs256_profile "$(left 260)" "${gen9b[@]}" --repeats 1 --max_num_seqs 256 --profile
      run gen9b_seqs256_in_place "$(left 150)" "${gen9b[@]}" --repeats 0 --max_num_seqs 256 --state_update in_place
      run gen9b_seqs_default "$(left 5)" "${gen9b[@]}" --repeats 0 ;;
    seqs9b)
      for mode in scatter in_place; do
        run "gen9b_seqs_default_$mode" "${T_GEN:-280}" python3 -m jaxrl_llm.bench --sections gen --presets qwen3_5_9b \
          --engines paged --repeats 1 --state_update "$mode" --compile_cache "$CACHE"
      done ;;
  esac
done
# diag (not in the default phases): the decode program's memory at the 9B's shapes, compiled, with XLA's buffer dump
if [[ " ${PHASES:-} " == *" diag "* ]]; then
  echo "=== diag"
  XLA_FLAGS="--xla_dump_to=/tmp/xd" timeout 300 python3 benchmarks/diag/decode_memory.py ${DIAG_SLOTS:-256 1024} \
    > "$OUT/diag.log" 2>&1
  echo "rc=$?"; grep -vE "cuda_timer|^W1" "$OUT/diag.log" | tail -40 | cut -c1-200
fi
if [[ " ${PHASES:-} " == *" diaggen "* ]]; then
  echo "=== diaggen"
  timeout "${T_DIAG:-400}" python3 benchmarks/diag/gen_memory.py ${DIAG_CAPS:-256 1024} > "$OUT/diaggen.log" 2>&1
  echo "rc=$?"; grep -vE "cuda_timer|^W1" "$OUT/diaggen.log" | tail -30 | cut -c1-250
fi
