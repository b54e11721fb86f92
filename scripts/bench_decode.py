"""Decode-step anatomy on the GPU: where a sampler step's time goes, and candidate fixes.

  python scripts/bench_decode.py --out $OUT [--preset qwen2p5_7b --batch 256]

* ceilings: copy bandwidth (several kernels, the best counts) and bf16 matmul, after a 1 s warm-up.
* attention: decode attention as einsum (batched matmul) vs multiply-reduce, at the preset's shape.
* sampling: categorical over [B, V] with threefry vs rbg keys, and inverse-CDF sampling.
* profile: a jax.profiler trace of a few decode steps, summarised as the top kernels by time.
* seed: the seed run's per-GPU generation (128 prompts x 5, response lengths drawn to its
  distribution, max 1,024 tokens) with the engine's phase trace, for each decode schedule in
  `--schedules`; then a kernel profile of one such generation.
"""

from __future__ import annotations

import argparse
import functools
import glob
import gzip
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl_llm.models.config import PRESETS  # noqa: E402
from scripts.bench_common import ROWS, emit  # noqa: E402
from scripts.bench_common import timeit as _timeit  # noqa: E402

timeit = functools.partial(_timeit, iters=20, warm_s=0.5)






def ceilings():
    x32 = jax.random.normal(jax.random.key(0), (1 << 29,), jnp.float32)  # 2 GiB
    for name, fn, arr in (("copy_f32_scale", jax.jit(lambda a: a * 1.5), x32),
                          ("copy_bf16_scale", jax.jit(lambda a: a * 1.5), x32.astype(jnp.bfloat16)),
                          ("copy_f32_2d", jax.jit(lambda a: a.reshape(8192, -1) + 1.0), x32)):
        dt = timeit(fn, arr, warm_s=1.0)
        emit(section="ceilings", what=name, tb_s=2 * arr.nbytes / dt / 1e12)
    a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (8192, 8192), jnp.bfloat16)
    for name, fn in (("matmul_bf16_out", jax.jit(lambda p, q: p @ q)),
                     ("matmul_f32_acc_out", jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32)))):
        dt = timeit(fn, a, b, warm_s=1.0)
        emit(section="ceilings", what=name, xla_flags=os.environ.get("XLA_FLAGS", ""), tflops=2 * 8192 ** 3 / dt / 1e12)


def attention(cfg, batch, ctx):
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


def sampling(cfg, batch):
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


def summarize_trace(trace_dir: str, top: int = 30, section: str = "profile") -> list[dict]:
    """Top GPU kernels by time in the perfetto trace under `trace_dir`; emits and returns their rows."""
    files = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
    with gzip.open(files[0]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    # GPU kernel events live on device "processes"; find them by pid names.
    pids = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {p for p, n in pids.items() if "GPU" in n or "gpu" in n or "/device:" in n}
    totals: dict[str, float] = {}
    count: dict[str, int] = {}
    span = [1e30, 0.0]
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids:
            name = e["name"][:90]
            totals[name] = totals.get(name, 0.0) + e.get("dur", 0.0)
            count[name] = count.get(name, 0) + 1
            span[0] = min(span[0], e["ts"])
            span[1] = max(span[1], e["ts"] + e.get("dur", 0.0))
    busy = sum(totals.values())
    emit(section=section, gpu_pids=[pids[p] for p in gpu_pids], kernel_busy_ms=busy / 1e3,
         span_ms=(span[1] - span[0]) / 1e3, kernels=sum(count.values()))
    rows = [dict(section=section + "_kernel", name=name, total_ms=tot / 1e3, calls=count[name], share=tot / busy)
            for name, tot in sorted(totals.items(), key=lambda kv: -kv[1])[:top]]
    for row in rows:
        emit(**row)
    return rows


def seed_generation(cfg, schedules: list[str], prompts_per_gpu: int = 128, n: int = 5, repeats: int = 3,
                    do_profile: bool = True, attentions: tuple[str, ...] = ("xla",)):
    """The seed step's generation on one GPU, per decode schedule ("every<K>": look for finished
    rows to drop every K steps; "every0": only when the cache grows) and decode attention ("xla", or
    "pallas": the ragged kernel)."""
    from jaxrl_llm.models import init_params
    from jaxrl_llm.rollout import DenseJaxEngine, SamplingParams
    from scripts.bench_common import gsm8k_prompts, seed_response_lengths

    compile_s = [0.0]

    def on_duration(event, duration, **_):
        if event.endswith("backend_compile_duration"):
            compile_s[0] += duration

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    params = init_params(cfg, seed=0)
    # Each repeat takes the next prompts (as each training step does), so its longest prompt differs.
    pool = gsm8k_prompts(prompts_per_gpu * (repeats + 1))
    sp = SamplingParams(n=n, temperature=1.0, max_new_tokens=1024, ignore_eos=True)
    for sched, attn in [(s, a) for s in schedules for a in attentions]:
        eng = DenseJaxEngine(cfg, params, dtype="bfloat16", max_batch_size=4096, max_prompt_length=512,
                        compact_every=int(sched.removeprefix("every")), decode_attention=attn)
        eng.trace = True
        for rep in range(repeats + 1):
            prompts = pool[rep * prompts_per_gpu:(rep + 1) * prompts_per_gpu]
            lens = seed_response_lengths(len(prompts) * n, seed=rep)
            compile_s[0] = 0.0
            t0 = time.perf_counter()
            out = eng.generate(prompts, sp.replace(seed=rep), max_new_tokens_per_row=lens)
            dt = time.perf_counter() - t0
            assert np.array_equal(out.lengths, lens)
            decode = [r for r in eng.last_trace if r["phase"] == "decode"]
            row_steps = sum(r["rows"] * (r["t1"] - r["t0"]) for r in decode)
            emit(section="seed_gen", schedule=sched, attention=attn, rep=rep, compile_s=compile_s[0], seconds=dt,
                 tokens=int(lens.sum()), tokens_per_s=float(lens.sum() / dt), row_steps=row_steps,
                 row_step_efficiency=float(lens.sum() / row_steps),
                 by_phase={ph: round(sum(r["seconds"] for r in eng.last_trace if r["phase"] == ph), 3)
                           for ph in ("prefill", "decode", "grow", "compact")})
            if rep == repeats:
                for r in eng.last_trace:
                    ms = r["seconds"] / max(1, r.get("t1", 1) - r.get("t0", 0)) * 1e3
                    emit(section="seed_gen_trace", schedule=sched, attention=attn, ms_per_step=ms, **r)
        if do_profile and sched == schedules[0] and attn == attentions[0]:
            eng.trace = False
            trace_dir = os.path.join("/tmp", "trace_seed")
            jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
            eng.generate(prompts, sp, max_new_tokens_per_row=seed_response_lengths(len(prompts) * n, seed=0))
            jax.profiler.stop_trace()
            summarize_trace(trace_dir, section="seed_profile")
        eng = None


def profile(cfg, batch, out_dir):
    from jaxrl_llm.models import init_params
    from jaxrl_llm.rollout import DenseJaxEngine, SamplingParams
    from scripts.bench_common import gsm8k_prompts

    params = init_params(cfg, seed=0)
    eng = DenseJaxEngine(cfg, params, dtype="bfloat16", max_batch_size=batch, gen_bucket=256)
    prompts = gsm8k_prompts(batch)
    sp = SamplingParams(n=1, temperature=1.0, max_new_tokens=64, ignore_eos=True)
    eng.generate(prompts, sp)
    t0 = time.perf_counter()
    eng.generate(prompts, sp)
    emit(section="profile", what="generate 64 tokens (timed)", seconds=time.perf_counter() - t0)
    trace_dir = os.path.join("/tmp", "trace")
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    eng.generate(prompts, sp)
    jax.profiler.stop_trace()
    summarize_trace(trace_dir)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/decode_out"))
    ap.add_argument("--preset", default="qwen2p5_7b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--sections", default="ceilings,attention,sampling,profile")
    ap.add_argument("--schedules", default="every0,every64", help="seed: decode schedules to compare")
    ap.add_argument("--no_profile", action="store_true", help="seed: skip the kernel profile")
    ap.add_argument("--seed_prompts", type=int, default=128, help="seed: prompts (x 5 responses)")
    ap.add_argument("--attentions", default="xla", help="seed: decode attentions to compare (xla,pallas)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ROWS.path = os.path.join(args.out, "decode.jsonl")
    extra = {"vocab_size": 151936, "max_position_embeddings": 2048} if args.preset == "tiny" else {}
    cfg = PRESETS[args.preset](dtype="bfloat16", param_dtype="bfloat16", **extra)
    s = args.sections.split(",")
    if "ceilings" in s:
        ceilings()
    if "attention" in s:
        attention(cfg, args.batch, 384)
    if "sampling" in s:
        sampling(cfg, args.batch)
    if "profile" in s:
        profile(cfg, args.batch, args.out)
    if "seed" in s:
        seed_generation(cfg, args.schedules.split(","), prompts_per_gpu=args.seed_prompts,
                        do_profile=not args.no_profile, attentions=tuple(args.attentions.split(",")))


if __name__ == "__main__":
    main()
