"""The `async_longtail` benchmark section on simulated CPU devices: each mode trains on the same heavy-tailed
response lengths (EOS off, so every row runs to its drawn length, the stream's rows too) and the summary compares
it with the synchronous step; a split that does not fit is one clear error."""

import gc
import json
import os
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from jaxrl_llm.bench.async_rl import plan_devices, run_mode, summarize
from tests.trainer import runs


def test_every_mode_runs_the_same_long_tail_and_is_compared_with_sync(tmp_path):
    """The CLI, in a process of its own, compiled as the pytest process compiles (unoptimised): on the demo's
    16-token vocabulary a mode's one step is mostly compiling (the generation of up to 64 tokens a row took 25 s of
    the sync step on Qwen2's vocabulary, so the test ran at XLA's default level then: 100-180 s of CI)."""
    out = subprocess.run(
        [sys.executable, "-m", "jaxrl_llm.bench", "--sections", "async_longtail", "--small", "--steps", "1",
         "--rollout_gpus", "1", "--train_gpus", "1", "--async_modes", "sync,fully_async", "--out", str(tmp_path)],
        cwd=runs.REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "bench.json").read_text())["results"]
    steps = {(r["mode"], r["step"]): r for r in rows if r["section"] == "async_longtail"}
    assert sorted(steps) == [("fully_async", 0), ("sync", 0)], out.stderr[-3000:]
    for mode in ("sync", "fully_async"):  # the tail reaches the cap (64), most rows are far shorter
        assert steps[mode, 0]["response_max"] == 64 and steps[mode, 0]["response_mean"] < 32, steps[mode, 0]
    assert steps["sync", 0]["devices"] == 2 and steps["fully_async", 0]["rollout_gpus"] == 1
    # step 0 compiles the step's programs, and each row names the slowest ('jit_step 1.23s')
    assert steps["sync", 0]["compile_s"] > 0 and all(" " in p for p in steps["sync", 0]["compiled"])
    assert len(steps["sync", 0]["compiled"]) == 5
    summary = {r["mode"]: r for r in rows if r["section"] == "async_longtail_summary"}
    for mode in ("sync", "fully_async"):  # one compiling step a mode: no steady figure, and no ratio
        assert summary[mode]["steady_steps"] == 0 and summary[mode]["vs_sync"] is None, summary[mode]
        assert "no steady step" in summary[mode]["note"]


def test_modes_run_in_separate_calls_are_summarized_against_sync():
    """At cap 8,192 a mode takes about a call: the summary joins the rows of several runs, each mode against the
    sync of the same preset, lengths and device count, over the steps from 2 on."""
    def rows(mode, rates, devices=4):
        return [dict(section="async_longtail", preset="p", lengths="long", devices=devices, mode=mode, step=i,
                     rollout_gpus=0 if mode == "sync" else 2, samples_per_s=x, wait_share=0.1 * i, wall_s=100 / x)
                for i, x in enumerate(rates)]

    out = summarize(rows("sync", [1.0, 9.0, 10.0, 12.0, 11.0]) + rows("fully_async", [2.0, 5.0, 20.0, 22.0, 24.0])
                    + rows("fully_async", [1.0, 1.0, 7.0], devices=2))
    got = {(r["mode"], r["devices"]): r for r in out}
    assert got["sync", 4]["samples_per_s"] == 11.0 and got["sync", 4]["vs_sync"] == 1.0
    assert got["fully_async", 4]["vs_sync"] == 2.0 and got["fully_async", 4]["steady_steps"] == 3
    assert got["fully_async", 4]["wait_share"] == pytest.approx(0.3) and got["fully_async", 2]["vs_sync"] is None


def test_no_ratio_is_computed_without_steady_steps_in_both_modes():
    """One sync step (compiling) against fully_async's steady steps printed vs_sync 3.23x: a mode without a step
    from 2 on gets no figures, and no mode gets a ratio against it; the note says why."""
    def rows(mode, rates):
        return [dict(section="async_longtail", preset="p", lengths="long", devices=4, mode=mode, step=i,
                     rollout_gpus=0 if mode == "sync" else 2, samples_per_s=x, wait_share=0.1, wall_s=100 / x)
                for i, x in enumerate(rates)]

    got = {r["mode"]: r for r in summarize(rows("sync", [3.0]) + rows("fully_async", [2.0, 5.0, 9.7, 9.7]))}
    assert got["sync"]["steady_steps"] == 0 and got["sync"]["samples_per_s"] is None
    assert got["sync"]["vs_sync"] is None and "no steady step" in got["sync"]["note"]
    assert got["fully_async"]["samples_per_s"] == 9.7 and got["fully_async"]["vs_sync"] is None
    assert "sync has none" in got["fully_async"]["note"]
    alone = summarize(rows("fully_async", [2.0, 5.0, 9.7]))[0]
    assert alone["vs_sync"] is None and "no sync run" in alone["note"]


def test_the_device_split_defaults_to_halves_and_one_that_does_not_fit_is_one_clear_error():
    assert plan_devices(None, None, 4) == (2, 2) and plan_devices(1, None, 4) == (1, 3)
    for rollout, train in ((6, 4), (4, None)):
        with pytest.raises(ValueError, match=r"--rollout_gpus \d --train_gpus \d: need at least one each"):
            plan_devices(rollout, train, 4)


def _live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def test_a_finished_async_mode_leaves_the_devices_as_it_found_them(own_rows):
    """The modes run one after the other in one process, and each engine sizes its KV pool from the memory free
    when it starts: a closed async trainer frees its rollout engine's pool and weights, and nothing of the mode
    stays on a device (on 2×H200 the fully_async mode found 116 GiB of one_step_off's pool still held)."""
    opts = types.SimpleNamespace(small=True, steps=4, remat="full", token_budget=2048, prompts_per_gpu=4,
                                 long_cap=64, staleness=0.5, async_lengths="long")
    before = _live_bytes()
    rows = run_mode(opts, "tiny", "one_step_off", 2, 1)
    assert len(rows) == 4 and rows[0]["samples"] > 0
    # One step off to the end: each batch after the first was generated while the step before it trained (the
    # run's length is the benchmark's, not make_run's default of 3, past which the steps turned synchronous).
    assert [r["staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert _live_bytes() <= before + 1024, (before, _live_bytes())


def test_the_summary_over_several_runs_is_a_command(tmp_path):
    """`python -m jaxrl_llm.bench.async_rl A/rows.jsonl B/rows.jsonl` (the session script's last line; the module is
    also one the package imports, so its section must not refuse to register a second time)."""
    rows = [dict(section="async_longtail", preset="p", lengths="long", devices=4, mode=mode, step=i,
                 rollout_gpus=0 if mode == "sync" else 2, samples_per_s=rate * (i + 1), wait_share=0.0, wall_s=1.0)
            for mode, rate in (("sync", 1.0), ("one_step_off", 2.0)) for i in range(3)]
    for i, mode in enumerate(("sync", "one_step_off")):
        (tmp_path / f"{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["mode"] == mode))
    out = subprocess.run([sys.executable, "-m", "jaxrl_llm.bench.async_rl", str(tmp_path / "0.jsonl"),
                          str(tmp_path / "1.jsonl")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = {r["mode"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert got["one_step_off"]["vs_sync"] == 2.0 and got["sync"]["samples_per_s"] == 3.0


def test_the_seed_shape_hands_every_mode_the_seed_runs_lengths():
    """`--async_lengths seed`: the seed run's GSM8K lengths (lognormal, mean 232, at most 1,024) instead of the tail,
    the same sequence for every mode."""
    from jaxrl_llm.bench.async_rl import _capped_lengths
    from jaxrl_llm.bench.workload import seed_response_lengths

    opts = types.SimpleNamespace(small=False, async_lengths="seed", long_cap=8192)
    first, again = _capped_lengths(opts, 640, 1024), _capped_lengths(opts, 640, 1024)
    drawn = first(640)
    np.testing.assert_array_equal(drawn, seed_response_lengths(640, seed=0))
    np.testing.assert_array_equal(again(640), drawn)
    assert drawn.max() <= 1024 and 180 < drawn.mean() < 290
    tail = _capped_lengths(types.SimpleNamespace(small=False, async_lengths="long", long_cap=8192), 640, 8192)(640)
    assert tail.max() == 8192
