"""Device memory of a training step, estimated from shapes: the first pass of `model.remat='auto'`.

Saving the matmul outputs of every layer (remat "dots") skips the recomputed forward in the backward
pass (about 8·N → 6·N FLOPs a token), but the saved outputs grow with the micro-batch's tokens; "full"
keeps only each layer's input, and the policies between keep chosen activations (`models/remat.py`).
`choose_remat` offers the first policy of the ladder (the least recompute first) whose step's estimated peak
fits the device with a margin. The estimate is arithmetic and fast; the memory check before the first step
(trainer/memory/check.py) compiles the offered choice, and the ladder below it where that does not fit, and
trusts XLA's own analysis, so the estimate only spares it compiling policies that cannot fit. It counts, per
device:

  actor      fp32 params, Adam's two moments and the gradient accumulator (4 x 4 bytes a param), sharded;
             under LoRA that for the adapters alone, plus the frozen base: 2 bytes a param, or with
             `model.base_quantization` 1 byte a layer kernel's param (and its fp32 scales), 2 for the rest
  reference  compute-dtype params (2 bytes a param), sharded, unless offloaded to the host (none under
             LoRA: the reference is the frozen base)
  critic     like the actor (PPO)
  engine     the sampler's compute-dtype weights, split over `tensor` only (none with rollout.free_cache_engine:
             the worker drops them for the update and the sync rebuilds them); an 8-bit base is dequantized
             into the engine's copy, which stays in the compute dtype
  saved      per token and layer: the layer input ("full"), chosen activations (the policies between,
             `models/remat.py`), or every matmul output and the attention's output and statistics ("dots"; a
             Qwen3.5's gated q_proj is twice as wide, and its Gated DeltaNet layers keep their five projections'
             outputs and the delta rule's); under LoRA "dots" also keeps each adapter's two matmul outputs, x·A
             [r] and (x·A)·B [out]: at 7B with rank 32 on every linear layer that is 2.8 MB a token, as much
             again as the base's own matmuls (issue 32: left out, it made `auto` take "dots" for the 7B LoRA step
             on one H100, whose update then asked XLA for 84.8 GiB)
  working    one layer's recomputed activations and the vocab-chunked log-prob's [tokens, chunk] logits (and a
             Gated DeltaNet layer's fp32 [chunk] decay, pair and solve matrices a value head)
"""

from __future__ import annotations

import logging

import jax

from jaxrl_llm.models import quant
from jaxrl_llm.models.config import Qwen2Config
from jaxrl_llm.models.gated_delta import CHUNK
from jaxrl_llm.models.lora import adapter_shapes, num_adapter_params
from jaxrl_llm.models.remat import AUTO_LADDER, saved_values_per_layer

log = logging.getLogger(__name__)

# Share of the device's memory the estimate may use: the rest covers XLA's temporaries and fragmentation.
MARGIN = 0.85


def _param_count(cfg: Qwen2Config) -> int:
    return cfg.num_params()


def saved_bytes_per_token(cfg: Qwen2Config, remat: str, act_bytes: int = 2, lora_outputs: int = 0) -> int:
    """Activations kept for the backward pass, per token, over all layers. `lora_outputs`: the adapters'
    matmul outputs a token has over all layers (`lora_outputs_per_token`), which "dots" keeps too."""
    d, f, layers = cfg.hidden_size, cfg.active_intermediate_size, cfg.num_hidden_layers
    n_linear = _linear_layers(cfg)
    if remat not in ("dots", "none"):  # the named policies (models/remat.py) keep tagged activations
        # of the attention layers; a Gated DeltaNet layer keeps its input (and the MLP's gate under mlp_gate)
        linear = d + (f if remat == "mlp_gate" else 0)
        return ((layers - n_linear) * saved_values_per_layer(cfg, remat) + n_linear * linear) * act_bytes
    # "dots" (and "none", which keeps at least as much): the matmul outputs, the attention's output and its
    # fp32 softmax statistics (one a head); a Gated DeltaNet's projections and the delta rule's output
    mlp = 2 * f + d
    q_out = cfg.q_dim * (2 if cfg.is_hybrid else 1)  # Qwen3.5's q_proj makes the output gate too
    attention = q_out + 2 * cfg.kv_dim + d + cfg.q_dim + 2 * cfg.num_attention_heads
    linear = cfg.linear_conv_dim + 2 * cfg.linear_value_dim + 2 * cfg.linear_num_value_heads + d
    per_token = (layers - n_linear) * (attention + mlp) + n_linear * (linear + mlp)
    return (per_token + lora_outputs) * act_bytes


def _linear_layers(cfg: Qwen2Config) -> int:
    return sum(cfg.is_linear_layer(i) for i in range(cfg.num_hidden_layers))


def lora_outputs_per_token(cfg: Qwen2Config, spec) -> int:
    """Values the adapters of `spec` compute for one token over all layers: x·A [r] and (x·A)·B [out] of
    every adapted module (0 without LoRA)."""
    if spec is None:
        return 0
    return sum(b.shape[0] * (b.shape[1] + b.shape[2]) for path, b in
               jax.tree_util.tree_leaves_with_path(adapter_shapes(cfg, spec)) if path[-1].key == "lora_b")


def estimate_step_bytes(cfg: Qwen2Config, *, remat: str, tokens_per_device: int, param_shards: int,
                        tensor: int = 1, ref: bool = True, critic: bool = False, engine: bool = True,
                        logprob_chunk: int = 8192, lora_params: int = 0, base_quantization: str = "none",
                        lora_outputs: int = 0) -> float:
    """Estimated peak bytes a device holds during the actor update. `lora_params` > 0: a LoRA run with that
    many adapter params (per model), its frozen base held as `base_quantization` says, and `lora_outputs`
    adapter matmul outputs a token (`lora_outputs_per_token`)."""
    n = _param_count(cfg)
    total = model_state_bytes(cfg, lora_params, base_quantization) / param_shards
    if ref and not lora_params:
        total += 2.0 * n / param_shards
    if critic:
        total += model_state_bytes(cfg, lora_params, base_quantization) / param_shards
    if engine:
        total += 2.0 * n / tensor
    total += saved_bytes_per_token(cfg, remat, lora_outputs=lora_outputs) * tokens_per_device
    # One layer's recomputed activations (a few [tokens, F] buffers) and the chunked logits in fp32; a Gated DeltaNet
    # layer's chunked delta rule holds about four fp32 [C] rows a value head and token (decay, pairs, solve).
    total += tokens_per_device * (4 * cfg.active_intermediate_size * 2 + logprob_chunk * 4)
    if _linear_layers(cfg):
        total += tokens_per_device * 4 * cfg.linear_num_value_heads * CHUNK * 4
    return total


def model_state_bytes(cfg: Qwen2Config, lora_params: int = 0, base_quantization: str = "none") -> float:
    """A trained model's bytes over all devices: 16 a trained param (fp32 master, Adam's two moments, the
    gradient accumulator) and, under LoRA, the frozen base (`quant.base_bytes`)."""
    if not lora_params:
        return 16.0 * _param_count(cfg)
    return 16.0 * lora_params + quant.base_bytes(cfg, base_quantization)


def device_memory_bytes() -> int | None:
    """The memory XLA may use on the first local device, or None where it does not say (CPU)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def choose_remat(cfg: Qwen2Config, *, tokens_per_device: int, param_shards: int, tensor: int = 1,
                 ref: bool = True, critic: bool = False, engine: bool = True,
                 device_bytes: int | None = None, lora_params: int = 0, base_quantization: str = "none",
                 lora_outputs: int = 0) -> str:
    """The first policy of `AUTO_LADDER` (the least recompute first) whose estimated step fits the device, else
    "full" (also when the device size is unknown)."""
    if device_bytes is None:
        return "full"
    need = {}
    for remat in AUTO_LADDER:
        need[remat] = estimate_step_bytes(cfg, remat=remat, tokens_per_device=tokens_per_device,
                                          param_shards=param_shards, tensor=tensor, ref=ref, critic=critic,
                                          engine=engine, lora_params=lora_params,
                                          base_quantization=base_quantization, lora_outputs=lora_outputs)
        if need[remat] <= MARGIN * device_bytes:
            break
    log.info("model.remat='auto': %s first (%s of the device's %.1f GB)", remat,
             ", ".join(f"{k} ~{v / 1e9:.1f} GB" for k, v in need.items()), device_bytes / 1e9)
    return remat


def first_pass_remat(run, cfg: Qwen2Config, mesh_shape, lora, device_bytes: int | None) -> str:
    """`choose_remat` for a run on `mesh_shape` (`lora`: its adapters' spec, or None): the first pass of
    `model.remat='auto'`, where the memory check starts down the ladder. The policies above it are not compiled;
    it is only a candidate, which the check compiles and confirms (trainer/memory/check.py)."""
    tokens = max(1, run.actor.ppo_max_token_len_per_gpu // run.pack_length) * run.pack_length
    return choose_remat(cfg, tokens_per_device=tokens, param_shards=mesh_shape["fsdp"] * mesh_shape["tensor"],
                        tensor=mesh_shape["tensor"], critic=run.algo.uses_critic,
                        ref=(run.actor.use_kl_loss or run.algo.use_kl_in_reward) and not run.trainer.ref_offload,
                        engine=run.rollout.engine == "jax" and not run.rollout.free_cache_engine,
                        device_bytes=device_bytes, lora_params=num_adapter_params(cfg, lora),
                        base_quantization=run.model.base_quantization, lora_outputs=lora_outputs_per_token(cfg, lora))
