"""The gated delta rule (Qwen3.5's linear attention) on the GPU: the Pallas kernels (kernels/gated_delta.py)
against the jnp chunked form, beside the full-attention layers' cuDNN attention, in about 2 minutes.

  python -m jaxrl_llm.bench --sections gated_delta --out $OUT [--gdn_shapes 1024x4,4096x4] [--budget_s 150]

At Qwen3.5-9B's linear-attention shapes (16 key heads, 32 value heads, Dk = Dv = 128, bf16), for each T x B of
`--gdn_shapes`, with packed rows (a reset every 1,000 tokens) and a little right padding, as the training passes
see them:
1. time: the log-prob pass (forward) and the update's forward + backward (gradients of q, k, v, g, beta) of
   the kernels and of the jnp chunked form; and, for comparison, one full-attention layer's
   `jax.nn.dot_product_attention` (cuDNN, causal, 16 q heads, 4 kv heads, head dim 256) on the same tokens.
   Rows give ms (median of `--repeats` synchronised calls), tokens/s, the first call (compile) and XLA's
   temporary memory of the program;
2. check (first shape): the kernels' outputs and gradients against the jnp form's, the programs just timed;
3. at the last shape, variants: the scans' Dv block 32 (twice the programs), and the forward scan's launch
   (8 warps with 2 pipeline stages; 4 warps).
Rows (section `gated_delta/<part>`) carry `t_s`, the seconds since the section started; past --budget_s the
remaining parts are skipped.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.bench import harness
from jaxrl_llm.bench.harness import option, section
from jaxrl_llm.models import gated_delta as gd
from kernels.gated_delta import chunked_gated_delta_rule_kernel

KEY_HEADS, VALUE_HEADS, HEAD_K, HEAD_V = 16, 32, 128, 128  # Qwen3.5-9B's Gated DeltaNet layers
ATTN_Q, ATTN_KV, ATTN_DIM = 16, 4, 256  # its full-attention layers
ROW_TOKENS = 1000  # packed rows: a reset every ROW_TOKENS tokens

option("--gdn_shapes", help="gated_delta: T x B of the timed calls, comma-separated (e.g. 1024x4,4096x4)")

T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def emit(**row):
    harness.emit(**{**row, "section": f"gated_delta/{row['section']}", "t_s": round(elapsed(), 1)})


def inputs(b: int, t: int, dims, dtype, seed: int = 0):
    """Random q, k (unit rows, q scaled), v, g (log decay), beta, and the packed rows' resets and padding."""
    hk, hv, dk, dv = dims
    ks = jax.random.split(jax.random.key(seed), 5)
    q = gd.l2norm(jax.random.normal(ks[0], (b, t, hk, dk))) * dk ** -0.5
    k = gd.l2norm(jax.random.normal(ks[1], (b, t, hk, dk)))
    v = jax.random.normal(ks[2], (b, t, hv, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, hv)) - 1.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, hv)))
    pos = jnp.arange(t)
    resets = jnp.broadcast_to((pos % ROW_TOKENS == 0) & (pos > 0), (b, t))
    valid = jnp.broadcast_to(pos < t - t // 50, (b, t))  # 2% right padding
    return tuple(x.astype(dtype) for x in (q, k, v, g, beta)), dict(resets=resets, valid=valid)


def programs(fn, kw):
    """The forward (o, final state) and the forward + backward (the five inputs' gradients) of a form."""
    scale = jax.random.normal(jax.random.key(7), ())

    def loss(*a):
        o, s = fn(*a, **kw)
        return jnp.sum(o) * scale + jnp.sum(s)

    return jax.jit(lambda *a: fn(*a, **kw)), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def compile_and_time(fn, args, repeats):
    """(ms median, first call s including compile, XLA temp GB, the compiled program) of a jitted fn."""
    t = time.perf_counter()
    compiled = fn.lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    first = time.perf_counter() - t
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", 0) / 1e9 if mem is not None else None
    ms = harness.timeit(compiled, *args, warmup=1, iters=repeats, warm_s=0.2) * 1e3
    return ms, first, temp, compiled


def check(kernel, xla, args, kw):
    """The kernels against the jnp form (both compiled at XLA's default matmul precision): {program: compiled}
    of each, as `time_gdn` returns them."""
    (ko, ks), kg = jax.device_get((kernel["fwd"](*args), kernel["fwd_bwd"](*args)))
    (ro, rs), rg = jax.device_get((xla["fwd"](*args), xla["fwd_bwd"](*args)))
    rel = lambda x, y: float(np.linalg.norm(np.float32(x) - np.float32(y)) / np.linalg.norm(np.float32(y)))
    live = np.asarray(kw["valid"])
    row = dict(o_max_abs=float(np.max(np.abs(ko - ro)[live])), o_rel=rel(ko[live], ro[live]),
               state_rel=rel(ks, rs), **{f"d{n}_rel": rel(x, y) for n, x, y in zip("qkvgb", kg, rg)})
    emit(section="check", t=args[0].shape[1], b=args[0].shape[0], **row,
         ok=bool(max(v for k, v in row.items() if k.endswith("_rel")) < 2e-2))


def time_gdn(args, kw, repeats, name, fn, passes=("fwd", "fwd_bwd"), **extra):
    """Times `fn`'s forward and forward + backward; returns {program: compiled} of those it ran."""
    b, t = args[0].shape[:2]
    fwd, grad = programs(fn, kw)
    done = {}
    for pas, prog in zip(("fwd", "fwd_bwd"), (fwd, grad)):
        if pas not in passes:
            continue
        if elapsed() > BUDGET:
            emit(section="skipped", what=f"{name} {pas} t={t} b={b}", reason="time budget")
            continue
        ms, first, temp, done[pas] = compile_and_time(prog, args, repeats)
        emit(section="time", impl=name, **extra, program=pas, t=t, b=b, tokens=b * t, ms=round(ms, 3),
             tokens_per_s=round(b * t / ms * 1e3), first_call_s=round(first, 1), temp_gb=temp)
    return done


def time_attention(b, t, dims, dtype, repeats):
    """One full-attention layer: causal GQA through cuDNN (XLA's attention off the GPU)."""
    nq, nkv, d = dims
    ks = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(ks[0], (b, t, nq, d), dtype)
    k = jax.random.normal(ks[1], (b, t, nkv, d), dtype)
    v = jax.random.normal(ks[2], (b, t, nkv, d), dtype)
    cot = jax.random.normal(ks[3], (b, t, nq, d), dtype)
    impl = "cudnn" if jax.default_backend() == "gpu" else None
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    fwd = jax.jit(attn)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum((attn(*a) * cot).astype(jnp.float32)), argnums=(0, 1, 2)))
    for pas, prog in (("fwd", fwd), ("fwd_bwd", grad)):
        if elapsed() > BUDGET:
            emit(section="skipped", what=f"attention {pas} t={t} b={b}", reason="time budget")
            continue
        ms, first, temp, _ = compile_and_time(prog, (q, k, v), repeats)
        emit(section="time", impl=f"attention_{impl or 'xla'}", program=pas, t=t, b=b, tokens=b * t, ms=round(ms, 3),
             tokens_per_s=round(b * t / ms * 1e3), first_call_s=round(first, 1), temp_gb=temp)


BUDGET = 150.0


@section("gated_delta", help="the gated delta rule's Pallas kernels against the jnp chunked form at Qwen3.5-9B "
         "shapes (forward, forward + backward), beside cuDNN attention on the full-attention shape",
         defaults={"budget_s": 150.0, "gdn_shapes": "1024x4,1024x16,4096x1,4096x4", "repeats": 5})
def gated_delta(opts):
    global T0, BUDGET
    T0, BUDGET = time.perf_counter(), opts.budget_s
    dev = jax.devices()[0]
    import jaxlib

    emit(section="env", jax=jax.__version__, jaxlib=jaxlib.__version__, backend=jax.default_backend(),
         device=dev.device_kind, python=sys.version.split()[0], small=opts.small)
    gdn_dims, attn_dims, dtype = (KEY_HEADS, VALUE_HEADS, HEAD_K, HEAD_V), (ATTN_Q, ATTN_KV, ATTN_DIM), jnp.bfloat16
    shapes = [tuple(int(x) for x in s.split("x")) for s in opts.gdn_shapes.split(",")]
    if opts.small:  # a CPU smoke run: tiny heads, the kernels interpreted
        gdn_dims, attn_dims, dtype, shapes = (2, 4, 16, 32), (4, 2, 16), jnp.float32, [(128, 2)]
    repeats = 1 if opts.small else opts.repeats
    for i, (t, b) in enumerate(shapes):
        args, kw = inputs(b, t, gdn_dims, dtype)
        kernel = time_gdn(args, kw, repeats, "kernel", chunked_gated_delta_rule_kernel)
        # On a small CPU the jnp form's backward (batched triangular solves side by side) can deadlock jaxlib's
        # thread pool when called in a loop; the smoke run times only its forward.
        xla = time_gdn(args, kw, repeats, "xla_chunked", gd.chunked_gated_delta_rule,
                       passes=("fwd",) if opts.small else ("fwd", "fwd_bwd"))
        if i == 0 and len(kernel) == len(xla) == 2:
            check(kernel, xla, args, kw)
        time_attention(b, t, attn_dims, dtype, repeats)
    t, b = shapes[-1]
    args, kw = inputs(b, t, gdn_dims, dtype)
    variants = [({"block_v": 32}, ("fwd", "fwd_bwd")), ({"launch": {"scan": (8, 2)}}, ("fwd",)),
                ({"launch": {"scan": (8, 1)}}, ("fwd", "fwd_bwd")),
                ({"launch": {"scan": (8, 1), "dstate": (8, 1), "grads": (8, 1)}}, ("fwd_bwd",))]
    for extra, passes in variants:
        time_gdn(args, kw, repeats, "kernel", lambda *a, extra=extra, **k: chunked_gated_delta_rule_kernel(
            *a, **extra, **k), passes=passes, variant=str(extra))
    emit(section="done", seconds=round(elapsed(), 1))
