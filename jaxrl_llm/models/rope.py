"""Rotary position embeddings: the frequencies (default and Llama 3's scaled bands) and their use.

`rope_inv_freq` is the one place where RoPE frequencies are computed; the trainer's model and the
sampler's prefill and decode steps all call it, so a scaled-RoPE family cannot drift between them.
The float32 arithmetic follows transformers' `_compute_default_rope_parameters` and
`_compute_llama3_parameters` step by step, so the tables agree with HF's to the last bit or two.

Shapes: B batch, T time, H head dim.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxrl_llm.models.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """HF's `rope_scaling` of type "llama3" (Llama 3.1 and 3.2).

    Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` keep their
    frequency, those longer than `original_max_position_embeddings / low_freq_factor` are divided by
    `factor`, and the band between is interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"

    def __post_init__(self):
        if self.rope_type != "llama3":
            raise ConfigError(f"rope_scaling.rope_type={self.rope_type!r} is not supported; supported rope types: "
                              f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        if not self.factor > 0:
            raise ConfigError(f"rope_scaling.factor={self.factor} must be > 0")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(f"rope_scaling: need 0 < low_freq_factor ({self.low_freq_factor}) < high_freq_factor "
                              f"({self.high_freq_factor})")
        if not self.original_max_position_embeddings > 0:
            raise ConfigError(f"rope_scaling.original_max_position_embeddings="
                              f"{self.original_max_position_embeddings} must be > 0")

    def to_hf(self) -> dict:
        return {"rope_type": self.rope_type, "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings}


def rope_scaling_from_hf(rope: dict | None, *, where: str, field: str = "rope_scaling",
                         max_position_embeddings: int | None = None) -> RopeScaling | None:
    """HF's `rope_scaling` / `rope_parameters` dict -> None (plain RoPE) or a `RopeScaling`.

    Any other rope type, and partial rotary embeddings, are one ConfigError naming the field.
    """
    if not rope:
        return None
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{where}: {field}.rope_type={rope_type!r} is not supported; supported rope types: "
                          f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{where}: {field}.partial_rotary_factor={partial} is not supported (only full RoPE)")
    if rope_type == "default":
        return None
    need = ("factor", "low_freq_factor", "high_freq_factor")
    missing = [k for k in need if rope.get(k) is None]
    if missing:
        raise ConfigError(f"{where}: {field} of type 'llama3' lacks {missing}")
    original = rope.get("original_max_position_embeddings") or max_position_embeddings
    if original is None:
        raise ConfigError(f"{where}: {field} of type 'llama3' lacks 'original_max_position_embeddings'")
    try:
        return RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                           high_freq_factor=float(rope["high_freq_factor"]),
                           original_max_position_embeddings=int(original))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """Inverse frequencies [H/2] float32 of HF's non-interleaved RoPE, scaled by `scaling` if given."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # [H/2]
    if scaling is None:
        return inv_freq
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed down by `factor`; short ones are kept.
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # Between the two, interpolate: smooth = 0 at the low-frequency edge, 1 at the high-frequency one.
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables of HF's non-interleaved RoPE.

    Args:
      positions: [B, T] int.
      inv_freq: [H/2] float32, from `rope_inv_freq`.
    Returns:
      cos, sin: [B, T, H] float32.
    """
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, H]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, heads, H]; cos/sin: [B, T, R] with R <= H: the first R dims of each head are rotated (HF's
    partial rotary embedding when R < H, Qwen3.5's quarter), the rest pass through."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin
