"""Weights-only Orbax checkpoints: how trainer params travel to a rollout pool in another process.

Each step the trainer writes `<dir>/<step>/{params, model}`: the params tree (Orbax, atomic commit)
and the HF config.json dict of the model (its family included), so a reader needs nothing else to
rebuild a HF directory through the family's HF table (`jaxrl_llm.models.write_hf_dir`).

The tensors are written without compression and read back as host numpy arrays. Orbax compresses
with zstd by default; on the trainer's bf16 weights that saves ~20% of the bytes and costs more time
than it saves (a 3 GB tree on 2 CPU cores: 6.3 s save and 7.5 s restore with zstd and restore to jax
CPU arrays, 1.5 s and 1.8 s without compression and restored as numpy; `python -m jaxrl_llm.bench
--sections sync` measures the 7B tree on a GPU host).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_llm.models.config import DecoderConfig


def _manager(directory: str, *, max_to_keep: int | None = 2, read_only: bool = False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False,
                                           create=not read_only, read_only=read_only)
    return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                                 item_handlers={"params": ocp.PyTreeCheckpointHandler(use_compression=False),
                                                "model": ocp.JsonCheckpointHandler()})


def save_weights(directory: str, step: int, params, cfg: DecoderConfig, *, max_to_keep: int = 2) -> str:
    """Writes params (any sharding) and the model's HF config; returns the step directory."""
    with _manager(directory, max_to_keep=max_to_keep) as mngr:
        mngr.save(step, args=ocp.args.Composite(params=ocp.args.PyTreeSave(params),
                                                model=ocp.args.JsonSave(cfg.to_hf())), force=True)
        mngr.wait_until_finished()
    return os.path.join(os.path.abspath(directory), str(step))


def latest_weights_step(directory: str) -> int | None:
    if not os.path.isdir(directory):
        return None
    with _manager(directory, read_only=True) as mngr:
        return mngr.latest_step()


def restore_weights(directory: str, step: int | None = None) -> tuple[int, dict, DecoderConfig]:
    """(step, params as host numpy arrays, config) of `step` (default: the latest)."""
    with _manager(directory, read_only=True) as mngr:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{directory}: no weights checkpoint")
        meta = mngr.item_metadata(step)["params"]
        # Host numpy arrays straight from tensorstore (bf16 as ml_dtypes.bfloat16): no jax CPU arrays
        # and no second copy.
        numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
        restored = mngr.restore(step, args=ocp.args.Composite(
            params=ocp.args.PyTreeRestore(restore_args=numpy), model=ocp.args.JsonRestore()))
    return step, restored["params"], DecoderConfig.from_hf(dict(restored["model"]))
