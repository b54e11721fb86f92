"""Weight-sync sections: the trainer-to-engine sync and the Orbax round trip of the actor's weights (`sync`),
the variants of the bf16 weights checkpoint the trainer writes for a vLLM pool (`weights_checkpoint`), and
the pool's own side on a CPU, through a HF directory or from host memory (`weight_path`).

weights_checkpoint: random bf16 weights of a preset on the default device (never zeros), then, in each
directory of --dirs:
  d2h       device -> host numpy (`jax.device_get`), the part every format pays
  raw       a floor: that numpy tree written with `ndarray.tofile` and read back with `np.fromfile`
  weights_io  `save_weights` / `restore_weights` (Orbax, PyTree handler, uncompressed, numpy restore)
  no_ocdbt  the same Orbax handler without OCDBT (one tensorstore array per leaf)
  wide      weights_io's format with 4x Orbax's default concurrent-GB limits
  no_ocdbt_wide  both
Each timed twice.

weight_path: random bf16 weights saved with `weights_io.save_weights` as the trainer does, one `VllmActor`
(no Ray) started from the checkpoint, then `--repeats` times each:
  save    save_weights (the trainer's side)
  files   load_weights(via_files=True): Orbax restore, write_hf_dir, vLLM reload from the files
  memory  load_weights(): Orbax restore, vLLM reload from the tensors in host memory
  convert the memory path without vLLM: Orbax restore and the HF table's tensors as torch tensors
          (`iter_hf_tensors`: renames, casts and transposes), i.e. what the memory path's
          "reload_s" spends before vLLM's own work
and the medians (each key's own). Greedy tokens and logprobs after a files load and after a memory load
must be equal. Qwen2.5-0.5B takes under a minute on 2 cores.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.bench.harness import TRAINER_MEM_FRACTION, emit, option, scratch_dir, section, timeit
from jaxrl_llm.bench.lora_sync import VLLM_ENV
from jaxrl_llm.bench.workload import dir_bytes

emit_checkpoint = functools.partial(emit, section="weights_checkpoint")
emit_path = functools.partial(emit, section="weight_path")
option("--dirs", default="/tmp", help="sync, weights_checkpoint: where the weights checkpoints go (e.g. /tmp,/dev/shm)")


def _preset_cfg(opts, **kw):
    from jaxrl_llm.models.config import PRESETS

    name = opts.small_preset if opts.small else opts.presets.split(",")[0]
    return name, PRESETS[name](**kw, **({"vocab_size": 151936} if opts.small else {}))


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


@section("sync", help="trainer -> engine weight sync in device memory, and the Orbax save/restore of the actor's "
         "bf16 weights", defaults={"presets": "qwen2p5_0p5b,qwen2p5_1p5b,qwen2p5_7b"},
         mem_fraction=TRAINER_MEM_FRACTION)
def sync(opts):
    from jaxrl_llm.models import init_params
    from jaxrl_llm.models.config import PRESETS
    from jaxrl_llm.rollout import JaxEngine
    from jaxrl_llm.weights_io import restore_weights, save_weights

    for preset in [opts.small_preset] if opts.small else opts.presets.split(","):
        cfg = PRESETS[preset](dtype="bfloat16", param_dtype="float32", **({"vocab_size": 151936} if opts.small else {}))
        params = init_params(cfg, seed=0)
        eng = JaxEngine(cfg, None, dtype="bfloat16")
        eng.update_weights(params)
        dt = timeit(lambda e=eng, p=params: e.update_weights(p) and e.params, iters=3)
        emit(section="sync", preset=preset, what="trainer->engine (fp32 -> bf16 engine layout, in device memory)",
             seconds=dt)
        eng = None
        bf = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        params = None
        size = sum(x.nbytes for x in jax.tree.leaves(bf)) / 1e9
        for root in opts.dirs.split(","):
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


def _orbax(handler, path, tree):
    import orbax.checkpoint as ocp

    ck = ocp.Checkpointer(handler)
    t0 = time.perf_counter()
    ck.save(path, args=ocp.args.PyTreeSave(tree))
    t1 = time.perf_counter()
    meta = ck.metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    out = ck.restore(path, args=ocp.args.PyTreeRestore(restore_args=numpy))
    t2 = time.perf_counter()
    assert np.array_equal(jax.tree.leaves(out)[0].view(np.uint16), np.asarray(jax.tree.leaves(tree)[0]).view(np.uint16))
    return t1 - t0, t2 - t1


@section("weights_checkpoint", help="the trainer's side of the vLLM weight path: the bf16 weights checkpoint "
         "and its Orbax variants", defaults={"presets": "qwen2p5_7b"})
def weights_checkpoint(args):
    import orbax.checkpoint as ocp

    from jaxrl_llm.models import init_params
    from jaxrl_llm.weights_io import restore_weights, save_weights

    preset, cfg = _preset_cfg(args, dtype="bfloat16", param_dtype="bfloat16")
    params = jax.block_until_ready(init_params(cfg, seed=0))
    gb = sum(x.nbytes for x in jax.tree.leaves(params)) / 1e9
    emit_checkpoint(what="meta", preset=preset, gb=gb, device=jax.devices()[0].device_kind,
                    leaves=len(jax.tree.leaves(params)))
    for root in args.dirs.split(","):
        for rep in range(2):
            d = tempfile.mkdtemp(dir=root)
            try:
                t0 = time.perf_counter()
                host = jax.device_get(params)
                t_d2h = time.perf_counter() - t0
                emit_checkpoint(what="d2h", dir=root, rep=rep, seconds=t_d2h, gb_s=gb / t_d2h)
                leaves = jax.tree.leaves(host)
                t0 = time.perf_counter()
                for i, x in enumerate(leaves):
                    np.ascontiguousarray(x).tofile(os.path.join(d, f"{i}.bin"))
                t1 = time.perf_counter()
                back = [np.fromfile(os.path.join(d, f"{i}.bin"), dtype=x.dtype).reshape(x.shape)
                        for i, x in enumerate(leaves)]
                t2 = time.perf_counter()
                del back
                emit_checkpoint(what="raw", dir=root, rep=rep, save_s=t1 - t0, restore_s=t2 - t1, total_s=t2 - t0)
                t0 = time.perf_counter()
                save_weights(os.path.join(d, "w"), 1, params, cfg)
                t1 = time.perf_counter()
                restore_weights(os.path.join(d, "w"), 1)
                t2 = time.perf_counter()
                emit_checkpoint(what="weights_io", dir=root, rep=rep, save_s=t1 - t0, restore_s=t2 - t1,
                                total_s=t2 - t0)
                for name, handler in (
                        ("no_ocdbt", ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False)),
                        ("wide", ocp.PyTreeCheckpointHandler(use_compression=False, save_concurrent_gb=384,
                                                             restore_concurrent_gb=384)),
                        ("no_ocdbt_wide", ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False,
                                                                      save_concurrent_gb=384,
                                                                      restore_concurrent_gb=384))):
                    s, r = _orbax(handler, os.path.join(d, name), params)
                    emit_checkpoint(what=name, dir=root, rep=rep, save_s=s, restore_s=r, total_s=s + r)
            except Exception as e:  # a variant the installed Orbax lacks: say so and go on
                emit_checkpoint(what="error", dir=root, rep=rep, error=f"{type(e).__name__}: {str(e)[:300]}")
            finally:
                shutil.rmtree(d, ignore_errors=True)


def _greedy(actor, prompts):
    request = dict(n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=8, stop_token_ids=(),
                   ignore_eos=True, seeds=[0] * len(prompts))
    return [r[0][:2] for r in actor.generate(prompts, request)]  # (tokens, logprobs) per prompt


@section("weight_path", help="the vLLM pool's weight update on a CPU: through a HF directory against from host memory",
         defaults={"presets": "qwen2p5_0p5b", "repeats": 3}, env=VLLM_ENV)
def weight_path(args) -> None:
    from jaxrl_llm.models import init_params
    from jaxrl_llm.models.hf_io import iter_hf_tensors
    from jaxrl_llm.rollout.vllm_worker import VllmActor, _as_torch
    from jaxrl_llm.weights_io import restore_weights, save_weights

    preset, cfg = _preset_cfg(args, dtype="bfloat16", param_dtype="bfloat16")
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_params(cfg, seed=0))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    emit_path(what="init", preset=preset, params=sum(x.size for x in jax.tree.leaves(params)), bytes=nbytes,
         seconds=time.perf_counter() - t0)

    root = scratch_dir("bench_weight_path_", args.work_dir)
    weights_dir = os.path.join(root, "weights")
    rows: dict[str, list[dict]] = {"save": [], "files": [], "memory": [], "convert": []}
    try:
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            save_weights(weights_dir, rep + 1, params, cfg)
            row = dict(what="save", rep=rep, seconds=time.perf_counter() - t0)
            rows["save"].append(row)
            emit_path(**row)
        step = args.repeats
        emit_path(what="checkpoint", step=step, bytes_on_disk=dir_bytes(os.path.join(weights_dir, str(step))))
        del params

        t0 = time.perf_counter()
        actor = VllmActor(None, weights_dir, step, dtype="bfloat16", max_model_len=256, scratch_dir=root,
                          engine_kwargs=dict(enforce_eager=True, kv_cache_memory_bytes=args.kv_cache_mb << 20,
                                             max_num_seqs=4, max_num_batched_tokens=256))
        emit_path(what="engine_start", seconds=time.perf_counter() - t0)

        prompts = [[9707, 11, 1879, 0], [785, 6722, 315, 9625, 374]]
        outputs = {}
        for rep in range(args.repeats):  # interleaved, so both paths see the same page cache
            for what, via_files in (("files", True), ("memory", False)):
                t0 = time.perf_counter()
                timings = actor.load_weights(weights_dir, step, via_files=via_files)
                row = dict(what=what, rep=rep, seconds=time.perf_counter() - t0, **timings)
                rows[what].append(row)
                emit_path(**row)
                if rep == args.repeats - 1:
                    outputs[what] = _greedy(actor, prompts)
            t0 = time.perf_counter()
            _, restored, restored_cfg = restore_weights(weights_dir, step)
            t1 = time.perf_counter()
            for _, arr in iter_hf_tensors(restored, restored_cfg, dtype="bfloat16"):
                _as_torch(arr)
            row = dict(what="convert", rep=rep, seconds=time.perf_counter() - t0, restore_s=t1 - t0,
                       convert_s=time.perf_counter() - t1)
            del restored
            rows["convert"].append(row)
            emit_path(**row)
        same = outputs["files"] == outputs["memory"]
        emit_path(what="greedy_equal", equal=same, tokens=[t for t, _ in outputs["memory"]])
        if not same:
            raise AssertionError(f"the two load paths generate differently: {outputs}")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    for what, rs in rows.items():
        keys = [k for k in rs[0] if k not in ("what", "rep")]
        emit_path(what=f"median/{what}", repeats=len(rs), bytes=nbytes,
             **{k: statistics.median(r[k] for r in rs) for k in keys})
