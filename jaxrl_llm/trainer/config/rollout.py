"""`rollout.*`: the rollout engine's configuration (veRL's `actor_rollout_ref.rollout.*`), a part of
`RunConfig` (trainer/config/run.py)."""

from __future__ import annotations

import dataclasses
import os

import gin

from jaxrl_llm.agent.config import MultiTurnConfig
from jaxrl_llm.trainer.config.check import check as _check


@gin.configurable("rollout")
@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """veRL's `actor_rollout_ref.rollout.*`."""

    engine: str = "jax"  # "jax" (in-process sampler) or "vllm" (a pool of Ray actors; not for Qwen3.5)
    n: int = 1  # responses sampled a prompt (GRPO's group size)
    temperature: float = 1.0  # sampling temperature of the training rollouts
    top_p: float = 1.0  # nucleus sampling (1.0: off)
    top_k: int = -1  # top-k sampling (-1: off)
    ignore_eos: bool = False  # sample past the end-of-sequence token, each row to its token cap (benchmarks)
    # The JAX engine's KV memory: "paged" (a page pool under a budget, continuous batching; the default)
    # or "dense" (per-row caches; the baseline it is measured against)
    kv_cache: str = "paged"
    # Paged: the share of device memory total use may reach while generating (trainer state and engine
    # weights included); kv_cache_memory_bytes (bytes a device) overrides it
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # paged: the KV pool's bytes a device (None: from gpu_memory_utilization)
    free_cache_engine: bool = True  # release the KV pool after each rollout (the update gets the memory)
    # Paged, per data-parallel shard (each is an engine of its own, as vLLM's data-parallel engine cores): rows
    # decoded together at most, and prompt tokens one prefill call processes at most
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192  # paged, per shard: prompt tokens one prefill call processes at most
    # Paged: prompt + response tokens a row holds at most (fixes the programs' block tables); None:
    # data.max_prompt_length + data.max_response_length
    max_model_len: int | None = None
    page_size: int = 16  # paged: tokens a KV page holds
    max_batch_size: int = 1024  # dense: response rows decoded together
    # JAX engine's decode attention: "xla" (every cache slot), "pallas" (a kernel that reads only each
    # row's valid slots; kernels/decode_attention.py), "auto" (the kernel on GPUs, XLA elsewhere)
    decode_attention: str = "auto"
    # paged, Qwen3.5: the dtype of the linear-attention layers' recurrent state in the engine: "auto" (the
    # engine's dtype, as vLLM's mamba_ssm_cache_dtype 'auto'), "float32" (as transformers keeps it; twice what
    # each decode step reads and writes in bf16) or "bfloat16"
    linear_state_dtype: str = "auto"
    # paged, Qwen3.5: how a decode step writes the new recurrent states: "in_place" (the decode kernel writes each
    # slot in the pool's buffer: half the state traffic; the 9B's generation 34.8 -> 16.6 s on an H100) or "scatter"
    # (the rows' states, then XLA's scatter into their slots)
    state_update: str = "in_place"
    # The JAX engine builds every program of its ladders before its first call (decode at each slot bucket, the
    # prefill and copy ladders; under train.compile_ahead while the worker compiles its own, so step 0 compiles
    # none): None is on where the devices are accelerators, off on a CPU
    warm_programs: bool | None = None
    val_temperature: float = 0.0  # validation is greedy (mean@1) unless val_n > 1
    val_n: int = 1  # responses a validation prompt (veRL's val_kwargs.n): mean@N, best@N, pass@k
    val_top_p: float = 1.0  # validation's top_p (veRL's val_kwargs.top_p)
    val_top_k: int = -1  # validation's top_k (veRL's val_kwargs.top_k)
    vllm_workers: int = 1  # rollout.engine = 'vllm': Ray actors in the pool, one vLLM engine each
    # Where the trainer writes the vLLM pool's weights each step: '' is <run_dir>/weights; a directory
    # such as /dev/shm (a RAM disk, one host) gets a subdirectory of this run, removed at the end.
    weights_dir: str = ""
    # A LoRA run on the vLLM pool: False syncs the base once, then the adapters as vLLM LoRA requests; True: the merged
    lora_merge: bool = False  # weights every step (a full sync, the fallback). The JAX engine merges at every sync.
    # Token budget of one micro-batch a device in the old/reference log-prob (and value) passes; None:
    # twice actor.ppo_max_token_len_per_gpu (a forward pass keeps no activations for a backward one).
    log_prob_max_token_len_per_gpu: int | None = None
    # The old and reference log-prob passes as one program a micro-batch (both models' forward passes: one placing
    # of the micro-batch, and the reference's weight gathers free to overlap the actor's compute); the memory
    # check turns it off where only the two programs apart fit. Measured on 4xH200 at the 7B seed share (2026-11-27):
    # the two passes 14.71 -> 11.68 s, MFU 44.0% -> 55.4% (BENCHMARKS.md, issue 40).
    fuse_log_prob_passes: bool = True
    multi_turn: MultiTurnConfig = dataclasses.field(default_factory=MultiTurnConfig)  # rollout.multi_turn.*
    # async_training: the rollout's own devices (veRL's keys), apart from the trainer's; and its tensor-parallel
    # size there (veRL's tensor_model_parallel_size)
    n_gpus_per_node: int = 0
    nnodes: int = 1  # async_training: the rollout's nodes (rollout.n_gpus_per_node each; over processes, processes)
    tensor_model_parallel_size: int = 1  # async_training: devices that split each rollout shard's heads

    def validate(self):
        _check(self.engine in ("jax", "vllm"), "rollout.engine", f"{self.engine!r}; use 'jax' or 'vllm'")
        _check(self.n_gpus_per_node >= 0 and self.nnodes >= 1 and self.tensor_model_parallel_size >= 1,
               "rollout.n_gpus_per_node / nnodes / tensor_model_parallel_size",
               f"{self.n_gpus_per_node} / {self.nnodes} / {self.tensor_model_parallel_size}; need >= 0, >= 1, >= 1")
        self.multi_turn.validate()
        _check(not self.weights_dir or os.path.isdir(self.weights_dir), "rollout.weights_dir",
               f"{self.weights_dir!r} is not a directory; give an existing one ('/dev/shm' on one host, a shared "
               "file system across hosts) or '' for <run_dir>/weights")
        _check(self.kv_cache in ("paged", "dense"), "rollout.kv_cache", f"{self.kv_cache!r}; use 'paged' or 'dense'")
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "rollout.gpu_memory_utilization",
               f"{self.gpu_memory_utilization} is not a fraction in (0, 1]")
        _check(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0, "rollout.kv_cache_memory_bytes",
               f"{self.kv_cache_memory_bytes}; give a positive byte count or None")
        _check(self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0, "rollout.page_size",
               f"{self.page_size} is not a power of two")
        _check(self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 16,
               "rollout.max_num_seqs / max_num_batched_tokens",
               "need max_num_seqs >= 1 and max_num_batched_tokens >= 16")
        _check(self.max_model_len is None or self.max_model_len > 1, "rollout.max_model_len",
               f"{self.max_model_len}; give prompt + response tokens, or None for the data lengths' sum")
        _check(self.decode_attention in ("auto", "xla", "pallas"), "rollout.decode_attention",
               f"{self.decode_attention!r}; use 'auto', 'xla' or 'pallas'")
        _check(self.linear_state_dtype in ("auto", "float32", "bfloat16"), "rollout.linear_state_dtype",
               f"{self.linear_state_dtype!r}; use 'auto', 'float32' or 'bfloat16'")
        _check(self.state_update in ("scatter", "in_place"), "rollout.state_update",
               f"{self.state_update!r}; use 'scatter' or 'in_place'")
        _check(isinstance(self.n, int) and self.n >= 1, "rollout.n", f"n={self.n}; need n >= 1")
        _check(0.0 < self.top_p <= 1.0, "rollout.top_p", f"{self.top_p} is not in (0, 1]")
        _check(self.temperature > 0.0, "rollout.temperature", "training rollouts need temperature > 0")
        _check(isinstance(self.val_n, int) and self.val_n >= 1, "rollout.val_n", f"val_n={self.val_n}; need >= 1")
        _check(self.val_n == 1 or self.val_temperature > 0.0, "rollout.val_temperature",
               f"rollout.val_n={self.val_n} samples the same greedy response {self.val_n} times; set "
               "rollout.val_temperature > 0 (e.g. 1.0) or val_n = 1")
