"""Validation beyond mean@1: veRL's bootstrap metrics and their val-core / val-aux split, pass@k, by hand
and against a float64 loop reference; then the loop's `validate()` on the tiny demo with val_n > 1."""

import dataclasses
import math
from collections import defaultdict

import numpy as np
import pytest

from jaxrl_llm.trainer.config import OverlongBufferSettings
from jaxrl_llm.trainer.validation import (
    ValidationResults,
    bootstrap_indices,
    compute_pass_at_k,
    compute_validation_metrics,
    pass_at_k_sizes,
    subset_sizes,
)


# ---- a float64 reference: plain loops over prompts and bootstrap rows, numpy's global generator ----------
def _reference(sources, uids, infos, seed=42, n_boot=1000):
    out = {}
    by_src = defaultdict(lambda: defaultdict(list))
    for i, (s, u) in enumerate(zip(sources, uids)):
        by_src[s][u].append(i)
    for src, prompts in by_src.items():
        per = defaultdict(lambda: defaultdict(list))  # var -> metric -> [value per prompt]
        for idx in prompts.values():
            for var, vals in infos.items():
                xs = [float(vals[i]) for i in idx if vals[i] is not None and not isinstance(vals[i], str)]
                if not xs:
                    continue
                preds = [infos["pred"][i] for i in idx] if "pred" in infos else None
                voting = preds is not None and len(preds) == len(xs) and None not in preds
                n = len(xs)
                per[var][f"mean@{n}"].append(sum(xs) / n)
                if n == 1:
                    continue
                per[var][f"std@{n}"].append(float(np.std(xs)))
                sizes, m = [], 2
                while m < n:
                    sizes.append(m)
                    m *= 2
                for m in sizes + [n]:
                    np.random.seed(seed)
                    rows = np.random.choice(n, size=(n_boot, m), replace=True)
                    best = [max(xs[j] for j in row) for row in rows]
                    worst = [min(xs[j] for j in row) for row in rows]
                    for name, v in (("best", best), ("worst", worst)):
                        per[var][f"{name}@{m}/mean"].append(float(np.mean(v)))
                        per[var][f"{name}@{m}/std"].append(float(np.std(v)))
                    if voting:
                        maj = []
                        for row in rows:
                            seen = {}  # vote -> [count, value of its first response]
                            for j in row:
                                seen.setdefault(preds[j], [0, xs[j]])[0] += 1
                            top = max(c for c, _ in seen.values())
                            maj.append(next(v for c, v in seen.values() if c == top))
                        per[var][f"maj@{m}/mean"].append(float(np.mean(maj)))
                        per[var][f"maj@{m}/std"].append(float(np.std(maj)))
        core_var = "acc" if "acc" in per else "reward"
        for var, metrics in per.items():
            top = max(int(k.split("@")[1].split("/")[0]) for k in metrics)
            for name, vals in metrics.items():
                n = int(name.split("@")[1].split("/")[0])
                core = var == core_var and name.split("@")[0] in ("mean", "best", "maj") and n == top
                out[f"{'val-core' if core else 'val-aux'}/{src}/{var}/{name}"] = float(np.mean(vals))
        if max(len(idx) for idx in prompts.values()) > 1:
            ks = defaultdict(list)
            for idx in prompts.values():
                if "acc" in infos:
                    c = sum(float(infos["acc"][i] or 0) > 0.5 for i in idx)
                else:
                    c = sum(float(infos["reward"][i]) > 0.5 for i in idx)
                n = len(idx)
                k_all = sorted({2 ** e for e in range(n) if 2 ** e <= n} | {n})
                for k in k_all:
                    ks[k].append(1 - math.comb(n - c, k) / math.comb(n, k))
            out.update({f"val-core/{src}/reward/pass@{k}": float(np.mean(v)) for k, v in ks.items()})
    out["val-core/mean"] = float(np.mean(np.asarray(infos["reward"], np.float64)))
    return out


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-12), k


# ---- pure functions, by hand -------------------------------------------------------------------------
def test_sizes():
    assert subset_sizes(1) == [] and subset_sizes(2) == [2] and subset_sizes(4) == [2, 4]
    assert subset_sizes(5) == [2, 4, 5] and subset_sizes(16) == [2, 4, 8, 16]
    assert pass_at_k_sizes(1) == [1] and pass_at_k_sizes(4) == [1, 2, 4] and pass_at_k_sizes(6) == [1, 2, 4, 6]


@pytest.mark.parametrize("n,c,k,want", [(4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 1, 4, 1.0), (4, 0, 2, 0.0),
                                        (5, 2, 2, 0.7), (4, 4, 1, 1.0), (8, 3, 4, 1 - 5 / 70)])
def test_pass_at_k_by_hand(n, c, k, want):
    assert compute_pass_at_k(n, c, k) == pytest.approx(want, abs=1e-15)
    assert compute_pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-15)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError, match="pass@k"):
        compute_pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="pass@k"):
        compute_pass_at_k(4, 1, 5)


def test_bootstrap_draws_are_veRLs():
    np.random.seed(42)
    want = np.random.choice(5, size=(1000, 3), replace=True)
    np.testing.assert_array_equal(bootstrap_indices(5, 3), want)


def test_val_n_1_is_mean_at_1_as_before():
    got = compute_validation_metrics(["a", "a", "b"], [0, 1, 2], {"reward": [1.0, 0.0, 0.5]})
    assert got == {"val-core/a/reward/mean@1": 0.5, "val-core/b/reward/mean@1": 0.5, "val-core/mean": 0.5}


def test_constant_prompts_by_hand():
    got = compute_validation_metrics(["s"] * 4, [0, 0, 1, 1], {"reward": [1.0, 1.0, 0.0, 0.0]})
    assert got["val-core/s/reward/mean@2"] == 0.5 and got["val-aux/s/reward/std@2"] == 0.0
    assert got["val-core/s/reward/best@2/mean"] == 0.5 and got["val-core/s/reward/best@2/std"] == 0.0
    assert got["val-aux/s/reward/worst@2/mean"] == 0.5 and got["val-aux/s/reward/worst@2/std"] == 0.0
    assert got["val-core/s/reward/pass@1"] == 0.5 and got["val-core/s/reward/pass@2"] == 0.5


def test_best_of_two_of_a_coin():
    """[0, 1]: a subset of 2 drawn with replacement holds a 1 with probability 3/4 (and no 0 with 1/4)."""
    got = compute_validation_metrics(["s", "s"], [0, 0], {"reward": [0.0, 1.0]})
    assert got["val-core/s/reward/best@2/mean"] == pytest.approx(0.75, abs=0.04)
    assert got["val-aux/s/reward/worst@2/mean"] == pytest.approx(0.25, abs=0.04)
    assert got["val-core/s/reward/pass@1"] == 0.5 and got["val-core/s/reward/pass@2"] == 1.0


def test_acc_is_the_core_variable_and_decides_pass_at_k():
    infos = {"reward": [0.9, 0.9, 0.1, 0.1], "acc": [False, False, True, False]}
    got = compute_validation_metrics(["s"] * 4, [0] * 4, infos)
    assert got["val-core/s/acc/mean@4"] == 0.25 and "val-aux/s/reward/mean@4" in got
    assert not any(k.startswith("val-core/s/reward/mean") for k in got)
    assert got["val-core/s/reward/pass@1"] == 0.25  # acc decides, not the score > 0.5


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_against_the_float64_reference(n):
    rng = np.random.default_rng(n)
    prompts = 7
    sources = [("a" if p % 3 else "b") for p in range(prompts) for _ in range(n)]
    uids = [p for p in range(prompts) for _ in range(n)]
    reward = rng.integers(0, 2, prompts * n).astype(float) + rng.choice([0.0, 0.25], prompts * n)
    preds = [str(x) for x in rng.integers(0, 3, prompts * n)]
    length = rng.integers(1, 50, prompts * n).tolist()
    length[3] = None  # a response without the key is left out of that variable
    infos = {"reward": reward.tolist(), "pred": preds, "length": length}
    _assert_same(compute_validation_metrics(sources, uids, infos), _reference(sources, uids, infos))
    assert f"val-core/a/reward/maj@{n}/mean" in _reference(sources, uids, infos)


def test_results_accumulate_chunks_with_different_keys():
    res = ValidationResults()
    res.add(["s", "s"], [0, 0], np.array([1.0, 0.0]), {"acc": [True, False]})
    res.add(["s", "s"], [1, 1], np.array([0.0, 0.0]), {})
    assert res.infos == {"reward": [1.0, 0.0, 0.0, 0.0], "acc": [True, False, None, None]}
    got = res.metrics()
    assert got["val-core/s/acc/mean@2"] == 0.5  # the second prompt has no acc: only the first counts
    assert got["val-core/mean"] == 0.25


# ---- the loop ------------------------------------------------------------------------------------------
# A custom reward with partial credit and a prediction: 1.0 when the response starts with an even digit.
REWARD = '''
def first_digit(data_source, solution_str, ground_truth, extra_info=None):
    head = solution_str.strip()[:1]
    return {"score": float(head != "" and head in "02468"), "pred": head}
'''


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "first_digit.py"
    path.write_text(REWARD)
    return [f"reward.custom_reward_path='{path}'", "reward.custom_reward_name='first_digit'"]


def test_validate_with_val_n_equals_a_recomputation(tmp_path, reward_file):
    from jaxrl_llm.rewards import load_custom_reward_fn
    from jaxrl_llm.trainer.loop import RLTrainer
    from jaxrl_llm.trainer.step_rewards import decode_responses
    from tests.trainer import runs

    trainer = RLTrainer(runs.run_config(*reward_file, "rollout.val_n=4", "rollout.val_temperature=1.0",
                                        run_dir=tmp_path / "run"))
    got = trainer.validate()
    items = [trainer.val_data[i] for i in range(len(trainer.val_data))]
    rollout = trainer.generate(items, trainer.sampling(0, validate=True))
    assert len(rollout) == 4 * len(items)
    texts = decode_responses(trainer.tokenizer, [rollout.response_ids(i) for i in range(len(rollout))])
    fn = load_custom_reward_fn(reward_file[0].split("'")[1], "first_digit")
    out = [fn("arithmetic", t, items[p]["ground_truth"]) for t, p in zip(texts, rollout.prompt_index)]
    infos = {"reward": [o["score"] for o in out], "pred": [o["pred"] for o in out]}
    sources = ["arithmetic"] * len(out)
    _assert_same(got, _reference(sources, rollout.prompt_index.tolist(), infos))
    for key in ("mean@4", "best@4/mean", "best@4/std", "maj@4/mean", "maj@4/std", "pass@1", "pass@2", "pass@4"):
        assert f"val-core/arithmetic/reward/{key}" in got, key
    for key in ("std@4", "worst@4/mean", "best@2/mean", "maj@2/mean"):
        assert f"val-aux/arithmetic/reward/{key}" in got, key
    assert 0 < got["val-core/arithmetic/reward/mean@4"] < 1  # sampled responses differ: the test has teeth
    assert got["val-core/arithmetic/reward/pass@1"] == pytest.approx(got["val-core/arithmetic/reward/mean@4"])


def test_val_n_1_keys_are_as_before(tmp_path):
    from jaxrl_llm.trainer.loop import RLTrainer
    from tests.trainer import runs

    got = RLTrainer(runs.run_config(run_dir=tmp_path / "run")).validate()
    assert sorted(got) == ["val-core/arithmetic/reward/mean@1", "val-core/mean"]


def test_validation_scores_carry_the_overlong_penalty(tmp_path, reward_file):
    """veRL's DAPO reward manager shapes validation scores too; with `log` its extras are val-aux metrics."""
    from jaxrl_llm.trainer.loop import RLTrainer
    from tests.trainer import runs

    ob = "reward.reward_kwargs.overlong_buffer_cfg"
    trainer = RLTrainer(runs.run_config(*reward_file, f"{ob}.enable=True", f"{ob}.len=2", f"{ob}.log=True",
                                        run_dir=tmp_path / "run"))
    shaped = trainer.validate()
    trainer.run = dataclasses.replace(trainer.run, overlong_buffer=OverlongBufferSettings(enable=False))
    plain = trainer.validate()
    penalty = shaped["val-aux/arithmetic/overlong_reward/mean@1"]
    assert penalty < 0 and "val-aux/arithmetic/overlong/mean@1" in shaped
    assert shaped["val-core/arithmetic/reward/mean@1"] == pytest.approx(
        plain["val-core/arithmetic/reward/mean@1"] + penalty, abs=1e-6)


def test_fit_logs_val_n_metrics(tmp_path):
    from jaxrl_llm.trainer.loop import RLTrainer
    from tests.trainer import runs

    run = runs.run_config("rollout.val_n=4", "rollout.val_temperature=1.0", "train.val_before_train=True",
                          "train.test_freq=2", steps=2, run_dir=tmp_path / "run")
    RLTrainer(run).fit()
    rows = runs.metrics(tmp_path / "run")
    val_rows = [r for r in rows if "val-core/mean" in r]
    assert [r["step"] for r in val_rows] == [0, 2]
    for r in val_rows:
        for key in ("mean@4", "best@4/mean", "pass@1", "pass@4"):
            assert f"val-core/arithmetic/reward/{key}" in r, key
        assert not any(k.endswith("mean@1") for k in r)
