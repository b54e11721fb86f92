"""`shards_check`: the paged engine's tokens on every mesh of the machine's GPUs against one GPU's.

Each data-parallel shard runs executables compiled for the first shard and loaded onto its own devices
(rollout/programs.py); this checks they compute what the first shard's do. A small model, 16 GSM8K prompts x 2
a GPU with random budgets up to 128 tokens, greedy and sampled (each row its own stream): on fsdp meshes the rows
must equal one GPU's; on tensor-parallel meshes bf16 sums are ordered differently, so greedy rows may part ways
at a near-tie of random weights' flat distributions (the row reports the share that stay equal).
"""

from __future__ import annotations

import numpy as np

from jaxrl_llm.bench.harness import emit, section
from jaxrl_llm.bench.workload import gsm8k_prompts


@section("shards_check", help="paged engine: every mesh's tokens (fsdp, fsdp x tensor 2) against one GPU's",
         defaults={"presets": "qwen2p5_0p5b", "repeats": 2})
def shards_check(opts):
    import jax

    from jaxrl_llm import sharding
    from jaxrl_llm.models import init_params
    from jaxrl_llm.models.config import PRESETS
    from jaxrl_llm.rollout import JaxEngine, SamplingParams

    k = jax.device_count()
    preset = opts.small_preset if opts.small else opts.presets.split(",")[0]
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="bfloat16")
    params = init_params(cfg, seed=0)
    prompts = gsm8k_prompts(16 * k, vocab_size=cfg.vocab_size)
    lens = np.random.default_rng(0).integers(1, 128, size=len(prompts) * 2)
    meshes = {"1": None, f"fsdp{k}": sharding.make_mesh(1, k, 1)}
    if k % 2 == 0 and cfg.num_key_value_heads % 2 == 0:
        meshes[f"fsdp{k // 2}_tensor2"] = sharding.make_mesh(1, k // 2, 2)
    for sp in (SamplingParams(n=2, temperature=0.0, max_new_tokens=128, ignore_eos=True),
               SamplingParams(n=2, temperature=1.0, max_new_tokens=128, ignore_eos=True, seed=7)):
        ref = None
        for name, mesh in meshes.items():
            eng = JaxEngine(cfg, params, mesh=mesh, dtype="bfloat16", max_prompt_length=512, max_model_len=640)
            for _ in range(max(1, opts.repeats)):  # the later calls reuse the programs and the pool
                out = eng.generate(prompts, sp, max_new_tokens_per_row=lens)
            ref = out if ref is None else ref
            emit(section="shards_check", preset=preset, mesh=name, temperature=sp.temperature,
                 rows_equal_1gpu=float(np.mean(np.all(out.tokens == ref.tokens, axis=1))),
                 **{key: v for key, v in eng.last_stats.items() if key in (
                     "shard_segments", "programs_compiled", "programs_moved", "stolen", "seconds")})
            del eng
