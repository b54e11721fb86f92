"""Decode-step anatomy on the GPU: where a sampler step's time goes, and candidate fixes (the seed-shaped
generation's phases are `gen.seed_gen`).

* decode_ceilings: copy bandwidth (several kernels, the best counts) and bf16 matmul, after a 1 s warm-up.
* decode_attention: decode attention as einsum (batched matmul) vs multiply-reduce, at the preset's shape.
* sampling: categorical over [B, V] with threefry vs rbg keys, and the LM head's matmul.
* decode_profile: a jax.profiler trace of a few decode steps, summarised as the top kernels by time.
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.bench import trace
from jaxrl_llm.bench.harness import emit, option, section
from jaxrl_llm.bench.harness import timeit as _timeit
from jaxrl_llm.bench.workload import gsm8k_prompts

timeit = functools.partial(_timeit, iters=20, warm_s=0.5)
DEFAULTS = {"presets": "qwen2p5_7b"}
option("--batch", type=int, help="decode_attention, sampling, decode_profile: rows", default=256)


def _cfg(opts):
    from jaxrl_llm.models.config import PRESETS

    preset = opts.small_preset if opts.small else opts.presets.split(",")[0]
    extra = {"vocab_size": 151936, "max_position_embeddings": 2048} if preset == "tiny" else {}
    return PRESETS[preset](dtype="bfloat16", param_dtype="bfloat16", **extra)






@section("decode_ceilings", help="copy bandwidth (several kernels) and bf16 matmul, after a 1 s warm-up",
         defaults=DEFAULTS)
def ceilings(opts):
    x32 = jax.random.normal(jax.random.key(0), (1 << 29,), jnp.float32)  # 2 GiB
    for name, fn, arr in (("copy_f32_scale", jax.jit(lambda a: a * 1.5), x32),
                          ("copy_bf16_scale", jax.jit(lambda a: a * 1.5), x32.astype(jnp.bfloat16)),
                          ("copy_f32_2d", jax.jit(lambda a: a.reshape(8192, -1) + 1.0), x32)):
        dt = timeit(fn, arr, warm_s=1.0)
        emit(section="decode_ceilings", what=name, tb_s=2 * arr.nbytes / dt / 1e12)
    a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    for name, fn in (("matmul_bf16_out", jax.jit(lambda p, q: p @ q)),
                     ("matmul_f32_acc_out", jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32)))):
        dt = timeit(fn, a, b, warm_s=1.0)
        emit(section="decode_ceilings", what=name, xla_flags=os.environ.get("XLA_FLAGS", ""),
             tflops=2 * 8192 ** 3 / dt / 1e12)


@section("decode_attention", help="decode attention as einsum vs multiply-reduce, at the preset's shape",
         defaults=DEFAULTS)
def attention(opts, ctx: int = 384):
    cfg, batch = _cfg(opts), opts.batch
    r, k, g, h = batch, cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (r, k, g, h), jnp.bfloat16)
    kc = jax.random.normal(keys[1], (r, k, ctx, h), jnp.bfloat16)
    vc = jax.random.normal(keys[2], (r, k, ctx, h), jnp.bfloat16)
    valid = jnp.arange(ctx)[None, :] < (ctx - 10)
    valid = jnp.broadcast_to(valid, (r, ctx))

    def einsum_impl(q, kc, vc):
        s = jnp.einsum("rkgh,rkch->rkgc", q, kc, preferred_element_type=jnp.float32) * h ** -0.5
        s = jnp.where(valid[:, None, None], s, -1e30)
        p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
        return jnp.einsum("rkgc,rkch->rkgh", p, vc)

    def reduce_impl(q, kc, vc):
        s = jnp.sum(q[:, :, :, None, :].astype(jnp.float32) * kc[:, :, None, :, :].astype(jnp.float32), -1)
        s = jnp.where(valid[:, None, None], s * h ** -0.5, -1e30)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.sum(p[..., None] * vc[:, :, None, :, :].astype(jnp.float32), axis=3).astype(q.dtype)

    bytes_kv = kc.nbytes + vc.nbytes
    ref = None
    for name, fn in (("einsum", einsum_impl), ("multiply_reduce", reduce_impl)):
        f = jax.jit(fn)
        out = np.asarray(f(q, kc, vc), np.float32)
        ref = out if ref is None else ref
        dt = timeit(f, q, kc, vc)
        emit(section="decode_attention", impl=name, batch=r, ctx=ctx, us=dt * 1e6, tb_s=bytes_kv / dt / 1e12,
             max_err_vs_einsum=float(np.max(np.abs(out - ref))))


@section("sampling", help="categorical over [B, V] with threefry vs rbg keys, log-probs, the LM head's matmul",
         defaults=DEFAULTS)
def sampling(opts):
    cfg, batch = _cfg(opts), opts.batch
    from jaxrl_llm.rollout.sampling import sample_next, token_logprobs

    logits = jax.random.normal(jax.random.key(4), (batch, cfg.vocab_size), jnp.float32) * 3
    for impl in ("threefry2x32", "rbg", "unsafe_rbg"):
        key = jax.random.key(0, impl=impl)
        f = jax.jit(lambda lg, key: sample_next(lg, key, temperature=1.0))
        dt = timeit(f, logits, key)
        emit(section="sampling", what=f"categorical_{impl}", batch=batch, us=dt * 1e6)
    g = jax.jit(lambda lg, t: token_logprobs(lg, t, temperature=1.0))
    tok = jnp.zeros((batch,), jnp.int32)
    emit(section="sampling", what="token_logprobs", batch=batch, us=timeit(g, logits, tok) * 1e6)
    lmh = jax.random.normal(jax.random.key(5), (cfg.hidden_size, cfg.vocab_size), jnp.bfloat16)
    hid = jax.random.normal(jax.random.key(6), (batch, cfg.hidden_size), jnp.bfloat16)
    head = jax.jit(lambda hh, w: jnp.dot(hh, w, preferred_element_type=jnp.float32))
    dt = timeit(head, hid, lmh)
    emit(section="sampling", what="lm_head_matmul", batch=batch, us=dt * 1e6, tb_s=lmh.nbytes / dt / 1e12)


@section("decode_profile", help="a kernel profile of 64 decode steps of the dense engine: top kernels by time",
         defaults=DEFAULTS)
def profile(opts):
    from jaxrl_llm.models import init_params
    from jaxrl_llm.rollout import DenseJaxEngine, SamplingParams

    cfg, batch = _cfg(opts), opts.batch

    params = init_params(cfg, seed=0)
    eng = DenseJaxEngine(cfg, params, dtype="bfloat16", max_batch_size=batch, gen_bucket=256)
    prompts = gsm8k_prompts(batch)
    sp = SamplingParams(n=1, temperature=1.0, max_new_tokens=64, ignore_eos=True)
    eng.generate(prompts, sp)
    t0 = time.perf_counter()
    eng.generate(prompts, sp)
    emit(section="decode_profile", what="generate 64 tokens (timed)", seconds=time.perf_counter() - t0)
    trace_dir = os.path.join("/tmp", "trace")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    eng.generate(prompts, sp)
    jax.profiler.stop_trace()
    trace.summarize_trace(trace_dir, section="decode_profile")
