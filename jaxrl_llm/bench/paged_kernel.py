"""The paged decode-attention kernel (kernels/paged_attention.py) on the GPU, in under 3 minutes.

  python -m jaxrl_llm.bench --sections paged_kernel --out $OUT [--budget_s 160]
  python -m jaxrl_llm.bench --sections paged_kernel --small   # CPU: tiny shapes in interpret mode

At the decode shapes of Qwen2.5-7B (28 q heads, 4 kv heads, H 128) and Qwen3-8B (32, 8, 128), bf16,
64 / 256 / 512 slots with lengths drawn uniformly from 100..1,300 and page sizes 16 / 32 / 64, three
attentions over the same K/V (random, never zeros):
- `paged`: the paged kernel over shuffled pages through a block table;
- `dense`: the ragged dense kernel (kernels/decode_attention.py) on the same K/V gathered into an
  [S, K, C, H] cache (C = 1,344 slots), starts 0 and ends = lengths;
- `xla`: the paged jnp reference (a gather of every table entry, then XLA attention), what a paged
  sampler without the kernel would run.
Each time is the median over calls of one jitted program that runs the attention over LAYERS layers'
pools (so no L2 reuse between calls), divided by LAYERS. One JSON line a case: microseconds a call, TB/s
of the K/V bytes the slots attend to (sum of lengths x K x H x 2 x 2 bytes), and the max |difference| of
the first layer's output from the bf16 reference and from an fp32 one (section `paged_kernel/<part>`, with
`t_s` the seconds since the section started); past --budget_s seconds the remaining cases are skipped.
Uses jax and numpy only.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.bench import harness
from jaxrl_llm.bench.harness import layered, option, section, timed
from kernels.decode_attention import decode_attention
from kernels.paged_attention import (
    default_pages_per_block,
    paged_decode_attention,
    paged_decode_attention_reference,
)

MODELS = {"qwen2p5_7b": (28, 4, 128), "qwen3_8b": (32, 8, 128)}  # N, K, H
CAPACITY = 1344  # positions a slot's table covers (21 x 64 >= 1,300), and the dense cache's slots
MIN_LEN, MAX_LEN = 100, 1300
LAYERS = 4

T0 = time.perf_counter()
BUDGET = 160.0
option("--models", default=",".join(MODELS), help="paged_kernel: decode shapes (qwen2p5_7b, qwen3_8b)")
option("--page_sizes", default="16,32,64", help="paged_kernel: page sizes")
option("--sweep", action="store_true", help="paged_kernel: also a few launch configurations of the paged kernel")


def elapsed() -> float:
    return time.perf_counter() - T0


def emit(**row):
    harness.emit(**{**row, "section": f"paged_kernel/{row['section']}", "t_s": round(elapsed(), 1)})


def paged_layout(rng, lengths, page_size, capacity):
    """Block tables [S, W] over a pool of shuffled pages (page 0 scratch, as the sampler leaves unused
    entries), and the pool's page count."""
    width = capacity // page_size
    used = -(-lengths // page_size)
    pages = 1 + int(used.sum())
    ids = rng.permutation(np.arange(1, pages)).astype(np.int32)
    tables = np.zeros((len(lengths), width), np.int32)
    ends = np.cumsum(used)
    for s, u in enumerate(used):
        tables[s, :u] = ids[ends[s] - u:ends[s]]
    return jnp.asarray(tables), pages


def pools(key, kv_heads, pages, page_size, head_dim, layers):
    shape = (kv_heads, pages, page_size, head_dim)
    make = jax.jit(lambda k: jax.random.normal(k, shape, jnp.bfloat16))
    keys = jax.random.split(key, 2 * layers)
    return [make(keys[i]) for i in range(layers)], [make(keys[layers + i]) for i in range(layers)]


@jax.jit
def to_dense(pages, tables):
    """[K, P, ps, H] pool -> [S, K, W * ps, H] cache holding the same K/V at the same positions."""
    kh, _, ps, h = pages.shape
    s, w = tables.shape
    return jnp.swapaxes(pages[:, tables].reshape(kh, s, w * ps, h), 0, 1)


def max_err(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def bench_slots(rng, model, rows, page_sizes, iters, paged_configs):
    """One model and slot count: the dense kernel once, then each page size's paged kernel and reference."""
    n, kh, h = MODELS[model]
    lengths = rng.integers(MIN_LEN, MAX_LEN + 1, rows).astype(np.int32)
    lens = jnp.asarray(lengths)
    q = jax.random.normal(jax.random.key(rows + n), (rows, n, h), jnp.bfloat16)
    kv_tb = float(lengths.sum()) * kh * h * 2 * 2 / 1e12  # K and V, bf16, one layer
    base = dict(section="attention", model=model, rows=rows, mean_len=round(float(lengths.mean()), 1))

    def record(impl, fn, args, out, ref, ref32, **extra):
        if elapsed() > BUDGET:
            emit(section="skipped", what=f"{model} {rows} {impl} {extra}", reason="time budget")
            return
        first, dt = timed(fn, *args, iters=iters)
        us = dt / LAYERS * 1e6
        emit(**base, impl=impl, **extra, us_per_call=round(us, 1), kv_tb_s=round(kv_tb / (us * 1e-6), 3),
             max_abs_vs_ref=max_err(out, ref), max_abs_vs_fp32_ref=max_err(out, ref32),
             first_program_s=round(first, 2))

    dense_done = False
    for ps in page_sizes:
        if elapsed() > BUDGET:
            emit(section="skipped", what=f"{model} {rows} ps{ps}", reason="time budget")
            continue
        tables, pages = paged_layout(rng, lengths, ps, CAPACITY)
        ks, vs = pools(jax.random.key(rows * ps + kh), kh, pages, ps, h, LAYERS)
        ref = paged_decode_attention_reference(q, ks[0], vs[0], tables, lens)
        with jax.default_matmul_precision("highest"):
            ref32 = paged_decode_attention_reference(q.astype(jnp.float32), ks[0].astype(jnp.float32),
                                                     vs[0].astype(jnp.float32), tables, lens)
        for sweep in paged_configs:  # {"block": positions a loop step covers} becomes pages_per_block
            cfg = {k: v for k, v in sweep.items() if k != "block"}
            if "block" in sweep:
                cfg["pages_per_block"] = max(1, sweep["block"] // ps)
            out = paged_decode_attention(q, ks[0], vs[0], tables, lens, **cfg)
            ppb = cfg.get("pages_per_block") or default_pages_per_block(ps)
            record("paged", layered(lambda *a, c=cfg: paged_decode_attention(*a, **c)), (q, ks, vs, tables, lens),
                   out, ref, ref32, page_size=ps, config=cfg, block_positions=ppb * ps, pages=pages)
        record("xla", layered(paged_decode_attention_reference), (q, ks, vs, tables, lens), ref, ref, ref32,
               page_size=ps)
        if not dense_done:  # the same K/V laid out densely: the dense kernel's time does not depend on ps
            kd, vd = [to_dense(k, tables) for k in ks], [to_dense(v, tables) for v in vs]
            starts = jnp.zeros_like(lens)
            dense = lambda q, k, v, s, e: decode_attention(q[:, None], k, v, s, e)[:, 0]
            out = dense(q, kd[0], vd[0], starts, lens)
            record("dense", layered(dense), (q, kd, vd, starts, lens), out, ref, ref32, slots=CAPACITY)
            del kd, vd
            dense_done = True
        del ks, vs


@section("paged_kernel", help="the paged decode-attention kernel against the dense kernel and XLA at 7B and Qwen3-8B "
         "shapes", defaults={"budget_s": 160.0, "rows": "64,256,512"})
def paged_kernel(args):
    global T0, BUDGET, LAYERS, CAPACITY, MIN_LEN, MAX_LEN
    T0, BUDGET = time.perf_counter(), args.budget_s
    rows, page_sizes, iters = [int(x) for x in args.rows.split(",")], [int(x) for x in args.page_sizes.split(",")], 10
    if args.small:  # head dim 32, short slots, one layer, one timed call
        for m, (n, kh, _) in list(MODELS.items()):
            MODELS[m] = (n, kh, 32)
        rows, page_sizes, iters, LAYERS, CAPACITY, MIN_LEN, MAX_LEN = [4], [16], 1, 1, 128, 10, 100
    dev = jax.devices()[0]
    import jaxlib

    emit(section="env", jax=jax.__version__, jaxlib=jaxlib.__version__, backend=jax.default_backend(),
         device=dev.device_kind, sms=getattr(dev, "core_count", None), python=sys.version.split()[0],
         smoke=args.small, layers=LAYERS, capacity=CAPACITY, lengths=[MIN_LEN, MAX_LEN])
    configs = [{}]
    if args.sweep:
        configs += [{"block": 32}, {"block": 128}, {"num_stages": 3}, {"block": 32, "num_stages": 3},
                    {"num_warps": 8}, {"num_warps": 2}]
    rng = np.random.default_rng(0)
    for model in args.models.split(","):
        for r in rows:
            bench_slots(rng, model, r, page_sizes, iters, configs)
    emit(section="done", seconds=round(elapsed(), 1))
