"""The memory estimate counts an 8-bit LoRA base: Qwen2.5-14B's frozen base is ~16.3 GB in int8 (layer
kernels at 1 byte, embeddings and lm_head at 2) against ~29.5 GB in bf16. (Whether a 14B LoRA run fits one
80 GB device is the memory check's verdict from XLA's compiled programs: tests/trainer/test_memory_check.py
and the memory matrix in BENCHMARKS.md.)"""

import jax
import numpy as np

from jaxrl_llm.models import DecoderConfig, quant
from jaxrl_llm.models.lora import LoraSpec, adapter_shapes, resolve_targets

GB = 1e9


def _lora_params(cfg, rank=32):
    spec = LoraSpec(rank=rank, alpha=64.0, targets=resolve_targets("all-linear"))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapter_shapes(cfg, spec)))


def test_the_frozen_base_bytes_of_qwen2p5_14b():
    cfg = DecoderConfig.qwen2p5_14b()
    n, q = cfg.num_params(), quant.quantized_params(cfg)
    assert 14.7e9 < n < 14.8e9 and 13.2e9 < q < 13.3e9  # 48 layers x 275M; 2 x 779M embeddings not quantized
    assert quant.base_bytes(cfg, "none") == 2 * n
    int8 = quant.base_bytes(cfg, "int8")
    assert 16.2 * GB < int8 < 16.4 * GB and int8 == quant.base_bytes(cfg, "fp8")
    assert _lora_params(cfg) == 137_625_600  # rank 32 on all 7 linear modules
