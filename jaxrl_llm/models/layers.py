"""The decoder's building blocks shared by its attention and linear-attention layers: the linear layer (with
its LoRA adapter and 8-bit base), RMSNorm (plain, or zero-centred as Qwen3.5 holds it) and the SwiGLU MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxrl_llm import sharding
from jaxrl_llm.models import quant
from jaxrl_llm.models.config import DecoderConfig


def _dtype(name: str):
    return jnp.dtype(name)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, out] stored in param_dtype, computed in dtype.

    A module whose `name` is in `cfg.lora_targets` also holds a LoRA adapter: y += (x @ lora_a) @ lora_b
    * alpha / rank, with lora_a [in, r] drawn as PEFT does and lora_b [r, out] zero, so a fresh adapter
    changes nothing.
    """

    def __init__(self, din: int, dout: int, *, use_bias: bool, cfg: DecoderConfig, rngs: nnx.Rngs,
                 name: str = ""):
        init = jax.nn.initializers.normal(cfg.initializer_range)
        pdt = _dtype(cfg.param_dtype)
        if cfg.base_quantization != "none" and name in quant.QUANT_MODULES:  # a frozen 8-bit kernel, [out] scales
            self.kernel = nnx.Param(jnp.zeros((din, dout), quant.QDTYPES[cfg.base_quantization]))
            self.kernel_scale = nnx.Param(jnp.ones((dout,), jnp.float32))
        else:
            self.kernel = nnx.Param(init(rngs.params(), (din, dout), pdt))
            self.kernel_scale = None
        self.bias = nnx.Param(jnp.zeros((dout,), pdt)) if use_bias else None
        self.dtype = _dtype(cfg.dtype)
        if cfg.lora_rank and name in cfg.lora_targets:
            r = cfg.lora_rank
            bound = din ** -0.5  # PEFT: kaiming_uniform(a=sqrt(5)) on its [r, in] weight
            self.lora_a = nnx.Param(jax.random.uniform(rngs.params(), (din, r), pdt, -bound, bound))
            self.lora_b = nnx.Param(jnp.zeros((r, dout), pdt))
            self.lora_scale = cfg.lora_alpha / r
        else:
            self.lora_a = self.lora_b = None

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        if self.kernel_scale is None:
            w = self.kernel[...].astype(self.dtype)
        else:  # dequantized here, inside the layer scan: one layer's weights in the compute dtype at a time
            w = quant.dequantize(self.kernel[...], self.kernel_scale[...], self.dtype)
        y = jnp.dot(x, w)
        if self.lora_a is not None:
            low = jnp.dot(x, self.lora_a[...].astype(self.dtype))  # [..., r]
            y = y + jnp.dot(low, self.lora_b[...].astype(self.dtype)) * jnp.asarray(self.lora_scale, self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, offset: bool = False) -> jax.Array:
    """HF's RMSNorm. Qwen2, Qwen3 and Llama: normalise in fp32, cast back to x's dtype, then scale by weight.
    `offset` (Qwen3.5's zero-centred norm): scale by 1 + weight in fp32, then cast."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


class RMSNorm(nnx.Module):
    """Weight [dim]: ones, or (Qwen3.5, `cfg.is_hybrid`) zeros held as the offset from one."""

    def __init__(self, dim: int, *, cfg: DecoderConfig):
        self.offset = cfg.is_hybrid
        self.weight = nnx.Param((jnp.zeros if self.offset else jnp.ones)((dim,), _dtype(cfg.param_dtype)))
        self.eps = cfg.rms_norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, offset=self.offset)


class MLP(nnx.Module):
    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs, width: int | None = None):
        d, f = cfg.hidden_size, width or cfg.intermediate_size
        self.gate_proj = Linear(d, f, use_bias=False, cfg=cfg, rngs=rngs, name="gate_proj")
        self.up_proj = Linear(d, f, use_bias=False, cfg=cfg, rngs=rngs, name="up_proj")
        self.down_proj = Linear(f, d, use_bias=False, cfg=cfg, rngs=rngs, name="down_proj")

    def __call__(self, x: jax.Array) -> jax.Array:
        # Tagged for the remat policies (models/remat.py).
        gate, up = checkpoint_name(self.gate_proj(x), "gate_proj"), checkpoint_name(self.up_proj(x), "up_proj")
        h = jax.nn.silu(gate) * up  # [B, T, F]
        h = sharding.constrain(h, ("batch", "length", "act_mlp"))
        return self.down_proj(h)
