"""Entropy of the token distribution from logits, and the entropy bonus as a loss term."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.algorithms.aggregation import LossNorm, agg_loss


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy of softmax(logits) in float32: logsumexp(l) - Σ softmax(l)·l.

    The logsumexp form stays finite for very peaked distributions, where -Σ p·log p would take
    log of underflowed probabilities. Materialises [..., V]; for a full vocabulary from hidden
    states use `logprobs.compute_token_logprobs`, which never does.

    Args:
      logits: [..., V] any float dtype.
    Returns:
      [...] float32 entropy in nats.
    """
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(probs * logits, axis=-1)


def compute_entropy_loss(entropy: jax.Array, response_mask: jax.Array, loss_agg_mode: str = "token-mean",
                         norm: LossNorm | None = None) -> jax.Array:
    """Aggregate per-token entropy [B, T] into the scalar entropy term (the trainer subtracts
    `entropy_coeff` times it from the loss, as veRL's actor does)."""
    return agg_loss(entropy, response_mask, loss_agg_mode, norm=norm)
