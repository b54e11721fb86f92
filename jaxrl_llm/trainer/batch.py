"""The training batch and its packing into fixed-shape micro-batches.

Two layouts:
  * response layout [R, Tr]: one row per response, veRL's layout; every piece of RL maths runs
    here (advantages, losses, metrics). Tr is the configured max response length.
  * packed layout [rows, L]: whole sequences (prompt + response) packed end to end into rows of
    L tokens with segment ids, so a micro-batch has one fixed shape whatever the lengths (no
    recompiles, almost no padding). The model runs here.

`resp_pos[s, j]` is the flat packed position whose hidden state predicts response token j of slot s;
per-token model outputs are gathered from packed to response layout through it. Which sequences go to
which micro-batch, row and offset, and at which of a few fixed shapes, is `trainer/packing.py`'s choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrl_llm.trainer import router_replay


@dataclasses.dataclass(frozen=True)
class PackShape:
    """Static shape of one micro-batch: `rows` x `length` packed tokens, up to `max_seqs` sequences,
    responses up to `resp_len` tokens."""

    rows: int
    length: int
    max_seqs: int
    resp_len: int


@dataclasses.dataclass
class TrainBatch:
    """One step's responses on the host, in response layout (R rows).

    `fields` holds per-token [R, Tr] arrays (old_log_prob, ref_log_prob, values, advantages, returns,
    token_level_rewards, rollout_log_probs, ...) and per-response [R] arrays (scores, ...).
    """

    prompt_ids: list[np.ndarray]  # R arrays of prompt token ids
    responses: np.ndarray  # [R, Tr] int32, right-padded with 0
    response_mask: np.ndarray  # [R, Tr] float32
    group_ids: np.ndarray  # [R] int32, dense ids of the prompt each response answers
    fields: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def response_lengths(self) -> np.ndarray:
        """[R] tokens of each response in its sequence: up to its last mask-1 token. A multi-turn response
        holds tool turns with mask 0 inside it, so this can exceed `loss_token_counts`."""
        m = self.response_mask > 0
        return np.where(m.any(-1), m.shape[1] - np.argmax(m[:, ::-1], -1), 0).astype(np.int32)

    @property
    def loss_token_counts(self) -> np.ndarray:
        """[R] mask-1 (sampled assistant) tokens of each response: the ones losses and metrics count."""
        return self.response_mask.sum(-1).astype(np.int32)

    @property
    def prompt_lengths(self) -> np.ndarray:
        return np.asarray([len(p) for p in self.prompt_ids], np.int32)

    def select(self, idx: Sequence[int] | np.ndarray) -> TrainBatch:
        idx = np.asarray(idx)
        return TrainBatch(prompt_ids=[self.prompt_ids[i] for i in idx], responses=self.responses[idx],
                          response_mask=self.response_mask[idx], group_ids=self.group_ids[idx],
                          fields={k: v[idx] for k, v in self.fields.items()})

    def to_arrays(self) -> dict[str, np.ndarray]:
        """A flat dict of arrays (for dumping / replaying batches)."""
        lens = self.prompt_lengths
        flat = np.concatenate(self.prompt_ids) if len(self) else np.zeros(0, np.int32)
        out = {"prompt_lengths": lens, "prompt_flat": flat.astype(np.int32), "responses": self.responses,
               "response_mask": self.response_mask, "group_ids": self.group_ids}
        out.update({f"field/{k}": v for k, v in self.fields.items()})
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> TrainBatch:
        bounds = np.concatenate([[0], np.cumsum(arrays["prompt_lengths"])])
        prompts = [arrays["prompt_flat"][a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        fields = {k[len("field/"):]: v for k, v in arrays.items() if k.startswith("field/")}
        return cls(prompt_ids=prompts, responses=arrays["responses"], response_mask=arrays["response_mask"],
                   group_ids=arrays["group_ids"], fields=fields)


def build_micro_batch(batch: TrainBatch, placements: list[tuple[int, int, int]], shape: PackShape,
                      fields: Sequence[str] = (), pad_id: int = 0) -> dict[str, np.ndarray]:
    """Packs the placed sequences into fixed-shape arrays.

    Returns:
      input_ids, positions, segment_ids, targets: [rows, L] int32 (packed layout);
      resp_pos: [S, Tr] int32; response_mask: [S, Tr] float32; responses: [S, Tr] int32;
      each requested field: [S, Tr] or [S] (response layout); seq_ids: [S] int32, -1 for empty slots;
      seq_start: [S] int32, each slot's first flat packed position; and, when the batch carries MoE
      routing (`router_replay.FIELD`), routed_experts: [rows, L, L_moe, k] (packed layout).
    """
    rows, length, s_max, tr = shape.rows, shape.length, shape.max_seqs, shape.resp_len
    ids = np.full((rows, length), pad_id, np.int32)
    positions = np.zeros((rows, length), np.int32)
    segments = np.zeros((rows, length), np.int32)
    targets = np.zeros((rows, length), np.int32)
    resp_pos = np.zeros((s_max, tr), np.int32)
    seq_ids = np.full((s_max,), -1, np.int32)
    seq_start = np.zeros((s_max,), np.int32)
    seg_count = np.zeros(rows, np.int32)
    lengths = batch.response_lengths  # [R] whole responses, tool turns included
    for slot, (i, row, off) in enumerate(placements):
        prompt = batch.prompt_ids[i]
        lp = len(prompt)
        lr = int(lengths[i])
        seq = np.concatenate([prompt, batch.responses[i, :lr]]).astype(np.int32)
        n = lp + lr
        seg_count[row] += 1
        ids[row, off:off + n] = seq
        positions[row, off:off + n] = np.arange(n)
        segments[row, off:off + n] = seg_count[row]
        targets[row, off:off + n - 1] = seq[1:]
        resp_pos[slot, :lr] = row * length + off + lp - 1 + np.arange(lr)
        seq_ids[slot] = i
        seq_start[slot] = row * length + off
    used = seq_ids >= 0
    sel = np.where(used, seq_ids, 0)
    keep = lambda x: np.where(used.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0).astype(x.dtype)  # empty slots: 0
    out = {"input_ids": ids, "positions": positions, "segment_ids": segments, "targets": targets,
           "resp_pos": resp_pos, "seq_ids": seq_ids, "seq_start": seq_start,
           "response_mask": keep(batch.response_mask[sel]), "responses": keep(batch.responses[sel])}
    for name in fields:
        out[name] = keep(batch.fields[name][sel])
    if router_replay.FIELD in batch.fields:
        out[router_replay.FIELD] = router_replay.pack(batch.fields[router_replay.FIELD], placements,
                                                      batch.prompt_lengths + batch.response_lengths, rows, length)
    return out


def split_mini_batches(num_responses: int, mini_batch_responses: int) -> list[np.ndarray]:
    """Contiguous mini-batches of response indices (veRL's order; the last may be smaller)."""
    return [np.arange(a, min(a + mini_batch_responses, num_responses))
            for a in range(0, num_responses, mini_batch_responses)]
