"""Diagnostics: the paged engine's copy program (copy on write of pages, and the state forks of a prompt's samples)
at Qwen3.5-9B's shapes, compiled, not run: XLA's memory analysis, as the engine builds it (each linear layer's
gather ordered after the previous layer's scatter by an optimization barrier) and unchained (as it was built before).

The copy program's widest form takes pow2(slot cap) pairs (a round's call takes the narrowest width of the copy
ladder that covers its pairs, rollout/ladders.py): at the default max_num_seqs the 9B's slot cap is about 565, so
1,024 pairs, and a linear layer's gathered rows are [1024, 32, 128, 128] bf16 = 1 GiB; where XLA keeps the 24
layers' gathers alive together, that is 24 GiB, the allocation the first rollout at the default asked for
(BENCHMARKS.md). On the GPU the chained form should hold about one layer's. XLA's CPU pipeline drops optimization
barriers before scheduling and widens bf16 scatters to fp32, so the CPU's figures say nothing about the chain. No
weights are needed: it compiles in seconds.

    python benchmarks/diag/copy_memory.py 1024,707,27100 256,321,51453    # C (pairs), state slots, pages
"""

import dataclasses
import sys

import jax
import numpy as np

from jaxrl_llm.models import DecoderConfig
from jaxrl_llm.rollout import JaxEngine, SamplingParams, paged_decode


def unchained_copy_pages(pool, src, dst, state_src=None, state_dst=None):
    """`paged_decode.copy_pages` as it was: nothing orders the linear layers' copies."""
    def local(k, v, s, d):
        s, d = s[0], d[0]
        return k.at[:, d].set(k[:, s]), v.at[:, d].set(v[:, s])

    def states(conv, rec):
        return conv.at[state_dst].set(conv[state_src]), rec.at[state_dst].set(rec[state_src])

    return [states(*entry) if paged_decode.is_state(entry)
            else paged_decode._per_shard(local, (*entry, src, dst), ("pool", "pool", "rows", "rows"), ("pool", "pool"))
            for entry in pool]


def main():
    cfg = DecoderConfig.qwen3_5_9b(dtype="bfloat16", param_dtype="bfloat16")
    eng = JaxEngine(cfg, None, dtype="bfloat16", max_num_seqs=1024, max_model_len=1536, max_prompt_length=512,
                    warm_programs=False)
    spec = dataclasses.replace(eng._spec(SamplingParams(), eng.decode_attention), max_new_tokens=0)
    eng._fix_width(1500)
    base = eng._base
    original = paged_decode.copy_pages
    for arg in sys.argv[1:] or ["1024,707,27100", "256,321,51453"]:
        c, slots, pages = map(int, arg.split(","))
        pool = eng.abstract_pool(spec, pages, slots, base)
        args = eng._abstract((pool, np.zeros((4, c), np.int32)), base.mesh)
        for label, fn in (("as built", original), ("unchained", unchained_copy_pages)):
            paged_decode.copy_pages = fn
            jax.clear_caches()  # else the second lowering reuses the first trace
            with jax.set_mesh(base.mesh):
                m = JaxEngine._copy.lower(eng, *args).compile().memory_analysis()
            print(f"copy C={c} state slots {slots} pages {pages} ({label}): temp {m.temp_size_in_bytes / 2**30:.2f} "
                  f"GiB, out {m.output_size_in_bytes / 2**30:.2f}, alias {m.alias_size_in_bytes / 2**30:.2f}",
                  flush=True)
    paged_decode.copy_pages = original


if __name__ == "__main__":
    main()
