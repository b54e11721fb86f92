"""Finding config keys: `--list_keys` lists every key with its default and doc, `--help` points to it, an unknown
key gets the nearest one (or ours for a veRL spelling), data.train_files takes a string, and the operative
config in the run dir holds every key, defaults included."""

import dataclasses
import os
import re
import subprocess
import sys

import gin
import pytest

from jaxrl_llm.train import UsageError, main, parse_config
from jaxrl_llm.trainer.config import PARTS
from jaxrl_llm.trainer.config.keys import all_keys, field_docs, hint, operative_config
from tests.trainer import runs


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxrl_llm.train", *args], cwd=runs.REPO, capture_output=True,
                          text=True, timeout=120)


def _main(capsys, *args) -> tuple[int, str]:
    """What `_cli(*args)` runs (`python -m jaxrl_llm.train` is `sys.exit(main())`), in this process: main()'s exit
    code and stdout. A CLI process spends seconds importing jax and the trainer's config before `--list_keys`
    prints; `--help` below still goes through the real CLI process."""
    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().out


def test_every_key_has_a_default_and_a_doc_and_list_keys_prints_them_all(capsys):
    keys = all_keys()
    names = [k.name for k in keys]
    assert len(names) == len(set(names)) > 150
    # Each part's own fields (the nested rollout.multi_turn.* is its own section) are there, named as gin binds them.
    for _, section, cls in PARTS:
        for f in dataclasses.fields(cls):
            nested = f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)
            assert f"{section}.{f.name}" in names or nested, f.name
    assert "rollout.multi_turn.max_assistant_turns" in names and "actor.policy_loss.loss_mode" in names
    undocumented = [k.name for k in keys if len(k.doc) < 8]
    assert not undocumented, f"keys without a doc (add a comment on the field): {undocumented}"
    code, out = _main(capsys, "--list_keys")
    assert code == 0
    for k in keys:
        assert f"{k.name} = {k.default!r}  # {k.doc}" in out
    assert "actor.lr = 1e-06  # learning rate" in out
    only = _main(capsys, "--list_keys=save")[1].strip().splitlines()
    assert only == ["# train.*", "train.save_freq = 20  # a checkpoint every N steps and at the end (-1: only "
                                 "at the end)"]


def test_docs_come_from_field_comments_and_docstring_entries():
    from jaxrl_llm.agent.config import MultiTurnConfig
    from jaxrl_llm.trainer.config import RolloutConfig

    rollout = field_docs(RolloutConfig)
    assert rollout["engine"].startswith('"jax" (in-process sampler)')  # a comment after the field
    assert rollout["kv_cache"].startswith("The JAX engine's KV memory: \"paged\"")  # comment lines above it
    multi = field_docs(MultiTurnConfig)  # `a / b: text` entries of the class docstring, continuation lines too
    assert multi["max_user_turns"] == multi["max_assistant_turns"]
    assert multi["max_user_turns"].endswith("None is no cap other than data.max_response_length.")


def test_help_names_the_key_list_the_shorthand_and_the_recipes():
    out = _cli("--help")
    assert out.returncode == 0
    assert "--list_keys" in out.stdout and "--gin.train.total_epochs=3" in out.stdout
    assert "gin/grpo_tiny.gin" in out.stdout and "gin/grpo_tiny_lora.gin" in out.stdout
    assert "trainer.* is train.*" in out.stdout


@pytest.mark.parametrize("binding,advice", [
    ("actor.lrr=1e-3", "unknown key actor.lrr (bindings string line 1); did you mean actor.lr"),
    ("trainer.total_epochs=3", "veRL's trainer.total_epochs is train.total_epochs here"),
    ("actor_rollout_ref.actor.optim.lr=1e-6", "veRL's actor_rollout_ref.actor.optim.lr is actor.lr here"),
    ("actor_rollout_ref.rollout.val_kwargs.n=4", "veRL's actor_rollout_ref.rollout.val_kwargs.n is rollout.val_n"),
    ("algorithm.kl_ctrl.kl_coef=0.01", "veRL's algorithm.kl_ctrl.kl_coef is algorithm.kl_coef here"),
    ("custom_reward_function.path='r.py'", "veRL's custom_reward_function.path is reward.custom_reward_path"),
    ("trainer.n_gpus_per_node=8", "veRL's trainer.n_gpus_per_node is train.n_gpus_per_node here"),
    ("trainer.nnodes=2", "veRL's trainer.nnodes is train.nnodes here"),
    ("rollout.multi_turn.enabel=True", "did you mean rollout.multi_turn.enable"),
])
def test_an_unknown_key_gets_the_nearest_key_or_ours_for_a_verl_name(binding, advice):
    gin.clear_config()
    with pytest.raises(UsageError) as e:
        parse_config(["gin/grpo_tiny.gin"], [binding])
    assert advice in str(e.value) and "--list_keys" in str(e.value)
    assert len(str(e.value).splitlines()) == 1


def test_an_unknown_key_in_a_gin_file_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.gin"
    bad.write_text("include 'gin/grpo_tiny.gin'\n\nactor.lrr = 1e-3\n")
    gin.clear_config()
    with pytest.raises(UsageError, match=rf'unknown key actor.lrr \(file "{bad}", line 3\); did you mean actor.lr'):
        parse_config([str(bad)], [])


def test_a_hydra_style_override_says_how_to_bind_it(capsys):
    assert main(["--gin_file=gin/grpo_tiny.gin", "trainer.total_epochs=3"]) == 2
    err = capsys.readouterr().err
    assert "bindings go in --gin.KEY=VALUE" in err and "veRL's trainer.total_epochs is train.total_epochs" in err


def test_a_verl_key_a_doc_names_is_the_key_the_hint_gives():
    """One name for one key: where a key's doc (`--list_keys`) says it is veRL's X, the hint for X names that key
    (trainer.n_gpus_per_node and trainer.nnodes were sent to train.devices_per_process and train.num_processes)."""
    named = {}
    for k in all_keys():
        for verl in re.findall(r"veRL's ((?:trainer|actor_rollout_ref|critic|algorithm|custom_reward_function)"
                               r"(?:\.\w+)+)", k.doc):
            named[verl] = k.name
    assert {"trainer.n_gpus_per_node", "trainer.nnodes"} <= set(named), named
    for verl, ours in named.items():
        assert hint(verl) == f"veRL's {verl} is {ours} here", (verl, ours)


def test_hint_is_empty_for_nothing_near():
    assert hint("zzz.qqq") == ""


def test_data_files_take_a_plain_string_as_verl_does(tmp_path):
    gin.clear_config()
    run = parse_config(["gin/grpo_tiny.gin"], ["data.train_files='a.parquet'", "data.val_files='b.parquet'"])
    assert run.data.train_files == ("a.parquet",) and run.data.val_files == ("b.parquet",)
    gin.clear_config()
    run = parse_config(["gin/grpo_tiny.gin"], ["data.train_files=['a.parquet', 'c.parquet']", "data.val_files=''"])
    assert run.data.train_files == ("a.parquet", "c.parquet") and run.data.val_files == ()


def test_the_operative_config_holds_every_key_and_rebuilds_the_same_run(tmp_path):
    gin.clear_config()
    run = parse_config(["gin/grpo_tiny_lora.gin"], ["actor.lr=3e-3"])
    text = operative_config(run)
    bound = {line.split(" = ")[0] for line in text.splitlines() if " = " in line and not line.startswith("#")}
    missing = [k.name for k in all_keys() if k.name not in bound]
    assert not missing, missing
    assert "actor.lr = 0.003" in text and "rollout.multi_turn.enable = False" in text  # our names, not gin's short ones
    path = tmp_path / "operative_config.gin"
    path.write_text(text)
    gin.clear_config()
    assert parse_config([str(path)], []) == run


def test_the_run_dir_gets_the_operative_config_with_the_defaults(tmp_path):
    out = runs.run(tmp_path, steps=1)
    assert out.returncode == 0, out.stderr[-3000:]
    text = (tmp_path / "operative_config.gin").read_text()
    assert "actor.clip_ratio_c = 3.0" in text and "train.max_checkpoints_to_keep = 2" in text  # defaults, unbound
    path = tmp_path / "again.gin"
    path.write_text(text)
    gin.clear_config()
    rebuilt = parse_config([str(path)], [])
    assert rebuilt.trainer.run_dir == str(tmp_path) and rebuilt.data.train_batch_size == 8


def test_readme_points_to_the_key_list():
    readme = open(os.path.join(runs.REPO, "README.md")).read()
    assert "python -m jaxrl_llm.train --list_keys" in readme



def test_list_keys_documents_the_qwen35_presets_fields_and_lora_targets(capsys):
    """Every Qwen3.5 preset is named in model.preset's doc, every field only a Qwen3.5 has in model.overrides', the
    family's own LoRA targets in model.target_modules'; rollout.engine says the vLLM pool does not take it."""
    from jaxrl_llm.models.config import PRESETS, DecoderConfig
    from jaxrl_llm.models.lora import LINEAR_ATTENTION_MODULES

    docs = {line.split(" = ")[0]: line for line in _main(capsys, "--list_keys=model")[1].splitlines()}
    qwen35 = [name for name in PRESETS if PRESETS[name]().is_hybrid]
    assert len(qwen35) == 4 and all(f"'{name}'" in docs["model.preset"] for name in qwen35)
    fields = [f.name for f in dataclasses.fields(DecoderConfig) if f.name.startswith(("linear_", "layer_types"))]
    assert all(name in docs["model.overrides"] for name in
               (*fields, "partial_rotary_factor", "shared_expert_intermediate_size")), docs["model.overrides"]
    assert all(name in docs["model.target_modules"] for name in (*LINEAR_ATTENTION_MODULES, "shared_expert_gate"))
    assert "not for Qwen3.5" in _main(capsys, "--list_keys=rollout.engine")[1]
