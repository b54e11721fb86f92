"""The packed layout of a micro-batch, and the ladder's smaller shapes giving the same log-probs and update."""

import numpy as np

from jaxrl_llm.trainer.batch import PackShape, TrainBatch, build_micro_batch, split_mini_batches
from jaxrl_llm.trainer.packing import plan_packing
from tests.trainer import runs


def _batch(lengths, prompt_len=3, seed=0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    tr = max(lengths)
    mask = (np.arange(tr)[None] < np.asarray(lengths)[:, None]).astype(np.float32)
    responses = rng.integers(1, 50, size=(len(lengths), tr)).astype(np.int32) * mask.astype(np.int32)
    prompts = [rng.integers(1, 50, size=prompt_len).astype(np.int32) for _ in lengths]
    return TrainBatch(prompt_ids=prompts, responses=responses, response_mask=mask,
                      group_ids=np.arange(len(lengths), dtype=np.int32))


def test_micro_batch_layout_gathers_each_response_token():
    b = _batch([4, 2, 6])
    shape = PackShape(rows=2, length=16, max_seqs=4, resp_len=6)
    (_, placements), = plan_packing(b.prompt_lengths + b.response_lengths, (shape,), 1)
    mb = build_micro_batch(b, placements, shape)
    for slot, i in enumerate(mb["seq_ids"]):
        if i < 0:
            continue
        n = int(b.response_lengths[i])
        # The target at each response token's predicting position is that response token.
        np.testing.assert_array_equal(mb["targets"].reshape(-1)[mb["resp_pos"][slot, :n]], b.responses[i, :n])


def test_tail_shapes_give_the_same_log_probs_and_update(tmp_path):
    from jaxrl_llm.trainer.loop import RLTrainer, build_train_batch

    out = {}
    for depth in (1, 3):
        # 6 rows of 32 tokens a micro-batch; the 32 responses of a step fill 8 rows: a tail of 2.
        run = runs.run_config("train.driver='inprocess'", "actor.ppo_max_token_len_per_gpu=192",
                              "actor.ppo_mini_batch_size=8", "rollout.log_prob_max_token_len_per_gpu=192",
                              "actor.pack_length=32", f"actor.tail_shapes={depth}", run_dir=tmp_path / str(depth))
        trainer = RLTrainer(run)
        prompts = next(trainer.iterator)
        rollout = trainer.generate(prompts, trainer.sampling(0))
        batch = build_train_batch(prompts, rollout, run.data.max_response_length)
        w = trainer.worker
        shapes = []  # rows of every micro-batch of every mini-batch of the update
        for idx in split_mini_batches(len(batch), run.actor.ppo_mini_batch_size * run.rollout.n):
            sub = batch.select(idx)
            shapes += [shape.rows for shape, _ in plan_packing(sub.prompt_lengths + sub.response_lengths,
                                                                w.pack_ladder, w.dp)]
        lp = w.compute_log_prob(batch)
        batch.fields["old_log_prob"] = lp["old_log_prob"]
        batch.fields["advantages"] = np.random.default_rng(0).standard_normal(batch.response_mask.shape).astype(
            np.float32) * batch.response_mask
        metrics = w.update_actor(batch, 0)
        fill = w.pack_metrics()
        assert set(fill) == {"perf/pack_fill", "perf/pack_fill/log_prob", "perf/pack_fill/update"}
        assert 0 < fill["perf/pack_fill"] <= 1 and w.pack_metrics() == {}  # counted since the last call
        out[depth] = (shapes, lp["old_log_prob"], metrics)
    (full_shapes, lp1, m1), (tail_shapes_, lp3, m3) = out[1], out[3]
    assert len(full_shapes) >= 2 and set(full_shapes) == {full_shapes[0]}
    assert min(tail_shapes_) < full_shapes[0]  # some tail ran at a smaller shape
    np.testing.assert_allclose(lp3, lp1, rtol=1e-6, atol=1e-6)
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        np.testing.assert_allclose(m3[k], m1[k], rtol=1e-5, err_msg=k)
