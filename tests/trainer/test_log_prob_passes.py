"""The old and reference log-prob passes as one program a micro-batch give what the two programs apart give,
and the memory check keeps them apart where only that fits."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_llm.trainer.loop import RLTrainer, build_train_batch
from jaxrl_llm.trainer.memory import check as memory_check
from jaxrl_llm.trainer.memory.check import AUTO_SHARE, FIT_SHARE
from jaxrl_llm.trainer.memory.programs import StepPrograms
from jaxrl_llm.trainer.roles.model_load import model_config
from jaxrl_llm.trainer.roles.worker import TrainerWorker
from tests.trainer import runs

BOTH = ("train.driver='inprocess'", "actor.use_kl_loss=True", "actor.ppo_mini_batch_size=4",  # old and ref passes
        "rollout.fuse_log_prob_passes=True",
        "actor.lr_warmup_steps=0")


@pytest.mark.parametrize("lora", [False, True])
def test_one_program_gives_the_two_passes(tmp_path, lora):
    """Under LoRA the reference is the actor's frozen base: the fused program takes the actor's params alone, so
    the base is one argument of its compiled form, not two."""
    extra = ("model.lora_rank=4", "model.lora_alpha=8", "actor.lr=1e-2") if lora else ()
    trainer = RLTrainer(runs.run_config(*BOTH, *extra, run_dir=tmp_path / "run"))
    w = trainer.worker
    assert trainer.needs_old and trainer.needs_ref and w.run.rollout.fuse_log_prob_passes
    args = w.old_ref_params()
    assert len(args) == (1 if lora else 2)
    base_bytes = sum(x.nbytes for x in jax.tree.leaves(w.actor.reference()))
    _, mb = next(iter(w._micro_batches(build_train_batch(
        (p := next(trainer.iterator)), trainer.engine.generate([q["prompt_ids"] for q in p], trainer.sampling(0)),
        trainer.run.data.max_response_length), (), w.fwd_ladder, "log_prob")))
    with jax.set_mesh(w.mesh):
        compiled = w.old_ref_fn.lower(*args, mb).compile()
    argument_bytes = compiled.memory_analysis().argument_size_in_bytes  # the params and the micro-batch
    assert (argument_bytes < 2 * base_bytes) if lora else (argument_bytes > 2 * base_bytes), (argument_bytes,
                                                                                              base_bytes)
    prompts = next(trainer.iterator)
    batch = build_train_batch(prompts, trainer.engine.generate([p["prompt_ids"] for p in prompts], trainer.sampling(0)),
                              trainer.run.data.max_response_length)
    # One update first, so that the policy and the reference differ.
    batch.fields["old_log_prob"] = w.compute_log_prob(batch)["old_log_prob"]
    batch.fields["ref_log_prob"] = w.compute_ref_log_prob(batch)
    batch.fields["advantages"] = np.random.default_rng(0).standard_normal(batch.response_mask.shape).astype(
        np.float32) * batch.response_mask
    w.update_actor(batch, 0)

    fused = w._forward(batch, old=True, ref=True)
    assert w.old_ref_fn._cache_size() == 1
    w.run = dataclasses.replace(w.run, rollout=dataclasses.replace(w.run.rollout, fuse_log_prob_passes=False))
    apart = w._forward(batch, old=True, ref=True)
    assert set(fused) == set(apart) == {"old_log_prob", "entropy", "ref_log_prob"}
    for k in fused:
        np.testing.assert_allclose(fused[k], apart[k], rtol=1e-6, atol=1e-6, err_msg=k)
    assert np.abs(fused["old_log_prob"] - fused["ref_log_prob"]).max() > 1e-4  # two different models


def _build(r, c):
    return TrainerWorker(r, total_steps=2, model_cfg=c, abstract=True)


def test_the_memory_check_keeps_the_passes_apart_where_only_that_fits():
    # Wide log-prob micro-batches and a 4k vocabulary: the forward passes are the step's largest programs.
    params = (*BOTH, "rollout.log_prob_max_token_len_per_gpu=2048", "actor.ppo_max_token_len_per_gpu=128",
              "model.overrides={'vocab_size': 4096, 'intermediate_size': 1024}")
    run = runs.run_config("train.device_memory_limit_bytes=1000000000000", *params)
    progs = StepPrograms(_build(run, model_config(run)), 10**12)
    assert progs.fusions() == [True, False]
    fused = max(p.need for p in progs.forward(2048, True))
    apart = max(p.need for p in progs.forward(2048, False))
    rest = max(p.need for p in progs.updates() + progs.optimizer_and_sync())
    if not fused > max(apart, rest):
        pytest.skip(f"XLA:CPU gave the fused pass no more memory than the largest other program ({fused}, "
                    f"{apart}, {rest})")
    limit = int(max(apart, rest) / FIT_SHARE) + 1
    assert fused > AUTO_SHARE * limit
    run = runs.run_config(f"train.device_memory_limit_bytes={limit}", *params)
    plan = memory_check.plan(run, model_config(run), _build)
    assert not plan.run.rollout.fuse_log_prob_passes
    assert {p.name for p in plan.programs} >= {"old log-prob pass", "reference log-prob pass"}
    run = runs.run_config("train.device_memory_limit_bytes=1000000000000", *params)
    plan = memory_check.plan(run, model_config(run), _build)
    assert plan.run.rollout.fuse_log_prob_passes and "old + reference log-prob pass" in {p.name for p in plan.programs}


def test_the_step_programs_hold_no_full_fp32_logits():
    """The update's grad step and the fused log-prob pass, as the step compiles them: with a vocabulary of 8
    chunks, no [tokens, V] fp32 buffer (forward, entropy or backward) appears in either program."""
    from jaxrl_llm.trainer.memory.warm_programs import forward_programs, update_programs

    v = 4096
    run = runs.run_config(*BOTH, "actor.logprob_chunk_size=512", "actor.ppo_max_token_len_per_gpu=256",
                          "rollout.log_prob_max_token_len_per_gpu=256", f"model.overrides={{'vocab_size': {v}}}")
    w = _build(run, model_config(run))
    pack = w.pack_shape(256)
    programs = update_programs(w, pack)[:1] + forward_programs(w, pack, fused=True)
    assert [p.name for p in programs] == ["actor update", "old + reference log-prob pass"]
    for p in programs:
        with jax.set_mesh(w.mesh):
            text = p.jitted.lower(*p.args).compile().as_text()
        full = (f"f32[{pack.rows * pack.length},{v}]", f"f32[{pack.rows},{pack.length},{v}]")
        assert not any(s in text for s in full), p.name
        assert f"f32[{pack.rows * pack.length},512]" in text  # one chunk's logits
