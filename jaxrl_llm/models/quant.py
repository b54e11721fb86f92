"""The frozen base in 8 bits under LoRA (`model.base_quantization`): weight-only int8 or FP8 kernels.

Each linear kernel W [in, out] of the decoder layers (the modules LoRA can target: q/k/v/o, gate/up/down,
and a Qwen3.5's linear-attention projections in_proj_qkv/z/b/a and out_proj, in every stack) is held as
`kernel` (int8, or float8_e4m3fn) and `kernel_scale` [out] fp32, symmetric with one scale an output channel:

    scale = max_i |W[i, :]| / qmax        (qmax: 127 for int8, 448 for e4m3)
    kernel = round(W / scale)             (int8: round to nearest, clipped; FP8: the cast's rounding)
    W ≈ kernel * scale

Embeddings, the lm_head, norms and biases stay in the compute dtype. `qwen2.Linear` dequantizes inside
the layer scan (`dequantize`), so one layer's compute-dtype weights exist at a time; the adapters stay
float. The engines get the base dequantized with the adapters merged in, layer by layer (`plain_layer`),
so the int8 tree is never expanded whole. Quantizing is deterministic: a resumed run re-quantizes the
same base to the same bits (the base is not checkpointed, only adapters and optimizer state).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, SingleDeviceSharding

from jaxrl_llm import sharding
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.errors import ConfigError

BASE_QUANTIZATIONS = ("none", "int8", "fp8")
QDTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": 448.0}
# The layers' linear modules (the ones LoRA can target, `lora.LORA_MODULES`), found by name under any stack.
QUANT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                 "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "shared_expert_gate")
SCALE = "kernel_scale"


def check_setting(kind, lora_rank) -> None:
    """`model.base_quantization` as a run sets it; one ConfigError naming the key and the fix."""
    if kind not in BASE_QUANTIZATIONS:
        raise ConfigError(f"model.base_quantization: {kind!r}; use 'none' (the compute dtype), 'int8' or 'fp8' "
                          "(weight-only, one scale an output channel)")
    if kind != "none" and not lora_rank:
        raise ConfigError(f"model.base_quantization={kind!r} quantizes the frozen base of a LoRA run, and this run "
                          "trains every weight (model.lora_rank = 0); set model.lora_rank > 0 (e.g. 32) or "
                          "model.base_quantization = 'none'")


def quantize(w: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """Symmetric per-output-channel quantization of kernels.

    Args:
      w: [..., in, out] float.
      kind: 'int8' or 'fp8'.
    Returns:
      (kernel [..., in, out] int8 or float8_e4m3fn, scale [..., out] fp32); an all-zero channel gets scale 1.
    """
    wf = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(wf), axis=-2)  # [..., out]
    scale = jnp.where(absmax > 0, absmax / QMAX[kind], 1.0)
    x = wf / scale[..., None, :]
    if kind == "int8":
        return jnp.clip(jnp.round(x), -127, 127).astype(jnp.int8), scale
    return jnp.clip(x, -QMAX[kind], QMAX[kind]).astype(QDTYPES[kind]), scale


def dequantize(kernel: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """kernel [..., in, out] (int8/FP8), scale [..., out] -> kernel * scale [..., in, out] in `dtype` (via fp32)."""
    return (kernel.astype(jnp.float32) * scale.astype(jnp.float32)[..., None, :]).astype(dtype)


def apply(cfg: DecoderConfig, kind: str) -> DecoderConfig:
    """The model config whose graph holds quantized kernels (`qwen2.Linear` reads `cfg.base_quantization`)."""
    if kind != "none" and cfg.is_moe:
        raise ConfigError(f"model.base_quantization={kind!r}: an 8-bit base covers the linear modules' kernels, and "
                          "on a mixture-of-experts model (Qwen3-MoE, Qwen3.5-MoE) the routed experts, most of its "
                          "weights, would stay in the compute dtype; set model.base_quantization = 'none'")
    return cfg if kind == "none" else cfg.replace(base_quantization=kind)


def _modules(tree: dict):
    """(parent dict, module name, path) of every quantizable module present in a params tree's layer stacks
    (`layers`, `dense_layers`, `linear_layers`), at any depth (`mlp.shared_expert.gate_proj`)."""
    def walk(node, path):
        for key, child in node.items():
            if not isinstance(child, dict):
                continue
            if key in QUANT_MODULES and "kernel" in child:
                yield node, key, path + (key,)
            else:
                yield from walk(child, path + (key,))

    for stack, layers in tree.get("model", {}).items():
        if stack.endswith("layers") and isinstance(layers, dict):
            yield from walk(layers, ("model", stack))


def _copy(tree):
    return {k: _copy(v) if isinstance(v, dict) else v for k, v in tree.items()}


def quantize_base(body: dict, kind: str) -> dict:
    """The frozen base with its layers' kernels quantized (pure; call under jit). Each stacked kernel
    [L, in, out] is quantized one layer at a time (`lax.map`), so the fp32 temporaries stay one layer's."""
    out = _copy(body)
    for parent, name, _ in _modules(out):
        mod = dict(parent[name])
        mod["kernel"], mod[SCALE] = jax.lax.map(lambda w: quantize(w, kind), mod["kernel"])
        parent[name] = mod
    return out


def dequantize_base(frozen: dict, dtype) -> dict:
    """The frozen tree with plain kernels in `dtype` (what a model without quantization runs); pure."""
    out = _copy(frozen)
    for parent, name, _ in _modules(out):
        mod = dict(parent[name])
        if SCALE in mod:
            mod["kernel"] = dequantize(mod["kernel"], mod.pop(SCALE), dtype)
        parent[name] = mod
    return out


def merge_module(mod: dict, dtype, lora_scale: float = 1.0) -> dict:
    """One linear module's params (stacked or not) -> {kernel in `dtype`, bias}: the kernel dequantized
    when it is quantized, plus lora_a @ lora_b * lora_scale when it has an adapter, summed in fp32."""
    out = {k: v for k, v in mod.items() if k not in ("kernel", SCALE, "lora_a", "lora_b")}
    w = mod["kernel"]
    w = dequantize(w, mod[SCALE], jnp.float32) if SCALE in mod else w.astype(jnp.float32)
    if "lora_a" in mod:
        delta = jnp.einsum("...ir,...ro->...io", mod["lora_a"].astype(jnp.float32), mod["lora_b"].astype(jnp.float32))
        w = w + delta * lora_scale
    out["kernel"] = w.astype(dtype)
    return out


def plain_layer(layer: dict, dtype) -> dict:
    """One decoder layer's params (a slice of the stack) with every quantized or adapted module made a
    plain kernel (`merge_module`; adapters are expected pre-scaled, see `ModelState.engine_params`), at any
    depth (`linear_attn.in_proj_qkv`, `mlp.shared_expert.up_proj`). Plain layers pass through unchanged (the
    same dicts): the engines call this on every layer."""
    out, changed = {}, False
    for key, child in layer.items():
        if isinstance(child, dict) and "kernel" in child and (SCALE in child or "lora_a" in child):
            out[key], changed = merge_module(child, dtype), True
        elif isinstance(child, dict):
            out[key] = plain_layer(child, dtype)
            changed = changed or out[key] is not child
        else:
            out[key] = child
    return out if changed else layer


def merged_base(frozen: dict, adapters: dict, lora_scale: float, dtype) -> dict:
    """The base params tree with each quantized kernel dequantized and its adapter merged in (pure; under
    jit): what an HF export or a vLLM pool runs. It carries the quantization error of the base."""
    from jaxrl_llm.models.lora import combine

    out = _copy(combine(frozen, adapters))
    for parent, name, _ in _modules(out):
        parent[name] = merge_module(parent[name], dtype, lora_scale)
    return jax.tree.map(lambda x: x.astype(dtype), out)


def frozen_shardings(cfg: DecoderConfig, base_sh: dict, mesh: Mesh | None) -> dict:
    """The quantized frozen tree's shardings: kernels as the base's, each scale [L, out] split like its
    kernel's layer and output axes."""
    out = _copy(base_sh)
    rows = {row.path: row for row in _quantized_rows(cfg)}
    for parent, name, path in _modules(out):
        mod = dict(parent[name])
        if mesh is None:
            mod[SCALE] = SingleDeviceSharding(jax.devices()[0])
        else:
            row = rows[path + ("kernel",)]
            layers_ax, _, out_ax = row.axes
            mod[SCALE] = sharding.named_sharding(mesh, (layers_ax, out_ax), _scale_shape(row, cfg))
        parent[name] = mod
    return out


def _quantized_rows(cfg: DecoderConfig) -> list:
    """The HF table's rows of the kernels an 8-bit base holds in 8 bits (every stack's linear modules)."""
    from jaxrl_llm.models.hf_table import param_table

    return [row for row in param_table(cfg) if row.stacked and row.path[-1] == "kernel"
            and row.path[-2] in QUANT_MODULES]


def _scale_shape(row, cfg: DecoderConfig) -> tuple[int, int]:
    shape = row.shape(cfg)  # [L, in, out]
    return (shape[0], shape[-1])


def quantized_params(cfg: DecoderConfig) -> int:
    """How many of the model's params the quantization holds in 8 bits (the layers' linear kernels)."""
    return sum(math.prod(row.shape(cfg)) for row in _quantized_rows(cfg))


def base_bytes(cfg: DecoderConfig, kind: str, compute_bytes: int = 2) -> float:
    """Bytes of the frozen base: 8-bit kernels with fp32 scales, the rest in the compute dtype."""
    n = cfg.num_params()
    if kind == "none":
        return float(compute_bytes * n)
    q = quantized_params(cfg)
    scales = 4.0 * sum(math.prod(_scale_shape(row, cfg)) for row in _quantized_rows(cfg))
    return float(q) + compute_bytes * (n - q) + scales
