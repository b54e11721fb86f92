"""The gen section's workloads: with --shard_work tiled, the paged engine's dealer gives every shard the work one
GPU gets (the same groups, up to swaps between groups of equal cost), so K GPUs against one compares equal work;
'drawn' is K independent shares."""

import numpy as np
import pytest

from jaxrl_llm.bench.gen import workload
from jaxrl_llm.bench.workload import long_lengths, seed_response_lengths
from jaxrl_llm.rollout.dealer import deal
from jaxrl_llm.rollout.rows import Row, RowStore


def _groups(prompts, lens, n):
    store = RowStore(len(lens), 1, 0)
    rows = [Row(i, i // n, np.asarray(prompts[i // n], np.int32), int(lens[i]), store) for i in range(len(lens))]
    return [rows[i * n:(i + 1) * n] for i in range(len(prompts))]


def _costs(groups):
    """A shard's work: its groups' costs (prompt and response tokens), sorted."""
    return sorted(len(g[0].ids) * len(g) + sum(r.max_tokens for r in g) for g in groups)


def _work(groups):
    """A shard's groups as sorted (prompt ids, response lengths)."""
    return sorted((tuple(g[0].ids.tolist()), tuple(r.max_tokens for r in g)) for g in groups)


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("lengths", [seed_response_lengths, long_lengths])
def test_tiled_gives_every_shard_one_gpus_rows(devices, lengths):
    rng = np.random.default_rng(0)
    per_gpu, n, rep = 32, 5, 1
    prompts_all = [list(rng.integers(0, 1000, rng.integers(20, 90))) for _ in range(per_gpu * devices * 3)]
    one_prompts, one_lens = workload(prompts_all, rep, per_gpu, n, 1, "tiled", lengths)
    prompts, lens = workload(prompts_all, rep, per_gpu, n, devices, "tiled", lengths)
    assert len(prompts) == per_gpu * devices and len(lens) == per_gpu * devices * n
    single = _groups(one_prompts, one_lens, n)
    dealt = deal(_groups(prompts, lens, n), devices)
    for shard in dealt:
        assert _costs(shard) == _costs(single)
    # together the shards hold each of one GPU's groups `devices` times
    assert sorted(g for shard in dealt for g in _work(shard)) == sorted(_work(single) * devices)


def test_drawn_takes_new_shares_and_one_gpu_is_the_same_either_way():
    prompts_all = [[i, i + 1] for i in range(64 * 3)]
    p1, l1 = workload(prompts_all, 1, 16, 5, 1, "drawn", seed_response_lengths)
    t1, tl1 = workload(prompts_all, 1, 16, 5, 1, "tiled", seed_response_lengths)
    assert p1 == t1 and np.array_equal(l1, tl1)
    p4, l4 = workload(prompts_all, 1, 16, 5, 4, "drawn", seed_response_lengths)
    assert len(set(map(tuple, p4))) == 64 and len(l4) == 320  # four shares, no copies
    assert p4 == prompts_all[64:128] and np.array_equal(l4, seed_response_lengths(320, seed=1))
