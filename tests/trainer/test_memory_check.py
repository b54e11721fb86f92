"""The memory check before the first step, through a fake device limit (`train.device_memory_limit_bytes`):
XLA's analysis of each compiled program against it, a refusal that names the program and the keys, the
automatic choices, the engine's report, and the one-line error of the CLI. Limits are set from the sizes
XLA reports for the same programs on this machine (XLA:CPU's differ from a GPU's), never hard-coded."""

import jax
import pytest

from jaxrl_llm.errors import DeviceMemoryError
from jaxrl_llm.trainer.memory import check as memory_check
from jaxrl_llm.trainer.memory.check import AUTO_SHARE, FIT_SHARE, MemoryPlan, ProgramMemory
from jaxrl_llm.trainer.memory.programs import StepPrograms, device_bytes, size
from jaxrl_llm.trainer.roles import worker as worker_module
from jaxrl_llm.trainer.roles.model_load import model_config
from jaxrl_llm.trainer.roles.worker import TrainerWorker
from tests.trainer import runs

BIG = 10**12  # a limit every program fits
# The tiny demo with a wider MLP (its saved activations show), at the demo's update budget (4096 tokens: 32 rows of
# 128), one micro-batch row in the forward passes.
WIDE = ("model.overrides={'vocab_size': 16, 'intermediate_size': 1024}", "actor.ppo_max_token_len_per_gpu=4096",
        "rollout.log_prob_max_token_len_per_gpu=128")


def _build(r, c):
    return TrainerWorker(r, total_steps=2, model_cfg=c, abstract=True)


def _run(limit, *params):
    return runs.run_config("train.driver='inprocess'", f"train.device_memory_limit_bytes={limit}", *WIDE, *params)


def _update_need(remat: str, *params) -> int:
    run = _run(BIG, f"model.remat='{remat}'", *params)
    return StepPrograms(_build(run, model_config(run)), BIG).updates()[0].need


def test_a_refused_update_names_the_program_its_sizes_and_the_keys_before_loading_anything(monkeypatch):
    def no_loading(*a, **k):
        raise AssertionError("the check must fail before any weights are loaded")

    need = _update_need("full")
    limit = int(0.6 * need)
    monkeypatch.setattr(worker_module, "load_actor_params", no_loading)
    with pytest.raises(DeviceMemoryError) as e:
        TrainerWorker(_run(limit, "model.remat='full'"), total_steps=2)
    msg = str(e.value)
    assert msg.startswith(f"device memory: the actor update (jit 'step'; remat 'full', 32 rows of 128 tokens) "
                          f"needs {size(need)} a device")
    assert "XLA temporaries" in msg and f"{FIT_SHARE:.0%} of the {size(limit)} a device" in msg
    for key in ("actor.ppo_max_token_len_per_gpu (now 4096; about", "model.lora_rank > 0", "train.mesh_fsdp = 1"):
        assert key in msg
    suggested = int(msg.split("about ")[1].split(" would fit")[0])
    assert 0 < suggested < 4096 and suggested % 128 == 0
    # The budget it names does fit.
    monkeypatch.undo()
    run = _run(limit, "model.remat='full'", f"actor.ppo_max_token_len_per_gpu={suggested}")
    plan = memory_check.plan(run, model_config(run), _build)
    assert plan.programs[0].name == "actor update" and plan.programs[0].need <= FIT_SHARE * limit


def test_auto_remat_takes_the_least_recompute_that_fits():
    """Down the ladder dots, mlp_gate, attention_block, ...: the first policy whose compiled update fits."""
    deep = "model.overrides={'vocab_size': 16, 'intermediate_size': 1024, 'num_hidden_layers': 8}"  # saved
    need = {r: _update_need(r, deep) for r in ("dots", "mlp_gate", "attention_block")}  # activations dominate
    assert need["dots"] > need["mlp_gate"] > need["attention_block"]  # each keeps less for the backward pass
    for taken, above in (("mlp_gate", "dots"), ("attention_block", "mlp_gate")):
        # Between the two: the one above does not fit in AUTO_SHARE of the limit, this one does.
        limit = int((need[above] + need[taken]) / 2 / AUTO_SHARE)
        run = _run(limit, "model.remat='auto'", deep)
        plan = memory_check.plan(run, model_config(run), _build)
        assert plan.cfg.remat == taken and plan.run.model.remat == taken
        assert plan.programs[0].need == need[taken]
    # A remat the run names is kept: where "dots" does not fit at all, it is refused, not replaced.
    dots = _update_need("dots")
    run = _run(int(dots / FIT_SHARE) - 1, "model.remat='dots'")
    with pytest.raises(DeviceMemoryError, match=r"the actor update \(jit 'step'; remat 'dots'.*model.remat = 'full'"):
        memory_check.plan(run, model_config(run), _build)


def test_an_unset_log_prob_budget_takes_the_update_budget_where_twice_it_does_not_fit():
    # A larger vocabulary: the forward pass's logit chunks grow with its tokens, so at twice the update's
    # budget it is the step's largest program (as at Qwen's 152k vocabulary).
    params = ("model.remat='full'", "rollout.log_prob_max_token_len_per_gpu=None",
              "actor.ppo_max_token_len_per_gpu=1024", "model.overrides={'vocab_size': 4096}")
    run = _run(BIG, *params)
    progs = StepPrograms(_build(run, model_config(run)), BIG)
    assert progs.logprob_budgets() == [2048, 1024]
    wide, narrow = (max(p.need for p in progs.forward(b)) for b in (2048, 1024))
    update = progs.updates()[0].need
    limit = int(max(narrow, update) / FIT_SHARE) + 1
    if wide <= AUTO_SHARE * limit:
        pytest.fail(f"the test needs the doubled pass to be the largest program (2048: {wide}, 1024: {narrow}, "
                    f"update {update})")
    plan = memory_check.plan(_run(limit, *params), model_config(run), _build)
    assert plan.run.rollout.log_prob_max_token_len_per_gpu == 1024
    assert [p.detail for p in plan.programs if p.name == "old log-prob pass"] == ["8 rows of 128 tokens"]
    plan = memory_check.plan(_run(BIG, *params), model_config(run), _build)
    assert plan.run.rollout.log_prob_max_token_len_per_gpu is None  # twice the update's budget, as configured


def test_what_stays_resident_beside_each_program_and_the_lora_sync():
    """The update's held bytes are the trainer's states alone (rollout.free_cache_engine drops the engine's
    weights), the forward passes keep the engine's weights, and a LoRA sync converts the merged kernels
    beside the base: exactly the adapted kernels in the compute dtype, as XLA sizes the merge's outputs."""
    run = _run(BIG, "model.remat='full'", "model.lora_rank=4", "model.dtype='bfloat16'")
    w = _build(run, model_config(run))
    progs = StepPrograms(w, BIG)
    assert set(progs.held("update")) == {"actor params", "actor optimizer", "frozen base"}
    assert progs.held("forward")["engine weights"] == progs.engine_weights > 0
    assert progs.resident["frozen base"] == device_bytes(w.actor.frozen)
    by_name = {p.name: p for p in progs.optimizer_and_sync()}
    merge, convert = by_name["weight sync: merge"], by_name["weight sync: convert"]
    cfg = w.cfg
    layers, d, f, q, kv = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim
    kernels = layers * (d * q + 2 * d * kv + q * d + 3 * d * f) * 2  # q, k, v, o, gate, up, down in bf16
    # XLA counts an 8-byte pointer for each output in the result tuple besides the arrays.
    assert 0 <= merge.outputs - kernels <= 7 * 8 and convert.held["merged weights"] == merge.outputs
    assert "engine weights" not in convert.held  # a sync drops the old copy first
    assert 0 <= convert.outputs - progs.engine_weights <= 32 * 8


def test_bytes_a_device_holds_follow_the_sharding():
    from jaxrl_llm import sharding
    from jaxrl_llm.models import DecoderConfig
    from jaxrl_llm.trainer.roles.model_state import abstract_params

    cfg = DecoderConfig.tiny()
    whole = device_bytes(abstract_params(cfg, sharding.make_mesh(fsdp=1, devices=jax.devices()[:1])))
    split = device_bytes(abstract_params(cfg, sharding.make_mesh(fsdp=8)))
    assert whole == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_params(cfg, None)))
    assert whole / 8 <= split < whole / 2  # most leaves split 8 ways; norms and small biases stay whole


class _Engine:
    def __init__(self, report):
        self.report = report

    def memory_report(self):
        return self.report


def test_the_engine_report_is_checked_beside_the_trainers_resident_state():
    held = {"actor params": 3 * 10**9, "frozen base": 10 * 10**9}
    plan = MemoryPlan(run=None, cfg=None, limit=40 * 10**9, generation_held=held,
                      generation_fixes=["fewer rows or prompt tokens at once (rollout.max_num_seqs, ...)"])
    plan.check_engine(_Engine([("prefill[8192]", 20 * 10**9), ("decode[256]", 25 * 10**9)]))  # 13 + 25 = 38 fits
    expected = (r"the generation program decode\[1024\] \(jit 'decode\[1024\]'\) needs 41\.0 GB a device: 13\.0 GB "
                r"held \(frozen base 10\.0 GB, actor params 3\.0 GB\), 28\.0 GB the engine's .*rollout.max_num_seqs")
    with pytest.raises(DeviceMemoryError, match=expected):
        plan.check_engine(_Engine([("decode[1024]", 28 * 10**9)]))
    plan.check_engine(object())  # an engine without a report is not checked here
    MemoryPlan(run=None, cfg=None, limit=None).check_engine(_Engine([("decode", 10**15)]))  # no limit: no check
    assert [p.name for p in plan.programs] == ["generation program prefill[8192]", "generation program decode[256]",
                                               "generation program decode[1024]"]
    assert plan.rows()[-1]["fits"] is False and plan.rows()[0]["need_gb"] == pytest.approx(33.0)
    assert isinstance(plan.programs[0], ProgramMemory)


def test_the_cli_fails_before_the_first_step_with_one_line(tmp_path):
    out = runs.run(tmp_path / "run", "train.device_memory_limit_bytes=2000000", steps=1)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert lines[0].startswith("error: DeviceMemoryError: device memory: the actor update (jit 'step'")
    assert "train.mesh_fsdp" in lines[0]
    assert not runs.metrics(tmp_path / "run")


def test_resident_state_past_the_limit_is_refused_without_compiling(monkeypatch):
    import jaxrl_llm.trainer.memory.programs as programs

    def no_compiling(*a, **k):
        raise AssertionError("resident state past the limit needs no compile")

    monkeypatch.setattr(programs, "compiled_memory", no_compiling)
    run = _run(100_000, "model.remat='full'")
    with pytest.raises(DeviceMemoryError, match=r"the trainer's resident state needs .* held \(actor optimizer .*"
                                                r"train adapters"):
        memory_check.plan(run, model_config(run), _build)
