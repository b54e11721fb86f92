"""One command for the GPU benchmarks; writes JSON and a markdown table.

  python scripts/bench_torch.py --out /tmp/tb           # transformers peers + parity reference
  python scripts/bench.py --sections all --torch_results /tmp/tb --out $OUT

Sections (comma-separated, or "all"):
  ceilings  device copy bandwidth and bf16 matmul rate (the roofline and MFU denominators)
  attention cuDNN flash attention on packed rows vs XLA (values, gradients, time); XLA if it fails
  parity    Qwen2.5-1.5B shape: our fp32 logits vs transformers' fp32 on the same GPU; bf16 vs fp32
  logprob   chunked logprob+entropy vs naive for a Qwen2.5-7B head (D 3584, V 151936) at 16k tokens
  rollout   JAX sampler tokens/s and % of the HBM roofline at batch 64/256/1024, 232 new tokens
  train     fwd+bwd+AdamW at the peers' shapes, and the GRPO actor update at the seed's per-GPU batch
  e2e       full GRPO steps (seed shape per GPU) through RLTrainer: time per phase, tokens/s/GPU, MFU
  sync      trainer -> engine weight sync, and Orbax save/restore of the actor weights

Everything runs on random weights (never zeros) at the real Qwen2.5 shapes. `--small` swaps in tiny
shapes to smoke-test the script on a CPU.

Multi-process (one process per GPU, as a multi-host run would be): start it with the launcher,
  python -m jaxrl_llm.launch --num_processes 4 --gpus_per_process 1 --module scripts.bench -- --sections e2e ...
Every process runs the benchmark; process 0 writes the results. `--compile_cache DIR` turns on JAX's
persistent compilation cache (a second run with the same DIR measures the warm start).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # as the trainer's CLI sets it
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl_llm.models import Qwen2Config, init_params, load_hf  # noqa: E402
from jaxrl_llm.models.config import PRESETS  # noqa: E402
from scripts.bench_common import (  # noqa: E402
    ATTENTION,
    CEILINGS,
    REPO,
    ROWS,
    compiled_gb,
    emit,
    generate_twice,
    gsm8k_prompts,
    timeit,
)
from scripts.bench_train import e2e, train  # noqa: E402

RESULTS = ROWS.rows


# ---- sections ------------------------------------------------------------------------------------


def ceilings(small: bool):
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


def attention(small: bool):
    """cuDNN flash attention on packed rows (segment mask + causal) against XLA: values, gradients, time."""
    from jaxrl_llm.models.qwen2 import dot_product_attention, segment_mask

    b, t, n, k, h = (2, 64, 4, 2, 16) if small else (8, 2048, 12, 2, 128)
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


def parity(torch_dir: str, small: bool):
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


def logprob(small: bool):
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


def _random_params(cfg: Qwen2Config, mesh=None):
    return init_params(cfg, mesh=mesh, seed=0)


def _preset(name: str, small: bool, **kw) -> Qwen2Config:
    """A preset by name; the CPU smoke test's tiny model keeps Qwen2's vocabulary for real prompts."""
    return PRESETS[name](**kw, **({"vocab_size": 151936} if small else {}))


def rollout(presets, batches, small: bool, new_tokens: int = 232):
    from jaxrl_llm.rollout import JaxEngine, SamplingParams

    bw = CEILINGS["copy_tb_s"] or 4.25  # PEERS.md: 4.25 TB/s measured on the lent H200
    for preset in presets:
        cfg = _preset(preset, small, dtype="bfloat16", param_dtype="bfloat16")
        params = _random_params(cfg)
        for batch in batches:
            eng = JaxEngine(cfg, params, dtype="bfloat16", max_num_seqs=batch, max_prompt_length=512)
            prompts = gsm8k_prompts(batch)
            sp = SamplingParams(n=1, temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
            first, out, dt = generate_twice(eng, prompts, sp)
            assert int(out.lengths.min()) == new_tokens
            eng.generate(prompts, sp.replace(max_new_tokens=1))
            t0 = time.perf_counter()
            eng.generate(prompts, sp.replace(max_new_tokens=1, seed=2))
            t_prefill = time.perf_counter() - t0
            # Bytes a decode step must read: every weight once (the LM head too, not the embedding
            # table), plus each sequence's K/V so far. Averaged over the 232 steps.
            weight_bytes = (cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)) * 2
            kv_per_token = cfg.num_hidden_layers * 2 * cfg.kv_dim * 2
            mean_ctx = float(np.mean([len(p) for p in prompts])) + (new_tokens - 1) / 2
            step_bytes = weight_bytes + batch * mean_ctx * kv_per_token
            roofline_s = new_tokens * step_bytes / (bw * 1e12)
            decode_s = dt - t_prefill
            emit(section="rollout", preset=preset, batch=batch, new_tokens=new_tokens,
                 mean_prompt=float(np.mean([len(p) for p in prompts])), seconds=dt, first_call_s=first,
                 tokens_per_s=batch * new_tokens / dt, prefill_s=t_prefill,
                 decode_ms_per_step=decode_s / (new_tokens - 1) * 1e3, step_gb=step_bytes / 1e9,
                 roofline_pct=100 * roofline_s / dt,
                 decode_roofline_pct=100 * roofline_s * (new_tokens - 1) / new_tokens / decode_s, hbm_tb_s=bw)
            eng = None
        params = None


def _orbax_defaults_round_trip(directory: str, params) -> tuple[float, float]:
    """The weights path before issue 13: Orbax's StandardCheckpointHandler defaults (zstd) and a
    restore to jax CPU arrays then numpy; (save s, restore s)."""
    import orbax.checkpoint as ocp

    path = os.path.join(directory, "std")
    ck = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    t0 = time.perf_counter()
    ck.save(path, args=ocp.args.StandardSave(params))
    t_save = time.perf_counter() - t0
    t0 = time.perf_counter()
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), params)
    out = jax.tree.map(np.asarray, ck.restore(path, args=ocp.args.StandardRestore(target)))
    t_restore = time.perf_counter() - t0
    del out
    return t_save, t_restore


def sync(presets, small: bool, dirs=("/tmp",)):
    from jaxrl_llm.rollout import JaxEngine
    from jaxrl_llm.weights_io import restore_weights, save_weights

    for preset in presets:
        cfg = _preset(preset, small, dtype="bfloat16", param_dtype="float32")
        params = _random_params(cfg)
        eng = JaxEngine(cfg, None, dtype="bfloat16")
        eng.update_weights(params)
        dt = timeit(lambda e=eng, p=params: e.update_weights(p) and e.params, iters=3)
        emit(section="sync", preset=preset, what="trainer->engine (fp32 -> bf16 engine layout, in device memory)",
             seconds=dt)
        eng = None
        bf = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        params = None
        size = sum(x.nbytes for x in jax.tree.leaves(bf)) / 1e9
        for root in dirs:
            if not os.path.isdir(root):
                emit(section="sync", preset=preset, dir=root, error="no such directory")
                continue
            st = os.statvfs(root)
            free_gb = st.f_bavail * st.f_frsize / 1e9
            if free_gb < 2.5 * size:  # both formats at once, and a margin
                emit(section="sync", preset=preset, dir=root, error=f"{free_gb:.1f} GB free")
                continue
            d = tempfile.mkdtemp(dir=root)
            try:
                t_save, t_restore = _orbax_defaults_round_trip(d, bf)
                emit(section="sync", preset=preset, dir=root, what="orbax defaults (zstd), restore to jax CPU arrays",
                     gb=size, save_s=t_save, restore_s=t_restore, total_s=t_save + t_restore)
                for rep in range(2):
                    t0 = time.perf_counter()
                    save_weights(d, 1 + rep, bf, cfg)
                    t_save = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    restore_weights(d, 1 + rep)
                    t_restore = time.perf_counter() - t0
                    emit(section="sync", preset=preset, dir=root, rep=rep,
                         what="weights_io (uncompressed), restore to numpy", gb=size, save_s=t_save,
                         restore_s=t_restore, total_s=t_save + t_restore)
            finally:
                subprocess.run(["rm", "-rf", d], check=False)
        bf = None


def torch_rows(torch_dir: str | None):
    if not torch_dir:
        return
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


# ---- report --------------------------------------------------------------------------------------


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"### {meta['date']} · {meta['device']} · commit {meta['commit']}", ""]
    by = {}
    for r in rows:
        by.setdefault(r["section"], []).append(r)
    for section, items in by.items():
        keys = [k for k in items[0] if k != "section"]
        for it in items[1:]:
            keys += [k for k in it if k not in keys and k != "section"]
        lines.append(f"**{section}**")
        lines.append("")
        lines.append("| " + " | ".join(keys) + " |")
        lines.append("|" + "---|" * len(keys))
        for it in items:
            cells = []
            for k in keys:
                v = it.get(k, "")
                cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="all")
    ap.add_argument("--presets", default="qwen2p5_0p5b,qwen2p5_1p5b,qwen2p5_7b")
    ap.add_argument("--train_presets", default="qwen2p5_0p5b,qwen2p5_1p5b")
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--remat", default="full", help="full, dots, none, or auto (the trainer's default)")
    ap.add_argument("--torch_results", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench_out"))
    ap.add_argument("--small", action="store_true", help="tiny shapes, to smoke-test on a CPU")
    ap.add_argument("--small_preset", default="tiny", help="--small: the tiny preset (tiny, or tiny_moe for the MoE)")
    ap.add_argument("--fsdp", type=int, default=-1, help="e2e mesh: fsdp size (-1: the devices left by --tensor)")
    ap.add_argument("--token_budget", type=int, default=32768, help="e2e: ppo_max_token_len_per_gpu")
    ap.add_argument("--tensor", type=int, default=1, help="e2e mesh: tensor-parallel size")
    ap.add_argument("--steps", type=int, default=3, help="e2e steps")
    ap.add_argument("--prompts_per_gpu", type=int, default=128, help="e2e: prompts a GPU (x5; seed: 128)")
    ap.add_argument("--append", default=None, help="also append the markdown table to this file (BENCHMARKS.md)")
    ap.add_argument("--decode_attention", default="auto", help="e2e: rollout.decode_attention (auto, xla or pallas)")
    ap.add_argument("--kv_cache", default="paged", help="e2e: rollout.kv_cache (paged or dense)")
    ap.add_argument("--sync_dirs", default="/tmp", help="sync: where the weights checkpoint goes (e.g. /tmp,/dev/shm)")
    ap.add_argument("--compile_cache", default="", help="JAX persistent compilation cache dir ('' = off)")
    ap.add_argument("--lora_rank", type=int, default=0, help="e2e: model.lora_rank on all linear layers (0: full)")
    ap.add_argument("--lora_alpha", type=float, default=64.0, help="e2e: model.lora_alpha")
    ap.add_argument("--base_quantization", default="none", help="e2e: model.base_quantization (none, int8, fp8; "
                    "needs --lora_rank > 0)")
    args = ap.parse_args()
    from jaxrl_llm import distributed
    from jaxrl_llm.trainer.process import enable_compilation_cache

    distributed.initialize(distributed.spec_from_env())  # the launcher's processes join here
    enable_compilation_cache(args.compile_cache)
    sections = {"ceilings", "attention", "parity", "logprob", "rollout", "train", "e2e", "sync"} \
        if args.sections == "all" \
        else set(args.sections.split(","))
    presets = [args.small_preset] if args.small else args.presets.split(",")
    train_presets = [args.small_preset] if args.small else args.train_presets.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    os.makedirs(args.out, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    meta = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
            "n_devices": jax.device_count(), "processes": jax.process_count(), "jax": jax.__version__,
            "commit": commit}
    print(json.dumps(meta), flush=True)

    main_process = jax.process_index() == 0

    def run(name, fn, *a):
        if name not in sections:
            return
        try:
            fn(*a)
        except Exception as e:
            traceback.print_exc()
            emit(section=name, error=f"{type(e).__name__}: {str(e)[:300]}")
        if main_process:
            with open(os.path.join(args.out, "bench.json"), "w") as f:
                json.dump({"meta": meta, "results": RESULTS}, f, indent=1)

    run("ceilings", ceilings, args.small)
    run("attention", attention, args.small)
    if args.torch_results:
        torch_rows(args.torch_results)
    run("parity", parity, args.torch_results, args.small)
    run("logprob", logprob, args.small)
    run("rollout", rollout, presets, batches, args.small)
    run("train", train, train_presets, args.small, args.remat.split(","))
    run("e2e", e2e, train_presets, args.small, args.steps, args.fsdp, args.tensor, args.remat.split(",")[0],
        args.token_budget, args.decode_attention, args.kv_cache, args.lora_rank, args.lora_alpha,
        args.base_quantization, args.prompts_per_gpu)
    run("sync", sync, presets, args.small, args.sync_dirs.split(","))
    if not main_process:
        return
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(markdown(RESULTS, meta))
    if args.append:
        with open(args.append, "a") as f:
            f.write("\n" + markdown(RESULTS, meta))
    print(markdown(RESULTS, meta))


if __name__ == "__main__":
    main()
