"""DAPO in the loop: dynamic sampling (the group filter by hand, then the real trainer on the tiny demo,
including an exact resume after SIGKILL), overlong shaping of training scores, and the loop's inputs of
the estimators that need more than the score (REMAX's greedy baseline, GDPO's reward components), plus
every array of the forward passes reaching the batch."""


import numpy as np
import pytest

from jaxrl_llm.trainer.batch import TrainBatch
from jaxrl_llm.trainer.config import ConfigValueError, FilterGroupsSettings
from jaxrl_llm.trainer.dynamic_sampling import (
    GroupFilter,
    ScoredDraw,
    compute_filter_groups_mask,
    concat_draws,
    draw_seed,
    extra_info_fields,
    filter_metric_values,
)
from tests.trainer import runs

T, F = True, False


# ---- the group filter, by hand --------------------------------------------------------------------------
def test_mask_by_hand():
    values = [1, 1, 0, 1, 0, 0, 0, 0, 2, 2, 2, 2, 0.5, np.nan, 1]
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 4, 4]
    want = [T, T, T, T, F, F, F, F, F, F, F, F, T, F, F]  # a group of one is kept; a NaN drops its group
    assert compute_filter_groups_mask(np.array(values), np.array(groups)).tolist() == want


def test_mask_matches_a_std_reference_on_shuffled_groups():
    rng = np.random.default_rng(0)
    groups = rng.permutation(np.repeat(np.arange(50), 4))
    values = rng.integers(0, 2, 200).astype(float) * rng.choice([1.0, 1.0, 0.5], 200)
    got = compute_filter_groups_mask(values, groups)
    for g in range(50):
        vals = values[groups == g]
        assert (got[groups == g] == (np.std(vals.astype(np.float64)) > 0)).all()
    assert 0 < got.mean() < 1


def test_metric_values_from_scores_or_extra_info():
    scores = np.array([0.5, 1.0], np.float32)
    np.testing.assert_array_equal(filter_metric_values(scores, {}, "reward"), [0.5, 1.0])
    np.testing.assert_array_equal(filter_metric_values(scores, {"acc": [True, None]}, "acc"), [1.0, 0.0])
    with pytest.raises(ConfigValueError, match=r"algorithm.filter_groups.metric: 'acc' .*\['pred'\]"):
        filter_metric_values(scores, {"pred": ["1", "2"]}, "acc")
    with pytest.raises(ConfigValueError, match="algorithm.filter_groups.metric: 'acc' .*plain score"):
        filter_metric_values(scores, {}, "acc")
    with pytest.raises(ConfigValueError, match="not a number"):
        filter_metric_values(scores, {"pred": ["a", "b"]}, "pred")


def test_gdpo_fields_and_their_error():
    got = extra_info_fields({"acc": [1, 0], "fmt": [0.5, None]}, ("acc", "fmt"), binding="algorithm.gdpo_reward_keys",
                            prefix="score/")
    assert sorted(got) == ["score/acc", "score/fmt"] and got["score/fmt"].dtype == np.float32
    np.testing.assert_array_equal(got["score/fmt"], [0.5, 0.0])
    with pytest.raises(ConfigValueError, match=r"algorithm.gdpo_reward_keys: 'len' .*\['acc', 'fmt'\]"):
        extra_info_fields({"acc": [1], "fmt": [1]}, ("acc", "len"), binding="algorithm.gdpo_reward_keys",
                          prefix="score/")


def test_draw_seeds_are_pure_and_distinct():
    assert draw_seed(1, 7, 0) == 1 * 100003 + 7  # a run without filtering samples as before
    seeds = {draw_seed(1, s, d) for s in range(20) for d in range(10)}
    assert len(seeds) == 200 and draw_seed(1, 3, 2) == draw_seed(1, 3, 2) != draw_seed(2, 3, 2)
    assert all(0 <= x < 2 ** 31 for x in seeds)


def _draw(tag: int, scores, n=2) -> ScoredDraw:
    """A draw of len(scores) / n prompts; response i has the token 100 * tag + i, for tracing it."""
    r = len(scores)
    responses = (100 * tag + np.arange(r, dtype=np.int32))[:, None].repeat(2, 1)
    batch = TrainBatch(prompt_ids=[np.array([tag, i // n], np.int32) for i in range(r)], responses=responses,
                       response_mask=np.ones((r, 2), np.float32), group_ids=np.arange(r, dtype=np.int32) // n,
                       fields={"reward_baselines": np.full(r, tag, np.float32)})
    return ScoredDraw(batch, np.asarray(scores, np.float32), {"acc": list(scores)},
                      {"reward/num_errors": tag, "reward/num_nonfinite": 0})


def test_filter_keeps_earlier_draws_first_then_trims():
    groups = GroupFilter(FilterGroupsSettings(enable=True, metric="reward"), train_batch_size=3)
    groups.add(_draw(1, [0, 1, 1, 1, 0, 1]))  # keeps groups 0 and 2
    assert not groups.full
    groups.check_budget()  # no limit
    groups.add(_draw(2, [1, 0, 0, 1, 0, 0]))  # keeps groups 0 and 1
    assert groups.full
    out = groups.result()
    assert out.batch.responses[:, 0].tolist() == [100, 101, 104, 105, 200, 201]
    assert out.batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert [p.tolist() for p in out.batch.prompt_ids] == [[1, 0], [1, 0], [1, 2], [1, 2], [2, 0], [2, 0]]
    assert out.scores.tolist() == [0, 1, 0, 1, 1, 0] and out.extra_info["acc"] == [0, 1, 0, 1, 1, 0]
    assert out.batch.fields["reward_baselines"].tolist() == [1, 1, 1, 1, 2, 2]
    assert out.counts == {"reward/num_errors": 3, "reward/num_nonfinite": 0}  # every scored response counts
    assert groups.metrics() == {"train/num_gen_batches": 2, "training/filter_groups/evicted_samples": 2,
                                "training/filter_groups/discarded_surplus_samples": 1, "filter_groups/kept_groups": 4,
                                "filter_groups/kept_ratio": 4 / 6}


def test_concat_offsets_groups():
    out = concat_draws([_draw(1, [0, 1]), _draw(2, [0, 1, 1, 0])])
    assert out.batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2] and len(out.batch.prompt_ids) == 6


def test_budget_error_names_the_setting():
    groups = GroupFilter(FilterGroupsSettings(enable=True, metric="acc", max_num_gen_batches=2), train_batch_size=2)
    groups.add(_draw(1, [1, 1, 0, 0]))
    groups.check_budget()
    groups.add(_draw(2, [1, 1, 1, 1]))
    with pytest.raises(ConfigValueError, match=r"algorithm.filter_groups.max_num_gen_batches: 2 prompt batches .*"
                                               r"kept only 0 of the 2 groups"):
        groups.check_budget()


# ---- the loop on the tiny demo ----------------------------------------------------------------------------
REWARDS = '''
def parity(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the response starts with an even digit: about a third of random responses."""
    head = solution_str.strip()[:1]
    even = float(head != "" and head in "02468")
    return {"score": even, "acc": even, "len": float(len(solution_str))}


def digit(data_source, solution_str, ground_truth, extra_info=None):
    """The first digit of the response / 9 (0 without one): scores that differ between prompts."""
    head = solution_str.strip()[:1]
    return int(head) / 9 if head.isdigit() else 0.0


def constant(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 1.0, "acc": 1.0}


def one(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
'''

FILTER = ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric='acc'"]


@pytest.fixture
def reward(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return lambda name: [f"reward.custom_reward_path='{path}'", f"reward.custom_reward_name='{name}'"]


def _trainer(*params, run_dir, steps=2):
    from jaxrl_llm.trainer.loop import RLTrainer

    return RLTrainer(runs.run_config(*params, steps=steps, run_dir=run_dir))


def _batch(run_dir, step) -> TrainBatch:
    with np.load(run_dir / "batches" / f"step_{step:06d}.npz") as f:
        return TrainBatch.from_arrays(dict(f))


def test_dynamic_sampling_fills_the_batch_with_varied_groups(tmp_path, reward):
    d = tmp_path / "run"
    trainer = _trainer(*reward("parity"), *FILTER, "train.dump_batches=True", run_dir=d, steps=4)
    trainer.fit()
    rows = runs.metrics(d)
    draws = [r["train/num_gen_batches"] for r in rows]
    assert max(draws) > 1  # some step drew more than one prompt batch
    it = trainer.iterator
    assert it.epoch * it.steps_per_epoch + it.position == sum(draws)  # the iterator served every draw
    for r in rows:
        assert r["training/filter_groups/evicted_samples"] + r["filter_groups/kept_groups"] == 8 * r[
            "train/num_gen_batches"]
        assert r["training/filter_groups/discarded_surplus_samples"] == r["filter_groups/kept_groups"] - 8
    for step in range(4):
        batch = _batch(d, step)
        assert batch.group_ids.tolist() == np.repeat(np.arange(8), 4).tolist()  # exactly 8 prompts x n = 4
        scores = batch.fields["token_level_scores"].sum(-1)
        for g in range(8):
            assert np.ptp(scores[batch.group_ids == g]) > 0  # every kept group's acc varies
        # every array of the forward passes is in the batch (the old log-probs and their entropy here)
        assert {"old_log_prob", "entropy"} <= set(batch.fields)


def test_filter_metric_the_reward_does_not_return_is_one_clear_error(tmp_path, reward):
    trainer = _trainer(*reward("one"), *FILTER, run_dir=tmp_path / "run")
    with pytest.raises(ConfigValueError, match=r"algorithm.filter_groups.metric: 'acc' is not a key"):
        trainer.train_step(next(trainer.iterator), 0)


def test_max_num_gen_batches_stops_with_one_clear_error(tmp_path, reward):
    trainer = _trainer(*reward("constant"), *FILTER, "algorithm.filter_groups.max_num_gen_batches=3",
                       run_dir=tmp_path / "run")
    with pytest.raises(ConfigValueError, match="algorithm.filter_groups.max_num_gen_batches: 3 prompt batches"):
        trainer.train_step(next(trainer.iterator), 0)
    it = trainer.iterator
    assert it.epoch * it.steps_per_epoch + it.position == 3
    out = runs.run(tmp_path / "cli", *reward("constant"), *FILTER, "algorithm.filter_groups.max_num_gen_batches=2",
                   steps=2)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "algorithm.filter_groups.max_num_gen_batches: 2 prompt batches" in out.stderr.strip().splitlines()[-1]


STEPS = 6


def test_dynamic_sampling_resumes_exactly_after_sigkill(tmp_path, reward):
    """Extra prompt batches move the iterator; its checkpointed state and the per-draw seeds make a resumed
    run draw, sample and train exactly what the uninterrupted one did."""
    params = [*reward("parity"), *FILTER, "train.save_freq=1"]
    ref_dir = tmp_path / "reference"
    out = runs.run(ref_dir, *params, steps=STEPS)
    assert out.returncode == 0, out.stderr[-3000:]
    reference = runs.by_step(runs.metrics(ref_dir))
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert sum(reference[s]["train/num_gen_batches"] > 1 for s in reference) >= 2  # the test has teeth
    resumed = runs.kill_then_resume(tmp_path / "run", *params, steps=STEPS, kill_after=(2, 4))
    for step in range(1, STEPS + 1):
        assert resumed[step] == reference[step], f"step {step} differs after a resume"


def test_overlong_penalty_shapes_training_scores(tmp_path, reward):
    ob = "reward.reward_kwargs.overlong_buffer_cfg"
    d = tmp_path / "run"
    trainer = _trainer(*reward("one"), f"{ob}.enable=True", f"{ob}.len=2", f"{ob}.penalty_factor=0.5",
                       f"{ob}.log=True", "train.dump_batches=True", run_dir=d)
    m = trainer.train_step(next(trainer.iterator), 0)
    batch = _batch(d, 0)
    lengths = batch.response_lengths
    # max_response_length 3, buffer 2: one token is free, then -0.25 a token
    penalty = np.array([min(-(n - 1) / 2 * 0.5, 0.0) for n in lengths.tolist()])
    np.testing.assert_allclose(batch.fields["token_level_scores"].sum(-1), 1.0 + penalty, atol=1e-7)
    assert m["reward/overlong_reward/mean"] == pytest.approx(penalty.mean())
    assert m["reward/overlong/mean"] == pytest.approx(np.mean(penalty < 0))
    assert m["critic/score/mean"] == pytest.approx(1.0 + penalty.mean(), abs=1e-6) and penalty.min() < 0


def test_remax_baseline_is_each_prompts_greedy_score(tmp_path, reward):
    from jaxrl_llm.rewards import load_custom_reward_fn
    from jaxrl_llm.rollout import SamplingParams
    from jaxrl_llm.trainer import metrics as M
    from jaxrl_llm.trainer.step_rewards import decode_responses

    d = tmp_path / "run"
    trainer = _trainer(*reward("digit"), "algorithm.adv_estimator='remax'", "train.dump_batches=True", run_dir=d)
    prompts = next(trainer.iterator)
    timer = M.Timer()
    scored = trainer.score_rollout(trainer.rollout(prompts, 0, 0, timer))
    greedy = trainer.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=3))
    texts = decode_responses(trainer.tokenizer, [greedy.response_ids(i) for i in range(len(greedy))])
    fn = load_custom_reward_fn(str(tmp_path / "rewards.py"), "digit")
    by_prompt = np.array([fn("arithmetic", t, prompts[i]["ground_truth"]) for t, i in zip(texts, greedy.prompt_index)])
    baselines = scored.batch.fields["reward_baselines"]
    assert baselines.dtype == np.float32 and baselines.shape == (32,)
    np.testing.assert_allclose(baselines, by_prompt[scored.batch.group_ids].astype(np.float32))
    assert len(set(by_prompt.tolist())) > 1  # greedy scores differ between prompts: the test has teeth
    assert "gen_max" in timer.times
    m = trainer.train_step(prompts, 0)
    assert np.isfinite(m["actor/pg_loss"]) and m["timing_s/gen_max"] > 0
    np.testing.assert_allclose(_batch(d, 0).fields["reward_baselines"], by_prompt[scored.batch.group_ids])


def test_gdpo_gets_each_reward_component(tmp_path, reward):
    d = tmp_path / "run"
    gdpo = ["algorithm.adv_estimator='gdpo'", "algorithm.gdpo_reward_keys=('acc', 'len')"]
    trainer = _trainer(*reward("parity"), *gdpo, "train.dump_batches=True", run_dir=d)
    m = trainer.train_step(next(trainer.iterator), 0)
    assert np.isfinite(m["actor/pg_loss"])
    batch = _batch(d, 0)
    lengths = [len(t) for t in trainer.tokenizer.batch_decode(
        [batch.responses[i, :n] for i, n in enumerate(batch.response_lengths)], skip_special_tokens=True)]
    np.testing.assert_array_equal(batch.fields["score/len"], np.float32(lengths))
    np.testing.assert_array_equal(batch.fields["score/acc"], batch.fields["token_level_scores"].sum(-1))
    bad = _trainer(*reward("parity"), "algorithm.adv_estimator='gdpo'", "algorithm.gdpo_reward_keys=('acc', 'fmt')",
                   run_dir=tmp_path / "bad")
    with pytest.raises(ConfigValueError, match=r"algorithm.gdpo_reward_keys: 'fmt' .*\['acc', 'len'\]"):
        bad.train_step(next(bad.iterator), 0)
