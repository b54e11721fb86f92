"""With `train.compile_ahead`, the worker builds the update and log-prob passes at every shape of their ladders
before the first step, and the engine its programs for the run's rollouts beside them: a run whose later steps
pack into shapes step 0 never used compiles nothing after it, synchronous, one step off policy or fully async."""

import numpy as np

from jaxrl_llm import compile_watch
from jaxrl_llm.rollout import stream as stream_module
from jaxrl_llm.trainer.loop import RLTrainer
from jaxrl_llm.trainer.roles import worker as worker_module
from tests.trainer import runs

# Rows of 32 tokens, 3 a micro-batch in the update and 6 in the log-prob pass (ladders 3, 2, 1 and 6, 3, 2); two
# mini-batches a step, so the old-log-prob pass runs; responses up to 16 tokens.
PARAMS = ("train.driver='inprocess'", "train.compile_ahead=True", "actor.tail_shapes=3", "actor.pack_length=32",
          "data.max_response_length=16", "actor.ppo_max_token_len_per_gpu=96",
          "rollout.log_prob_max_token_len_per_gpu=192", "actor.ppo_mini_batch_size=4",
          # the sampler's programs built ahead too (its own default on a GPU), for rows run to their caps
          "rollout.warm_programs=True", "rollout.ignore_eos=True")
SPLIT = ("rollout.n_gpus_per_node=1", "train.n_gpus_per_node=1", "train.save_freq=-1")


def _trainer(tmp_path, *params) -> RLTrainer:
    return RLTrainer(runs.run_config(*PARAMS, *params, run_dir=tmp_path / "run"))


def _cap_generate(trainer, caps) -> None:
    """The sampler's calls, in order, run every row to the next of `caps` tokens."""
    caps, generate = iter(caps), trainer.engine.sampler.generate

    def capped(prompts, sampling, max_new_tokens_per_row=None, **kw):
        lens = np.full(len(prompts) * sampling.n, next(caps))
        return generate(prompts, sampling, max_new_tokens_per_row=lens, **kw)

    trainer.engine.sampler.generate = capped


def _record_shapes(monkeypatch) -> list[set]:
    """A list that a step appends a set to gets the (ladder, micro-batch rows) shapes its packing chose."""
    shapes, plan = [], worker_module.plan_packing

    def recorded(lengths, ladder, shards):
        plans = plan(lengths, ladder, shards)
        shapes[-1].update((ladder[0].rows, shape.rows) for shape, _ in plans)
        return plans

    monkeypatch.setattr(worker_module, "plan_packing", recorded)
    return shapes


def _steps(trainer, shapes, n: int) -> tuple[list[dict], list[int]]:
    """`n` steps of an async trainer: their metric rows, and the XLA compiles of the whole process in each."""
    rows, compiled = [], []
    try:
        for step in range(n):
            shapes.append(set())
            before = compile_watch.totals()["compiles"]
            rows.append(trainer.step(step))
            trainer.global_step = step + 1
            compiled.append(compile_watch.totals()["compiles"] - before)
    finally:
        trainer.close()
    return rows, compiled


def test_later_steps_of_other_lengths_compile_nothing(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path)
    w = trainer.worker
    assert [s.rows for s in w.pack_ladder] == [3, 2, 1] and [s.rows for s in w.fwd_ladder] == [6, 3, 2]
    _cap_generate(trainer, [16, 1])  # step 0 samples 16 tokens a response (the sampler builds its programs), step 1 one
    shapes = _record_shapes(monkeypatch)
    metrics, engine_compiled = [], []
    for step in range(2):
        shapes.append(set())
        metrics.append(trainer.train_step(next(trainer.iterator), step))
        engine_compiled.append(trainer.engine.stats()["programs_compiled"])
    assert shapes[1] - shapes[0], shapes  # step 1 met shapes that step 0 did not compile
    assert metrics[1]["perf/compiles"] == 0
    # The engine built its programs with the trainer's (before, step 0's rollout compiled them: 8 programs)
    assert engine_compiled == [0, 0], engine_compiled
    assert all(0 < m["perf/pack_fill"] <= 1 for m in metrics)


def test_one_step_off_compiles_nothing_after_step_0(tmp_path, monkeypatch):
    """One step off policy (the rollout on a device of its own, a batch ahead on its thread): with the passes built
    ahead and the sampler's programs warmed, later batches of other lengths compile nothing, on either side and in
    the weight syncs between them (issue 40: the long-tail benchmark's async modes compiled after step 0)."""
    trainer = _trainer(tmp_path, "async_training.mode='one_step_off'", *SPLIT)
    # Batch 0 samples 16 tokens a response, batch 1 (generated during step 0, trained at step 1) one, then 7.
    _cap_generate(trainer, [16, 1, 7, 7])
    shapes = _record_shapes(monkeypatch)
    rows, compiled = _steps(trainer, shapes, 3)
    assert rows[1]["fully_async/staleness/mean"] == 1  # step 1 trained on the batch generated during step 0
    assert shapes[1] - shapes[0], shapes  # step 1 met shapes that step 0 did not compile
    assert compiled[0] > 0 and compiled[1:] == [0, 0], compiled
    assert [r["perf/compiles"] for r in rows[1:]] == [0, 0]


def test_fully_async_compiles_nothing_after_step_0(tmp_path, monkeypatch):
    """Fully async (a stream on the rollout device, fed while the trainer trains): batch 0's rows run to 16 tokens,
    every later batch's to 7, so later steps pack into other shapes; with the passes built ahead nothing compiles
    after step 0, on either side or in the syncs."""
    trainer = _trainer(tmp_path, "async_training.mode='fully_async'", *SPLIT, "actor.ppo_mini_batch_size=8")
    sampling = trainer.sampling
    monkeypatch.setattr(trainer, "sampling", lambda *a, **k: sampling(*a, **k).replace(ignore_eos=True))
    submit = stream_module.RolloutStream.submit

    def capped(self, prompts, metas, **kw):
        caps = [16 if m["batch"] == 0 else 7 for m in metas for _ in range(self.n)]
        return submit(self, prompts, metas, **{**kw, "max_new_tokens_per_row": caps})

    monkeypatch.setattr(stream_module.RolloutStream, "submit", capped)
    shapes = _record_shapes(monkeypatch)
    rows, compiled = _steps(trainer, shapes, 3)
    assert shapes[2] - shapes[0], shapes  # a later step met shapes that step 0 did not compile
    assert compiled[0] > 0 and compiled[1:] == [0, 0], compiled
