"""The weight side of `TrainerWorker` (trainer/roles/worker.py): the actor's weights into the JAX engine (in place when
colocated, through a `WeightSync` on the rollout's own devices, over one program of both sides' devices to another
process), freeing what the engine holds, and writing weights and adapters for a vLLM pool or an export."""

from __future__ import annotations

import os

import jax

from jaxrl_llm.trainer.processes.remote import RemoteEngine


class WorkerWeights:
    """Mixin of TrainerWorker: uses its `actor`, `engine`, `_weight_sync`, `rollout_devices`, `run`, `cfg` and
    `lora`."""

    def _release_engine_weights(self) -> None:
        """With rollout.free_cache_engine, the JAX engine's weight copy is dropped for the updates (the sync that
        follows every actor update rebuilds it), like its KV pool after every rollout."""
        if self.engine is not None and self.run.rollout.free_cache_engine and self.rollout_devices is None:
            self.engine.release_weights()

    def sync_rollout_weights(self, step: int) -> None:
        """Moves the new actor weights into the JAX engine, in device memory (another process's: device to device
        over one program of both sides' devices)."""
        if isinstance(self.engine, RemoteEngine):
            self.engine.sync_from(self.actor, step)
        elif self.engine is not None:
            self.engine.update_weights(self.rollout_weights(), step=step)
            jax.block_until_ready(self.engine.params)

    def release_rollout(self) -> None:
        """Frees what the rollout's own devices hold (the engine's KV pools and weights, LoRA's base kept by the
        sync) now; a later sync moves the base again. For the end of an async run."""
        self.engine.release()
        self.engine.release_weights()
        if self._weight_sync is not None:
            self._weight_sync.drop_base()

    def rollout_weights(self) -> dict:
        """The actor's weights as the engine's `update_weights` takes them. On the rollout's own devices they go
        through a WeightSync (device to device, in layer buckets; with LoRA the adapters alone after the first
        sync, the frozen base staying there); colocated, the engine reads the trainer's arrays in place."""
        if self.rollout_devices is None:
            return self.actor.engine_params()
        return self._weight_sync.from_model_state(self.actor)

    def weight_sync_metrics(self) -> dict[str, float]:
        """What the last sync to the rollout's own devices moved ({} colocated): `rollouter/weight_sync_mb`, copied
        device to device (with LoRA after the first sync, the adapters alone)."""
        sync = self.engine.sync if isinstance(self.engine, RemoteEngine) else self._weight_sync
        if sync is None:
            return {}
        return {"rollouter/weight_sync_mb": sync.stats.bytes / 2**20,
                "rollouter/weight_sync_cross_process": float(sync.side is not None)}

    def save_weights(self, directory: str, step: int, *, base: bool = False) -> str:
        """Writes the actor params as a weights-only Orbax checkpoint (for a vLLM pool), in the compute
        dtype the pool runs in (bf16 by default: half the bytes of the fp32 master weights to write and to
        read back), cast on the devices in the params' own sharding. LoRA: the base with the adapters
        merged in (rollout.lora_merge), or with `base` the frozen base alone (the adapters follow as PEFT
        directories, `save_adapters`)."""
        from jaxrl_llm.weights_io import save_weights

        if base and self.lora is not None:  # an 8-bit base goes out dequantized: vLLM runs what the trainer does
            params = self.actor.frozen if self.actor.quantization == "none" else self.actor.merged_base()
        else:
            params = self.actor.merged(self.cfg.dtype)
        return save_weights(directory, step, params, self.cfg)

    def save_adapters(self, directory: str, step: int) -> str:
        """Writes the actor's adapters, in the compute dtype, as the PEFT directory <directory>/adapters/<step>
        (every process joins the gather, process 0 writes); returns its path."""
        from jaxrl_llm.models.peft_io import save_peft

        path = os.path.join(os.path.abspath(directory), "adapters", str(step))
        return save_peft(self.actor.adapters(), self.lora, path, self.cfg, dtype=self.cfg.dtype)
