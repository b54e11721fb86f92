"""Bad input through the real CLI entry point, `jaxrl_llm.train.main(argv)`.

The house rule: bad input gets one clear error line (what, where, how to fix) and exit code 2, or a
counted and logged filter; never a traceback, never a broken run dir. Each case below is one bad
input. Most run `main()` in this process (fast: setup errors stop before any model is built); three
run `python -m jaxrl_llm.train` in a subprocess to prove the end-to-end behaviour.
"""

import copy
import dataclasses
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys
import traceback

import gin
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl_llm import train
from jaxrl_llm.data.arithmetic import build_tokenizer
from jaxrl_llm.trainer.roles import worker as worker_module

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY_GIN = str(REPO / "gin" / "grpo_tiny.gin")

# One step of the tiny CPU demo, in this process, logging only to metrics.jsonl.
FAST = ("train.total_training_steps = 1", "train.val_before_train = False", "train.test_freq = -1",
        "train.driver = 'inprocess'", "train.logger = ('jsonl',)", "train.progress_bar = False")
# The error line: ours, or argparse's (which prefixes the program name).
ERROR_LINE = re.compile(r"^(python -m jaxrl_llm\.train: )?error: ")
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")  # main()'s logging format


# ---- running the CLI ----------------------------------------------------------------------------


@dataclasses.dataclass
class CliResult:
    code: int | None  # None: an exception escaped main()
    stdout: str
    stderr: str
    escaped: str = ""  # the traceback of an exception that escaped main(), if any


def run_main(argv: list[str], capsys) -> CliResult:
    """`main(argv)` in this process. main() does not reset gin's global config, so we do."""
    gin.clear_config()
    capsys.readouterr()
    try:
        code, escaped = train.main(argv), ""
    except BaseException:  # SystemExit too: main(argv) should return its exit code, not exit
        code, escaped = None, traceback.format_exc()
    out = capsys.readouterr()
    return CliResult(code, out.out, out.err, escaped)


def run_subprocess(argv: list[str], cwd: pathlib.Path) -> CliResult:
    proc = subprocess.run([sys.executable, "-m", "jaxrl_llm.train", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def assert_user_error(res: CliResult, *needles: str, run_dir: pathlib.Path | None = None) -> str:
    """Exit code 2, exactly one one-line `error:` message containing every needle, no traceback, and
    a run dir that is absent or holds no half state. Returns the error line."""
    assert not res.escaped, f"an exception escaped main() (a bare traceback for the user):\n{res.escaped}"
    assert "Traceback" not in res.stdout + res.stderr, res.stdout + res.stderr
    assert res.code == 2, (res.code, res.stderr[-2000:])
    lines = res.stderr.splitlines()
    at = [i for i, line in enumerate(lines) if ERROR_LINE.match(line)]
    assert len(at) == 1, f"want exactly one error line:\n{res.stderr}"
    for extra in lines[at[0] + 1:]:  # only log records may follow: the message itself is one line
        assert LOG_RECORD.match(extra), f"the error message runs past one line: {extra!r}\n{res.stderr}"
    line = lines[at[0]]
    for needle in needles:
        assert needle in line, f"{needle!r} not in the error line: {line}"
    if run_dir is not None:
        assert_run_dir_not_broken(run_dir)
    return line


def assert_run_dir_not_broken(run_dir: pathlib.Path) -> None:
    """A failed run leaves no half state: no checkpoint, no metric rows, no temp files. (What setup may
    leave today, an operative_config.gin, an empty checkpoints/ and a tokenizer/, is harmless: a rerun
    starts fresh.)"""
    if not run_dir.exists():
        return
    ckpt = run_dir / "checkpoints"
    assert not ckpt.exists() or not any(ckpt.iterdir()), sorted(p.name for p in ckpt.iterdir())
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or metrics.stat().st_size == 0, metrics.read_text()[:500]
    temps = [p for p in run_dir.rglob("*") if "tmp" in p.name.lower()]
    assert not temps, temps


@pytest.fixture(autouse=True)
def _clear_gin_after():
    """main() leaves its bindings in gin's global config; later test modules must not see them."""
    yield
    gin.clear_config()


@pytest.fixture
def no_model_load(monkeypatch):
    """Setup errors must stop before the (possibly 7B) model is built: building it fails the test."""

    def tripwire(self, *args, **kwargs):
        raise AssertionError("the bad input was not caught before the trainer worker (the model) was built")

    monkeypatch.setattr(worker_module.TrainerWorker, "__init__", tripwire)


def tiny_args(run_dir: pathlib.Path, *bindings: str) -> list[str]:
    """The arithmetic demo (built-in data and tokenizer, random tiny model), one step."""
    params = (*FAST, f"train.run_dir = {str(run_dir)!r}", *bindings)
    return [f"--gin_file={TINY_GIN}", *(f"--gin_param={p}" for p in params)]


def files_args(run_dir: pathlib.Path, train_files, tokenizer_dir, *bindings: str) -> list[str]:
    """GSM8K-style veRL data files with a HF tokenizer and a random tiny model, one step."""
    return tiny_args(run_dir, "data.source = 'files'",
                     f"data.train_files = {[str(f) for f in train_files]!r}",
                     f"model.tokenizer_path = {str(tokenizer_dir)!r}", "model.overrides = {'vocab_size': 151936}",
                     "data.train_batch_size = 2", "actor.ppo_mini_batch_size = 2", "rollout.n = 2",
                     "data.max_prompt_length = 96", "data.max_response_length = 4",
                     "actor.ppo_max_token_len_per_gpu = 512", *bindings)


# ---- fixture data -------------------------------------------------------------------------------


def gsm8k_row(i: int, *, content: str | None = None, ground_truth: str | None = None) -> dict:
    """A veRL-schema row as `scripts/prepare_gsm8k.py` writes it, with a short question."""
    a, b = i % 7 + 1, i % 5 + 2
    if content is None:
        content = f'What is {a} plus {b}? Output the final answer after "####".'
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": content}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth or str(a + b)},
            "extra_info": {"split": "train", "index": i}}


def write_jsonl(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


ROWS = [gsm8k_row(i) for i in range(6)]


def without(rows: list[dict], index: int, field: str) -> list[dict]:
    """A copy of rows with `field` ("a" or "a.b") removed from row `index`."""
    rows = copy.deepcopy(rows)
    *parents, leaf = field.split(".")
    target = rows[index]
    for p in parents:
        target = target[p]
    del target[leaf]
    return rows


@pytest.fixture(scope="module")
def small_tokenizer_dir(tmp_path_factory) -> pathlib.Path:
    """A HF tokenizer dir that loads in milliseconds (the demo's, with a chat template), for cases
    that fail before any prompt is tokenized for real."""
    out = tmp_path_factory.mktemp("small_tokenizer")
    build_tokenizer(str(out))
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> pathlib.Path:
    """A tiny random HF Qwen2 (vocab 128 >= the demo tokenizer's 16), saved with save_pretrained."""
    from tests.hf_models import make_hf_model

    out = tmp_path_factory.mktemp("hf_qwen2")
    make_hf_model(out)
    return out


def edited_hf_dir(src: pathlib.Path, dst: pathlib.Path, edit) -> pathlib.Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


# ---- data ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("field", ["prompt", "reward_model.ground_truth", "data_source"])
def test_row_missing_a_required_field(field, fmt, tmp_path, small_tokenizer_dir, capsys, no_model_load):
    path = (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"train.{fmt}", without(ROWS, 3, field))
    run_dir = tmp_path / "run"
    res = run_main(files_args(run_dir, [path], small_tokenizer_dir), capsys)
    assert_user_error(res, "DataError", f"{path} row 3", repr(field), run_dir=run_dir)


def test_corrupt_parquet(tmp_path, small_tokenizer_dir, capsys, no_model_load):
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1" + b"\x00 not a parquet file" * 10)
    res = run_main(files_args(tmp_path / "run", [path], small_tokenizer_dir), capsys)
    assert_user_error(res, "DataError", str(path), "cannot read it as parquet", run_dir=tmp_path / "run")


def test_train_file_does_not_exist(tmp_path, small_tokenizer_dir, capsys, no_model_load):
    path = tmp_path / "nope.parquet"
    res = run_main(files_args(tmp_path / "run", [path], small_tokenizer_dir), capsys)
    assert_user_error(res, "DataError", str(path), "no such dataset file", run_dir=tmp_path / "run")


def test_invalid_json_line(tmp_path, small_tokenizer_dir, capsys, no_model_load):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    res = run_main(files_args(tmp_path / "run", [path], small_tokenizer_dir), capsys)
    assert_user_error(res, "DataError", f"{path} line 2", "not valid JSON", run_dir=tmp_path / "run")


def test_unknown_file_type(tmp_path, small_tokenizer_dir, capsys, no_model_load):
    path = tmp_path / "train.csv"
    path.write_text("data_source,prompt\n")
    res = run_main(files_args(tmp_path / "run", [path], small_tokenizer_dir), capsys)
    assert_user_error(res, "DataError", str(path), ".parquet", run_dir=tmp_path / "run")


def test_every_row_filtered(tmp_path, small_tokenizer_dir, capsys, no_model_load):
    rows = [gsm8k_row(i, ground_truth="seven") for i in range(4)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    res = run_main(files_args(tmp_path / "run", [path], small_tokenizer_dir), capsys)
    assert_user_error(res, "DataError", str(path), "empty after filtering", "4 with a non-numeric",
                      run_dir=tmp_path / "run")


def test_fewer_prompts_than_one_batch(tmp_path, small_tokenizer_dir, capsys, no_model_load):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS[:3])
    res = run_main(files_args(tmp_path / "run", [path], small_tokenizer_dir, "data.train_batch_size = 4",
                              "actor.ppo_mini_batch_size = 4"), capsys)
    assert_user_error(res, "DataError", "3 prompts, fewer than one batch of 4", str(path), "data.train_batch_size",
                      run_dir=tmp_path / "run")


def test_data_source_without_a_reward_function(tmp_path, small_tokenizer_dir, capsys, no_model_load):
    rows = copy.deepcopy(ROWS)
    for row in rows:
        row["data_source"] = "my_org/my_dataset"
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    res = run_main(files_args(tmp_path / "run", [path], small_tokenizer_dir), capsys)
    assert_user_error(res, "RewardConfigError", "'my_org/my_dataset'", "reward.custom_reward_path",
                      run_dir=tmp_path / "run")


# Counted filters: one successful run over a file with one row for each filter, then one test each.
@pytest.fixture(scope="module")
def filtered_run(tmp_path_factory, qwen2_tokenizer_dir):
    tmp = tmp_path_factory.mktemp("filtered_run")
    rows = [gsm8k_row(i) for i in range(4)]
    rows.insert(1, gsm8k_row(10, content="  "))                                   # row 1: empty
    rows.insert(2, gsm8k_row(11, content="Count the sheep. " * 40))               # row 2: overlong
    rows.insert(3, gsm8k_row(12, ground_truth="about seven"))                      # row 3: not a number
    path = write_jsonl(tmp / "train.jsonl", rows)
    run_dir = tmp / "run"
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("jaxrl_llm.data")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    gin.clear_config()
    try:
        code = train.main(files_args(run_dir, [path], qwen2_tokenizer_dir))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    summary = [r for r in records if r.startswith("PromptDataset")]
    return code, summary, path, run_dir


@pytest.mark.parametrize("what", [
    pytest.param("1 empty prompts (first: {path} row 1)", id="empty_prompt"),
    pytest.param("1 longer than 96 tokens (first: {path} row 2", id="overlong_prompt"),
    pytest.param("1 non-numeric gsm8k ground truths (first: {path} row 3: 'about seven')", id="non_numeric_truth"),
])
def test_counted_filter(filtered_run, what):
    code, summary, path, run_dir = filtered_run
    assert code == 0
    assert len(summary) == 1, summary
    assert "kept 4 of 7 rows" in summary[0]
    assert what.format(path=path) in summary[0], summary[0]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]


# ---- config -------------------------------------------------------------------------------------


def binding_case(binding: str, *needles: str):
    return pytest.param(binding, needles, id=binding)


@pytest.mark.parametrize("binding, needles", [
    binding_case("train.nope = 1", "unknown key train.nope", "--list_keys"),
    binding_case("trian.total_epochs = 1", "unknown key trian.total_epochs", "did you mean train.total_epochs"),
    binding_case("trainer.save_freq = 10", "veRL's trainer.save_freq is train.save_freq here"),
    binding_case("model.target_modules = ['q_proj']", "model.target_modules is set but model.lora_rank is 0"),
    binding_case("rollout.top_p = 1.5", "rollout.top_p", "1.5"),
    binding_case("rollout.n = 0", "rollout.n", "n >= 1"),
    binding_case("data.source = 'files'", "data.train_files"),  # a required value is missing
    binding_case("actor.ppo_mini_batch_size = 10", "actor.ppo_mini_batch_size", "does not divide", "25"),
    binding_case("algorithm.adv_estimator = 'grpoo'", "algorithm.adv_estimator", "'grpoo'", "'grpo'"),
    binding_case("data.train_batch_size = 'abc'", "data.train_batch_size", "str"),
    binding_case("rollout.n = '4'", "rollout.n", "'4'", "str"),
    binding_case("train.total_epochs = [", "train.total_epochs"),
    binding_case("train.logger = ('jsonl', 'tensorbord')", "train.logger", "'tensorbord'"),
    binding_case("rollout.weights_dir = '/no/such/ram/disk'", "rollout.weights_dir", "'/no/such/ram/disk'",
                 "not a directory"),
    binding_case("rollout.decode_attention = 'triton'", "rollout.decode_attention", "'triton'", "'auto'"),
])
def test_bad_binding(binding, needles, tmp_path, capsys, no_model_load):
    res = run_main(tiny_args(tmp_path / "run", binding), capsys)
    assert_user_error(res, *needles, run_dir=tmp_path / "run")


def test_gin_file_does_not_exist(tmp_path, capsys):
    res = run_main([f"--gin_file={tmp_path / 'nope.gin'}"], capsys)
    assert_user_error(res, "--gin_file", str(tmp_path / "nope.gin"), "no such file")


def test_gin_file_syntax_error(tmp_path, capsys):
    path = tmp_path / "broken.gin"
    path.write_text(f"include {TINY_GIN!r}\ntrain.total_epochs = = 3\n")
    res = run_main([f"--gin_file={path}"], capsys)
    assert_user_error(res, "broken.gin", "line 2")


def test_no_gin_file_flag(capsys):
    res = run_main([], capsys)
    assert_user_error(res, "--gin_file")


def test_preset_without_tokenizer_for_data_files(tmp_path, capsys, no_model_load):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    res = run_main(tiny_args(tmp_path / "run", "data.source = 'files'", f"data.train_files = [{str(path)!r}]"),
                   capsys)
    assert_user_error(res, "model.tokenizer_path", run_dir=tmp_path / "run")


def test_tokenizer_path_does_not_exist(tmp_path, capsys, no_model_load):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    res = run_main(files_args(tmp_path / "run", [path], tmp_path / "no_tokenizer"), capsys)
    assert_user_error(res, "model.tokenizer_path", str(tmp_path / "no_tokenizer"), run_dir=tmp_path / "run")


def test_unknown_model_preset(tmp_path, capsys):
    res = run_main(tiny_args(tmp_path / "run", "model.preset = 'tinyy'"), capsys)
    assert_user_error(res, "model.preset", "'tinyy'", run_dir=tmp_path / "run")


def test_model_override_names_no_field(tmp_path, capsys):
    res = run_main(tiny_args(tmp_path / "run", "model.overrides = {'vocab_sise': 16}"), capsys)
    assert_user_error(res, "ConfigError", "'vocab_sise'", "did you mean 'vocab_size'", "model.overrides",
                      run_dir=tmp_path / "run")


def test_model_dtype_is_not_a_dtype(tmp_path, capsys):
    res = run_main(tiny_args(tmp_path / "run", "model.dtype = 'float33'"), capsys)
    assert_user_error(res, "ConfigError", "dtype='float33'", run_dir=tmp_path / "run")


def test_model_path_does_not_exist(tmp_path, capsys):
    path = tmp_path / "no_model"
    res = run_main(tiny_args(tmp_path / "run", "model.preset = None", f"model.path = {str(path)!r}"), capsys)
    assert_user_error(res, str(path), "local HF model directory", run_dir=tmp_path / "run")


def test_hf_model_with_mismatched_tensor_shapes(tmp_path, hf_dir, capsys):
    path = edited_hf_dir(hf_dir, tmp_path / "hf", lambda c: c.update(intermediate_size=80))
    res = run_main(tiny_args(tmp_path / "run", "model.preset = None", f"model.path = {str(path)!r}",
                             "model.overrides = None"), capsys)
    assert_user_error(res, "CheckpointError", str(path), "'model.layers.0.mlp.gate_proj.weight'", "[96, 64]",
                      "[80, 64]", run_dir=tmp_path / "run")


def test_hf_model_with_unsupported_architecture(tmp_path, hf_dir, capsys):
    path = edited_hf_dir(hf_dir, tmp_path / "hf", lambda c: c.update(architectures=["LlamaForCausalLM"]))
    res = run_main(tiny_args(tmp_path / "run", "model.preset = None", f"model.path = {str(path)!r}",
                             "model.overrides = None"), capsys)
    assert_user_error(res, "ConfigError", str(path / "config.json"), "LlamaForCausalLM", "Qwen2ForCausalLM",
                      run_dir=tmp_path / "run")


@pytest.mark.parametrize("edit,needles", [
    # Qwen3-MoE is supported; a Mixtral-style expert count on a dense family is not.
    (dict(num_local_experts=8), ["num_local_experts=8", "mixture-of-experts", "model_type='qwen2'", "qwen3_moe"]),
    (dict(use_sliding_window=True, sliding_window=16), ["use_sliding_window=true", "sliding-window"]),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), ["rope_scaling.rope_type='yarn'", "default, llama3"]),
], ids=["moe", "sliding_window", "rope_type"])
def test_hf_model_with_unsupported_feature(edit, needles, tmp_path, hf_dir, capsys):
    path = edited_hf_dir(hf_dir, tmp_path / "hf", lambda c: c.update(edit))
    res = run_main(tiny_args(tmp_path / "run", "model.preset = None", f"model.path = {str(path)!r}",
                             "model.overrides = None"), capsys)
    assert_user_error(res, "ConfigError", str(path / "config.json"), *needles, run_dir=tmp_path / "run")


def test_hf_config_missing_a_field(tmp_path, hf_dir, capsys):
    path = edited_hf_dir(hf_dir, tmp_path / "hf", lambda c: c.pop("intermediate_size"))
    res = run_main(tiny_args(tmp_path / "run", "model.preset = None", f"model.path = {str(path)!r}",
                             "model.overrides = None"), capsys)
    assert_user_error(res, "ConfigError", str(path / "config.json"), "'intermediate_size'", run_dir=tmp_path / "run")


def test_mesh_that_the_devices_cannot_form(tmp_path, capsys):
    # 8 simulated devices. (A batch that the data-parallel size does not divide is *not* bad input:
    # micro-batches are packed to fixed [rows x dp] shapes, so batch 6 trains on fsdp=8.)
    res = run_main(tiny_args(tmp_path / "run", "train.mesh_fsdp = 3"), capsys)
    assert_user_error(res, "MeshError", "fsdp=3", "8 device", "train.mesh_fsdp", run_dir=tmp_path / "run")


# ---- rewards ------------------------------------------------------------------------------------


def test_custom_reward_file_does_not_exist(tmp_path, capsys, no_model_load):
    path = tmp_path / "my_reward.py"
    res = run_main(tiny_args(tmp_path / "run", f"reward.custom_reward_path = {str(path)!r}"), capsys)
    assert_user_error(res, "RewardConfigError", str(path), "does not exist", run_dir=tmp_path / "run")


def test_custom_reward_file_raises_on_import(tmp_path, capsys, no_model_load):
    path = tmp_path / "my_reward.py"
    path.write_text("import math\nimport no_such_module_for_this_test\n")
    res = run_main(tiny_args(tmp_path / "run", f"reward.custom_reward_path = {str(path)!r}"), capsys)
    assert_user_error(res, "RewardConfigError", f"{path}:2", "ModuleNotFoundError", run_dir=tmp_path / "run")


def test_custom_reward_name_is_not_defined(tmp_path, capsys, no_model_load):
    path = tmp_path / "my_reward.py"
    path.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    res = run_main(tiny_args(tmp_path / "run", f"reward.custom_reward_path = {str(path)!r}",
                             "reward.custom_reward_name = 'compute_score'"), capsys)
    assert_user_error(res, "RewardConfigError", "'compute_score'", str(path), "['my_score']",
                      run_dir=tmp_path / "run")


# ---- the run dir --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["data", "model"])
def test_setup_failure_leaves_no_run_dir(case, tmp_path, small_tokenizer_dir, hf_dir, capsys):
    run_dir = tmp_path / "run"
    if case == "data":
        args = files_args(run_dir, [tmp_path / "nope.jsonl"], small_tokenizer_dir)
    else:
        path = edited_hf_dir(hf_dir, tmp_path / "hf", lambda c: c.update(intermediate_size=80))
        args = tiny_args(run_dir, "model.preset = None", f"model.path = {str(path)!r}", "model.overrides = None")
    assert_user_error(run_main(args, capsys))
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())


# ---- end to end: `python -m jaxrl_llm.train` ----------------------------------------------------


def test_cli_missing_train_file(tmp_path, small_tokenizer_dir):
    path = tmp_path / "nope.parquet"
    res = run_subprocess(files_args(tmp_path / "run", [path], small_tokenizer_dir), cwd=tmp_path)
    assert_user_error(res, "DataError", str(path), run_dir=tmp_path / "run")


def test_cli_gin_syntax_error(tmp_path):
    path = tmp_path / "broken.gin"
    path.write_text(f"include {TINY_GIN!r}\ntrain.total_epochs = = 3\n")
    res = run_subprocess([f"--gin_file={path}"], cwd=tmp_path)
    assert_user_error(res, "broken.gin", "line 2")


def test_cli_no_gin_file_flag(tmp_path):
    res = run_subprocess([], cwd=tmp_path)
    assert_user_error(res, "--gin_file")
