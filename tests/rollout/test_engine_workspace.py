"""The paged engine's pool under a device budget leaves a workspace for its programs' temporaries. The workspace is
estimated from shapes before the programs exist; once they are built, XLA's own figure is known, and where a
program needs more than the estimate the pool is sized again leaving that, so no program runs out of memory
mid-rollout (Qwen3.5-9B's first decode asked for 24 GiB beyond the budget on an H100, BENCHMARKS.md)."""

import numpy as np

from jaxrl_llm.models import DecoderConfig, init_params
from jaxrl_llm.rollout import JaxEngine, SamplingParams, page_pool
from jaxrl_llm.rollout.engine_memory import beside_inputs
from jaxrl_llm.rollout.programs import Programs

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, n=2)


def test_a_workspace_under_what_the_built_programs_need_is_raised_to_it_and_the_pool_shrinks(monkeypatch):
    cfg = DecoderConfig.tiny_qwen35(dtype="float32")
    params = init_params(cfg, seed=0)
    kw = dict(dtype="float32", max_num_seqs=8, max_prompt_length=16, max_model_len=32, max_num_batched_tokens=64)
    reference = JaxEngine(cfg, params, **kw).generate(PROMPTS, GREEDY)  # the CPU's unbounded pool

    limit = 1 << 30
    monkeypatch.setattr(page_pool, "device_memory", lambda device=None: (limit, int(0.9 * limit) - (64 << 20), 0))
    monkeypatch.setattr(JaxEngine, "workspace_bytes", lambda self, table_width: 1)  # an estimate far too small
    warmed, warm = [], Programs.warm
    monkeypatch.setattr(Programs, "warm", lambda self, items, **k: (warmed.append(len(items)), warm(self, items, **k)))
    eng = JaxEngine(cfg, params, warm_programs=True, **kw)
    out = eng.generate(PROMPTS, GREEDY)
    # The widest decode, prefill and copy programs alone showed the estimate short; the ladder was built once, for
    # the pool sized again (without the probe: [N, N], every program built for both pools)
    assert warmed[0] == 3 and sum(n > 3 for n in warmed) == 1, warmed
    need = max(beside_inputs(p) for p in eng._base.programs.values())
    assert need > 1 << 10  # the tiny model's programs do need temporaries
    stats = eng.last_stats
    assert stats["budget_source"] == "gpu_memory_utilization"
    assert stats["workspace_bytes"] >= need  # without the check: 1
    pages_if_trusted = (64 << 20) - 1
    assert stats["kv_bytes"] + stats["state_slots"] * eng.state_bytes() <= pages_if_trusted - need + eng.page_bytes()
    np.testing.assert_array_equal(out.tokens, reference.tokens)  # the same tokens from the smaller pool
