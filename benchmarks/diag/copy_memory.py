"""Diagnostics: the paged engine's copy program (copy on write of pages, and the state forks of a prompt's samples)
at Qwen3.5-9B's shapes, compiled, not run: XLA's memory analysis, as the engine builds it and with each linear
layer's gather ordered after the previous layer's scatter (an optimization barrier, as the decode step has).

The copy program takes `copy_slots` = pow2(slot cap) pairs whatever a round copies: at the default max_num_seqs the
9B's slot cap is about 565, so 1,024 pairs, and a linear layer's gathered rows are [1024, 32, 128, 128] bf16 =
1 GiB; if XLA keeps the 24 layers' gathers alive together, that is 24 GiB, the allocation the first rollout at the
default asked for (BENCHMARKS.md). No weights are needed: it compiles in seconds.

    python benchmarks/diag/copy_memory.py 1024,707,27100 256,321,51453    # C (pairs), state slots, pages
"""

import dataclasses
import sys

import jax
import numpy as np

from jaxrl_llm.models import DecoderConfig
from jaxrl_llm.rollout import JaxEngine, SamplingParams, paged_decode


def chained_copy_pages(pool, src, dst, state_src=None, state_dst=None):
    """`paged_decode.copy_pages` with each linear layer's copy waiting for the previous one's."""
    def local(k, v, s, d):
        s, d = s[0], d[0]
        return k.at[:, d].set(k[:, s]), v.at[:, d].set(v[:, s])

    out, after = [], None
    for entry in pool:
        if paged_decode.is_state(entry):
            conv, rec, _ = jax.lax.optimization_barrier((*entry, after))
            entry = conv.at[state_dst].set(conv[state_src]), rec.at[state_dst].set(rec[state_src])
            after = entry[1]
        else:
            entry = paged_decode._per_shard(local, (*entry, src, dst), ("pool", "pool", "rows", "rows"),
                                            ("pool", "pool"))
        out.append(entry)
    return out


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
        for label, fn in (("as built", original), ("chained", chained_copy_pages)):
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
