"""Diagnostics: the paged engine's widest prefill programs at Qwen3.5-9B's shapes, compiled, not run: XLA's memory
analysis with each linear layer's slot reads ordered after its input (paged_decode.ORDER_SLOT_READS, as built)
and unordered. The 9B's 64-row fresh prefill at 128 tokens asked for 7.23 GiB beside its inputs on an H100
(2026-11-28), about 52 MiB a row: as if every layer's fp32 state were alive at once. XLA's CPU pipeline drops
optimization barriers before scheduling, so the CPU's figures say nothing here.

    python benchmarks/diag/prefill_memory.py 64,128 32,256    # rows,length of fresh chunks
"""

import dataclasses
import sys

import jax
import numpy as np

from jaxrl_llm.models import DecoderConfig, init_params
from jaxrl_llm.rollout import JaxEngine, SamplingParams, paged_decode


def main():
    cfg = DecoderConfig.qwen3_5_9b(dtype="bfloat16", param_dtype="bfloat16")
    eng = JaxEngine(cfg, init_params(cfg, seed=0), dtype="bfloat16", max_model_len=1536, max_prompt_length=512,
                    warm_programs=False)
    spec = dataclasses.replace(eng._spec(SamplingParams(), eng.decode_attention), max_new_tokens=0)
    eng._fix_width(1500)
    base, lad = eng._base, eng.ladders
    with jax.set_mesh(eng.mesh):
        budget = eng._pool_budget(1500)
    pool = eng.abstract_pool(spec, budget.num_pages, budget.state_slots, base)
    print(f"pool: {budget.num_pages} pages, {budget.state_slots} state slots; workspace estimate "
          f"{budget.workspace / 2**30:.2f} GiB", flush=True)
    for arg in sys.argv[1:] or ["64,128", "32,256"]:
        rows, length = map(int, arg.split(","))
        packed = np.zeros((rows, length + lad.table_width(length, True) + paged_decode.PREFILL_COLS), np.int32)
        args = eng._abstract((base.params, pool, packed), base.mesh)
        for label, ordered in (("ordered", True), ("unordered", False)):
            paged_decode.ORDER_SLOT_READS = ordered
            jax.clear_caches()
            with jax.set_mesh(base.mesh):
                m = JaxEngine._prefill.lower(eng, *args, spec=spec, length=length).compile().memory_analysis()
            print(f"prefill rows {rows} length {length} ({label}): temp {m.temp_size_in_bytes / 2**30:.3f} GiB, "
                  f"{m.temp_size_in_bytes / rows / 2**20:.1f} MiB a row", flush=True)
    paged_decode.ORDER_SLOT_READS = True


if __name__ == "__main__":
    main()
