"""`sync_split`: the weight sync of asynchronous training (issue 30) between a training mesh and a rollout mesh on
disjoint devices of one host (`rollout/weight_sync.py`), on random weights of a preset (never zeros).

  python -m jaxrl_llm.bench --sections sync_split [--presets qwen2p5_7b] [--sync_splits 1+1,2+2,2+2tp2]
                            [--repeats 5] [--lora_rank 32] [--sync_bucket_mb 1024]
  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
      python -m jaxrl_llm.bench --sections sync_split --small      # the tiny preset on simulated CPU devices

A split "A+B" puts the training mesh on the first A devices and the rollout mesh on the next B, fsdp over each;
"tpN" after a side splits that side over N tensor devices (2tp2+2: fsdp 1 x tensor 2 training, fsdp 2 rollout).
Splits that need more devices than the machine has are reported as skipped. Per split, each timed the median
of --repeats calls after one that compiles, every sync under `no_host_copies()` (a host round trip would raise):

  sync/bf16       bf16 params (a LoRA run's merged weights, or a bf16 trainer's) onto the rollout devices
  engine_convert  `EngineWeights.update_weights` of that synced tree: the engine's cast, fusion and all-gather on
                  its own devices (what follows every sync)
  device_put      the naive `jax.device_put(params, param_shardings(cfg, rollout mesh))`, unguarded;
                  host_copy says whether it went through host memory (the same put under the guard raises)
  sync/fp32       fp32 master params (full fine-tuning), cast to bf16 in layer buckets on the training devices
  lora/bf16, lora/int8  `adapters()` of rank --lora_rank after `base_once` (its seconds and bytes in base_*)

The acceptance target (issue 30): sync/bf16 of qwen2p5_7b in <= 0.1 s with no host copy.
"""

from __future__ import annotations

import re

from jaxrl_llm.bench.harness import emit as _emit
from jaxrl_llm.bench.harness import option, section, timeit

option("--sync_splits", help="sync_split: training+rollout device splits, e.g. 1+1,2+2,2+2tp2,3+1")
option("--sync_bucket_mb", type=int, help="sync_split: WeightSync's bucket size in MB")
DEFAULTS = {"presets": "qwen2p5_7b", "sync_splits": "1+1,2+2,2+2tp2,2tp2+2,1+3,3+1", "repeats": 5,
            "lora_rank": 32, "lora_alpha": 64.0, "sync_bucket_mb": 1024}
SMALL_SPLITS = "1+1,2+2,2tp2+2tp2,2tp2+2,4+2tp2,1+3,3+1,4+3"
SPLIT = re.compile(r"^(\d+)(?:tp(\d+))?\+(\d+)(?:tp(\d+))?$")


def emit(**row):
    _emit(section="sync_split", **row)


def parse_split(text: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """"A[tpX]+B[tpY]" -> ((A, X), (B, Y)); one ValueError naming the option otherwise."""
    m = SPLIT.match(text.strip())
    sides = m and ((int(m[1]), int(m[2] or 1)), (int(m[3]), int(m[4] or 1)))
    if not sides or any(n < 1 or tp < 1 or n % tp for n, tp in sides):
        raise ValueError(f"--sync_splits: {text!r}; use A+B or AtpX+BtpY (A training and B rollout devices, tensor "
                         "size X and Y dividing them), e.g. 2+2 or 2tp2+2")
    return sides


def _meshes(sides, devices):
    from jaxrl_llm import sharding

    (a, ta), (b, tb) = sides
    return (sharding.make_mesh(1, a // ta, ta, devices=devices[:a]),
            sharding.make_mesh(1, b // tb, tb, devices=devices[a:a + b]))


def _timed_sync(sync, fn, repeats):
    """(median seconds, stats of the last call) of `fn()`, a sync, after a compiling call."""
    s = timeit(fn, warmup=1, iters=repeats)
    return s, sync.stats


def _host_copy(params, shardings) -> bool:
    """Whether `jax.device_put(params, shardings)` goes through host memory (it raises under the guard)."""
    import jax

    from jaxrl_llm.rollout.weight_sync import no_host_copies

    try:
        with no_host_copies():
            jax.block_until_ready(jax.device_put(params, shardings))
    except Exception as e:  # the guard's JaxRuntimeError
        if "Disallowed" not in str(e):
            raise
        return True
    return False


def _adapters(cfg, spec, mesh):
    """Adapters as after some training (lora_b non-zero; fresh ones are zero), sharded like the trainer's."""
    import jax

    from jaxrl_llm.models.lora import init_adapters

    fresh = init_adapters(cfg, spec, mesh=mesh, seed=1)

    def bump(tree):
        leaves, treedef = jax.tree.flatten(tree)
        keys = jax.random.split(jax.random.key(2), len(leaves))
        return jax.tree.unflatten(treedef, [x + 0.01 * jax.random.normal(k, x.shape, x.dtype)
                                            for x, k in zip(leaves, keys)])

    return jax.jit(bump, out_shardings=jax.tree.map(lambda x: x.sharding, fresh))(fresh)


def bench_split(opts, cfg, name, sides, devices) -> None:
    import jax
    import jax.numpy as jnp

    from jaxrl_llm.models import init_params, quant
    from jaxrl_llm.models.lora import LoraSpec, resolve_targets
    from jaxrl_llm.models.params import param_shardings
    from jaxrl_llm.rollout.engine_weights import EngineWeights
    from jaxrl_llm.rollout.weight_sync import WeightSync

    train, rollout = _meshes(sides, devices)
    bucket = opts.sync_bucket_mb << 20
    row = dict(split=name, train_mesh=dict(train.shape), rollout_mesh=dict(rollout.shape))
    sync = WeightSync(cfg, rollout, dtype="bfloat16", bucket_bytes=bucket)

    params = init_params(cfg, mesh=train, seed=0, dtype=jnp.bfloat16)
    out = None
    s, st = _timed_sync(sync, lambda: sync(params), opts.repeats)
    emit(**row, what="sync/bf16", median_of=opts.repeats, seconds=s, gb=st.bytes / 1e9, gb_s=st.bytes / 1e9 / s,
         copies=st.copies, rounds=st.rounds, buckets=st.buckets, bucket_mb=st.bucket_bytes / 2**20,
         route=sync.describe(params))
    out = sync(params)
    engine = EngineWeights(cfg.replace(dtype="bfloat16"), mesh=rollout, dtype="bfloat16")
    s = timeit(lambda: engine.update_weights(out) and engine.params, warmup=1, iters=opts.repeats)
    emit(**row, what="engine_convert", median_of=opts.repeats, seconds=s)
    engine.release_weights()
    out = None
    shardings = param_shardings(cfg, rollout)
    s = timeit(lambda: jax.device_put(params, shardings), warmup=1, iters=opts.repeats)
    emit(**row, what="device_put", median_of=opts.repeats, seconds=s, host_copy=_host_copy(params, shardings))

    spec = LoraSpec(rank=opts.lora_rank, alpha=opts.lora_alpha, targets=resolve_targets("all-linear"))
    adapters = _adapters(cfg, spec, train)
    for kind in ("bf16", "int8"):
        frozen = params if kind == "bf16" else jax.jit(
            lambda b: quant.quantize_base(b, "int8"),
            out_shardings=quant.frozen_shardings(cfg, param_shardings(cfg, train), train))(params)
        lora = WeightSync(cfg, rollout, dtype="bfloat16", bucket_bytes=bucket)
        lora.base_once(frozen)
        base = lora.base_stats
        s, st = _timed_sync(lora, lambda lora=lora: lora.adapters(adapters, lora_scale=spec.scale), opts.repeats)
        emit(**row, what=f"lora/{kind}", rank=spec.rank, median_of=opts.repeats, seconds=s, gb=st.bytes / 1e9,
             base_s=base.seconds, base_gb=base.bytes / 1e9)
        frozen = lora = None
    params = None

    masters = init_params(cfg, mesh=train, seed=0)  # fp32
    s, st = _timed_sync(sync, lambda: sync(masters), opts.repeats)
    emit(**row, what="sync/fp32", median_of=opts.repeats, seconds=s, gb=st.bytes / 1e9, gb_s=st.bytes / 1e9 / s,
         copies=st.copies, rounds=st.rounds, buckets=st.buckets, bucket_mb=st.bucket_bytes / 2**20,
         route=sync.describe(masters))


@section("sync_split", help="weight sync training mesh -> rollout mesh on disjoint devices (device to device, "
         "buckets, LoRA adapters only) against a plain device_put", defaults=DEFAULTS)
def sync_split(opts):
    import jax

    from jaxrl_llm.models import PRESETS

    preset = opts.small_preset if opts.small else opts.presets.split(",")[0]
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="float32")
    devices = jax.devices()
    splits = SMALL_SPLITS if opts.small and opts.sync_splits == DEFAULTS["sync_splits"] else opts.sync_splits
    emit(what="setup", preset=preset, devices=len(devices), device=devices[0].device_kind,
         params_b=cfg.num_params() / 1e9, bucket_mb=opts.sync_bucket_mb)
    for name in splits.split(","):
        sides = parse_split(name)
        need = sides[0][0] + sides[1][0]
        if need > len(devices):
            emit(split=name, what="skipped", error=f"needs {need} devices, this machine has {len(devices)}")
            continue
        bench_split(opts, cfg, name, sides, devices)
