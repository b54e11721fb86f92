"""Adapter sync time against a full sync, for both rollout engines (issue 21), on random weights of a preset.

  python -m jaxrl_llm.bench --sections lora_sync [--presets qwen2p5_0p5b] [--lora_rank 32] [--repeats 3]
                            [--engines jax,vllm]

JAX engine (in this process, in device memory), what the engine role's `sync` does each step:
  jax/full      a full fine-tuning run's sync: the fp32 master params cast and converted into the engine's
                layout (`EngineWeights.update_weights`)
  jax/merge     a LoRA run's sync: W + A @ B * alpha / r for every target (`lora.merge_adapters`, fp32 maths,
                bf16 out) on the frozen bf16 base, then the same conversion
  jax/decode_*  the other option, adapters applied beside the weights (not built: the engines' fused decode
                layers would each need the adapters' two extra matmuls), measured as its cost where it
                would be paid: one decode step's projections over every layer at `--decode_rows` rows, with
                (`beside`) and without (`merged`) the adapters' x @ A @ B
vLLM pool (one `VllmActor`, no Ray, as the weight_path section):
  vllm/full     `rollout.lora_merge = True`: save_weights (the trainer's side) + load_weights (the actor's
                Orbax restore and in-place reload), on an engine without LoRA
  vllm/adapter  the default: save_peft of the adapters (the trainer's side) + load_adapter (vLLM reads the
                PEFT directory into its LoRA cache), on an engine started with enable_lora
One row (section lora_sync) per measurement, then the medians. On 2 CPU cores the qwen2p5_0p5b preset takes a
few minutes and about 6 GB of host memory. It runs in a process of its own, on the CPU unless JAX_PLATFORMS
says otherwise (`JAX_PLATFORMS= ... --engines jax` measures the JAX engine on the GPU).
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import time

from jaxrl_llm.bench.harness import emit as _emit
from jaxrl_llm.bench.harness import option, scratch_dir, section, timeit
from jaxrl_llm.bench.workload import dir_bytes

# A pool actor's environment (`vllm_worker.DEFAULT_ENV`), set before JAX and vLLM read it.
VLLM_ENV = {"JAX_PLATFORMS": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCHDYNAMO_DISABLE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING"}
option("--decode_rows", type=int, default=64, help="lora_sync: rows of the beside-vs-merged decode proxy")
DEFAULTS = {"presets": "qwen2p5_0p5b", "lora_rank": 32, "lora_alpha": 64.0, "repeats": 3,
                   "engines": "jax,vllm"}


def emit(**row):
    _emit(section="lora_sync", **row)


def _trained_adapters(cfg, spec, seed=1):
    """Adapters as after some training: lora_b non-zero (fresh ones are zero)."""
    import jax

    from jaxrl_llm.models.lora import init_adapters

    leaves, tree = jax.tree.flatten(init_adapters(cfg, spec, seed=seed))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.01 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def bench_jax(args, cfg, spec, rows: dict) -> None:
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.models import init_params
    from jaxrl_llm.models.lora import merge_adapters, module_path
    from jaxrl_llm.rollout.engine_weights import EngineWeights

    full = jax.block_until_ready(init_params(cfg, seed=0))  # fp32 master params (full fine-tuning)
    base = jax.block_until_ready(jax.tree.map(lambda x: x.astype(jnp.bfloat16), full))  # LoRA's frozen base
    adapters = _trained_adapters(cfg, spec)
    engine = EngineWeights(cfg, dtype="bfloat16")
    merge = jax.jit(lambda b, a: merge_adapters(b, a, spec, jnp.bfloat16))

    def sync(params_fn):
        def run():
            engine.update_weights(params_fn())
            jax.block_until_ready(engine.params)
        return run

    for what, fn in (("jax/full", sync(lambda: full)), ("jax/merge", sync(lambda: merge(base, adapters)))):
        s = timeit(fn, warmup=1, iters=args.repeats)  # the median of `repeats` calls
        rows.setdefault(what, []).append(dict(seconds=s))
        emit(what=what, median_of=args.repeats, seconds=s)
    full = None  # frees the master copy
    engine.release_weights()

    # Beside: one decode step's projections over every layer, at R rows, with and without the adapters.
    layers, ad = base["model"]["layers"], adapters["model"]["layers"]
    paths = [module_path(name)[2:] for name in spec.targets]  # (parent, module)
    dims = {layers[p][m]["kernel"].shape[1] for p, m in paths}  # every projection's input width
    key = jax.random.key(0)
    xs = {d: jax.random.normal(jax.random.fold_in(key, d), (args.decode_rows, d), jnp.bfloat16) for d in dims}

    def projections(beside):
        def step(layers, ad, xs):
            def layer(acc, i):
                for p, m in paths:
                    w = layers[p][m]["kernel"][i]  # [in, out]
                    y = xs[w.shape[0]] @ w  # [R, out]
                    if beside:
                        a, b = ad[p][m]["lora_a"][i].astype(w.dtype), ad[p][m]["lora_b"][i].astype(w.dtype)
                        y = y + ((xs[w.shape[0]] @ a) @ b) * jnp.asarray(spec.scale, w.dtype)  # [R, r] -> [R, out]
                    acc = acc + y[:, 0].astype(jnp.float32)
                return acc, None

            return jax.lax.scan(layer, jnp.zeros((args.decode_rows,), jnp.float32),
                                jnp.arange(cfg.num_hidden_layers))[0]
        return jax.jit(step)

    for what, beside in (("jax/decode_merged", False), ("jax/decode_beside", True)):
        s = timeit(projections(beside), layers, ad, xs, warmup=1, iters=args.repeats * 3)
        rows.setdefault(what, []).append(dict(seconds=s))
        emit(what=what, rows=args.decode_rows, median_of=args.repeats * 3, seconds=s)


def bench_vllm(args, cfg, spec, rows: dict, root: str) -> None:
    import jax

    from jaxrl_llm.models import init_params
    from jaxrl_llm.models.peft_io import save_peft
    from jaxrl_llm.rollout.vllm_pool import vllm_lora_kwargs
    from jaxrl_llm.rollout.vllm_worker import VllmActor
    from jaxrl_llm.weights_io import save_weights

    bf16 = cfg.replace(dtype="bfloat16", param_dtype="bfloat16")
    params = jax.block_until_ready(init_params(bf16, seed=0))
    adapters = _trained_adapters(cfg, spec)
    weights_dir = os.path.join(root, "weights")
    save_weights(weights_dir, 0, params, bf16)
    emit(what="checkpoint", bytes_on_disk=dir_bytes(os.path.join(weights_dir, "0")))
    engine = dict(enforce_eager=True, kv_cache_memory_bytes=args.kv_cache_mb << 20, max_num_seqs=4,
                  max_num_batched_tokens=256)
    prompts = [[t % cfg.vocab_size for t in p] for p in ([9707, 11, 1879, 0], [785, 6722, 315, 9625, 374])]
    request = dict(n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=8, stop_token_ids=(), ignore_eos=True,
                   seeds=[0] * len(prompts))

    def measure(what, actor, save, load):
        for rep in range(args.repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            path = save(rep + 1)
            t1 = time.perf_counter()
            timings = load(path, rep + 1)
            row = dict(seconds=time.perf_counter() - t0, save_s=t1 - t0, load_s=time.perf_counter() - t1,
                       **{k: v for k, v in timings.items()})
            if rep:
                rows.setdefault(what, []).append(row)
                emit(what=what, rep=rep, **row)
        actor.generate(prompts, request)  # the engine still serves

    t0 = time.perf_counter()
    actor = VllmActor(None, weights_dir, 0, dtype="bfloat16", max_model_len=256, scratch_dir=root,
                      engine_kwargs=engine)
    emit(what="vllm/engine_start", lora=False, seconds=time.perf_counter() - t0)
    measure("vllm/full", actor, lambda step: save_weights(weights_dir, step, params, bf16),
            lambda path, step: actor.load_weights(weights_dir, step))
    del actor
    gc.collect()

    t0 = time.perf_counter()
    actor = VllmActor(None, weights_dir, args.repeats + 1, dtype="bfloat16", max_model_len=256, scratch_dir=root,
                      engine_kwargs={**engine, **vllm_lora_kwargs(spec.rank)})
    emit(what="vllm/engine_start", lora=True, seconds=time.perf_counter() - t0)
    last = {}

    def save_adapter(step):
        path = save_peft(adapters, spec, os.path.join(weights_dir, "adapters", str(step)), cfg, dtype="bfloat16")
        if "path" in last:
            shutil.rmtree(last["path"], ignore_errors=True)  # what the pool does with the old version
        last["path"] = path
        last["bytes"] = dir_bytes(path)
        return path

    measure("vllm/adapter", actor, save_adapter, actor.load_adapter)
    emit(what="adapter_dir", bytes_on_disk=last["bytes"])


@section("lora_sync", help="adapter sync against a full sync, JAX engine (merge at sync, or adapters beside) and "
         "vLLM pool (PEFT directory vs Orbax checkpoint)", defaults=DEFAULTS, env=VLLM_ENV)
def lora_sync(args):
    import jax

    from jaxrl_llm.models import PRESETS
    from jaxrl_llm.models.lora import LoraSpec, resolve_targets

    preset = args.small_preset if args.small else args.presets.split(",")[0]
    extra = {"head_dim": 32, "num_attention_heads": 2, "num_key_value_heads": 1} if preset == "tiny" else {}
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="float32", **extra)  # vLLM's CPU attention: head_dim >= 32
    spec = LoraSpec(rank=args.lora_rank, alpha=args.lora_alpha, targets=resolve_targets("all-linear"))
    emit(what="setup", preset=preset, rank=args.lora_rank, targets=list(spec.targets), device=str(jax.devices()[0]),
         layers=cfg.num_hidden_layers, hidden=cfg.hidden_size)
    rows: dict[str, list[dict]] = {}
    root = scratch_dir("bench_lora_sync_", args.work_dir)
    try:
        engines = args.engines.split(",")
        if "jax" in engines:
            bench_jax(args, cfg, spec, rows)
        if "vllm" in engines:
            bench_vllm(args, cfg, spec, rows, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for what, rs in rows.items():
        emit(what=f"median/{what}", repeats=len(rs), **{k: statistics.median(r[k] for r in rs) for k in rs[0]})
