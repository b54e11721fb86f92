"""Diagnostics: Qwen3.5-9B generation at the seed share on one GPU, with the engine's budget and every decode
program's compiled memory printed, at each `max_num_seqs` given (an out-of-memory is reported, not raised).

    python benchmarks/diag/gen_memory.py 256 1024
"""

import sys
import time

import jax

from jaxrl_llm.bench.workload import gsm8k_prompts, seed_response_lengths
from jaxrl_llm.models import DecoderConfig, init_params
from jaxrl_llm.rollout import JaxEngine, SamplingParams
from jaxrl_llm.rollout import programs as programs_mod

cfg = DecoderConfig.qwen3_5_9b(dtype="bfloat16", param_dtype="bfloat16")
params = init_params(cfg, seed=0)
orig_get = programs_mod.Programs.get


def get(self, name, jitted, owner, args, static, keep=True):
    compiled = orig_get(self, name, jitted, owner, args, static, keep)
    m = compiled.memory_analysis()
    if m is not None and name.startswith("_decode"):
        print(f"  {name} {args[-1].shape}: temp {m.temp_size_in_bytes / 2**30:.2f} GiB out "
              f"{m.output_size_in_bytes / 2**30:.2f} alias {m.alias_size_in_bytes / 2**30:.2f}", flush=True)
    return compiled


programs_mod.Programs.get = get
prompts = gsm8k_prompts(128, vocab_size=cfg.vocab_size)
lens = seed_response_lengths(640, seed=0)
for cap in [int(x) for x in sys.argv[1:]] or [256]:
    eng = JaxEngine(cfg, params, dtype="bfloat16", max_num_seqs=cap, max_prompt_length=512, max_model_len=1536)
    t0 = time.perf_counter()
    try:
        eng.generate(prompts, SamplingParams(n=5, temperature=1.0, max_new_tokens=1024, ignore_eos=True),
                     max_new_tokens_per_row=lens)
        ok = "ok"
    except Exception as e:  # noqa: BLE001
        ok = f"{type(e).__name__}: {str(e)[:200]}"
    st = eng.last_stats
    mem = jax.devices()[0].memory_stats()
    print(f"max_num_seqs={cap}: {ok} in {time.perf_counter() - t0:.1f} s; slot_cap {st.get('slot_cap')} state_slots "
          f"{st.get('state_slots')} pages {st.get('num_pages')} kv {st.get('kv_bytes', 0) / 2**30:.1f} GiB; peak "
          f"{mem['peak_bytes_in_use'] / 2**30:.1f} of {mem['bytes_limit'] / 2**30:.1f} GiB", flush=True)
    eng.release()
    eng = None
