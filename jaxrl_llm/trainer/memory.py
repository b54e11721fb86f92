"""Device memory of a training step, estimated from shapes, to pick the remat policy (`model.remat='auto'`).

Saving the matmul outputs of every layer (remat "dots") skips the recomputed forward in the backward
pass (about 8·N → 6·N FLOPs a token), but the saved outputs grow with the micro-batch's tokens; "full"
keeps only each layer's input. `choose_remat` takes "dots" when the step's estimated peak fits the device
with a margin, else "full". The estimate counts, per device:

  actor      fp32 params, Adam's two moments and the gradient accumulator (4 x 4 bytes a param), sharded;
             under LoRA the frozen base in the compute dtype (2 bytes a param, no fp32 master) and those
             16 bytes for each adapter param only
  reference  compute-dtype params (2 bytes a param), sharded, unless offloaded to the host; none under
             LoRA (the reference is the frozen base run without the adapters)
  critic     like the actor (PPO)
  engine     the sampler's compute-dtype weights, split over `tensor` only (none with rollout.free_cache_engine:
             the worker drops them for the update and the sync rebuilds them)
  saved      per token and layer: the layer input ("full"), or every matmul output and the attention's
             output and statistics ("dots")
  working    one layer's recomputed activations and the vocab-chunked log-prob's [tokens, chunk] logits
"""

from __future__ import annotations

import logging

from jaxrl_llm.models.config import Qwen2Config

log = logging.getLogger(__name__)

# Share of the device's memory the estimate may use: the rest covers XLA's temporaries and fragmentation.
MARGIN = 0.85


def _param_count(cfg: Qwen2Config) -> int:
    return cfg.num_params()


def saved_bytes_per_token(cfg: Qwen2Config, remat: str, act_bytes: int = 2) -> int:
    """Activations kept for the backward pass, per token, over all layers."""
    d, f, layers = cfg.hidden_size, cfg.active_intermediate_size, cfg.num_hidden_layers
    if remat == "full":
        per_layer = d
    else:  # "dots" (and "none", which keeps at least as much): the matmul outputs, the attention's
        # output and its fp32 softmax statistics (one a head)
        per_layer = cfg.q_dim + 2 * cfg.kv_dim + d + 2 * f + d + cfg.q_dim + 2 * cfg.num_attention_heads
    return per_layer * layers * act_bytes


def estimate_step_bytes(cfg: Qwen2Config, *, remat: str, tokens_per_device: int, param_shards: int,
                        tensor: int = 1, ref: bool = True, critic: bool = False, engine: bool = True,
                        logprob_chunk: int = 8192, lora_params: int = 0) -> float:
    """Estimated peak bytes a device holds during the actor update. `lora_params` > 0: a LoRA run with
    that many adapter params (a critic's too, when there is one)."""
    n = _param_count(cfg)
    if lora_params:
        trained = 2.0 * n + 16.0 * lora_params  # the frozen base + the adapters' fp32 params, moments, grads
        ref = False
    else:
        trained = 16.0 * n  # fp32 params + Adam mu, nu + fp32 gradient accumulator
    total = trained / param_shards
    if ref:
        total += 2.0 * n / param_shards
    if critic:
        total += trained / param_shards
    if engine:
        total += 2.0 * n / tensor
    total += saved_bytes_per_token(cfg, remat) * tokens_per_device
    # One layer's recomputed activations (a few [tokens, F] buffers) and the chunked logits in fp32.
    total += tokens_per_device * (4 * cfg.active_intermediate_size * 2 + logprob_chunk * 4)
    return total


def device_memory_bytes() -> int | None:
    """The memory XLA may use on the first local device, or None where it does not say (CPU)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def choose_remat(cfg: Qwen2Config, *, tokens_per_device: int, param_shards: int, tensor: int = 1,
                 ref: bool = True, critic: bool = False, engine: bool = True,
                 device_bytes: int | None = None, lora_params: int = 0) -> str:
    """"dots" when the step fits the device with it, else "full" (also when the device size is unknown)."""
    if device_bytes is None:
        return "full"
    need = estimate_step_bytes(cfg, remat="dots", tokens_per_device=tokens_per_device, param_shards=param_shards,
                               tensor=tensor, ref=ref, critic=critic, engine=engine, lora_params=lora_params)
    choice = "dots" if need <= MARGIN * device_bytes else "full"
    log.info("model.remat='auto': %s (dots would need ~%.1f GB of the device's %.1f GB)", choice, need / 1e9,
             device_bytes / 1e9)
    return choice
