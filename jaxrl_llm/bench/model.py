"""Model-level sections: the device's ceilings, cuDNN attention against XLA, parity of our logits with
transformers', and the chunked log-prob against the naive one."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.bench.harness import ATTENTION, CEILINGS, TRAINER_MEM_FRACTION, compiled_gb, emit, section, timeit

_AS_BENCH = dict(mem_fraction=TRAINER_MEM_FRACTION)  # measured as bench.py did, under the trainer's share


@section("ceilings", help="device copy bandwidth and bf16 matmul rate (the roofline and MFU denominators)",
         **_AS_BENCH)
def ceilings(opts):
    small = opts.small
    n = (1 << 20) if small else (1 << 31)  # bytes of bf16 data: 2 GiB on the GPU
    x = jax.random.normal(jax.random.key(0), (n // 2,), jnp.bfloat16)
    copy = jax.jit(lambda a: a * 1.5)
    dt = timeit(copy, x, iters=10, warm_s=1.0)
    emit(section="ceilings", what="xla_copy_bf16", framework="jax", tb_s=2 * x.nbytes / dt / 1e12)
    m = 512 if small else 8192
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    dt = timeit(mm, a, b, iters=10, warm_s=1.0)
    emit(section="ceilings", what="xla_bf16_matmul", framework="jax", m=m, tflops=2 * m ** 3 / dt / 1e12)


@section("attention", help="cuDNN flash attention on packed rows vs XLA (values, gradients, time); later "
         "sections use XLA if it fails", **_AS_BENCH)
def attention(opts):
    """cuDNN flash attention on packed rows (segment mask + causal) against XLA: values, gradients, time."""
    from jaxrl_llm.models.qwen2 import dot_product_attention, segment_mask

    b, t, n, k, h = (2, 64, 4, 2, 16) if opts.small else (8, 2048, 12, 2, 128)
    keys = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
    kk = jax.random.normal(keys[1], (b, t, k, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, k, h), jnp.bfloat16)
    seg = np.zeros((b, t), np.int32)
    for row in range(b):  # three packed sequences and right padding in every row
        cuts = sorted(np.random.default_rng(row).choice(np.arange(8, t - 8), 3, replace=False))
        seg[row, :cuts[0]], seg[row, cuts[0]:cuts[1]], seg[row, cuts[1]:cuts[2]] = 1, 2, 3
    idx = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = segment_mask(jnp.asarray(seg), jnp.asarray(seg), idx, idx)
    valid = jnp.asarray(seg > 0)[:, :, None, None]
    impls = ["xla"] + ([] if jax.default_backend() != "gpu" else ["cudnn"])
    outs = {}
    for impl in impls:
        f = jax.jit(lambda q, k, v, impl=impl: dot_product_attention(q, k, v, mask=mask, lengths=None, impl=impl))
        g = jax.jit(jax.grad(lambda q, k, v, impl=impl: jnp.sum(
            jnp.where(valid, dot_product_attention(q, k, v, mask=mask, lengths=None, impl=impl), 0).astype(jnp.float32)
            ** 2), argnums=(0, 1, 2)))
        try:
            outs[impl] = (np.asarray(f(q, kk, v), np.float32), [np.asarray(x, np.float32) for x in g(q, kk, v)])
            emit(section="attention", impl=impl, shape=f"{b}x{t} N{n} K{k} H{h}", fwd_ms=timeit(f, q, kk, v) * 1e3,
                 fwd_bwd_ms=timeit(g, q, kk, v) * 1e3)
        except Exception as e:
            emit(section="attention", impl=impl, error=f"{type(e).__name__}: {str(e)[:300]}")
            ATTENTION["impl"] = "xla"
    if "cudnn" in outs and "xla" in outs:
        vm = np.asarray(valid)
        ref, got = outs["xla"], outs["cudnn"]
        err = np.max(np.abs(np.where(vm, got[0] - ref[0], 0))) / np.max(np.abs(np.where(vm, ref[0], 0)))
        gerr = max(np.max(np.abs(a - r)) / np.max(np.abs(r)) for a, r in zip(got[1], ref[1]))
        emit(section="attention", impl="cudnn vs xla", out_rel_err=float(err), grad_rel_err=float(gerr))
        if not (err < 3e-2 and gerr < 5e-2):
            ATTENTION["impl"] = "xla"
            emit(section="attention", note="cuDNN disagrees with XLA; the rest of the run uses XLA attention")


@section("parity", help="Qwen2.5-1.5B shape: our fp32 logits vs transformers' fp32 on the same GPU "
         "(--torch_results); bf16 vs fp32", **_AS_BENCH)
def parity(opts):
    torch_dir = opts.torch_results
    if not torch_dir:
        raise ValueError("parity needs --torch_results DIR (the torch section's --out, run first)")
    from jaxrl_llm.models import load_hf

    ref = np.load(os.path.join(torch_dir, "parity_ref.npz"))
    ids, mask, ref_logits = ref["ids"], ref["mask"], ref["logits"]
    model_dir = next(os.path.join(torch_dir, d) for d in os.listdir(torch_dir) if d.startswith("hf_"))
    valid = mask.astype(bool)
    with jax.default_matmul_precision("highest"):
        model = load_hf(model_dir, dtype="float32")
        ours = np.asarray(jax.jit(lambda i, m, f=model: f(i, attention_mask=m))(jnp.asarray(ids, jnp.int32),
                                                                                  jnp.asarray(mask, jnp.int32)))
    err = np.max(np.abs(ours[valid] - ref_logits[valid])) / np.max(np.abs(ref_logits[valid]))
    emit(section="parity", what="fp32 jax vs fp32 torch (TF32 off)", rel_err=float(err),
         max_abs_ref=float(np.max(np.abs(ref_logits[valid]))))
    model = None
    bf = load_hf(model_dir, dtype="bfloat16")
    ours_bf = np.asarray(jax.jit(lambda i, m: bf(i, attention_mask=m))(jnp.asarray(ids, jnp.int32),
                                                                        jnp.asarray(mask, jnp.int32)))
    err_bf = np.max(np.abs(ours_bf[valid] - ours[valid])) / np.max(np.abs(ours[valid]))
    agree = np.mean(np.argmax(ours_bf[valid], -1) == np.argmax(ours[valid], -1))
    emit(section="parity", what="bf16 jax vs fp32 jax", rel_err=float(err_bf), argmax_agreement=float(agree))


@section("logprob", help="chunked logprob+entropy vs naive for a Qwen2.5-7B head (D 3584, V 151936) at 16k tokens",
         **_AS_BENCH)
def logprob(opts):
    small = opts.small
    from jaxrl_llm.algorithms import compute_token_logprobs, compute_token_logprobs_naive

    n, d, v = (2048, 64, 1000) if small else (16384, 3584, 151936)
    k = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(k[0], (n, d), jnp.bfloat16)
    w = (jax.random.normal(k[1], (d, v), jnp.float32) * 0.02).astype(jnp.bfloat16)
    tgt = jax.random.randint(k[2], (n,), 0, v)

    for name, fn in (("chunked", compute_token_logprobs), ("naive", compute_token_logprobs_naive)):
        fwd = jax.jit(lambda h, w, t, fn=fn: fn(h, w, t, with_entropy=True))

        def loss(h, w, t, fn=fn):
            lp, ent = fn(h, w, t, with_entropy=True)
            return jnp.mean(lp) + 0.01 * jnp.mean(ent)

        bwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
        t_f = timeit(fwd, h, w, tgt)
        t_b = timeit(bwd, h, w, tgt)
        emit(section="logprob", impl=name, tokens=n, d=d, v=v, fwd_ms=t_f * 1e3, fwd_bwd_ms=t_b * 1e3,
             fwd_gb=compiled_gb(fwd, h, w, tgt), fwd_bwd_gb=compiled_gb(bwd, h, w, tgt))


def torch_rows(torch_dir: str) -> None:
    """The torch section's rows (transformers peers, hardware ceilings), and the ceilings it measured as the
    roofline and MFU denominators of the sections that follow."""
    path = os.path.join(torch_dir, "torch_results.json")
    if os.path.exists(path):
        with open(path) as f:
            for row in json.load(f):
                if row.get("what") == "hw_copy":
                    CEILINGS["copy_tb_s"] = row["tb_s"]
                if row.get("what") == "hw_bf16_matmul":
                    CEILINGS["matmul_tflops"] = row["tflops"]
                if row.get("section") != "parity_ref":
                    emit(**row)
