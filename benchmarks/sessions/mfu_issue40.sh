#!/usr/bin/env bash
# Issue 40 (the training-bound step) on one host of GPUS GPUs (default 4; GPUS=2 for the 2-GPU fallback, the seed
# share of 2 GPUs at fsdp 2): run from the repo root with .whl and .bench_data carried; results land in $OUT.
# The 7B seed-share e2e step (`--sections e2e --remat auto --token_budget 16384 --train_presets qwen2p5_7b
# --kv_cache paged --fsdp GPUS`, 128 prompts x 5 a GPU, 4 mini-batches), each lever off, then on, in one call, and
# a kernel profile. PHASES picks the phases (default: off on profile, about 9 minutes on 4xH200 with a fresh
# compilation cache; STEPS=3 adds a second steady step to each e2e run, about +45 s each):
#   off       the levers off: the packing's shapes as before (actor.tail_shapes 3; the packing itself has no
#             switch), the old and reference passes as two programs, nothing compiled ahead, XLA's default flags
#   on        every lever on: 4 shapes, one program for the two log-prob passes, the ladder compiled ahead,
#             train.xla_gpu_overlap (jaxrl_llm/xla_flags.py); remat 'auto' walks the new ladder in both runs
#   noxla     'on' without the XLA overlap flags (what the flags alone do: against 'on')
#   mem80     'on' at an 80 GB card's memory (XLA_PYTHON_CLIENT_MEM_FRACTION=0.55 of an H200): which remat 'auto'
#             takes now (it took 'full' before: 47.2 s a step, 72.5 GB peak)
#   profile   one update and one log-prob pass (old + reference, fused) traced with jax.profiler at fsdp GPUS,
#             PROFILE_PROMPTS prompts x 5 a GPU (default 32: a quarter of the share, the same micro-batches), the
#             time of a device sorted into matmul, attention, collectives exposed / overlapped, elementwise and
#             norms, the optimizer and gaps (rows update_sorted, log_prob_sorted)
# Acceptance (issue 40): perf/mfu/actor and perf/mfu/log_prob >= 0.55, step <= 36 s on 4xH200 (<= 40 s in mem80),
# perf/compiles 0 after step 0, perf/pack_fill >= 0.95.
source "$(dirname "$0")/common.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
GPUS=${GPUS:-4}
CACHE=$XLA_CACHE  # common.sh's
SMALL=${SMALL:+--small}  # SMALL=1: the tiny model, to check the script's plumbing on a CPU
E2E=(python3 -m jaxrl_llm.bench --sections e2e --remat auto --token_budget 16384 --train_presets qwen2p5_7b
     --steps "${STEPS:-2}" --kv_cache paged --fsdp "$GPUS" --compile_cache $CACHE $SMALL)
OFF=(--tail_shapes 3 --fuse_log_prob_passes 0 --compile_ahead 0)
for phase in ${PHASES:-off on profile}; do
  case $phase in
    off) run e2e_off "${T_E2E:-290}" "${E2E[@]}" "${OFF[@]}" ;;
    on) run e2e_on "${T_E2E:-290}" "${E2E[@]}" --xla_gpu_overlap ;;
    noxla) run e2e_noxla "${T_E2E:-290}" "${E2E[@]}" ;;
    mem80) XLA_PYTHON_CLIENT_MEM_FRACTION=0.55 run e2e_mem80 "${T_E2E:-290}" "${E2E[@]}" --xla_gpu_overlap ;;
    profile)
      run profile "${T_PROFILE:-200}" python3 -m jaxrl_llm.bench --sections profile_update --remat auto \
        --token_budget 16384 --train_presets qwen2p5_7b --fsdp "$GPUS" --prompts_per_gpu "${PROFILE_PROMPTS:-32}" \
        --top 25 --xla_gpu_overlap --compile_cache $CACHE $SMALL
      grep -E '"(log_prob_pass|update)"' "$OUT/profile.log" | cut -c1-400 ;;
  esac
done
echo "=== summary"
result() {  # a run's bench.json, else the rows it wrote before a timeout
  if [ -f "$OUT/$1.json" ]; then echo "$OUT/$1.json"; elif [ -f "$OUT/$1.rows.jsonl" ]; then echo "$OUT/$1.rows.jsonl"; fi
}
E2E_COLS=step,wall_s,remat_used,fused,compile_ahead,timing_s/gen,timing_s/log_probs,timing_s/update_actor
E2E_COLS=$E2E_COLS,perf/mfu/actor,perf/mfu/log_prob,perf/pack_fill,perf/compiles,perf/compile_s,device_peak_gb
files=()
for name in e2e_off e2e_on e2e_noxla e2e_mem80; do
  f=$(result $name) && [ -n "$f" ] && files+=("$f")
done
[ ${#files[@]} -gt 0 ] && python3 -m jaxrl_llm.bench.table --section e2e --cols "$E2E_COLS" "${files[@]}" \
  | tee "$OUT/summary.md"
PROFILE_COLS=span_ms,gaps_ms,matmul_ms,attention_ms,collectives_ms,collectives_exposed_ms,collectives_overlapped_ms
PROFILE_COLS=$PROFILE_COLS,elementwise_ms,optimizer_ms
f=$(result profile)
for s in update_sorted log_prob_sorted; do
  [ -n "$f" ] && echo "$s" && python3 -m jaxrl_llm.bench.table --section $s --cols "$PROFILE_COLS" "$f" \
    | tee -a "$OUT/summary.md"
done
