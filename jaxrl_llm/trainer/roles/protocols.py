"""The interfaces of the trainer's roles, as the loop and the rollouters call them.

`WorkerRole` is the actor, reference and critic on the training mesh (roles/worker.py): the checkpointed states, the
forward passes, the advantages and the updates. `EngineRole` is the rollout engine: it generates, and takes the
actor's weights (roles/engines.py: the JAX engine beside the worker or on the rollout's own devices; roles/pool.py:
the vLLM pool; processes/remote.py: the JAX engine of another process). `StreamingEngine` is an engine that can
also run a rollout stream (fully_async). A handle to a role is typed as its Protocol, whether it is the object
itself or a proxy of one in a Ray actor (roles/handles.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from jaxrl_llm.models import Qwen2Config
from jaxrl_llm.rollout import RolloutBatch, SamplingParams
from jaxrl_llm.trainer.batch import TrainBatch


@runtime_checkable
class WorkerRole(Protocol):
    """The actor, reference and critic models on one device mesh, and their checkpoints."""

    # ---- what the driver reads once -------------------------------------------------------------------
    def model_config(self) -> Qwen2Config:
        """The model's config (after the memory check's choices)."""

    def num_devices(self) -> int:
        """Devices of the training mesh."""

    def peak_tflops(self) -> float:
        """A device's peak TFLOP/s, for MFU."""

    def needs_old_log_prob(self) -> bool:
        """Whether a step runs the old-log-prob pass (not exactly on-policy, not bypass mode)."""

    def needs_ref_flag(self) -> bool:
        """Whether a step runs the reference pass (a KL loss or a KL penalty in the reward)."""

    def describe(self) -> dict:
        """What the worker settled at its start: the mesh's axes, the remat policy, the fused passes, on-policy."""

    def memory_rows(self) -> list[dict]:
        """The memory check's programs, one row each (empty where nothing was checked)."""

    # ---- checkpoints -----------------------------------------------------------------------------------
    def open_checkpointer(self, directory: str, max_to_keep: int | None) -> list[int]:
        """Opens the run's checkpoint dir for saving; returns the steps already there."""

    def close_checkpointer(self) -> None:
        """Waits for pending saves and stops the checkpoint manager's threads."""

    def set_aside_checkpoints(self) -> list[str]:
        """A fresh start in a run dir that has checkpoints moves them aside."""

    def restore_checkpoint(self, directory: str, step: int | None = None) -> dict | None:
        """Restores the train states; returns the checkpoint's meta (with its step), or None."""

    def save_checkpoint(self, step: int, meta: dict) -> dict[str, float]:
        """Starts an async save of the train states; returns the disk usage of the committed ones."""

    def wait_checkpoint(self) -> None:
        """Waits until the last save has committed."""

    def save_weights(self, directory: str, step: int, *, base: bool = False) -> str:
        """Writes the actor's weights (a vLLM pool's) as a weights-only checkpoint."""

    def save_adapters(self, directory: str, step: int) -> str:
        """Writes the actor's LoRA adapters as a PEFT directory; returns its path."""

    # ---- one step --------------------------------------------------------------------------------------
    def start_forward_passes(self, batch: TrainBatch, *, old: bool = False, ref: bool = False,
                             values: bool = False) -> None:
        """Dispatches the asked passes over `batch` (old and reference log-probs, values) without waiting."""

    def forward_passes_ready(self) -> bool:
        """Whether the dispatched passes are done (never blocks)."""

    def finish_forward_passes(self) -> dict[str, np.ndarray]:
        """The passes' results, [R, Tr] each."""

    def compute_advantages(self, batch: TrainBatch, kl_coef: float = 0.0) -> dict:
        """Token-level rewards, advantages and returns ({"fields", "metrics"})."""

    def update_critic(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """The critic's PPO epochs over `batch`; its metrics."""

    def update_actor(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """The actor's PPO epochs over `batch`; its metrics."""

    def compile_stats(self) -> dict:
        """This process's XLA compiles so far (jaxrl_llm.compile_watch)."""

    def pack_metrics(self) -> dict[str, float]:
        """How full the packed micro-batches were since the last call (`perf/pack_fill`)."""


@runtime_checkable
class EngineRole(Protocol):
    """The rollout engine: generates responses, and takes the actor's weights."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 max_new_tokens_per_row: Sequence[int] | None = None,
                 seeds: Sequence[int] | None = None) -> RolloutBatch:
        """`sampling.n` responses a prompt. Every process of the run calls it; each gets the whole rollout."""

    def generate_on_main(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                         max_new_tokens_per_row: Sequence[int] | None = None,
                         seeds: Sequence[int] | None = None) -> RolloutBatch:
        """`generate`, called by process 0 alone (the agent loop's turns, which it drives there)."""

    def start(self, version: int) -> None:
        """Readies the engine once the run's states are restored: it holds the actor's weights of `version`."""

    def sync(self, version: int) -> None:
        """The actor's current weights into the engine, as `version`."""

    def stats(self) -> dict:
        """The last `generate`'s figures (programs compiled, the KV pool's size); {} where there are none."""

    def weight_sync_metrics(self) -> dict[str, float]:
        """What the last sync to the rollout's own devices moved; {} where the engine reads the weights in place."""

    def close(self) -> None:
        """Frees what the engine holds (its devices' pools and weights, its actors, its files); the end of a run."""


@runtime_checkable
class StreamingEngine(EngineRole, Protocol):
    """An engine on devices of its own that also runs a rollout stream (rollout/stream.py; fully_async)."""

    version: int  # the weights' version the engine runs
    pad_id: int

    def stream(self, sampling: SamplingParams, *, capacity: int, on_group: Callable, kv: str):
        """A rollout stream over this engine's shards; `on_group(GroupResult)` for each finished group."""

    def stage(self, stream, version: int) -> None:
        """The actor's current weights to `stream`, which its shards take at their next decode boundary."""
