"""Loss aggregation: a [B, T] per-token loss to a scalar, with veRL's `loss_agg_mode`s.

Modes (veRL `agg_loss`):
  * "token-mean": sum over all selected tokens / number of selected tokens.
  * "seq-mean-token-sum": per-sequence token sum, averaged over sequences.
  * "seq-mean-token-mean": per-sequence token mean, averaged over sequences.
  * "seq-mean-token-sum-norm" (Dr.GRPO): sum of the per-sequence token sums divided by a constant,
    the max response length (`loss_mask.shape[-1]`), *not* by the number of sequences. tunix's
    "sequence-mean-token-sum-norm" divides by the batch size instead; the two differ by B / T.

Exact micro-batching. A mini-batch is often split into micro-batches whose gradients are summed.
Dividing each micro-batch by its *own* token or sequence count makes that sum differ from one
step on the whole mini-batch. Pass `norm=compute_loss_norm(minibatch_mask)` to every micro-batch
instead: each loss is then (micro-batch numerator) / (mini-batch denominator), and the sum of the
micro-batch losses (and of their gradients) equals the mini-batch loss exactly, in every mode.

Empty rows (deviation from the veRL version whose semantics we follow elsewhere). A row whose mask
is all zero contributes 0 and is not counted as a sequence in the seq-mean modes. That veRL
divides seq-mean-token-mean by the row's token count (NaN for an empty row) and counts the row in
the mean; newer veRL, like us, drops empty rows. Without empty rows the results are identical.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


class LossNorm(NamedTuple):
    """A mini-batch's global loss denominators, shared by all of its micro-batches.

    A pytree of scalars, so it can be passed through `jit` with the batch.

    Attributes:
      num_tokens: selected tokens in the mini-batch ("token-mean" and token-level metrics).
      num_seqs: non-empty sequences in the mini-batch (the seq-mean modes).
      max_len: the constant of "seq-mean-token-sum-norm": the configured max response length.
    """

    num_tokens: jax.Array
    num_seqs: jax.Array
    max_len: jax.Array


def compute_loss_norm(response_mask: jax.Array, max_len: int | None = None) -> LossNorm:
    """Denominators of a whole mini-batch, computed once before splitting it into micro-batches.

    Args:
      response_mask: [B, T] 0/1 mask of the whole mini-batch.
      max_len: the max response length for "seq-mean-token-sum-norm". Defaults to the padded width
        T; the trainer should pass the configured max response length, since micro-batches may be
        padded to different widths.
    Returns:
      LossNorm of float32 scalars; counts are clamped to >= 1 so an empty batch gives loss 0.
    """
    mask = (response_mask != 0).astype(jnp.float32)
    num_tokens = jnp.maximum(jnp.sum(mask), 1.0)
    num_seqs = jnp.maximum(jnp.sum(jnp.any(mask > 0, axis=-1).astype(jnp.float32)), 1.0)
    width = response_mask.shape[-1] if max_len is None else max_len
    return LossNorm(num_tokens, num_seqs, jnp.asarray(width, jnp.float32))


def agg_loss(loss_mat: jax.Array, loss_mask: jax.Array, loss_agg_mode: str = "token-mean", *,
             norm: LossNorm | None = None) -> jax.Array:
    """Aggregate a per-token loss into a scalar.

    Args:
      loss_mat: [B, T] per-token loss.
      loss_mask: [B, T] 0/1.
      loss_agg_mode: one of `LOSS_AGG_MODES` (static).
      norm: the mini-batch's denominators when `loss_mat` is one micro-batch of it; None uses this
        batch's own (veRL's behaviour).
    Returns:
      float32 scalar.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"invalid loss_agg_mode {loss_agg_mode!r}; expected one of {LOSS_AGG_MODES}")
    if norm is None:
        norm = compute_loss_norm(loss_mask)
    mask = loss_mask != 0
    tokens = jnp.where(mask, loss_mat.astype(jnp.float32), 0.0)  # [B, T]
    if loss_agg_mode == "token-mean":
        return jnp.sum(tokens) / norm.num_tokens
    if loss_agg_mode == "seq-mean-token-sum":
        return jnp.sum(tokens) / norm.num_seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return jnp.sum(tokens) / norm.max_len
    # seq-mean-token-mean: the token mean is local to each sequence; empty rows give 0.
    seq_len = jnp.sum(mask.astype(jnp.float32), axis=-1)  # [B]
    seq_mean = jnp.sum(tokens, axis=-1) / jnp.maximum(seq_len, 1.0)  # [B]
    return jnp.sum(seq_mean) / norm.num_seqs


def token_metric_mean(values: jax.Array, mask: jax.Array, norm: LossNorm | None = None) -> jax.Array:
    """Token-level metric: masked mean, or sum(values·mask) / norm.num_tokens under micro-batching.

    With `norm`, summing the metric over the micro-batches of a mini-batch gives its value on the
    whole mini-batch, like the losses.

    Args:
      values: [B, T]; mask: [B, T] 0/1.
    Returns:
      float32 scalar.
    """
    if norm is None:
        norm = compute_loss_norm(mask)
    return jnp.sum(jnp.where(mask != 0, values.astype(jnp.float32), 0.0)) / norm.num_tokens
