"""Next-token sampling: greedy, temperature, top-k and top-p, as pure jittable functions.

The order is HF's and vLLM's: scale by temperature, keep the top-k logits, then keep the smallest
set of the remaining tokens whose probability reaches top_p. Top-k runs on `lax.top_k` so the
common RL settings never sort the whole vocabulary; only top-p without top-k needs a full sort.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _top_p_mask(sorted_logits: jax.Array, top_p: float) -> jax.Array:
    """For logits sorted descending [..., K]: keep token i iff the probability mass strictly before
    it is < top_p (so the first token is always kept)."""
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return mass_before < top_p


def sample_next(logits: jax.Array, key: jax.Array, *, temperature: float, top_k: int = 0,
                top_p: float = 1.0) -> jax.Array:
    """Samples one token per row.

    Args:
      logits: [B, V] float32.
      key: PRNG key (one per call; rows draw independently).
      temperature: 0 means greedy (argmax). top_k <= 0 and top_p == 1.0 disable truncation.
    Returns:
      [B] int32 token ids.
    """
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / temperature
    if top_k > 0 and top_k < scaled.shape[-1]:
        vals, idx = jax.lax.top_k(scaled, top_k)  # [B, k], sorted descending
        if top_p < 1.0:
            vals = jnp.where(_top_p_mask(vals, top_p), vals, -jnp.inf)
        choice = jax.random.categorical(key, vals, axis=-1)  # [B]
        return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    if top_p < 1.0:
        order = jnp.argsort(-scaled, axis=-1)  # [B, V]
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        sorted_logits = jnp.where(_top_p_mask(sorted_logits, top_p), sorted_logits, -jnp.inf)
        choice = jax.random.categorical(key, sorted_logits, axis=-1)
        return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


def token_logprobs(logits: jax.Array, tokens: jax.Array, *, temperature: float) -> jax.Array:
    """log softmax(logits / T)[token] per row ([B, V], [B] -> [B] float32), before truncation.

    This is what the trainer computes for the same token (veRL divides logits by the rollout
    temperature too), so sampler and trainer logprobs are directly comparable. Greedy uses T = 1.
    """
    t = temperature if temperature > 0 else 1.0
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def truncated_probs(logits: jax.Array, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """The exact distribution `sample_next` draws from ([B, V] -> [B, V]); used by tests."""
    scaled = logits / temperature
    keep = jnp.ones_like(scaled, dtype=bool)
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        keep &= scaled >= kth
    if top_p < 1.0:
        order = jnp.argsort(-jnp.where(keep, scaled, -jnp.inf), axis=-1)
        sorted_logits = jnp.take_along_axis(jnp.where(keep, scaled, -jnp.inf), order, axis=-1)
        sorted_keep = _top_p_mask(sorted_logits, top_p)
        inv = jnp.argsort(order, axis=-1)
        keep &= jnp.take_along_axis(sorted_keep, inv, axis=-1)
    return jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
