"""Routing replay R3 in the paged sampler: each row's record of the experts its tokens were routed to.

The prefill chunks and decode steps return the experts of the positions they ran ([.., L_moe, k] per
token); the engine writes them into `Row.routes` on the host and assembles `RolloutBatch.routed_experts`
(sequence layout: prompt, then response) when the request is done.
"""

from __future__ import annotations

import numpy as np

from jaxrl_llm.rollout.rows import Row


def record_routes(row: Row, start: int, routes: np.ndarray) -> None:
    """Writes the experts of positions [start, start + len(routes)) of `row`. A position keeps its first
    record: a row preempted and prefilled again recomputes positions whose tokens were already sampled
    from the first computation."""
    have = row.routes[start:start + len(routes)]
    row.routes[start:start + len(routes)] = np.where(have >= 0, have, routes)


def routed_experts_of_rows(rows: list[Row], width: int) -> np.ndarray:
    """`RolloutBatch.routed_experts` [R, P + width, L_moe, k] from the rows' records. Rows whose prompt
    pages were shared never ran those positions; they take the prompt's routing from a row that did."""
    longest = max(len(r.ids) for r in rows)
    out = np.full((len(rows), longest + width) + rows[0].routes.shape[1:], -1, np.int32)
    by_prompt: dict[int, list[Row]] = {}
    for r in rows:
        by_prompt.setdefault(r.prompt, []).append(r)
    for i, r in enumerate(rows):
        lp, used = len(r.ids), len(r.ids) + len(r.tokens) - 1  # the last token is never fed
        prompt = r.routes[:lp].copy()
        for other in by_prompt[r.prompt]:
            prompt = np.where(prompt >= 0, prompt, other.routes[:lp])
        out[i, :lp] = prompt
        out[i, lp:used] = r.routes[lp:used]
    return out
