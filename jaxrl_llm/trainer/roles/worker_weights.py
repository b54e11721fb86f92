"""The weight side of `TrainerWorker` (trainer/roles/worker.py): the roles that share its devices and give back what
they hold there for an update, and the actor's weights and adapters written for a vLLM pool or an export."""

from __future__ import annotations

import os


class WorkerWeights:
    """Mixin of TrainerWorker: uses its `actor`, `cfg`, `lora` and `_tenants`."""

    def share_devices(self, tenant) -> None:
        """`tenant` (a colocated engine) holds memory on this worker's devices that it gives back before each
        update (`tenant.free_for_update()`), so the update has what the memory check counted for it."""
        self._tenants.append(tenant)

    def _free_for_update(self) -> None:
        for tenant in self._tenants:
            tenant.free_for_update()

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
