#!/usr/bin/env bash
# Issue 30 (asynchronous training on split devices) on every GPU of one host (x4 for the acceptance; x2 gives a
# 1 + 1 figure): run from the repo root with .whl and .bench_data carried; results land in $OUT. PHASES picks
# the phases (default: all, in this order):
#   sync   the weight sync between the meshes (sync_split), 7B bf16 and fp32 masters and LoRA adapters, every
#          split the GPUs allow, against a plain device_put (target: 7B bf16 in <= 0.1 s, no host copy)
#   long   async_longtail: sync, one_step_off and fully_async with partial rollouts on the same heavy tail of
#          response lengths (up to 8,192), ROLLOUT_GPUS of the K GPUs generating (default K / 2); a process per
#          mode of MODES (default all three; one a call at cap 8,192: sync took 388 s for 5 steps on a cold cache on
#          4xH200, one_step_off 237 s), STEPS steps (default 6: four steady steps, 2-5), then each mode against sync
#          (targets on 4 GPUs: one_step_off >= 1.25x sync's samples/s, fully_async >= 1.6x, wait <= 15% of a step)
#   xproc  the sync across processes (sync_processes): a training process of K/2 GPUs sends 7B bf16 and fp32 masters
#          to a rollout process of K/2 through one program over both (NCCL), timed on the rollout process
#   seed   the same three modes on the seed run's GSM8K shape (--async_lengths seed: lognormal lengths, mean 232, at
#          most 1,024; SEED_PROMPTS prompts x 5 a GPU, default 128, the seed's per-GPU share)
source "$(dirname "$0")/common.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
K=$(nvidia-smi -L | wc -l)
CACHE=$XLA_CACHE  # common.sh's
for phase in ${PHASES:-sync long seed}; do
  echo "=== $phase"
  case $phase in
    sync)
      run sync_split "${T_SYNC:-300}" python3 -m jaxrl_llm.bench --sections sync_split --presets qwen2p5_7b \
        --sync_splits "${SPLITS:-1+1,2+2,2tp2+2,1+3,3+1}" --repeats 5 --compile_cache $CACHE ;;
    long)  # a process per mode (MODES; at cap 8,192 a mode takes about a call), then the ratios over every
           # mode's rows this warm machine has (/tmp persists between calls while it stays warm)
      for mode in ${MODES:-sync one_step_off fully_async}; do
        run "async_longtail_$mode" "${T_LONG:-560}" python3 -m jaxrl_llm.bench --sections async_longtail \
          --async_modes "$mode" --train_presets "${PRESET:-qwen2p5_1p5b}" \
          --rollout_gpus "${ROLLOUT_GPUS:-$((K / 2))}" --steps "${STEPS:-6}" --prompts_per_gpu "${PROMPTS:-16}" \
          --long_cap "${CAP:-8192}" --compile_cache $CACHE
      done
      python3 -m jaxrl_llm.bench.async_rl /tmp/out_async_longtail_*/rows.jsonl | tee "$OUT/async_longtail_vs_sync.txt" ;;
    xproc)
      run sync_processes "${T_XPROC:-400}" python3 -m jaxrl_llm.launch --num_processes 2 --gpus_per_process $((K / 2)) \
        --log_dir "$OUT/xproc_logs" --module jaxrl_llm.bench -- --sections sync_processes --presets qwen2p5_7b \
        --repeats 5 --compile_cache $CACHE ;;
    seed)
      run async_seed "${T_SEED:-560}" python3 -m jaxrl_llm.bench --sections async_longtail --async_lengths seed \
        --train_presets "${PRESET:-qwen2p5_1p5b}" --rollout_gpus "${ROLLOUT_GPUS:-$((K / 2))}" \
        --steps "${STEPS:-5}" --prompts_per_gpu "${SEED_PROMPTS:-128}" --compile_cache $CACHE ;;
  esac
done
