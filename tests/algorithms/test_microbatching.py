"""Gradient accumulation over micro-batches equals one step on the whole mini-batch, in every mode.

A tiny linear actor (log-probs and entropy from features @ W) and critic (features @ w) give a full
PPO/GRPO loss: policy loss + KL loss - entropy bonus + value loss. Each micro-batch is aggregated
with the mini-batch's `LossNorm`; summing the micro-batch losses, gradients and metrics must give
the mini-batch's values. Splits are uneven (k = 2 and 3), hold empty rows, and may be narrower than
the mini-batch (padded to a longer max response length).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.algorithms import (
    LOSS_AGG_MODES,
    PolicyLossConfig,
    agg_loss,
    compute_entropy_loss,
    compute_kl_loss,
    compute_loss_norm,
    compute_policy_loss_vanilla,
    compute_value_loss,
    entropy_from_logits,
    logprobs_from_logits,
)
from tests.algorithms.batches import random_batch

D, V = 4, 7
SPLITS = {2: (4,), 3: (2, 10)}  # split points of the B = 15 rows: sizes 4 + 11 and 2 + 8 + 5


def _problem(seed=0):
    batch = random_batch(seed)
    b, t = batch["response_mask"].shape
    rng = np.random.default_rng(seed)
    batch["features"] = rng.normal(size=(b, t, D)).astype(np.float32)
    batch["actions"] = rng.integers(0, V, (b, t)).astype(np.int32)
    params = {"actor": rng.normal(size=(D, V)).astype(np.float32),
              "critic": rng.normal(size=(D,)).astype(np.float32)}
    return params, batch


def _loss(params, batch, norm, mode):
    logits = batch["features"] @ params["actor"]  # [B, T, V]
    log_prob = logprobs_from_logits(logits, batch["actions"])
    mask = batch["response_mask"]
    pg_loss, metrics = compute_policy_loss_vanilla(batch["old_log_prob"], log_prob, batch["advantages"], mask,
                                                   config=PolicyLossConfig(clip_ratio_high=0.28, loss_agg_mode=mode),
                                                   norm=norm)
    kl_loss = compute_kl_loss(log_prob, batch["ref_log_prob"], mask, "low_var_kl", mode, norm=norm)
    entropy = compute_entropy_loss(entropy_from_logits(logits), mask, mode, norm=norm)
    vpreds = batch["features"] @ params["critic"]  # [B, T]
    vf_loss, vf_clipfrac = compute_value_loss(vpreds, batch["returns"], batch["values"], mask, 0.2, mode, norm=norm)
    metrics = dict(metrics, vf_clipfrac=vf_clipfrac)
    return pg_loss + 0.1 * kl_loss - 0.01 * entropy + vf_loss, metrics


@jax.jit
def _step(params, batch, norm):
    """Loss, metrics and gradients for every mode at once (one compile per batch shape)."""
    return {mode: jax.value_and_grad(functools.partial(_loss, mode=mode), has_aux=True)(params, batch, norm)
            for mode in LOSS_AGG_MODES}


def _micro_batches(batch, split_points, rows_bucket):
    """Uneven splits, each padded with empty rows to a common row bucket (as a trainer pads to
    bucket shapes, and so that one compiled step serves every micro-batch)."""
    for rows in np.split(np.arange(len(batch["index"])), split_points):
        pad = rows_bucket - len(rows)
        yield {k: np.concatenate([v[rows], np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}


def _widen(batch, extra):
    """Pad the time axis with masked-out steps, as padding to the max response length would."""
    return {k: (np.pad(v, [(0, 0), (0, extra)] + [(0, 0)] * (v.ndim - 2)) if v.ndim >= 2 else v)
            for k, v in batch.items()}


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("narrower_micro_batches", [False, True])
def test_accumulated_micro_batches_equal_the_mini_batch(k, narrower_micro_batches):
    """With `narrower_micro_batches` the mini-batch is padded to a max response length of T + 3
    while its micro-batches are only T wide: seq-mean-token-sum-norm must still divide by T + 3."""
    params, micro_source = _problem()
    mini = _widen(micro_source, 3) if narrower_micro_batches else micro_source
    # The trainer passes the configured max response length: the mini-batch's padded width here.
    norm = compute_loss_norm(mini["response_mask"], max_len=mini["response_mask"].shape[-1])
    want = _step(params, mini, norm)
    acc = None
    for micro in _micro_batches(micro_source, SPLITS[k], rows_bucket=len(micro_source["index"])):
        out = _step(params, micro, norm)
        acc = out if acc is None else jax.tree.map(jnp.add, acc, out)
    for mode in LOSS_AGG_MODES:
        chex.assert_trees_all_close(acc[mode], want[mode], rtol=1e-5, atol=1e-6, custom_message=mode)


def test_per_micro_batch_denominators_would_be_wrong():
    """The check has teeth: averaging per-micro-batch token means (no shared norm) gives another loss."""
    _, batch = _problem()
    agg = jax.jit(agg_loss, static_argnums=2)
    loss, mask = batch["advantages"], batch["response_mask"]
    micro = [agg(loss[rows], mask[rows], "token-mean") for rows in np.split(np.arange(len(loss)), SPLITS[2])]
    assert abs(float(np.mean(micro)) - float(agg(loss, mask, "token-mean"))) > 1e-2
