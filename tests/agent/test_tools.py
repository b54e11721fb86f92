"""Tools: schemas from signatures, every error kind as a result the model sees, concurrency, caps and
truncation, veRL-style class tools through veRL's YAML, the GSM8K tool and its data prep script."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import json
import pathlib
import threading
import time
from typing import Literal, Optional

import pytest

from jaxrl_llm.agent.builtin_tools import Gsm8kTool, calculator, multiply
from jaxrl_llm.agent.formats import get_format
from jaxrl_llm.agent.tools import (
    ERROR_KINDS,
    ToolCall,
    ToolCallError,
    ToolConfigError,
    ToolRunner,
    ToolSchemaError,
    function_schema,
    function_tool,
    load_tool_config,
    truncate_text,
)

REPO = pathlib.Path(__file__).resolve().parents[2]
GSM8K_TOOL_YAML = REPO / "gin" / "tools" / "gsm8k_tool_config.yaml"


def documented(a: int, b: float, name: str, flag: bool, xs: list[int], maybe: Optional[int] = None,  # noqa: UP045
               mode: Literal["fast", "slow"] = "fast", options: dict | None = None) -> str:
    """Does a documented thing.

    A second paragraph.

    Args:
        a: an int.
        b: a float
            described over two lines.
        name: the name.
        flag: a flag.
        xs: numbers.
        maybe: an optional int.
        mode: how fast.
        options: extra options.

    Returns:
        a summary.
    """
    return f"{a} {b} {name} {flag} {xs} {maybe} {mode} {options}"


def test_function_schema_equals_transformers_get_json_schema():
    from transformers.utils import get_json_schema

    for fn in (documented, calculator, multiply):
        # Byte-equal JSON: the tools render the same tokens in a chat template as with TRL/transformers.
        assert json.dumps(function_schema(fn)) == json.dumps(get_json_schema(fn)), fn.__name__
    params = function_schema(documented)["function"]["parameters"]
    assert params["required"] == ["a", "b", "name", "flag", "xs"]
    assert params["properties"]["b"]["description"] == "a float described over two lines."
    assert params["properties"]["maybe"] == {"type": "integer", "nullable": True, "description": "an optional int."}


def test_function_schema_refuses_what_a_model_cannot_fill():
    def untyped(a, b: int) -> int:
        return b

    def variadic(*args: int) -> int:
        return 0

    def odd_type(a: set[int]) -> int:
        return 0

    with pytest.raises(ToolSchemaError, match="'a' has no type hint"):
        function_schema(untyped)
    with pytest.raises(ToolSchemaError, match=r"\*args/\*\*kwargs"):
        function_schema(variadic)
    with pytest.raises(ToolSchemaError, match="no JSON schema"):
        function_schema(odd_type)
    with pytest.raises(ToolSchemaError, match="tool name"):
        function_schema(multiply, name="has space")


def _hang(seconds: float = 30.0) -> str:
    time.sleep(seconds)
    return "woke up"


async def _async_hang() -> str:
    await asyncio.sleep(30)
    return "woke up"


def _fail(x: int) -> str:
    raise RuntimeError(f"cannot handle {x}")


@pytest.fixture
def runner():
    tools = [documented, multiply, _hang, _async_hang, _fail]
    with ToolRunner(tools, max_parallel_calls=10, timeout_s=0.5, max_tool_response_length=400) as r:
        yield r


def test_every_bad_call_becomes_an_error_result_and_is_counted(runner):
    session = runner.open()
    calls = [
        ToolCallError("the tool call is not valid JSON", "{bad"),
        ToolCall("divide", {"a": 1}),
        ToolCall("multiply", {"a": 3}),                       # missing b
        ToolCall("multiply", {"a": 3, "b": 4, "c": 5}),        # extra c
        ToolCall("multiply", {"a": "three", "b": 4}),          # wrong type
        ToolCall("documented", {"a": 1, "b": 2.0, "name": "n", "flag": True, "xs": [1, "2"]}),
        ToolCall("_fail", {"x": 7}),
        ToolCall("_hang", {}),
        ToolCall("_async_hang", {}),
        ToolCall("multiply", {"a": 6, "b": 7.0}),              # 7.0 is an int: fixed, and it runs
    ]
    results = session.call(calls)
    assert [r.error for r in results] == ["parse", "unknown_tool", "bad_arguments", "bad_arguments",
                                          "bad_arguments", "bad_arguments", "raised", "timeout", "timeout", None]
    texts = [r.text for r in results]
    assert texts[0] == "Error: the tool call is not valid JSON"
    assert "unknown tool 'divide'" in texts[1] and "'multiply'" in texts[1]
    assert "missing required argument(s) ['b']" in texts[2]
    assert "unexpected argument(s) ['c']" in texts[3]
    assert "argument 'a' of tool 'multiply' must be integer" in texts[4]
    assert "argument 'xs' of tool 'documented'[1] must be integer" in texts[5]
    assert texts[6] == "Error: tool '_fail' raised RuntimeError: cannot handle 7"
    assert texts[7] == "Error: tool '_hang' timed out after 0.5 s" and texts[8].endswith("timed out after 0.5 s")
    assert texts[9] == "42"
    assert session.metrics["calls"] == 10 and session.metrics["errors"] == 9
    assert {k: session.metrics[f"errors/{k}"] for k in ERROR_KINDS} == {
        "parse": 1, "unknown_tool": 1, "bad_arguments": 4, "raised": 1, "timeout": 2, "too_many_calls": 0}
    assert session.metrics["seconds"] >= sum(r.seconds for r in results[7:9])
    assert runner.stuck_threads == 1  # the sync _hang keeps its daemon thread; the async one was cancelled
    session.release()


def test_calls_of_one_turn_run_concurrently():
    barrier = threading.Barrier(3, timeout=5.0)

    def meet(i: int) -> str:
        barrier.wait()  # raises BrokenBarrierError unless all three calls run at the same time
        return f"met {i}"

    with ToolRunner([meet], max_parallel_calls=3, timeout_s=10.0) as runner:
        results = runner.open().call([ToolCall("meet", {"i": i}) for i in range(3)])
    assert [r.text for r in results] == ["met 0", "met 1", "met 2"]


def test_worker_pool_stays_bounded_and_survives_a_hung_tool():
    with ToolRunner([multiply, _hang, _async_hang], max_parallel_calls=2, timeout_s=20.0, max_workers=2) as runner:
        sessions = [runner.open() for _ in range(50)]
        futures = [s.call_future([ToolCall("multiply", {"a": i, "b": 3})]) for i, s in enumerate(sessions)]
        assert [f.result()[0].text for f in futures] == [str(3 * i) for i in range(50)]
        runner.timeout_s = 0.3
        hung = sessions[0].call([ToolCall("_hang", {}), ToolCall("_hang", {})])
        runner.timeout_s = 20.0
        assert [r.error for r in hung] == ["timeout", "timeout"] and runner.stuck_threads == 2
        # both workers hang, yet calls still run: each hung worker was replaced
        assert sessions[1].call([ToolCall("multiply", {"a": 2, "b": 2})])[0].text == "4"
        workers = [t for t in threading.enumerate() if t.name == runner._pool.name]
        assert len(workers) == 4  # 2 hung + 2 replacements, after 54 calls
        in_flight = sessions[2].call_future([ToolCall("_async_hang", {})])
    with pytest.raises(concurrent.futures.CancelledError):  # closing cancels it: no caller waits forever
        in_flight.result(timeout=5.0)


def test_parallel_call_cap_and_truncation_sides():
    with ToolRunner([multiply], max_parallel_calls=2, timeout_s=5.0) as runner:
        results = runner.open().call([ToolCall("multiply", {"a": i, "b": 2}) for i in range(4)])
    assert [r.text for r in results[:2]] == ["0", "2"]
    assert [r.error for r in results] == [None, None, "too_many_calls", "too_many_calls"]
    assert "at most 2 run" in results[2].text
    text = "abcdefghij" * 3
    assert truncate_text(text, 30) == text
    assert truncate_text(text, 4, "left") == "abcd...(truncated)"
    assert truncate_text(text, 4, "right") == "(truncated)...ghij"
    assert truncate_text(text, 4, "middle") == "ab...(truncated)...ij"

    def long_text() -> str:
        return "0123456789" * 10

    for side, expected in (("left", "0123456789...(truncated)"), ("right", "(truncated)...0123456789"),
                           ("middle", "01234...(truncated)...56789")):
        with ToolRunner([long_text], max_tool_response_length=10, tool_response_truncate_side=side) as runner:
            assert runner.open().call([ToolCall("long_text", {})])[0].text == expected
    with pytest.raises(ValueError, match="tool_response_truncate_side"):
        ToolRunner([long_text], tool_response_truncate_side="top")
    with pytest.raises(ValueError, match="max_parallel_calls"):
        ToolRunner([long_text], max_parallel_calls=0)


VERL_STYLE_MODULE = '''
import asyncio
from uuid import uuid4

from jaxrl_llm.agent.tools import BaseTool


class Response:  # the shape of veRL's ToolResponse: the text is an attribute
    def __init__(self, text):
        self.text = text


class CounterTool(BaseTool):
    """Adds to a per-trajectory total that starts at create_kwargs['start'] (veRL's agent-loop style:
    create(create_kwargs=...) returning (instance_id, response))."""

    released = []

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.state = {}

    async def create(self, instance_id=None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self.state[instance_id] = kwargs["create_kwargs"]["start"]
        return instance_id, Response("")

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(0.01)
        self.state[instance_id] += parameters["amount"]
        return Response(f"total {self.state[instance_id]}"), self.config["step_reward"], {"amount": 1}

    async def calc_reward(self, instance_id, **kwargs):
        return float(self.state[instance_id] == self.config["target"])

    async def release(self, instance_id, **kwargs):
        CounterTool.released.append(self.state.pop(instance_id))
'''

VERL_STYLE_YAML = '''
tools:
  - class_name: {module}.CounterTool
    config: {{type: native, step_reward: 0.25, target: 10}}
    tool_schema:
      type: function
      function:
        name: add
        description: Adds an amount to the running total.
        parameters:
          type: object
          properties:
            amount: {{type: integer, description: what to add}}
          required: [amount]
'''


def test_verl_style_async_class_tool_from_yaml(tmp_path, monkeypatch):
    module = f"verl_style_tools_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(VERL_STYLE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "tools.yaml"
    config.write_text(VERL_STYLE_YAML.format(module=module))
    tools = load_tool_config(str(config))
    assert [t.name for t in tools] == ["add"] and tools[0].tool_schema.function.name == "add"
    with ToolRunner(tools, max_parallel_calls=2, timeout_s=5.0) as runner:
        assert runner.schemas[0]["function"]["parameters"]["required"] == ["amount"]
        first = runner.open({"add": {"create_kwargs": {"start": 5}}})
        other = runner.open({"add": {"create_kwargs": {"start": 0}}})
        calls = get_format("hermes").parse(
            '<tool_call>\n{"name": "add", "arguments": {"amount": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": "{\\"amount\\": 3}"}\n</tool_call>')
        results = first.call(calls)
        assert sorted(r.text for r in results) == ["total 10", "total 7"] or \
            sorted(r.text for r in results) == ["total 10", "total 8"]
        assert [r.reward for r in results] == [0.25, 0.25] and all(r.error is None for r in results)
        assert other.call([ToolCall("add", {"amount": 1})])[0].text == "total 1"
        assert first.reward() == 1.0 and other.reward() == 0.0  # instances are per trajectory
        first.release()
        other.release()
        first.release()  # twice is fine
    released = __import__(module).CounterTool.released
    assert sorted(released) == [1, 10]


def test_tool_config_errors_name_the_file_and_entry(tmp_path):
    cases = {
        "tools: []": "non-empty list under `tools:`",
        "tools: [{class_name: no.such.module.Tool}]": r"tools\[0\]: cannot import class_name 'no.such.module.Tool'",
        "tools: [{class_name: jaxrl_llm.agent.builtin_tools.Gsm8kTool, config: {type: mcp}}]": "'mcp' tools",
        "tools: [{class_name: jaxrl_llm.agent.builtin_tools.Gsm8kTool, tool_schema: {function: {}}}]":
            r"tools\[0\] \(jaxrl_llm.agent.builtin_tools.Gsm8kTool\): building the tool failed.*tool_schema must",
        "tools: [{class_name: jaxrl_llm.agent.builtin_tools.Gsm8kTool, schema: {}}]": r"unknown key\(s\) \['schema'\]",
        "tools: [{class_name: jaxrl_llm.agent.builtin_tools.multiply},"
        " {class_name: jaxrl_llm.agent.builtin_tools.multiply}]": "appear more than once",
        "tools: [": "not valid YAML",
    }
    for i, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.yaml"
        path.write_text(text)
        with pytest.raises(ToolConfigError, match=message) as info:
            load_tool_config(str(path))
        assert str(path) in str(info.value)
    with pytest.raises(ToolConfigError, match="tool_config_path"):
        load_tool_config(str(tmp_path / "missing.yaml"))
    verl_yaml = tmp_path / "verl.yaml"  # a config copied from veRL loads our GSM8K tool
    verl_yaml.write_text(GSM8K_TOOL_YAML.read_text().replace("jaxrl_llm.agent.builtin_tools.Gsm8kTool",
                                                             "verl.tools.gsm8k_tool.Gsm8kTool"))
    assert isinstance(load_tool_config(str(verl_yaml))[0], Gsm8kTool)


def test_tools_kwargs_are_checked():
    with ToolRunner([multiply]) as runner:
        with pytest.raises(ValueError, match="extra_info.tools_kwargs names tool 'add'.*tool_config_path"):
            runner.open({"add": {"create_kwargs": {}}})
        with pytest.raises(ValueError, match=r"\['multiply'\] has key 'create'"):
            runner.open({"multiply": {"create": {}}})
        runner.open({"multiply": None, "add": None})  # parquet fills absent struct fields with null


def test_gsm8k_tool_rewards_as_verl():
    tools = load_tool_config(str(GSM8K_TOOL_YAML))
    with ToolRunner(tools, timeout_s=5.0) as runner:
        session = runner.open({"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}})
        wrong, right, again = (session.call([ToolCall("calc_gsm8k_reward", {"answer": a})])[0]
                               for a in ("70", 72, "#### 72"))
        assert (wrong.text, wrong.reward) == ("Current parsed answer='70' reward=0.0", -0.05)
        assert (right.text, right.reward) == ("Current parsed answer='72' reward=1.0", 0.0)  # 72 -> "72"
        assert again.reward == -0.05  # no improvement
        assert session.reward() == 1.0
        session.release()
        assert tools[0]._instances == {}
        missing = runner.open().call([ToolCall("calc_gsm8k_reward", {"answer": "1"})])[0]
        assert missing.error == "raised" and "create_kwargs.ground_truth" in missing.text


def test_calculator_and_multiply():
    assert calculator("(12 + 30) * 4 / 3") == "56"
    assert calculator("2 ** 10 - sqrt(16) + abs(-2) + 3^2") == str(1024 - 4 + 2 + 9)
    assert calculator("7 / 2") == "3.5" and calculator("7 // 2") == "3" and calculator("0.1 + 0.2") == "0.3"
    for bad, message in (("__import__('os')", "not arithmetic"), ("9 ** 9 ** 9", "too large"),
                         ("1 / 0", "division by zero"), ("1 +", "cannot parse"), ("x + 1", "not arithmetic")):
        with pytest.raises(ValueError, match=message):
            calculator(bad)
    assert multiply(123456789, 987654321) == 123456789 * 987654321
    with ToolRunner([calculator, multiply]) as runner:
        results = runner.open().call([ToolCall("multiply", {"a": 12, "b": 11})])
    assert results[0].text == "132"
    assert function_tool(multiply).name == "multiply"


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_gsm8k_multiturn_rows_work_with_our_loader_and_the_tool(tmp_path, shared_data):
    from jaxrl_llm.data import read_rows

    script = _load_script("prepare_gsm8k_multiturn")
    out = tmp_path / "gsm8k_mt"
    assert script.main(["--local_dataset_path", str(shared_data / "gsm8k"), "--local_save_dir", str(out),
                        "--max_rows", "3"]) == 0
    rows = read_rows(str(out / "train.parquet"))
    assert len(rows) == 3 and len(read_rows(str(out / "test.parquet"))) == 3
    row = rows[0].data
    assert row["data_source"] == "openai/gsm8k" and row["agent_name"] == "tool_agent"
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert "calc_gsm8k_reward" in row["prompt"][0]["content"] and "####" in row["prompt"][1]["content"]
    truth = row["reward_model"]["ground_truth"]
    assert row["extra_info"]["need_tools_kwargs"] is True
    assert row["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"]["ground_truth"] == truth
    with ToolRunner(load_tool_config(str(GSM8K_TOOL_YAML))) as runner:
        session = runner.open(row["extra_info"]["tools_kwargs"])
        assert session.call([ToolCall("calc_gsm8k_reward", {"answer": truth})])[0].text.endswith("reward=1.0")
        assert session.reward() == 1.0
    assert script.main(["--local_dataset_path", str(tmp_path / "nowhere"), "--local_save_dir", str(out)]) == 2
