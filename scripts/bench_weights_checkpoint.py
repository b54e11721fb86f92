"""Where the trainer's side of the vLLM weight path spends its time: the bf16 weights checkpoint.

  python scripts/bench_weights_checkpoint.py --preset qwen2p5_7b --dirs /tmp,/dev/shm --out $OUT/ckpt.jsonl

Random bf16 weights of a preset on the default device (never zeros), then, in each directory:
  d2h       device -> host numpy (`jax.device_get`), the part every format pays
  raw       a floor: that numpy tree written with `ndarray.tofile` and read back with `np.fromfile`
  weights_io  `save_weights` / `restore_weights` (Orbax, PyTree handler, uncompressed, numpy restore)
  no_ocdbt  the same Orbax handler without OCDBT (one tensorstore array per leaf)
  wide      weights_io's format with 4x Orbax's default concurrent-GB limits
  no_ocdbt_wide  both
Each timed twice; one JSON row a measurement. `--small` runs the tiny preset (a CPU smoke test).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

from jaxrl_llm.models import init_params  # noqa: E402
from jaxrl_llm.models.config import PRESETS  # noqa: E402
from jaxrl_llm.weights_io import restore_weights, save_weights  # noqa: E402
from scripts.bench_common import ROWS, emit  # noqa: E402


def _orbax(handler, path, tree):
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2p5_7b")
    ap.add_argument("--dirs", default="/tmp")
    ap.add_argument("--out", default=None)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    ROWS.path = args.out
    preset = "tiny" if args.small else args.preset
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="bfloat16")
    params = jax.block_until_ready(init_params(cfg, seed=0))
    gb = sum(x.nbytes for x in jax.tree.leaves(params)) / 1e9
    emit(what="meta", preset=preset, gb=gb, device=jax.devices()[0].device_kind, leaves=len(jax.tree.leaves(params)))
    for root in args.dirs.split(","):
        for rep in range(2):
            d = tempfile.mkdtemp(dir=root)
            try:
                t0 = time.perf_counter()
                host = jax.device_get(params)
                t_d2h = time.perf_counter() - t0
                emit(what="d2h", dir=root, rep=rep, seconds=t_d2h, gb_s=gb / t_d2h)
                leaves = jax.tree.leaves(host)
                t0 = time.perf_counter()
                for i, x in enumerate(leaves):
                    np.ascontiguousarray(x).tofile(os.path.join(d, f"{i}.bin"))
                t1 = time.perf_counter()
                back = [np.fromfile(os.path.join(d, f"{i}.bin"), dtype=x.dtype).reshape(x.shape)
                        for i, x in enumerate(leaves)]
                t2 = time.perf_counter()
                del back
                emit(what="raw", dir=root, rep=rep, save_s=t1 - t0, restore_s=t2 - t1, total_s=t2 - t0)
                t0 = time.perf_counter()
                save_weights(os.path.join(d, "w"), 1, params, cfg)
                t1 = time.perf_counter()
                restore_weights(os.path.join(d, "w"), 1)
                t2 = time.perf_counter()
                emit(what="weights_io", dir=root, rep=rep, save_s=t1 - t0, restore_s=t2 - t1, total_s=t2 - t0)
                for name, handler in (
                        ("no_ocdbt", ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False)),
                        ("wide", ocp.PyTreeCheckpointHandler(use_compression=False, save_concurrent_gb=384,
                                                             restore_concurrent_gb=384)),
                        ("no_ocdbt_wide", ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False,
                                                                      save_concurrent_gb=384,
                                                                      restore_concurrent_gb=384))):
                    s, r = _orbax(handler, os.path.join(d, name), params)
                    emit(what=name, dir=root, rep=rep, save_s=s, restore_s=r, total_s=s + r)
            except Exception as e:  # a variant the installed Orbax lacks: say so and go on
                emit(what="error", dir=root, rep=rep, error=f"{type(e).__name__}: {str(e)[:300]}")
            finally:
                shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
