"""The rollout stream (rollout/stream.py): the paged engine running continuously for fully asynchronous training.
Groups come back as they finish with the tokens `generate` gives; new weights are taken at a decode boundary
with the running rows' K/V kept or recomputed, and every token records the version that sampled it; a pause
hands back the rows in flight, and resubmitting them resumes them exactly."""

from __future__ import annotations

import queue
import time
import types

import jax
import numpy as np
import pytest

from jaxrl_llm import sharding
from jaxrl_llm.rollout import JaxEngine, SamplingParams
from jaxrl_llm.rollout.stream import RolloutStream

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42], [20, 21, 22, 23]]
LONG = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, ignore_eos=True)


def engine(model, params=None, data: int = 2, **kw):
    cfg, base = model
    mesh = sharding.make_mesh(data, 1, 1, devices=jax.devices()[:data])
    kw = {"max_prompt_length": 56, **kw}
    return JaxEngine(cfg, base if params is None else params, dtype="float32", page_size=4, max_model_len=64,
                     max_segment=4, free_cache_engine=False, mesh=mesh, **kw)


def wait_for_rows(stream: RolloutStream, tokens: int, timeout_s: float = 120.0, poll_s: float = 0.005) -> None:
    """Waits until some row of the stream has `tokens` tokens, and fails the test after `timeout_s`: a stream
    whose thread died (or never starts a row) would otherwise spin this loop, and CI with it, forever."""
    deadline = time.monotonic() + timeout_s
    while stream.store.lengths.max() < tokens:
        if time.monotonic() > deadline:
            pytest.fail(f"no row of the stream reached {tokens} tokens in {timeout_s:.0f} s "
                        f"(longest: {int(stream.store.lengths.max())}): the stream is dead or stuck")
        time.sleep(poll_s)


def collect(q: queue.Queue, count: int) -> dict:
    out = {}
    while len(out) < count:
        r = q.get(timeout=120)
        out[r.meta] = r
    return out


def perturbed(params, seed: int = 1):
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(params))))
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), params)


def test_a_dead_stream_fails_the_wait_within_its_deadline():
    """A stream whose rows never grow (its thread died) fails `wait_for_rows` at the deadline, not never."""
    dead = types.SimpleNamespace(store=types.SimpleNamespace(lengths=np.zeros(4, np.int32)))
    with pytest.raises(pytest.fail.Exception, match="no row of the stream reached 3 tokens"):
        wait_for_rows(dead, 3, timeout_s=0.2)


def test_groups_come_back_as_they_finish_with_the_tokens_of_generate(model):
    ref = engine(model).generate(PROMPTS, LONG.replace(temperature=1.0, seed=3),
                                 max_new_tokens_per_row=[5, 40] * 5)
    eng = engine(model)
    q = queue.Queue()
    stream = RolloutStream(eng, LONG.replace(temperature=1.0), capacity=3, on_group=q.put)
    stream.submit(PROMPTS, list(range(5)), seed=3, max_new_tokens_per_row=[5, 40] * 5)  # waits for room: 3 at once
    got = collect(q, 5)
    stream.close()
    for i in range(5):
        r = got[i]
        np.testing.assert_array_equal(r.lengths, ref.lengths[2 * i: 2 * i + 2])
        for j in range(2):
            np.testing.assert_array_equal(r.tokens[j, : r.lengths[j]], ref.tokens[2 * i + j, : r.lengths[j]])
            np.testing.assert_allclose(r.logprobs[j, : r.lengths[j]], ref.logprobs[2 * i + j, : r.lengths[j]],
                                       atol=2e-5)
        mask = np.arange(r.tokens.shape[1])[None, :] < r.lengths[:, None]
        assert np.all(r.versions[mask] == eng.version) and not r.partial


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_new_weights_are_taken_at_a_boundary_and_each_token_keeps_its_version(model, kv):
    """Rows running at the swap continue with the new weights. Recompute: each row's tokens after the swap are
    version B's greedy continuation of its prompt and its tokens before (its K/V recomputed by B). Keep: the
    K/V before the swap stays version A's; the tokens before the swap are A's greedy tokens either way."""
    cfg, base = model
    other = perturbed(base)
    a, b = engine(model), engine(model, other)
    ref_a = a.generate(PROMPTS, LONG)
    eng = engine(model)
    q = queue.Queue()
    stream = RolloutStream(eng, LONG, capacity=8, on_group=q.put, kv=kv)
    stream.submit(PROMPTS, list(range(5)), seed=0)
    wait_for_rows(stream, 3)  # swap once a row has started
    v0 = eng.version
    stream.stage_weights(other, version=v0 + 1)
    stream.wait_swapped()
    got = collect(q, 5)
    stream.close()
    assert eng.version == v0 + 1 and stream.swaps == 1
    partial = 0
    after_swap = []  # (B's prompt: the prompt and the row's tokens before the swap, budget left, tokens after)
    for i, prompt in enumerate(PROMPTS):
        r = got[i]
        for j in range(2):
            v = r.versions[j, : r.lengths[j]]
            k = int((v == v0).sum())  # tokens sampled before the swap
            assert np.all(v[:k] == v0) and np.all(v[k:] == v0 + 1)
            partial += 0 < k < r.lengths[j]
            np.testing.assert_array_equal(r.tokens[j, :k], ref_a.tokens[2 * i + j, :k])
            if k < r.lengths[j]:
                after_swap.append((prompt + r.tokens[j, :k].tolist(), LONG.max_new_tokens - k, r.tokens[j, k:]))
    assert partial > 0
    if kv == "recompute":
        # B's greedy continuations of every row in one call, each capped at the budget its row had left (a
        # call a row compiled a fresh set of programs each; greedy rows do not depend on each other).
        cont = b.generate([p for p, _, _ in after_swap], LONG.replace(n=1),
                          max_new_tokens_per_row=[left for _, left, _ in after_swap])
        for row, (_, left, tokens) in enumerate(after_swap):
            assert cont.lengths[row] == left
            np.testing.assert_array_equal(tokens, cont.tokens[row, :left])
    assert (stream.recomputed > 0) == (kv == "recompute")


def test_rows_recomputed_past_the_longest_prompt_run_on_programs_built_ahead(model):
    """After a swap, a recomputed row prefills its prompt and every token it has (here past the 16 tokens of the
    longest prompt): the engine's programs, built ahead for its ladders, cover it, so the swap compiles
    nothing (a fully async run's partial rollouts do this at every sync)."""
    cfg, base = model
    eng = engine(model, max_prompt_length=16, warm_programs=True)
    other = perturbed(base)
    eng.convert(other)  # its conversion programs compiled now, so the rows are still running at the swap
    q = queue.Queue()
    stream = RolloutStream(eng, LONG, capacity=8, on_group=q.put, kv="recompute")
    stream.submit(PROMPTS, list(range(5)), seed=0)
    programs = eng._programs_for()
    wait_for_rows(stream, 14, poll_s=0.002)  # a row is past 16 tokens of context (its prompt has 2 to 11)
    before = dict(programs.stats)
    stream.stage_weights(other, version=eng.version + 1)
    stream.wait_swapped()
    got = collect(q, 5)
    stream.close()
    assert stream.recomputed > 0 and len(got) == 5
    assert programs.stats["compiled"] == before["compiled"], (before, programs.stats)


def test_a_paused_stream_hands_back_its_rows_and_resubmitting_them_resumes_them_exactly(model):
    ref = engine(model).generate(PROMPTS, LONG)
    eng = engine(model)
    q = queue.Queue()
    stream = RolloutStream(eng, LONG, capacity=8, on_group=q.put)
    stream.submit(PROMPTS, list(range(5)), seed=0)
    wait_for_rows(stream, 6)
    snap = stream.pause()
    assert len(snap["metas"]) > 0 and snap["lengths"].max() >= 6
    stream.resume()
    done = collect(q, 5)
    stream.close()
    again = RolloutStream(engine(model), LONG, capacity=8, on_group=q.put)
    idx = [PROMPTS.index(p) for p in snap["prompts"]]
    again.submit(snap["prompts"], [("again", i) for i in idx], seed=0,
                 streams=np.concatenate([[2 * i, 2 * i + 1] for i in idx]), partial=snap)
    resumed = collect(q, len(idx))
    again.close()
    for i in idx:
        r = resumed[("again", i)]
        np.testing.assert_array_equal(r.lengths, done[i].lengths)
        np.testing.assert_array_equal(r.tokens, done[i].tokens)
        np.testing.assert_array_equal(r.tokens[0, : r.lengths[0]], ref.tokens[2 * i, : r.lengths[0]])
