"""The fixed program shapes of a paged-engine shard, and how a plan's prefills map onto them.

Every shape a shard's programs take comes from the engine's config, never from a call's data, so the set of
programs is known before the first rollout (and built ahead, rollout/programs.py), and nothing compiles at a
later step:

* **Decode**: [S, W] with S a slot bucket (rollout/scheduler.py) and W the block-table width, fixed by the
  engine's `max_model_len` (prompt + response).
* **Fresh prefill** (a context from position 0, the common case: a new prompt): L, a power of two from 16 up
  to `fresh_top` (the longest prompt's, within `max_fresh`), with B(L) rows a call (the token budget
  `max_num_batched_tokens` over L), or B(L) / 8 rows for a call that would be mostly padding. The chunk attends
  within itself; its table covers L positions.
* **Continuation prefill** (a long prompt's later chunks; a preempted or recomputed row's context after its
  shared prompt pages, or after its first `fresh_top` tokens where it shares none): over the full table width
  W, at Lc (its attention scores within ATTN_BYTES) or Lc / 8 for a short rest. A resumed row's context (its
  prompt and the tokens it has) can be as long as `max_model_len`; taking what passes `fresh_top` in these
  chunks keeps it on programs built ahead (a fully async run's partial rollouts recompute theirs after every
  weight swap).
* **Copies** (page copy on write, and a Qwen3.5's state forks: each sibling of a prompt copies the prompt's state
  snapshot into its slot): one program of C pairs, C the slot cap's power of two, for a model with KV pages only (a
  page pair is a few KB a layer). A model with state slots copies 24 MiB a pair at Qwen3.5-9B, and a round copies
  about what it admitted, so there C comes from a ladder, powers of two from `copy_floor` up to that top, and a
  round's call takes the narrowest that covers its pairs (a padded pair still moves the scratch slot's rows).

Glossary: B rows a call, L chunk length, W table width (pages), ps page size, N q heads.
"""

from __future__ import annotations

import dataclasses
import math

from jaxrl_llm.rollout.scheduler import PrefillTask

ATTN_BYTES = 512 << 20  # a prefill call's fp32 attention scores stay under this
MIN_CHUNK = 16
MIN_COPY = 16  # the narrowest copy program of a model with state slots (a refill round admits about S / 16 rows)


def pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def floor_pow2(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Context tokens [start, end) of `task`'s row, in a prefill call of `length` tokens a row."""

    task: PrefillTask
    start: int
    end: int
    length: int
    fresh: bool  # from position 0, attending within the chunk (else over the row's whole table)


@dataclasses.dataclass(frozen=True)
class Ladders:
    """A shard's program shapes (see the module docstring).

    Args:
      width: W, block-table width in pages.
      page_size: ps.
      num_heads: N (the attention scores' size).
      max_batched_tokens: prompt tokens one prefill call takes at most (`rollout.max_num_batched_tokens`).
      max_prompt: the engine's longest prompt (the fresh lengths built ahead reach it).
      slot_cap: rows a shard decodes at most (`rollout.max_num_seqs`).
    """

    width: int
    page_size: int
    num_heads: int
    max_batched_tokens: int
    max_prompt: int
    slot_cap: int
    max_rows: int = 0  # rows a prefill call takes at most (0: no cap; a Qwen3.5's rows carry their fp32 states)
    copy_floor: int = 0  # the narrowest copy program (0: one width; a model with state slots: MIN_COPY)

    @property
    def max_fresh(self) -> int:
        """The longest fresh chunk: within the token budget, the table, and ATTN_BYTES of [L, L] scores."""
        by_attn = floor_pow2(max(MIN_CHUNK, math.isqrt(ATTN_BYTES // (self.num_heads * 4))))
        return max(MIN_CHUNK, min(floor_pow2(self.max_batched_tokens), by_attn, pow2(self.width * self.page_size)))

    @property
    def fresh_top(self) -> int:
        """The longest fresh chunk a plan uses, and the engine builds ahead: the longest prompt's (at most
        max_fresh)."""
        return self.fresh_lengths(self.max_prompt)[-1]

    def fresh_lengths(self, upto: int | None = None) -> list[int]:
        """Fresh chunk lengths, 16 .. max_fresh (or the first that covers `upto`)."""
        top = self.max_fresh if upto is None else min(self.max_fresh, max(MIN_CHUNK, pow2(upto)))
        out, x = [], MIN_CHUNK
        while x <= top:
            out.append(x)
            x *= 2
        return out

    def rows(self, length: int, fresh: bool) -> int:
        """B(L): rows a full call of chunks of `length` takes."""
        ctx = length if fresh else self.width * self.page_size
        by_attn = ATTN_BYTES // (self.num_heads * 4 * length * ctx)
        rows = min(self.max_batched_tokens // length, by_attn, self.max_rows or by_attn)
        return max(1, floor_pow2(max(1, rows)))

    def row_options(self, length: int, fresh: bool) -> list[int]:
        """The call sizes built for `length`: B(L), and B(L) / 8 for a small call."""
        b = self.rows(length, fresh)
        return sorted({b, max(1, b // 8)})

    def table_width(self, length: int, fresh: bool) -> int:
        return max(1, length // self.page_size) if fresh else self.width

    @property
    def cont_lengths(self) -> list[int]:
        """Continuation chunk lengths: Lc / 8 and Lc, Lc's [Lc, W ps] scores within ATTN_BYTES."""
        by_attn = ATTN_BYTES // (self.num_heads * 4 * self.width * self.page_size)
        lc = max(MIN_CHUNK, min(floor_pow2(max(1, by_attn)), self.max_fresh))
        return sorted({max(MIN_CHUNK, lc // 8), lc})

    @property
    def slot_cap_bucket(self) -> int:
        """The widest decode segment a shard runs: its slot cap's bucket."""
        from jaxrl_llm.rollout.scheduler import slot_ladder

        return slot_ladder(self.slot_cap)[-1]

    @property
    def copy_widths(self) -> list[int]:
        """The copy program's widths C (pairs a call takes): the slot cap's power of two alone, or powers of two from
        `copy_floor` up to it. A round copies at most the slot cap's pairs (a page per live row, a state per row it
        admits), so the top covers any round."""
        top = pow2(max(MIN_CHUNK, self.slot_cap))
        out, c = [], pow2(self.copy_floor) if self.copy_floor else top
        while c < top:
            out.append(c)
            c *= 2
        return [*out, top]

    def copy_width(self, pairs: int) -> int:
        """The narrowest copy width that takes `pairs` pairs (the top where none does: the caller splits)."""
        return next((c for c in self.copy_widths if c >= pairs), self.copy_widths[-1])

    # ---- a plan's prefills -----------------------------------------------------------------------
    def chunks(self, task: PrefillTask) -> list[Chunk]:
        """A task's chunks in order: one fresh chunk when it starts at 0 and fits in `fresh_top`, else a fresh
        first chunk (at 0) of `fresh_top` and continuation chunks."""
        out, a, top = [], task.start, self.fresh_top
        if a == 0:
            if task.end <= top:
                return [Chunk(task, 0, task.end, max(MIN_CHUNK, pow2(task.end)), True)]
            out.append(Chunk(task, 0, top, top, True))
            a = top
        short, lc = self.cont_lengths[0], self.cont_lengths[-1]
        while a < task.end:
            length = lc if task.end - a > lc // 2 else short
            out.append(Chunk(task, a, min(task.end, a + length), length, False))
            a += length
        return out

    def calls(self, tasks: list[PrefillTask]) -> list[list[Chunk]]:
        """The prefill calls of a plan, in order: fresh rows' tasks before resumed rows' (a resumed row may read
        prompt pages a fresh one writes), each in waves (chunk i of every task, then chunk i + 1), each wave in
        calls of one shape, each call of B(L) chunks, or B(L) / 8 for what is left when that covers it."""
        out: list[list[Chunk]] = []
        for phase in ([t for t in tasks if not t.row.ntok], [t for t in tasks if t.row.ntok]):
            per_task = [self.chunks(t) for t in phase]
            depth = max((len(c) for c in per_task), default=0)
            for i in range(depth):
                groups: dict[tuple[int, bool], list[Chunk]] = {}
                for c in per_task:
                    if i < len(c):
                        groups.setdefault((c[i].length, c[i].fresh), []).append(c[i])
                for (length, fresh), chunks in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
                    full, small = self.rows(length, fresh), self.row_options(length, fresh)[0]
                    while chunks:
                        b = small if len(chunks) <= small else full
                        out.append(chunks[:b])
                        chunks = chunks[b:]
        return out
