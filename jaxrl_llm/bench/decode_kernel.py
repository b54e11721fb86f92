"""The ragged decode-attention kernel (kernels/decode_attention.py) on the GPU, in about 2-3 minutes.

  python -m jaxrl_llm.bench --sections decode_kernel --out $OUT [--engine] [--budget_s 150]

At Qwen2.5-7B's decode shapes (28 q heads, 4 kv heads, head dim 128, bf16):
1. correctness: the Triton-compiled kernel against the jnp reference (the sampler's XLA attention) at
   256 rows x 1,216 slots, row lengths drawn like the seed's (prompt ~95 tokens + 0..1,024 generated);
2. attention alone, kernel vs the XLA path: ms a call and GB/s of *valid* K/V bytes (and of the bytes
   XLA actually reads), 8 layers' caches a timed program (so no launch gap and no L2 reuse), at
   256 rows x {320, 704, 1216} slots, 64 rows x 1216, and a sampler-like step where 80% of the rows
   have finished; plus a few kernel launch configurations;
3. with --engine (needs gin: carry .whl), a whole 7B decode step through the engine with random
   weights at 256 rows, once with each attention.
Rows (section `decode_kernel/<part>`) carry `t_s`, the seconds since the section started; past --budget_s
seconds the remaining parts are skipped. Uses jax and numpy only (1-2).
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.bench import harness
from jaxrl_llm.bench.harness import layered, option, section, timed
from kernels.decode_attention import _block_size, decode_attention, decode_attention_reference

N_HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128  # Qwen2.5-7B
PROMPT_SLOTS = 192  # the seed's prompts (~95 tokens, up to ~180) on the 32-slot prompt ladder
LAYERS = 8  # distinct caches a timed program reads (8 x 2 x 159 MB at 256 x 1216)

T0 = time.perf_counter()
BUDGET = 150.0
option("--engine", action="store_true", help="decode_kernel: 3, whole 7B decode steps through the engine")
option("--engine_tokens", type=int, default=256, help="decode_kernel --engine: new tokens")
option("--only_engine", action="store_true", help="decode_kernel: skip 1-2 (with --engine: only the engine steps)")
option("--engine_impls", default="xla,pallas", help="decode_kernel: attentions of the engine steps; one a process "
       "at 7B on an 80 GB GPU (two engines do not fit)")


def elapsed() -> float:
    return time.perf_counter() - T0


def emit(**row):
    harness.emit(**{**row, "section": f"decode_kernel/{row['section']}", "t_s": round(elapsed(), 1)})


def row_bounds(rng, rows, capacity, live_frac=1.0, shared_t=None):
    """[R] starts, ends: a left-padded prompt of ~95 tokens ending at PROMPT_SLOTS, then `shared_t`
    generated slots (a sampler step) or 1..C-P drawn per row; rows past `live_frac` have finished
    (ends = starts, as the sampler passes them)."""
    prompt = np.clip(np.round(rng.normal(95, 25, rows)), 20, PROMPT_SLOTS).astype(np.int32)
    starts = PROMPT_SLOTS - prompt
    gen = np.full(rows, shared_t) if shared_t else rng.integers(1, capacity - PROMPT_SLOTS + 1, rows)
    ends = (PROMPT_SLOTS + gen).astype(np.int32)
    live = rng.random(rows) < live_frac
    ends = np.where(live, ends, starts)
    return jnp.asarray(starts), jnp.asarray(ends)


def caches(key, rows, capacity, layers):
    shape = (rows, KV_HEADS, capacity, HEAD_DIM)
    keys = jax.random.split(key, 2 * layers)
    make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.bfloat16))
    return [make(keys[i]) for i in range(layers)], [make(keys[layers + i]) for i in range(layers)]


def correctness(rng, rows, capacity):
    key = jax.random.key(0)
    q = jax.random.normal(key, (rows, 1, N_HEADS, HEAD_DIM), jnp.bfloat16)
    (kc,), (vc,) = caches(jax.random.key(1), rows, capacity, 1)
    starts, ends = row_bounds(rng, rows, capacity)
    starts, ends = starts.at[0].set(PROMPT_SLOTS - 1), ends.at[0].set(PROMPT_SLOTS)  # one valid slot
    starts, ends = starts.at[1].set(0), ends.at[1].set(capacity)  # the whole cache
    starts, ends = starts.at[2].set(50), ends.at[2].set(50)  # a finished row
    t = time.perf_counter()
    out = jax.block_until_ready(decode_attention(q, kc, vc, starts, ends))
    compile_s = time.perf_counter() - t
    ref = jax.jit(decode_attention_reference)(q, kc, vc, starts, ends)
    f32 = [x.astype(jnp.float32) for x in (q, kc, vc)]
    with jax.default_matmul_precision("highest"):  # not TF32: the fp32 kernel's dots are IEEE
        exact = jax.jit(decode_attention_reference)(*f32, starts, ends)
    err_ref = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    err_f32 = float(jnp.max(jnp.abs(out.astype(jnp.float32) - exact)))
    xla_err_f32 = float(jnp.max(jnp.abs(ref.astype(jnp.float32) - exact)))
    out32 = decode_attention(*f32, starts, ends)
    err32 = float(jnp.max(jnp.abs(out32 - exact)))
    emit(section="correctness", rows=rows, slots=capacity, first_call_s=round(compile_s, 2),
         bf16_max_abs_vs_xla=err_ref, bf16_max_abs_vs_fp32_ref=err_f32, xla_bf16_max_abs_vs_fp32_ref=xla_err_f32,
         fp32_kernel_max_abs_vs_fp32_ref=err32, finished_row_zero=bool(jnp.all(out[2] == 0)),
         ok=bool(err_ref < 2e-2 and err_f32 < 2e-2 and err32 < 1e-4))


def attention_case(rng, rows, capacity, *, live_frac=1.0, shared_t=None, configs=({},), xla=True, name=None):
    starts, ends = row_bounds(rng, rows, capacity, live_frac, shared_t)
    q = jax.random.normal(jax.random.key(rows + capacity), (rows, 1, N_HEADS, HEAD_DIM), jnp.bfloat16)
    ks, vs = caches(jax.random.key(capacity), rows, capacity, LAYERS)
    per_slot = KV_HEADS * HEAD_DIM * 2 * 2  # k and v, bf16
    valid_gb = float(np.maximum(np.asarray(ends) - np.asarray(starts), 0).sum()) * per_slot * LAYERS / 1e9
    all_gb = rows * capacity * per_slot * LAYERS / 1e9
    base = dict(section="attention", case=name or f"b{rows}_c{capacity}", rows=rows, slots=capacity,
                live_frac=live_frac, mean_valid_slots=round(valid_gb / all_gb * capacity, 1))
    results = {}
    impls = ([("xla", decode_attention_reference, {})] if xla else []) + \
        [("pallas", lambda *a, c=c: decode_attention(*a, **c), c) for c in configs]
    for impl, fn, cfg in impls:
        if elapsed() > BUDGET:
            emit(section="skipped", what=f"{base['case']} {impl} {cfg}", reason="time budget")
            continue
        first, dt = timed(layered(fn), q, ks, vs, starts, ends)
        ms = dt / LAYERS * 1e3
        results[(impl, tuple(sorted(cfg.items())))] = ms
        used = {} if impl == "xla" else {"block_kv_used": _block_size(capacity, cfg.get("block_kv", 64))}
        emit(**base, impl=impl, config=cfg, **used, ms_per_call=round(ms, 4), valid_gb_s=round(valid_gb / dt, 1),
             read_gb_s=round((all_gb if impl == "xla" else valid_gb) / dt, 1), first_program_s=round(first, 2))
    del ks, vs
    return results


def engine_step(tokens: int, preset: str = "qwen2p5_7b", rows: int = 256, impls=("xla", "pallas")):
    """Whole decode steps through the engine (random weights), xla vs pallas attention."""
    from jaxrl_llm.models import init_params
    from jaxrl_llm.models.config import PRESETS
    from jaxrl_llm.rollout import DenseJaxEngine, SamplingParams

    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="bfloat16")
    params = init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, cfg.vocab_size, int(n)).tolist() for n in np.clip(rng.normal(95, 25, rows), 20, 180)]
    sp = SamplingParams(n=1, temperature=1.0, max_new_tokens=tokens, ignore_eos=True, seed=1)
    outs = {}
    for impl in impls:
        if elapsed() > BUDGET:
            emit(section="skipped", what=f"engine {impl}", reason="time budget")
            continue
        eng = DenseJaxEngine(cfg, params, dtype="bfloat16", max_batch_size=rows, max_prompt_length=256,
                        decode_attention=impl)
        t = time.perf_counter()
        eng.generate(prompts, sp)  # compiles
        first = time.perf_counter() - t
        eng.trace = True
        t = time.perf_counter()
        outs[impl] = eng.generate(prompts, sp)
        total = time.perf_counter() - t
        dec = [r for r in eng.last_trace if r["phase"] == "decode"]
        steps = sum(r["t1"] - r["t0"] for r in dec)
        emit(section="engine", impl=impl, preset=preset, rows=rows, new_tokens=tokens, first_generate_s=round(first, 1),
             generate_s=round(total, 3), decode_ms_per_step=round(sum(r["seconds"] for r in dec) / steps * 1e3, 3),
             segments=[(r["t0"], r["t1"], r["slots"], round(r["seconds"] / (r["t1"] - r["t0"]) * 1e3, 3))
                       for r in dec])
        del eng
    if len(outs) == 2:
        same = float(np.mean(outs["xla"].tokens == outs["pallas"].tokens))
        emit(section="engine", what="share of equal sampled tokens, xla vs pallas (bf16 rounding may differ)",
             value=same)


@section("decode_kernel", help="the ragged decode-attention kernel against XLA: correctness, attention alone at "
         "7B shapes, and (--engine) whole decode steps", defaults={"budget_s": 150.0})
def decode_kernel(args):
    global T0, BUDGET, LAYERS
    T0, BUDGET = time.perf_counter(), args.budget_s
    dev = jax.devices()[0]
    import jaxlib

    emit(section="env", jax=jax.__version__, jaxlib=jaxlib.__version__, backend=jax.default_backend(),
         device=dev.device_kind, sms=getattr(dev, "core_count", None), python=sys.version.split()[0], small=args.small)
    # --small: a CPU smoke run of this script (interpret mode), shapes cut to 1/32 of the rows.
    big, small, (c1, c2, c3) = (256, 64, (1216, 320, 704)) if not args.small else (8, 2, (256, 224, 240))
    if args.small:
        LAYERS = 2
    rng = np.random.default_rng(0)
    impls = tuple(args.engine_impls.split(","))
    if args.only_engine:
        engine_step(args.engine_tokens, *(("tiny", 8) if args.small else ()), impls=impls)
        emit(section="done", seconds=round(elapsed(), 1))
        return
    correctness(rng, big, c1)
    # Launch configurations (1216 = 64 x 19 slots: blocks of 128 need a multiple of 128, as the ladder's are).
    sweep = ({}, {"num_stages": 3}, {"block_kv": 32, "num_stages": 3}, {"num_warps": 2})
    attention_case(rng, big, c1, configs=sweep)
    for capacity in (c2, c3):
        attention_case(rng, big, capacity)
    attention_case(rng, small, c1, configs=({}, {"num_splits": 1}))
    # A sampler step in the 257-512 segment (t = 384 at 704 slots): one t for all, 80% of the rows finished.
    t = (c3 - PROMPT_SLOTS) * 3 // 4
    attention_case(rng, big, c3, live_frac=0.2, shared_t=t, name=f"b{big}_c{c3}_t{t}_live20")
    if args.engine:
        engine_step(args.engine_tokens, *(("tiny", 8) if args.small else ()), impls=impls)
    emit(section="done", seconds=round(elapsed(), 1))
