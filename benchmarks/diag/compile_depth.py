"""Diagnostics: how the compile time of the paged engine's programs grows with depth, beside the trainer side's
forward. The engine's prefill and decode programs run the layers in a Python loop over the pool's entries (one per
layer: K/V pages or a linear layer's state slots), so each program's HLO holds every layer; the trainer's model
scans the layers in groups (models/qwen2.py), so its compile time stays flat in depth. A cold build of
Qwen3.5-35B-A3B (40 layers) spent 2,270 of its 2,690 thread-seconds in the engine's programs (BENCHMARKS.md).

A tiny Qwen3.5 (a linear and a full-attention layer in turn) at each depth given, random weights, float32:
`JaxEngine.warm` (every program a call of 16 rows reaches, built ahead, nothing allocated) and a jitted forward of
the trainer's model, each timed from a cleared cache.

    JAX_PLATFORMS=cpu python benchmarks/diag/compile_depth.py 4 8 16
"""

import sys
import time

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.params import init_model, split_model
from jaxrl_llm.rollout.base import SamplingParams
from jaxrl_llm.rollout.jax_engine import JaxEngine


def main(depths: list[int]) -> None:
    for layers in depths:
        jax.clear_caches()
        cfg = DecoderConfig.tiny_qwen35(num_hidden_layers=layers,
                                        layer_types=["linear_attention", "full_attention"] * (layers // 2))
        model = init_model(cfg)
        params = split_model(model)[1]
        engine = JaxEngine(cfg, params, dtype="float32", page_size=4, max_prompt_length=32, max_model_len=64,
                           max_num_seqs=16, max_num_batched_tokens=256, kv_cache_memory_bytes=64 << 20,
                           warm_programs=True)
        t0 = time.perf_counter()
        engine.warm(SamplingParams(max_new_tokens=16), 16)
        t_engine = time.perf_counter() - t0
        t0 = time.perf_counter()
        jax.jit(lambda m, x: m(x)).lower(model, jnp.zeros((4, 64), jnp.int32)).compile()
        t_forward = time.perf_counter() - t0
        print(f"layers {layers}: engine programs {t_engine:.1f} s, trainer-side forward {t_forward:.1f} s", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [4, 8, 16])
