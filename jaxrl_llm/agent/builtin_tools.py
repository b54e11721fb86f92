"""Tools that ship with jaxrl_llm.

- `Gsm8kTool` (`calc_gsm8k_reward`): the answer-checking tool of veRL's GSM8K multi-turn example. The
  model submits `answer`; the tool scores it against the row's ground truth (our GSM8K scorer, flexible
  extraction) and says so. A submission that does not improve on the last one costs a -0.05 step reward.
  `calc_reward` is the trajectory's tool reward: 1.0 if the last submitted answer is right.
- `calculator`: arithmetic on numbers (+ - * / // % **, parentheses, abs/round/min/max/sqrt), parsed
  with `ast` and evaluated node by node (no `eval`), with caps on size.
- `multiply(a, b)`: the demo's tool (products too large for a tiny model to compute).
- `PythonTool` (`python`): runs code in the sandbox (`jaxrl_llm.agent.sandbox`) and returns its output.

Their tool YAML entries are in `gin/tools/` (veRL's format, for `rollout.multi_turn.tool_config_path`).
"""

from __future__ import annotations

import ast
import logging
import math
import operator
import threading
import uuid
from typing import Any

from jaxrl_llm.agent.sandbox import SandboxLimits, run_python
from jaxrl_llm.agent.tool_types import BaseTool
from jaxrl_llm.rewards.gsm8k import compute_score

logger = logging.getLogger(__name__)

GSM8K_TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if "
                       "parsed answer is incorrect or not correctly parsed)",
        "parameters": {"type": "object",
                       "properties": {"answer": {"type": "string",
                                                 "description": "The model's answer to the GSM8K math problem, "
                                                                "must be a digits"}},
                       "required": ["answer"]},
    },
}

PYTHON_TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Runs a Python program in a sandbox (no network, limited time and memory) and returns "
                       "what it printed. Print the values you need.",
        "parameters": {"type": "object",
                       "properties": {"code": {"type": "string", "description": "the Python program to run"}},
                       "required": ["code"]},
    },
}


class Gsm8kTool(BaseTool):
    """veRL's GSM8K answer tool (see the module docstring). Per-trajectory state lives in `_instances`."""

    # A resubmission that does not raise the score gets this step reward (veRL's value).
    no_improvement_penalty = -0.05

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def get_openai_tool_schema(self) -> dict:
        return GSM8K_TOOL_SCHEMA

    def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        if ground_truth is None:  # veRL's agent loop passes create_kwargs={...}
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        if ground_truth is None:
            raise ValueError("calc_gsm8k_reward needs a ground truth: set the row's extra_info.tools_kwargs."
                             "calc_gsm8k_reward.create_kwargs.ground_truth (scripts/prepare_gsm8k_multiturn.py "
                             "writes it)")
        with self._lock:
            self._instances[instance_id] = {"response": "", "ground_truth": str(ground_truth), "reward": 0.0}
        return instance_id

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else self.no_improvement_penalty
        state["reward"] = reward
        return f"Current parsed {answer=} {reward=}", step_reward, {}

    def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        return compute_score(state["response"], state["ground_truth"], method="flexible", format_score=0.0,
                             score=1.0)

    def release(self, instance_id: str, **kwargs) -> None:
        with self._lock:
            self._instances.pop(instance_id, None)


# ---- calculator -------------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt}
_MAX_EXPRESSION_CHARS = 500
_MAX_DIGITS = 1000  # an integer result longer than this is refused (9**9**9 would take the host down)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * math.log10(abs(left)) > _MAX_DIGITS:
            raise ValueError(f"{left} ** {right} is too large")
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int) and (
                left.bit_length() + right.bit_length() > _MAX_DIGITS * 3.33):
            raise ValueError("the product is too large")
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):
            raise ValueError("the result is not a real number")
        return result
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
            and not node.keywords:
        return _FUNCTIONS[node.func.id](*(_evaluate(a) for a in node.args))
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic; use numbers, + - * / // % **, parentheses and "
                     f"{sorted(_FUNCTIONS)}")


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression, such as (12 + 30) * 4 / 3.

    Args:
      expression: numbers combined with + - * / // % ** and parentheses; abs, round, min, max and sqrt
        may be called.
    """
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"cannot parse {expression!r}: {e.msg}") from None
    try:
        value = _evaluate(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large") from None
    if isinstance(value, int) and len(str(abs(value))) > _MAX_DIGITS:
        raise ValueError("the result is too large")
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}" if isinstance(value, float) else str(value)


def multiply(a: int, b: int) -> int:
    """Multiplies two integers exactly.

    Args:
      a: the first factor.
      b: the second factor.
    """
    return a * b


# ---- sandboxed python --------------------------------------------------------------------------------

_LOGGED_NOTES: set[str] = set()


class PythonTool(BaseTool):
    """Runs the model's Python code in the sandbox. `config` keys are `SandboxLimits` fields
    (timeout_s, cpu_s, memory_mb, max_processes, max_file_mb, max_open_files, max_output_bytes, network,
    user) and `python` (the interpreter; default: the trainer's). Keep `timeout_s` below the runner's
    per-call timeout, so that the sandbox kills the program before the runner gives up on it."""

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        options = {k: v for k, v in self.config.items() if k not in ("type", "python")}
        try:
            self.limits = SandboxLimits(**options)
        except TypeError as e:
            raise ValueError(f"python tool config: {e}; the keys are SandboxLimits fields and 'python'") from None
        self.python = self.config.get("python")

    def get_openai_tool_schema(self) -> dict:
        return PYTHON_TOOL_SCHEMA

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        result = run_python(str(parameters.get("code", "")), limits=self.limits, python=self.python)
        if result.isolation_note and result.isolation_note not in _LOGGED_NOTES:
            _LOGGED_NOTES.add(result.isolation_note)
            logger.warning("python tool sandbox: %s", result.isolation_note)
        metrics = {"network_isolated": float(result.network_isolated), "timed_out": float(result.timed_out),
                   "seconds": result.seconds}
        return result.text(self.limits.timeout_s), 0.0, metrics
