"""Random RL batches for the algorithm tests (mixed group sizes, empty rows, an all-equal group), and the
estimator tests' base class."""

from __future__ import annotations

import functools

import chex
import numpy as np

from jaxrl_llm.algorithms import AdvantageConfig

# The estimator tests' tolerance against the float64 references, and their seeds.
TOL = dict(rtol=1e-5, atol=1e-5)
SEEDS = [dict(testcase_name=f"seed{s}", seed=s) for s in range(3)]

# Groups of one, two and eight responses (and a second singleton and a triple), as the brief asks.
GROUP_SIZES = (1, 2, 8, 1, 3)


def random_batch(seed: int = 0, t: int = 6, group_sizes=GROUP_SIZES, num_empty_rows: int = 2) -> dict:
    """A float32 numpy batch with veRL's field names.

    Rows are shuffled so groups interleave, and group ids are arbitrary distinct ints in [0, B), not
    0..G-1. The 8-group has all-equal scores (0.1, which float32 cannot sum exactly). Some rows
    have an all-zero mask.
    """
    rng = np.random.default_rng(seed)
    b = sum(group_sizes)
    group_of_row = np.repeat(np.arange(len(group_sizes)), group_sizes)
    scores = rng.choice(np.array([0.0, 1.0, 0.5, -0.3, 2.0]), b)
    scores[group_of_row == group_sizes.index(8)] = 0.1
    labels = rng.choice(b, len(group_sizes), replace=False)
    perm = rng.permutation(b)
    index = labels[group_of_row][perm].astype(np.int32)
    scores = scores[perm]

    lengths = rng.integers(1, t + 1, b)
    lengths[rng.choice(b, num_empty_rows, replace=False)] = 0
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    outcome = np.zeros((b, t), np.float32)
    outcome[np.arange(b), np.maximum(lengths, 1) - 1] = scores  # the score sits on the last token

    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    old_log_prob = -np.abs(f32(b, t))
    return {
        "index": index,
        "response_mask": mask,
        "token_level_rewards": outcome,
        "dense_rewards": f32(b, t),
        "values": f32(b, t),
        "old_log_prob": old_log_prob,
        "log_prob": old_log_prob + 0.3 * f32(b, t),
        "ref_log_prob": old_log_prob + 0.3 * f32(b, t),
        "advantages": f32(b, t),
        "returns": f32(b, t),
    }


class EstimatorTest(chex.TestCase):
    """Base of the advantage-estimator tests: `_run` calls an estimator through the convention (config
    plus named inputs), under each chex variant, and checks the output shapes and dtypes."""

    def _run(self, fn, rewards, mask, config=None, **inputs):
        config = config or AdvantageConfig()
        adv, ret = self.variant(functools.partial(fn, config=config))(rewards, mask, **inputs)
        chex.assert_shape((adv, ret), np.shape(mask))
        chex.assert_type((adv, ret), np.float32)
        return np.asarray(adv), np.asarray(ret)
