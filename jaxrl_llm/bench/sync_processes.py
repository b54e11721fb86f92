"""`sync_processes`: the weight sync of asynchronous training across processes (issue 30), from a training process
to a rollout process joined by `jax.distributed`: one program over both sides' devices (rollout/union_copy.py; its
copies are XLA collective-permutes, NCCL on GPUs), on random weights of a preset (never zeros).

  python -m jaxrl_llm.launch --num_processes 2 --gpus_per_process 2 --module jaxrl_llm.bench -- \\
      --sections sync_processes [--presets qwen2p5_7b] [--repeats 5] [--sync_bucket_mb 1024]
  JAX_PLATFORMS=cpu python -m jaxrl_llm.launch --num_processes 2 --devices_per_process 2 \\
      --module jaxrl_llm.bench -- --sections sync_processes --small      # the tiny preset, gloo between processes

Process 0 holds the training mesh (fsdp over its devices) and sends; process 1 holds the rollout mesh (fsdp over
its own) and receives, as an async run's two sides do (`WeightSync(side='send' / 'receive')`). Each sync starts at a
barrier of both processes and is timed on the rollout process until its arrays are ready; a row gives the median
of --repeats after one that compiles, every sync under `no_host_copies()` on both sides (a host round trip raises):

  sync/bf16   bf16 params (a LoRA run's merged weights, or a bf16 trainer's)
  sync/fp32   fp32 master params (full fine-tuning), cast to bf16 in layer buckets on the training process

The target (issue 30): 7B bf16 in <= 0.1 s, with no host copy; one process's figures are `sync_split`'s.
"""

from __future__ import annotations

import time

import numpy as np

from jaxrl_llm.bench.harness import emit as _emit
from jaxrl_llm.bench.harness import section

CHANNEL = "bench_sync_processes"


def emit(**row):
    _emit(section="sync_processes", **row)


def _timed(me: int, call, repeats: int, name: str) -> list[float]:
    """Seconds of `call()` on this process, each after a barrier of both processes: the first compiles."""
    import jax

    from jaxrl_llm import distributed
    from jaxrl_llm.rollout.weight_sync import no_host_copies

    times = []
    for i in range(repeats + 1):
        distributed.set_group(None)
        distributed.barrier(f"{CHANNEL}/{name}/{i}")
        distributed.set_group([me])  # each side runs its own programs; only the sync's program spans both
        t0 = time.perf_counter()
        with no_host_copies():
            out = call()
            if me == 1:  # the arrays on the rollout devices: the sync is done when they are
                jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
        out = None
    return times


@section("sync_processes", help="weight sync from a training process to a rollout process (jax.distributed, one "
         "program over both sides' devices: NCCL on GPUs), device to device", defaults={
             "presets": "qwen2p5_7b", "repeats": 5, "sync_bucket_mb": 1024})
def sync_processes(opts):
    import jax
    import jax.numpy as jnp

    from jaxrl_llm import distributed, sharding
    from jaxrl_llm.models import PRESETS, init_params
    from jaxrl_llm.rollout.weight_sync import WeightSync
    from jaxrl_llm.trainer.processes.channel import Channel

    if jax.process_count() != 2:
        raise ValueError(f"sync_processes runs in 2 processes (a training one, then a rollout one), not "
                         f"{jax.process_count()}: python -m jaxrl_llm.launch --num_processes 2 --gpus_per_process K "
                         "--module jaxrl_llm.bench -- --sections sync_processes")
    me = jax.process_index()
    preset = opts.small_preset if opts.small else opts.presets.split(",")[0]
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="float32")
    train_devs, roll_devs = ([d for d in jax.devices() if d.process_index == p] for p in (0, 1))
    train = sharding.make_mesh(1, len(train_devs), 1, devices=train_devs)
    rollout = sharding.make_mesh(1, len(roll_devs), 1, devices=roll_devs)
    channel = Channel(CHANNEL)
    bucket = opts.sync_bucket_mb << 20
    emit(what="setup", preset=preset, processes=2, train_devices=len(train_devs), rollout_devices=len(roll_devs),
         device=jax.devices()[0].device_kind, params_b=cfg.num_params() / 1e9, bucket_mb=opts.sync_bucket_mb)
    for kind, dtype in (("bf16", jnp.bfloat16), ("fp32", jnp.float32)):
        distributed.set_group([me])
        if me == 0:
            sync = WeightSync(cfg, rollout, dtype="bfloat16", bucket_bytes=bucket, side="send")
            params = init_params(cfg, mesh=train, seed=0, dtype=dtype)
            channel.put("plan", sync.plan_of(_Actor(params)))
            times = _timed(me, lambda s=sync, p=params: s(p), opts.repeats, kind)
            got, stats = channel.get("times", timeout_s=600)
            seconds = float(np.median(got[1:]))  # the rollout side's, after the compiling first
            emit(what=f"sync/{kind}", median_of=opts.repeats, seconds=seconds, first_s=got[0],
                 sender_s=float(np.median(times[1:])), gb=stats["bytes"] / 1e9, gb_s=stats["bytes"] / 1e9 / seconds,
                 copies=stats["copies"],
                 buckets=sync.stats.buckets, route=sync.describe(params))
            params = None
        else:
            sync = WeightSync(cfg, rollout, dtype="bfloat16", bucket_bytes=bucket, side="receive")
            plan = channel.get("plan", timeout_s=600)
            times = _timed(me, lambda s=sync, p=plan: s.from_plan(p), opts.repeats, kind)
            st = sync.stats
            channel.put("times", (times, {"bytes": st.bytes, "copies": st.copies}))
    distributed.set_group(None)
    distributed.barrier(f"{CHANNEL}/done")


class _Actor:
    """What `WeightSync.plan_of` reads of an actor: its params, no adapters."""

    lora = None

    def __init__(self, params):
        self.state = {"params": params}
