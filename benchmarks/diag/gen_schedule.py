"""Diagnostics, host only (no model, no device): the paged engine's schedule of the `gen` section's work (repeat 1:
128 GSM8K prompts x 5, the seed's response lengths, EOS off) at a preset's shapes and a given pool, and the bytes
each decode step must move, summed into an HBM-bound lower bound of the generation.

The scheduler and the prefill ladders are the engine's own (rollout/scheduler.py, rollout/ladders.py); a decode
segment is simulated as the program runs it (each live row one token a step, to its budget; the segment ends at
`seg` steps or once `stop_free` slots are free), so segments, steps, slot buckets, prefill calls and copies are
those the engine plans for that pool.

    python benchmarks/diag/gen_schedule.py qwen3_5_9b --slot_cap 256 --state_slots 321 --num_pages 51453
    python benchmarks/diag/gen_schedule.py qwen2p5_7b --slot_cap 1024 --num_pages 40000

Bytes of a decode step of S slots (a active rows, their contexts c_i): every weight once (the LM head, not the
embedding table), each attention layer's K/V of the live rows' contexts, and per linear layer and slot the
recurrent state's traffic: `--state_passes` times [Hv, Dk, Dv] (4 today: the kernel reads the slot and writes the
row's new state, the scatter reads that and writes the slot; 2 where the kernel updates the slot in place), plus
the fp32 logits' passes (`--logit_passes`).
"""

from __future__ import annotations

import argparse
import collections
import math

import numpy as np

from jaxrl_llm.bench.workload import gsm8k_prompts, seed_response_lengths
from jaxrl_llm.models.config import PRESETS
from jaxrl_llm.rollout.ladders import ATTN_BYTES, Ladders, pow2
from jaxrl_llm.rollout.page_pool import PagePool, pages_for
from jaxrl_llm.rollout.rows import ListSource, Row, RowStore
from jaxrl_llm.rollout.scheduler import Scheduler


def simulate(cfg, slot_cap: int, num_pages: int, state_slots: int, rep: int = 1, prompts: int = 128, n: int = 5,
             page_size: int = 16, max_model_len: int = 1536, max_seg: int = 64, max_rows: int | None = None):
    """The engine's plan of repeat `rep`'s work; returns (segments [(S, live, steps, kv_tokens)], prefill calls
    [(length, rows, width)], page copies, state copies)."""
    ids = gsm8k_prompts(prompts * (rep + 1), vocab_size=cfg.vocab_size)[rep * prompts:(rep + 1) * prompts]
    lens = seed_response_lengths(prompts * n, seed=rep)
    store = RowStore(prompts * n, int(lens.max()), 0)
    rows = [Row(i * n + j, i, np.asarray(ids[i], np.int32), int(lens[i * n + j]), store)
            for i in range(prompts) for j in range(n)]
    if max_rows is None:
        state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        max_rows = max(1, ATTN_BYTES // (4 * state)) if cfg.is_hybrid else 0
    lad = Ladders(width=pow2(pages_for(max_model_len, page_size)), page_size=page_size,
                  num_heads=cfg.num_attention_heads, max_batched_tokens=8192, max_prompt=512, slot_cap=slot_cap,
                  max_rows=max_rows)
    sched = Scheduler(PagePool(num_pages, page_size), ListSource(rows), slot_cap=slot_cap, max_seg=max_seg,
                      width=lad.width, share_prompts=True,
                      states=PagePool(state_slots, 1) if state_slots else None)
    segments, prefills = [], []
    while not sched.done():
        plan = sched.plan()
        for call in lad.calls(plan.prefills):
            prefills.append((call[0].length, len(call), lad.row_options(call[0].length, call[0].fresh)))
        if not plan.live:
            continue
        s, live = plan.slots, plan.live
        left = (sched.maxtok[:live] - sched.ntok[:live]).astype(np.int64)
        ctx = sched.ctx[:live].astype(np.int64)
        count = np.zeros(s, np.int64)
        active = np.zeros(s, bool)
        active[:live] = left > 0
        step, kv = 0, 0
        while step < plan.seg and active.any() and (~active).sum() < plan.stop_free:
            kv += int((ctx[active[:live]] + count[:live][active[:live]] + 1).sum())
            count[active] += 1
            active[:live] &= count[:live] < left
            step += 1
        segments.append((s, live, step, kv))
        tokens = np.full((s, max_seg), 5, np.int32)
        sched.commit(tokens, np.zeros((s, max_seg), np.float32), count.astype(np.int32), active)
    return segments, prefills, sched.stats["copies"], sched.stats["state_copies"]


def step_bytes(cfg, dtype_bytes: int = 2, state_bytes: int = 2, state_passes: int = 4, logit_passes: int = 4):
    """(bytes every step moves, bytes a slot adds, bytes a context token adds) of a decode step."""
    linear = len(cfg.layer_stacks.get("linear_layers", ()))
    attn = cfg.num_hidden_layers - linear
    embed = cfg.vocab_size * cfg.hidden_size
    weights = (cfg.num_params() - (0 if cfg.tie_word_embeddings else embed)) * dtype_bytes
    per_slot = cfg.vocab_size * 4 * logit_passes
    if linear:
        rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * state_bytes
        conv = (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim * dtype_bytes * 2
        per_slot += linear * (rec * state_passes + conv)
    per_token = attn * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    return weights, per_slot, per_token


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset")
    ap.add_argument("--slot_cap", type=int, required=True)
    ap.add_argument("--num_pages", type=int, required=True)
    ap.add_argument("--state_slots", type=int, default=0)
    ap.add_argument("--max_rows", type=int, default=None, help="prefill rows a call at most (default: the engine's)")
    ap.add_argument("--state_passes", type=int, default=4)
    ap.add_argument("--logit_passes", type=int, default=4)
    ap.add_argument("--tb_s", type=float, default=3.35, help="HBM TB/s (H100 SXM: 3.35 peak)")
    a = ap.parse_args()
    cfg = PRESETS[a.preset](dtype="bfloat16", param_dtype="bfloat16")
    segs, prefills, copies, state_copies = simulate(cfg, a.slot_cap, a.num_pages, a.state_slots,
                                                    max_rows=a.max_rows)
    w, per_slot, per_token = step_bytes(cfg, state_passes=a.state_passes, logit_passes=a.logit_passes)
    steps = sum(s[2] for s in segs)
    row_steps = sum(s[0] * s[2] for s in segs)
    kv = sum(s[3] for s in segs)
    total = steps * w + row_steps * per_slot + kv * per_token
    by_bucket = collections.Counter()
    for s, _, st, _ in segs:
        by_bucket[s] += st
    print(f"{a.preset}: {len(segs)} segments, {steps} decode steps, {row_steps} slot-steps, "
          f"{len(prefills)} prefill calls {collections.Counter((p[0], p[1]) for p in prefills).most_common(8)}, "
          f"{copies} page copies, {state_copies} state copies")
    print(f"  steps by slot bucket: {dict(sorted(by_bucket.items()))}")
    print(f"  per step: weights {w / 1e9:.2f} GB; per slot {per_slot / 1e6:.1f} MB; per context token "
          f"{per_token / 1e3:.1f} kB")
    print(f"  whole decode: weights {steps * w / 1e12:.2f} TB, slots {row_steps * per_slot / 1e12:.2f} TB, KV "
          f"{kv * per_token / 1e12:.2f} TB; {total / 1e12:.2f} TB = {total / (a.tb_s * 1e12):.2f} s at "
          f"{a.tb_s} TB/s")
    print(f"  one step at {a.slot_cap} slots, mean context 400: "
          f"{(w + a.slot_cap * per_slot + a.slot_cap * 400 * per_token) / 1e9:.1f} GB = "
          f"{(w + a.slot_cap * per_slot + a.slot_cap * 400 * per_token) / (a.tb_s * 1e9):.2f} ms")
    return math.nan


if __name__ == "__main__":
    main()
