"""Qwen3.5's Gated DeltaNet layer (`linear_attn`): projections, short conv, the gated delta rule, gated norm.

Per token x [D]:

    q, k, v = split(silu(causal_conv(in_proj_qkv(x))))     (one conv over the q, k and v channels)
    z       = in_proj_z(x)                                 (the output gate, per value head)
    beta    = sigmoid(in_proj_b(x))                        (write strength, per value head)
    g       = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)   (log decay, per value head, fp32)
    o       = gated_delta_rule(l2norm(q) / sqrt(Dk), l2norm(k), v, g, beta)
    out     = out_proj(rms_norm(o) * weight * silu(z))

The maths lives in `gated_delta.py` (shared with the sampler's prefill and decode). Parameter names are HF's
(`linear_attn.in_proj_qkv.weight`, `conv1d.weight`, `A_log`, `dt_bias`, `norm.weight`, `out_proj.weight`), so
the HF table is renames; the conv kernel is stored [K, 1, E] (HF's [E, 1, K] transposed).

Packed rows and padding: `resets` [B, T] restarts the recurrent state and the conv window at each row's first
token; invalid tokens are identity steps (their inputs zeroed as transformers zeroes padding's hidden states).

Shapes: B batch, T time, D model, E = 2 Hk Dk + Hv Dv conv channels, Hk/Hv key/value heads, Dk/Dv their dims,
K conv width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.models.gated_delta import causal_conv1d, gated_delta_rule, l2norm
from jaxrl_llm.models.layers import Linear


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """transformers' Qwen3_5RMSNormGated: normalise x in fp32, scale by weight in x's dtype, multiply by
    silu(gate) in fp32, return in x's dtype. x, gate: [..., Dv]; weight [Dv]."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = weight.astype(x.dtype) * xf.astype(x.dtype)
    return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def decay_and_beta(a: jax.Array, b: jax.Array, a_log: jax.Array, dt_bias: jax.Array):
    """(g fp32 log decay, beta in b's dtype) from the in_proj_a / in_proj_b outputs [..., Hv]."""
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return g, jax.nn.sigmoid(b)


def split_qkv(mixed: jax.Array, key_heads: int, value_heads: int, dk: int, dv: int):
    """The conv's output [..., E] -> q, k [..., Hk, Dk] (q L2-normalised and scaled, k L2-normalised, fp32)
    and v [..., Hv, Dv]."""
    kd = key_heads * dk
    lead = mixed.shape[:-1]
    q = mixed[..., :kd].reshape(*lead, key_heads, dk)
    k = mixed[..., kd: 2 * kd].reshape(*lead, key_heads, dk)
    v = mixed[..., 2 * kd:].reshape(*lead, value_heads, dv)
    return l2norm(q) * (dk ** -0.5), l2norm(k), v


class Conv1d(nnx.Module):
    """`linear_attn.conv1d`: a depthwise kernel [K, 1, E] (HF's [E, 1, K] transposed; no bias)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        e, kw = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
        bound = kw ** -0.5  # torch's Conv1d default init (kaiming_uniform, a = sqrt(5)) for fan_in = K
        self.kernel = nnx.Param(jax.random.uniform(rngs.params(), (kw, 1, e), jnp.dtype(cfg.param_dtype),
                                                   -bound, bound))


class GatedNorm(nnx.Module):
    def __init__(self, cfg):
        self.weight = nnx.Param(jnp.ones((cfg.linear_value_head_dim,), jnp.dtype(cfg.param_dtype)))


class GatedDeltaNet(nnx.Module):
    """`linear_attn` of a Qwen3.5 linear-attention layer: x [B, T, D] -> [B, T, D]."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, hv = cfg.hidden_size, cfg.linear_num_value_heads
        pdt = jnp.dtype(cfg.param_dtype)
        self.in_proj_qkv = Linear(d, cfg.linear_conv_dim, use_bias=False, cfg=cfg, rngs=rngs, name="in_proj_qkv")
        self.in_proj_z = Linear(d, cfg.linear_value_dim, use_bias=False, cfg=cfg, rngs=rngs, name="in_proj_z")
        self.in_proj_b = Linear(d, hv, use_bias=False, cfg=cfg, rngs=rngs, name="in_proj_b")
        self.in_proj_a = Linear(d, hv, use_bias=False, cfg=cfg, rngs=rngs, name="in_proj_a")
        self.conv1d = Conv1d(cfg, rngs=rngs)
        self.dt_bias = nnx.Param(jnp.ones((hv,), pdt))
        # transformers draws A uniformly in [0.01, 16] (log kept away from -inf).
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), jnp.float32, 0.01, 16.0)).astype(pdt))
        self.norm = GatedNorm(cfg)
        self.out_proj = Linear(cfg.linear_value_dim, d, use_bias=False, cfg=cfg, rngs=rngs, name="out_proj")
        self.cfg = cfg
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x: jax.Array, *, resets: jax.Array | None = None, valid: jax.Array | None = None):
        """x [B, T, D]; resets, valid: [B, T] bool or None (see the module docstring)."""
        cfg = self.cfg
        b, t, _ = x.shape
        mixed = self.in_proj_qkv(x)  # [B, T, E]
        z = self.in_proj_z(x).reshape(b, t, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
        g, beta = decay_and_beta(self.in_proj_a(x), self.in_proj_b(x), self.A_log[...], self.dt_bias[...])
        mixed, _ = causal_conv1d(mixed, self.conv1d.kernel[...][:, 0, :].astype(self.dtype), resets=resets,
                                 valid=valid)
        q, k, v = split_qkv(mixed, cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                            cfg.linear_value_head_dim)
        o, _ = gated_delta_rule(q, k, v, g, beta, resets=resets, valid=valid)  # [B, T, Hv, Dv] fp32
        o = gated_rms_norm(o.astype(self.dtype), z, self.norm.weight[...], cfg.rms_norm_eps)
        return self.out_proj(o.reshape(b, t, cfg.linear_value_dim))
