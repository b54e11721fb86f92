"""One of two processes of `test_union_sync.py` (started by the launcher, `--module tests.rollout.union_sync_child`):
process 0 holds a training mesh (fsdp 2) and sends, process 1 holds a rollout mesh and receives, through
`WeightSync(side=...)`, with no host round trip (`no_host_copies`) and with every way to open a file raising."""

import builtins
import contextlib
import io
import os
import sys

import jax
import ml_dtypes
import numpy as np

from jaxrl_llm import distributed, sharding
from jaxrl_llm.models import init_params
from jaxrl_llm.rollout.weight_sync import WeightSync, no_host_copies
from jaxrl_llm.trainer.processes.channel import Channel
from tests.rollout.test_weight_sync import BUCKET, CFG

CASES = {  # name: (rollout mesh (data, fsdp, tensor), the trainer's param dtype)
    "fp32 masters into tensor 2, cast in layer buckets": ((1, 1, 2), "float32"),
}


@contextlib.contextmanager
def no_files():
    """Any file opened meanwhile (Python's open, io.open, os.open) is an error."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a file was opened during the weight sync: {args[:1]}")

    saved = builtins.open, io.open, os.open
    builtins.open = io.open = os.open = refuse
    try:
        yield
    finally:
        builtins.open, io.open, os.open = saved


def main() -> int:
    distributed.initialize(distributed.spec_from_env())
    me = jax.process_index()
    distributed.set_group([me])  # each side its own SPMD program; the sync spans both
    train_devs, roll_devs = ([d for d in jax.devices() if d.process_index == p] for p in (0, 1))
    channel = Channel("union_sync_test")
    for name, (rollout_shape, dtype) in CASES.items():
        rollout = sharding.make_mesh(*rollout_shape, devices=roll_devs)
        if me == 0:
            params = init_params(CFG, mesh=sharding.make_mesh(1, 2, 1, devices=train_devs), seed=1, dtype=dtype)
            sync = WeightSync(CFG, rollout, dtype="bfloat16", bucket_bytes=BUCKET, side="send")
            channel.put("plan", sync.plan_of(type("Actor", (), {"lora": None, "state": {"params": params}})))
            with no_host_copies(), no_files():
                out = sync(params)
            assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(out)), name
        else:
            sync = WeightSync(CFG, rollout, dtype="bfloat16", bucket_bytes=BUCKET, side="receive")
            plan = channel.get("plan")
            with no_host_copies(), no_files():
                out = sync.from_plan(plan)
            want = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16),
                                init_params(CFG, mesh=sharding.make_mesh(1, 1, 1, devices=roll_devs[:1]), seed=1,
                                            dtype=dtype))
            got = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(out)}
            for k, w in {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(want)}.items():
                assert got[k].sharding.device_set == set(roll_devs), k
                np.testing.assert_array_equal(np.asarray(got[k]).view(np.uint8), w.view(np.uint8), err_msg=k)
        print(f"{name}: {sync.stats.copies} shard copies, {sync.stats.bytes} bytes, {sync.stats.buckets} bucket "
              f"programs; {'arrived bit for bit' if me else 'sent'}", flush=True)
    distributed.set_group(None)
    distributed.barrier("done")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BaseException as e:  # the other process's next wait raises it, rather than wait for this one
        Channel("union_sync_test").fail(f"process {jax.process_index()}: {type(e).__name__}: {e}")
        raise
