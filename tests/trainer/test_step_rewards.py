"""Scoring a step's responses: fast decoding gives the tokenizer's own text, chunked scoring equals one
call, extras line up with their responses, and the exposed time counts only scoring after the device
was done."""

import numpy as np
import pytest
import transformers

from jaxrl_llm.rewards import RewardManager
from jaxrl_llm.trainer.step_rewards import StepScorer, decode_responses


@pytest.fixture(scope="module")
def tokenizer(qwen2_tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(qwen2_tokenizer_dir)


def test_fast_decode_equals_batch_decode(tokenizer):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 151_000, size=int(n)).tolist() for n in rng.integers(1, 300, size=64)]
    seqs[0] += [151645, 151643]  # <|im_end|>, <|endoftext|>: special tokens are skipped by both
    seqs[1] = tokenizer("#### 42 ok, ünïcödé 数学", add_special_tokens=False)["input_ids"]
    assert decode_responses(tokenizer, seqs) == tokenizer.batch_decode(seqs, skip_special_tokens=True)


def _reward_with_extras(data_source, solution_str, ground_truth, extra_info=None):
    score = float(solution_str.strip().endswith(str(ground_truth)))
    return {"score": score, "acc": score, "length": len(solution_str)} if len(solution_str) % 2 else score


def test_chunked_scores_and_extras_equal_one_call(tokenizer):
    rng = np.random.default_rng(1)
    texts = [f"the answer is {i % 7}" + " x" * int(rng.integers(0, 5)) for i in range(40)]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    lengths = np.asarray([len(x) for x in ids])
    responses = np.zeros((len(ids), lengths.max()), np.int64)
    for i, x in enumerate(ids):
        responses[i, : len(x)] = x
    items = [{"data_source": "custom", "ground_truth": str(i % 3), "extra_info": {}} for i in range(40)]
    rewards = RewardManager(_reward_with_extras)
    mask = (np.arange(responses.shape[1])[None] < lengths[:, None]).astype(np.float32)
    got = StepScorer(tokenizer, rewards, chunk=7).score(items, responses, mask)
    want = rewards.score_batch(["custom"] * 40, texts, [it["ground_truth"] for it in items], [{}] * 40)
    np.testing.assert_array_equal(got.scores, want.scores)
    assert got.metrics == want.metrics
    assert got.extra_info.keys() == want.extra_info.keys() and got.extra_info == want.extra_info
    assert len(got.extra_info["acc"]) == 40 and got.exposed_s == 0.0


def test_multi_turn_responses_score_the_assistant_turns_alone(tokenizer):
    """Mask-0 spans (tool turns) never reach the reward; the assistant's turns are joined by newlines."""
    enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]
    turns, tool = [enc("I will call the tool."), enc("#### 42")], enc("<tool_response>#### 41</tool_response>")
    ids = np.asarray([turns[0] + tool + turns[1] + [0, 0]])
    mask = np.asarray([[1] * len(turns[0]) + [0] * len(tool) + [1] * len(turns[1]) + [0, 0]], np.float32)
    seen = []

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(solution_str)
        return 1.0

    StepScorer(tokenizer, RewardManager(reward)).score([{"data_source": "x", "ground_truth": "42"}], ids, mask)
    assert seen == ["I will call the tool.\n#### 42"]


def test_exposed_time_counts_scoring_after_the_device_is_done(tokenizer):
    items = [{"data_source": "openai/gsm8k", "ground_truth": "1"}] * 64
    responses = np.full((64, 50), 1000, np.int64)
    mask = np.ones((64, 50), np.float32)
    scorer = StepScorer(tokenizer, RewardManager(), chunk=8)
    busy = scorer.score(items, responses, mask, device_done=lambda: False)
    done = scorer.score(items, responses, mask, device_done=lambda: True)
    assert busy.exposed_s == 0.0 and done.exposed_s > 0.0
    calls = iter(range(100))
    half = scorer.score(items, responses, mask, device_done=lambda: next(calls) >= 4)  # done mid-way
    assert half.exposed_s > 0.0


def test_step_scored_by_worker_processes_equals_in_process(tmp_path):
    """`reward.num_workers = 2, reward.backend = 'process'` (the way to score in parallel on a host without
    Ray): the same step, metric for metric, as scoring in the trainer's process."""
    from jaxrl_llm.trainer.loop import RLTrainer
    from tests.trainer import runs

    out = {}
    for name, params in (("inproc", ()), ("procs", ("reward.num_workers=2", "reward.backend='process'"))):
        trainer = RLTrainer(runs.run_config("train.driver='inprocess'", *params, steps=1, run_dir=tmp_path / name))
        try:
            out[name] = trainer.train_step(next(trainer.iterator), 0)
        finally:
            trainer.worker.close_checkpointer()
            trainer.rewards.close()
    assert trainer.rewards._pool is None  # closed
    keys = [k for k in out["inproc"] if not k.startswith(runs.TIME_KEYS)]
    assert "critic/score/mean" in keys
    assert {k: out["procs"][k] for k in keys} == {k: out["inproc"][k] for k in keys}
