"""Tool-call formats: Qwen's hermes `<tool_call>` blocks and Llama 3's JSON calls, including every way
a call can be malformed."""

from __future__ import annotations

import json

import pytest

from jaxrl_llm.agent.formats import get_format
from jaxrl_llm.agent.tools import ToolCall, ToolCallError


def hermes_block(name: str, arguments) -> str:
    """A call as Qwen2.5's chat template renders an assistant `tool_calls` entry."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_hermes_parses_every_call_of_a_turn():
    hermes = get_format("hermes")
    text = ("Let me compute both.\n" + hermes_block("multiply", {"a": 12, "b": 34}) + "\n"
            + hermes_block("calculator", {"expression": "1 + {2}"}) + "<|im_end|>")
    assert hermes.parse(text) == [ToolCall("multiply", {"a": 12, "b": 34}),
                                  ToolCall("calculator", {"expression": "1 + {2}"})]
    # arguments as a JSON string (some models and OpenAI's wire format), and no arguments at all
    text = hermes_block("multiply", json.dumps({"a": 1, "b": 2})) + '<tool_call>{"name": "now"}</tool_call>'
    assert hermes.parse(text) == [ToolCall("multiply", {"a": 1, "b": 2}), ToolCall("now", {})]
    # a final answer has no calls; a call inside Qwen3's thinking does not count
    assert hermes.parse("The answer is 408.") == []
    assert hermes.parse("<think>maybe " + hermes_block("multiply", {"a": 1, "b": 1}) + "</think>#### 1") == []
    # the stop string may cut the closing tag: the JSON is complete, so the call stands
    assert hermes.parse('<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n') == [
        ToolCall("multiply", {"a": 2, "b": 3})]


@pytest.mark.parametrize("body, message", [
    ('{"name": "multiply", "arguments": {"a": 1,}}', "not valid JSON"),
    ('["multiply", {"a": 1}]', "must be a JSON object, got list"),
    ('{"arguments": {"a": 1}}', 'no "name"'),
    ('{"name": "", "arguments": {}}', 'no "name"'),
    ('{"name": "multiply", "arguments": [1, 2]}', '"arguments" of the call to \'multiply\' must be a JSON object'),
    ('{"name": "multiply", "arguments": "{a: 1}"}', "a string that is not valid JSON"),
    ("", "an empty <tool_call> block"),
])
def test_hermes_malformed_calls_are_errors_for_the_model(body, message):
    calls = get_format("hermes").parse(f"<tool_call>\n{body}\n</tool_call>")
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError)
    assert message in calls[0].message
    assert '<tool_call>\n{"name": "tool_name", "arguments"' in calls[0].message  # says how to write a call


def test_hermes_keeps_good_calls_next_to_bad_ones():
    text = hermes_block("multiply", {"a": 1, "b": 2}) + "<tool_call>{oops</tool_call>" + \
        '<tool_call>\n{"name": "multiply", "arguments": {"a"'
    calls = get_format("hermes").parse(text)
    assert calls[0] == ToolCall("multiply", {"a": 1, "b": 2})
    assert isinstance(calls[1], ToolCallError) and "not valid JSON" in calls[1].message
    assert isinstance(calls[2], ToolCallError) and "not closed" in calls[2].message


def test_llama3_json_calls():
    llama = get_format("llama3_json")
    call = {"name": "multiply", "parameters": {"a": 3, "b": 4}}
    assert llama.parse(json.dumps(call)) == [ToolCall("multiply", {"a": 3, "b": 4})]
    assert llama.parse("<|python_tag|>" + json.dumps(call) + "<|eom_id|>") == [ToolCall("multiply", {"a": 3, "b": 4})]
    two = json.dumps(call) + "; " + json.dumps({"name": "calculator", "arguments": {"expression": "{1}; 2"}})
    assert llama.parse(two) == [ToolCall("multiply", {"a": 3, "b": 4}),
                                ToolCall("calculator", {"expression": "{1}; 2"})]
    assert llama.parse("The product is 12.<|eot_id|>") == []


@pytest.mark.parametrize("text, message", [
    ('{"name": "multiply", "parameters": {"a": 3', "not valid JSON"),
    ('{"name": "multiply", "parameters": {"a": 3}} and then', "not valid JSON"),
    ('{"parameters": {"a": 3}}', 'no "name"'),
    ('{"name": "multiply", "parameters": 3}', "must be a JSON object"),
    ("<|python_tag|>brave_search.call(query='x')", "only a JSON call is understood"),
])
def test_llama3_json_malformed_calls(text, message):
    calls = get_format("llama3_json").parse(text)
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError) and message in calls[0].message
    assert '"parameters"' in calls[0].message  # the fix is spelled out


def test_unknown_format_names_the_config_key():
    with pytest.raises(ValueError, match=r"rollout.multi_turn.format='xml'.*'hermes', 'llama3_json'"):
        get_format("xml")
    assert get_format("hermes").name == "hermes" and get_format("llama3_json").name == "llama3_json"
