"""The memory check on Qwen3.5 and Qwen3.5-MoE: its arithmetic estimate counts the hybrid layers, the step's
programs compile against a fake limit (R2's recorded routing over every sparse layer of both stacks), and a limit
too small is one DeviceMemoryError naming the program and the key, whose suggested budget fits. The rollout runs
on devices of its own here (one_step_off): converting the hybrid layers into the JAX engine's layout is the
engine's own work, which the colocated check compiles too."""

import pytest

from jaxrl_llm.errors import DeviceMemoryError
from jaxrl_llm.models import DecoderConfig
from jaxrl_llm.trainer.memory import check as memory_check
from jaxrl_llm.trainer.memory import estimate as memory
from jaxrl_llm.trainer.memory.check import FIT_SHARE
from jaxrl_llm.trainer.memory.programs import StepPrograms
from jaxrl_llm.trainer.memory.warm_programs import micro_batch
from jaxrl_llm.trainer.roles.model_load import model_config
from jaxrl_llm.trainer.roles.worker import TrainerWorker
from tests.trainer import runs

BIG = 10**12
SPLIT = ("async_training.mode='one_step_off'", "rollout.n_gpus_per_node=1", "train.n_gpus_per_node=1")


def _build(r, c):
    return TrainerWorker(r, total_steps=2, model_cfg=c, abstract=True)


def _run(limit, *params):
    return runs.run_config("train.driver='inprocess'", f"train.device_memory_limit_bytes={limit}", *SPLIT,
                           "actor.ppo_max_token_len_per_gpu=4096", "rollout.log_prob_max_token_len_per_gpu=128",
                           "model.remat='full'", *params)


def test_the_estimate_counts_the_hybrid_layers():
    cfg = DecoderConfig.tiny_qwen35()  # D 64, F 128, layers 1 and 3 attention (q 64, kv 32, 4 heads), 0 and 2 linear
    attention = 2 * 64 + 2 * 32 + 64 + 64 + 2 * 4  # gated q_proj, k and v, o_proj, the attention's output and stats
    linear = 128 + 2 * 64 + 2 * 4 + 64  # in_proj_qkv, in_proj_z and the delta rule's output, in_proj_b/a, out_proj
    mlp = 2 * 128 + 64
    assert memory.saved_bytes_per_token(cfg, "dots") == 2 * (2 * (attention + mlp) + 2 * (linear + mlp))
    assert memory.saved_bytes_per_token(cfg, "full") == 2 * 4 * 64
    assert memory.first_pass_remat(_run(BIG, "model.preset='tiny_qwen35'"), cfg, {"fsdp": 1, "tensor": 1}, None,
                                   BIG) == "dots"


@pytest.mark.parametrize("preset,params", [("tiny_qwen35", ()),
                                           ("tiny_qwen35_moe", ("actor.router_replay.mode='R2'",
                                                                "actor.ppo_mini_batch_size=8"))])
def test_the_check_compiles_qwen35s_programs_and_names_the_key_of_a_budget_too_small(preset, params):
    params = (f"model.preset='{preset}'", *params)
    run = _run(BIG, *params)
    progs = StepPrograms(_build(run, model_config(run)), BIG)
    if preset == "tiny_qwen35_moe":  # R2: the update replays the routing of all four (sparse) layers
        host, _ = micro_batch(progs.w, progs.w.pack, ["rollout_log_probs"], update=True)
        assert host["routed_experts"].shape[2:] == (4, 2)  # [rows, L, L_moe, k]
    update = progs.updates()[0]
    assert update.name == "actor update" and update.temp > 0
    limit = int(0.6 * update.need)
    with pytest.raises(DeviceMemoryError) as e:
        memory_check.plan(_run(limit, *params), model_config(run), _build)
    msg = str(e.value)
    assert msg.startswith("device memory: the actor update (jit 'step'; remat 'full'")
    assert "lower actor.ppo_max_token_len_per_gpu (now 4096; about" in msg
    suggested = int(msg.split("about ")[1].split(" would fit")[0])
    assert 0 < suggested < 4096
    run = _run(limit, *params, f"actor.ppo_max_token_len_per_gpu={suggested}")
    plan = memory_check.plan(run, model_config(run), _build)
    assert plan.programs[0].name == "actor update" and plan.programs[0].need <= FIT_SHARE * limit
