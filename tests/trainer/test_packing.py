"""Packing a pass into micro-batches of the ladder's shapes: every sequence placed once, no row overflowing,
no shape off the ladder, and at the seed's lengths at least 95% of the padded tokens real."""

import numpy as np
import pytest

from jaxrl_llm.trainer.batch import PackShape
from jaxrl_llm.trainer.packing import padded_tokens, plan_packing, shape_ladder


def _check(plans, lengths, ladder, shards):
    placed = sorted(i for _, p in plans for i, _, _ in p)
    assert placed == list(range(len(lengths)))
    for shape, placements in plans:
        assert shape in ladder and shape.rows % shards == 0
        assert len(placements) <= shape.max_seqs
        rows: dict[int, list] = {}
        for i, row, off in placements:
            rows.setdefault(row, []).append((off, lengths[i]))
        for row, spans in rows.items():
            assert 0 <= row < shape.rows
            spans.sort()
            ends = [off + n for off, n in spans]
            assert [off for off, _ in spans] == [0] + ends[:-1]  # end to end from offset 0, no overlap
            assert ends[-1] <= shape.length and len(spans) <= shape.max_seqs // shape.rows


def test_the_ladder_halves_the_rows_a_device():
    full = PackShape(rows=32, length=128, max_seqs=320, resp_len=64)
    assert [s.rows for s in shape_ladder(full, shards=2, depth=4)] == [32, 16, 8, 4]
    assert [s.max_seqs for s in shape_ladder(full, shards=2, depth=4)] == [320, 160, 80, 40]
    assert [s.rows for s in shape_ladder(full, shards=2, depth=1)] == [32]
    assert [s.rows // 4 for s in shape_ladder(PackShape(40, 1536, 7680, 1024), 4, 4)] == [10, 5, 3, 2]
    assert [s.rows for s in shape_ladder(PackShape(6, 64, 48, 32), 2, 9)] == [6, 4, 2]  # 3, 2, 1 a device


@pytest.mark.parametrize("shards,depth", [(1, 1), (2, 3), (4, 4)])
def test_every_sequence_is_placed_once_on_a_shape_of_the_ladder(shards, depth):
    rng = np.random.default_rng(shards)
    lengths = rng.integers(5, 64, size=300)
    ladder = shape_ladder(PackShape(rows=4 * shards, length=64, max_seqs=16 * shards, resp_len=60), shards, depth)
    plans = plan_packing(lengths, ladder, shards)
    _check(plans, lengths, ladder, shards)
    assert plan_packing(np.zeros(0, np.int32), ladder, shards) == []
    with pytest.raises(ValueError, match="actor.pack_length"):
        plan_packing(np.asarray([65]), ladder, shards)


def test_a_row_takes_no_more_sequences_than_its_slots():
    ladder = shape_ladder(PackShape(rows=2, length=64, max_seqs=4, resp_len=8), 1, 2)  # 2 sequences a row
    lengths = np.full(9, 3)  # 27 tokens would fit one row; their slots need five
    plans = plan_packing(lengths, ladder, 1)
    _check(plans, lengths, ladder, 1)
    assert sum(shape.rows for shape, _ in plans) == 5


def test_the_seeds_lengths_fill_95_percent_of_the_padded_tokens():
    """The seed share on 4 devices: 512 prompts x 5, 4 mini-batches in the update (16k tokens a device a
    micro-batch), the log-prob passes over the whole batch at twice that; rows of 1,536 tokens."""
    from jaxrl_llm.bench.workload import gsm8k_prompt_lengths, seed_response_lengths

    prompts = gsm8k_prompt_lengths()
    shards, length = 4, 1536
    for seed in range(4):
        rng = np.random.default_rng(seed)
        lengths = np.repeat(prompts[rng.integers(0, len(prompts), 512)], 5) + seed_response_lengths(2560, seed)
        for budget, passes in ((16384, np.split(np.arange(2560), 4)), (32768, [np.arange(2560)])):
            per = budget // length
            ladder = shape_ladder(PackShape(per * shards, length, per * shards * (length // 8), 1024), shards, 4)
            real = padded = 0
            for idx in passes:
                plans = plan_packing(lengths[idx], ladder, shards)
                _check(plans, lengths[idx], ladder, shards)
                real, padded = real + lengths[idx].sum(), padded + padded_tokens(plans)
            assert real / padded >= 0.95, (seed, budget, real / padded)
