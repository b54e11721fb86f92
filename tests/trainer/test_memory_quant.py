"""The memory pre-check counts an 8-bit LoRA base: Qwen2.5-14B's frozen base is ~16.3 GB in int8 (layer
kernels at 1 byte, embeddings and lm_head at 2) against ~29.5 GB in bf16, and a 14B LoRA run on one 80 GB
device fails before any work with a bf16 base (the sync's merged tree and the engine's copy beside the base)
and passes with an int8 one (merged layer by layer into the engine)."""

import jax
import numpy as np
import pytest

from jaxrl_llm.models import DecoderConfig, quant
from jaxrl_llm.models.errors import ConfigError
from jaxrl_llm.models.lora import LoraSpec, adapter_shapes, resolve_targets
from jaxrl_llm.trainer.memory import check_fits, estimate_step_bytes

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


def test_a_14b_lora_run_on_one_80gb_device_needs_the_int8_base():
    cfg = DecoderConfig.qwen2p5_14b()
    kw = dict(device_bytes=int(80 * GB), tokens_per_device=16384, param_shards=1, ref=True,
              lora_params=_lora_params(cfg))
    with pytest.raises(ConfigError, match=r"rollout needs ~90\.\d GB.*of its 80\.0 GB.*model.base_quantization = "
                                          r"'int8'"):
        check_fits(cfg, **kw, base_quantization="none", engine=False)  # base, merged tree, engine: 3 x 29.5, + 2.2
    check_fits(cfg, **kw, base_quantization="int8", engine=False)  # 16.3 + 29.5 + 2.2
    update = estimate_step_bytes(cfg, remat="full", engine=False, **{k: v for k, v in kw.items()
                                                                     if k != "device_bytes"}, base_quantization="int8")
    assert 28 * GB < update < 30 * GB  # state 18.5 GB; 16k tokens of layer inputs, one layer and logit chunks 10.4
    with pytest.raises(ConfigError, match=r"update needs.*actor.ppo_max_token_len_per_gpu -> 262144 tokens"):
        check_fits(cfg, **{**kw, "tokens_per_device": 262144}, base_quantization="int8", engine=False)
    check_fits(cfg, **kw, base_quantization="none", engine=False, jax_engine=False)  # vLLM holds the engine copy
    check_fits(cfg, **{**kw, "device_bytes": None}, base_quantization="none")  # unknown size (CPU): no check
