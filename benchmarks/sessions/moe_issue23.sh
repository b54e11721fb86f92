#!/usr/bin/env bash
# Issue 23 (MoE) on one GPU, one call of under 10 minutes. Run from the repo root on the GPU machine with
# .whl carried; JSON rows land in $OUT/moe.jsonl, logs in $OUT/*.log.
#   check    the Pallas grouped matmul against ragged_dot on the GPU (bf16, 30B-A3B widths), values and grads
#   grouped  Pallas vs ragged_dot vs dense-same-FLOPs vs capacity bmm at 2,048 and 16,384 tokens;
#            ragged_dot again with XLA's cuDNN ragged-dot fusion flag (if this XLA knows it)
#   update   the actor update at Qwen3-30B-A3B's width, as many layers as fit, MFU on active params
#   decode   256 rows of the paged engine
source "$(dirname "$0")/common.sh"
nvidia-smi -L | tee "$OUT/gpus.txt"
for phase in ${PHASES:-check grouped update decode}; do
  echo "=== $phase"
  case $phase in
    check)
      timeout 240 python3 - > "$OUT/check.log" 2>&1 <<'PY'
import jax, jax.numpy as jnp, numpy as np
from kernels.grouped_matmul import grouped_matmul
for t, e, k, d, i in [(512, 128, 8, 2048, 768), (37, 16, 2, 256, 512)]:
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (t * k, d), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (e, d, i), jnp.float32) * 0.02).astype(jnp.bfloat16)
    gs = jnp.bincount(jax.random.randint(ks[2], (t * k,), 0, e), length=e).astype(jnp.int32)
    cot = jax.random.normal(ks[3], (t * k, i), jnp.float32)
    f = lambda impl: jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(grouped_matmul(x, w, gs, impl=impl).astype(jnp.float32) * cot), argnums=(0, 1)))
    (a, (ax, aw)), (b, (bx, bw)) = f("pallas")(x, w), f("xla")(x, w)
    rel = lambda p, q: float(jnp.linalg.norm((p.astype(jnp.float32) - q.astype(jnp.float32)).ravel()) / jnp.linalg.norm(q.astype(jnp.float32).ravel()))
    print("check", dict(t=t, e=e, d=d, i=i, loss_rel=abs(float(a - b)) / abs(float(b)), dx_rel=rel(ax, bx), dw_rel=rel(aw, bw)), flush=True)
PY
      echo "rc=$?"; grep -E "check|Error" "$OUT/check.log" | cut -c1-300 ;;
    grouped)
      for tok in 2048 16384; do
        timeout 150 python3 -m jaxrl_llm.bench --sections moe_grouped --tokens $tok --out "$OUT/moe_grouped_$tok" > "$OUT/grouped_$tok.log" 2>&1
        echo "rc=$?"; grep -E '"moe_grouped"|Error' "$OUT/grouped_$tok.log" | cut -c1-300
      done
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_experimental_use_ragged_dot_fusion=true" timeout 120 python3 -m jaxrl_llm.bench \
        --sections moe_grouped --tokens 2048 --out "$OUT/moe_cudnn_flag" > "$OUT/grouped_cudnn_flag.log" 2>&1
      echo "cudnn flag rc=$?"; grep -E '"moe_grouped"|Error|Unknown' "$OUT/grouped_cudnn_flag.log" | cut -c1-300 ;;
    update)
      timeout 240 python3 -m jaxrl_llm.bench --sections moe_update --out "$OUT/moe_update" > "$OUT/update.log" 2>&1
      echo "rc=$?"; grep -E '"moe_update"|Error' "$OUT/update.log" | cut -c1-400 ;;
    decode)
      timeout 200 python3 -m jaxrl_llm.bench --sections moe_decode --out "$OUT/moe_decode" > "$OUT/decode.log" 2>&1
      echo "rc=$?"; grep -E '"moe_decode"|Error' "$OUT/decode.log" | cut -c1-400 ;;
  esac
done
