"""Routing replay for MoE RL (`actor.router_replay.mode`, veRL's key and modes; its settings: config/router_replay.py):
the routing's layouts in the trainer, and the sampler–trainer log-prob gap it is meant to close.

The sampler and the trainer run the same weights with different kernels and dtypes, so a token near a
routing tie goes to different experts in the two, and the importance ratio then measures routing noise
(arXiv 2507.18071). Replay hands the trainer's forward a recorded expert choice per token and sparse layer:
  * 'R3' (rollout routing replay): the JAX sampler records each token's experts (prompt and response,
    prefill and decode, `SamplingParams.return_routed_experts`); the old-log-prob, reference and update
    passes replay them.
  * 'R2' (vanilla routing replay): the old-log-prob pass records the old policy's routing and the update
    passes replay it. A step that skips the old pass (one mini-batch, one epoch: the update's own
    routing is then the old policy's) has nothing to record and needs nothing.
Only the choice is replayed: the gate weights come from the live router (`models/moe.py`). The critic
routes itself in both modes. The vLLM pool does not return routing, so R3 needs rollout.engine = 'jax'.

Layouts: `TrainBatch.fields["routed_experts"]` is [R, S, L_moe, k] int16 in sequence layout (row r's
prompt tokens, then its response tokens, from index 0; -1 where nothing was recorded, which routes the
token live). A micro-batch carries it packed, [rows, L, L_moe, k], like its input ids. L_moe runs over
`cfg.sparse_layers` in layer order, whatever stack holds them (a Qwen3.5-MoE's linear-attention layers are
sparse too: all of its layers).
"""

from __future__ import annotations

import numpy as np

FIELD = "routed_experts"


def to_train_layout(routed: np.ndarray | None, width: int) -> np.ndarray | None:
    """A rollout's `routed_experts` [R, P + T, L_moe, k] -> the batch's [R, width, L_moe, k] int16 (a fixed
    width, so that batches of several draws concatenate)."""
    if routed is None:
        return None
    out = np.full((routed.shape[0], width) + routed.shape[2:], -1, np.int16)
    w = min(width, routed.shape[1])
    out[:, :w] = routed[:, :w]
    return out


def pack(routed: np.ndarray, placements, seq_lengths: np.ndarray, rows: int, length: int) -> np.ndarray:
    """Sequence-layout routing of the placed sequences -> packed [rows, length, L_moe, k] (-1 elsewhere).

    Args:
      routed: [R, S, L_moe, k]; placements: (sequence index, row, offset) triples; seq_lengths: [R].
    """
    out = np.full((rows, length) + routed.shape[2:], -1, routed.dtype)
    for i, row, off in placements:
        n = min(int(seq_lengths[i]), routed.shape[1])
        out[row, off:off + n] = routed[i, :n]
    return out


def unpack(packed: np.ndarray, host: dict, seq_lengths: np.ndarray, out: dict) -> None:
    """Writes a micro-batch's recorded routing back to sequence layout, into `out[FIELD]` (made on first
    use, [R, max sequence length, L_moe, k] int16, -1 past each sequence).

    Args:
      packed: [rows, L, L_moe, k] the experts the pass used; host: the micro-batch's `seq_ids` and
        `seq_start` ([S] each slot's sequence, -1 if empty, and its first flat packed position);
      seq_lengths: [R] prompt + response tokens.
    """
    if FIELD not in out:
        out[FIELD] = np.full((len(seq_lengths), int(seq_lengths.max())) + packed.shape[2:], -1, np.int16)
    flat = packed.reshape((-1,) + packed.shape[2:])
    for i, start in zip(host["seq_ids"], host["seq_start"]):
        if i >= 0:
            n = int(seq_lengths[i])
            out[FIELD][i, :n] = flat[start:start + n]


def rollout_gap_metrics(old_log_prob: np.ndarray, rollout_log_probs: np.ndarray,
                        response_mask: np.ndarray) -> dict[str, float]:
    """veRL's `training/rollout_probs_diff_*`: |π_trainer - π_sampler| of the sampled tokens, from the
    old-log-prob pass (the update's own gap is `actor/logprob_gap_mean`, on log-probs). Routing replay
    should shrink both on a MoE."""
    m = response_mask > 0
    if not m.any():
        return {}
    diff = np.abs(np.exp(old_log_prob[m].astype(np.float64)) - np.exp(rollout_log_probs[m].astype(np.float64)))
    return {"training/rollout_probs_diff_mean": float(diff.mean()),
            "training/rollout_probs_diff_max": float(diff.max()),
            "training/rollout_probs_diff_std": float(diff.std())}
