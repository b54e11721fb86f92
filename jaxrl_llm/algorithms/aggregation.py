"""Loss aggregation: a [B, T] per-token loss to a scalar, with veRL 0.9.1's `loss_agg_mode`s.

Modes (veRL `agg_loss`):
  * "token-mean": sum over all selected tokens / number of selected tokens.
  * "token-sum": the plain sum over all selected tokens, no denominator. (veRL multiplies it by the
    data-parallel size because DDP/FSDP average gradients over ranks; our gradients are global sums
    over the mesh, so the factor is not needed.)
  * "seq-mean-token-sum": per-sequence token sum, averaged over sequences.
  * "seq-mean-token-mean": per-sequence token mean, averaged over sequences.
  * "seq-mean-token-sum-norm" (Dr.GRPO): the "seq-mean-token-sum" value further divided by a
    constant, the loss scale factor (`LossNorm.max_len`: `actor.loss_scale_factor`, or else the max
    response length). Changed to veRL 0.9.1's definition: older veRL (and this module before) divided
    the sum of the sequence sums by the constant alone, not by the number of sequences too, so the
    loss grew with the batch size. tunix's "sequence-mean-token-sum-norm" divides by the batch size
    only; ours is that value divided by max_len when no row is empty.

Exact micro-batching. A mini-batch is often split into micro-batches whose gradients are summed.
Dividing each micro-batch by its *own* token or sequence count makes that sum differ from one
step on the whole mini-batch. Pass `norm=compute_loss_norm(minibatch_mask)` to every micro-batch
instead: each loss is then (micro-batch numerator) / (mini-batch denominator), and the sum of the
micro-batch losses (and of their gradients) equals the mini-batch loss exactly, in every mode.

Empty rows. A row whose mask is all zero contributes 0 and is not counted as a sequence in the
seq-mean modes, as veRL 0.9.1's single-batch `agg_loss` does (older veRL counted it, and gave NaN
in seq-mean-token-mean). veRL's distributed path instead divides by its configured global batch
size, which counts empty rows; without empty rows the results are identical.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


class LossNorm(NamedTuple):
    """A mini-batch's global loss denominators, shared by all of its micro-batches.

    A pytree of scalars, so it can be passed through `jit` with the batch.

    Attributes:
      num_tokens: selected tokens in the mini-batch ("token-mean" and token-level metrics).
      num_seqs: non-empty sequences in the mini-batch (the seq-mean modes).
      max_len: the loss scale factor of "seq-mean-token-sum-norm": `actor.loss_scale_factor`, or the
        configured max response length.
    """

    num_tokens: jax.Array
    num_seqs: jax.Array
    max_len: jax.Array


def compute_loss_norm(response_mask: jax.Array, max_len: int | None = None) -> LossNorm:
    """Denominators of a whole mini-batch, computed once before splitting it into micro-batches.

    Args:
      response_mask: [B, T] 0/1 mask of the whole mini-batch.
      max_len: the loss scale factor of "seq-mean-token-sum-norm". Defaults to the padded width T
        (veRL's default); the trainer should pass `actor.loss_scale_factor` or else the configured
        max response length, since micro-batches may be padded to different widths.
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
    if loss_agg_mode == "token-sum":
        return jnp.sum(tokens)
    if loss_agg_mode == "seq-mean-token-sum":
        return jnp.sum(tokens) / norm.num_seqs
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return jnp.sum(tokens) / norm.num_seqs / norm.max_len
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
