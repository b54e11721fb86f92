"""The vLLM pool as a rollout role (`EngineRole`, `rollout.engine = 'vllm'`).

The pool is Ray actors, each holding a `vllm.LLM` (rollout/vllm_pool.py), driven from process 0 of the run: its
rollout reaches every process by a broadcast. Weights reach it through files the worker writes (every process
its shards): a weights-only Orbax checkpoint the actors load in place, or under LoRA (unless `rollout.lora_merge`)
the frozen base once and then the adapters alone, as a PEFT directory vLLM serves as LoRA requests. The files live
in `<run_dir>/weights`, or in this run's own directory under `rollout.weights_dir` (a RAM disk), removed at the end.
"""

from __future__ import annotations

import hashlib
import os
import shutil

from jaxrl_llm import distributed
from jaxrl_llm.agent.config import engine_prompt_length
from jaxrl_llm.ray_cluster import init_ray
from jaxrl_llm.trainer.roles.model_load import lora_spec
from jaxrl_llm.trainer.roles.protocols import WorkerRole


def weights_dir(run) -> str:
    """The pool's weights checkpoint dir: <run_dir>/weights, or this run's own subdirectory of `rollout.weights_dir`
    (named by the run dir, so every process of the run finds the same one)."""
    root = run.rollout.weights_dir
    if not root:
        return os.path.join(run.trainer.run_dir, "weights")
    tag = hashlib.sha1(os.path.abspath(run.trainer.run_dir).encode()).hexdigest()[:12]
    return os.path.join(root, f"jaxrl_llm_weights_{tag}")


class PoolEngine:
    """The vLLM pool, started at `start` from the actor's weights of that step."""

    def __init__(self, run, worker: WorkerRole):
        self.run, self.worker = run, worker
        self.main = distributed.is_main()
        self.lora = lora_spec(run)
        # LoRA: the base once, then only the adapters (vLLM LoRA requests), unless rollout.lora_merge
        self.sync_adapters = self.lora is not None and not run.rollout.lora_merge
        self.weights_dir = weights_dir(run)
        self.pool = None  # on process 0 only, once started

    def start(self, version: int) -> None:
        """Writes the actor's weights of `version` (LoRA with adapter syncs: the frozen base, then the adapters; a
        killed run's newer adapters, left on disk, go first) and starts the pool from them."""
        from jaxrl_llm.rollout import VllmPool

        if self.sync_adapters and self.main:
            shutil.rmtree(os.path.join(self.weights_dir, "adapters"), ignore_errors=True)
        self.worker.save_weights(self.weights_dir, version, base=self.sync_adapters)  # every process its shards
        adapter = self.worker.save_adapters(self.weights_dir, version) if self.sync_adapters else None
        if not self.main:
            return
        init_ray(self.run.trainer.ray_address)
        d, lora = self.run.data, self.lora if self.sync_adapters else None
        self.pool = VllmPool(self.worker.model_config(), num_workers=self.run.rollout.vllm_workers,
                             weights_dir=self.weights_dir, max_prompt_length=engine_prompt_length(self.run),
                             max_model_len=d.max_prompt_length + d.max_response_length, dtype=self.run.model.dtype,
                             seed=d.seed, lora_rank=lora.rank if lora else 0,
                             lora_targets=lora.targets if lora else ())
        if adapter is not None:
            self.pool.update_adapter(adapter, step=version)

    def generate(self, prompts, sampling, max_new_tokens_per_row=None, seeds=None):
        """Process 0 drives the pool; every process gets its rollout."""
        return distributed.broadcast_object(
            self.generate_on_main(prompts, sampling, max_new_tokens_per_row, seeds) if self.main else None)

    def generate_on_main(self, prompts, sampling, max_new_tokens_per_row=None, seeds=None):
        return self.pool.generate(prompts, sampling, max_new_tokens_per_row=max_new_tokens_per_row, seeds=seeds)

    def sync(self, version: int) -> None:
        """New weights through files: the adapters alone (process 0 writes them), or every process its shards of the
        merged weights; the pool loads them."""
        if self.sync_adapters:
            adapter = self.worker.save_adapters(self.weights_dir, version)
            if self.main:
                self.pool.update_adapter(adapter, step=version)
        else:
            self.worker.save_weights(self.weights_dir, version)
            if self.main:
                self.pool.update_weights(step=version)
        distributed.barrier(f"weights_{version}")

    def stats(self) -> dict:
        return {}

    def weight_sync_metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Stops the pool's actors, and drops its weights when they live outside the run dir (a RAM disk keeps two
        steps of weights in host memory otherwise)."""
        if self.pool is not None:
            self.pool.shutdown()
        if self.main and self.run.rollout.weights_dir:
            shutil.rmtree(self.weights_dir, ignore_errors=True)
