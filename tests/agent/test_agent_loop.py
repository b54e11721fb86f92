"""The agent loop's mechanics with a scripted policy (what a random model would never write: tool calls)
and the real loop, renderer, tool runner and call formats: token-in-token-out against the chat template
(Qwen2.5-style and Llama-3.1-style fixtures on the real Qwen2 vocabulary), the loss mask, the caps, and
a slow tool that holds back only its own row."""

import re
import threading

import numpy as np
import pytest

from jaxrl_llm.agent.config import MultiTurnConfig
from jaxrl_llm.agent.formats import get_format
from jaxrl_llm.agent.loop import AgentLoop
from jaxrl_llm.agent.tools import ToolRunner, function_tool
from jaxrl_llm.rollout import SamplingParams
from jaxrl_llm.trainer.step_rewards import assistant_spans
from tests.agent.scripted import ScriptedEngine
from tests.agent.templates import qwen2_tokenizer

SECRET = 7919  # the tool's output carries it; no assistant turn ever writes it


def multiply(a: int, b: int) -> str:
    """Multiplies two integers.

    Args:
      a: the first factor.
      b: the second factor.
    """
    return f"{a * b} (checked {SECRET})"


def _call(style: str, a: int, b: int) -> str:
    if style == "qwen2.5":
        call = f'{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}'
        return f"Let me compute.\n<tool_call>\n{call}\n</tool_call>"
    return f'{{"name": "multiply", "parameters": {{"a": {a}, "b": {b}}}}}'


def _policy(style: str, calls_per_turn: int = 1, always_call: bool = False):
    """Turn 1 calls multiply on the question's numbers; after a tool response, answers with its number."""
    sep = "\n" if style == "qwen2.5" else "; "

    def policy(context: str, seed: int) -> str:
        a, b = map(int, re.findall(r"What is (\d+) times (\d+)", context)[-1])
        answers = re.findall(r"(\d+) \(checked", context)
        if answers and not always_call:
            return f"The answer is {answers[-1]}."
        return sep.join([_call(style, a, b)] * calls_per_turn)
    return policy


def _rows(tokenizer, runner, count=2):
    rows = []
    for i in range(count):
        messages = [{"role": "user", "content": f"What is {12 + i} times {34 + i}?"}]
        text = tokenizer.apply_chat_template(messages, tools=runner.schemas, add_generation_prompt=True,
                                             tokenize=False)
        rows.append({"prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"], "messages": messages,
                     "extra_info": {}, "index": i})
    return rows


def _run(style, *, tools=(multiply,), policy=None, max_len=400, n=2, engine=None, **config):
    tok = qwen2_tokenizer(style)
    eos = tok.convert_tokens_to_ids("<|im_end|>" if style == "qwen2.5" else "<|eot_id|>")
    runner = ToolRunner(list(tools), max_parallel_calls=config.pop("max_parallel_calls", 1),
                        timeout_s=config.pop("timeout_s", 30.0))
    engine = engine or ScriptedEngine(tok, policy or _policy(style), eos)
    fmt = get_format("hermes" if style == "qwen2.5" else "llama3_json")
    loop = AgentLoop(engine.generate, tok, runner, fmt, MultiTurnConfig(enable=True, **config),
                     max_response_length=max_len)
    rows = _rows(tok, runner)
    try:
        out = loop.run(rows, SamplingParams(n=n, max_new_tokens=max_len, seed=5))
    finally:
        runner.close()
    return tok, rows, out, loop, engine


@pytest.mark.parametrize("style", ["qwen2.5", "llama3.1"])
def test_ids_are_the_template_of_the_conversation_and_the_mask_covers_the_assistant_alone(style):
    tok, rows, out, loop, _ = _run(style, max_assistant_turns=3)
    assert out.finish_reasons == ["stop"] * 4 and out.assistant_turns.tolist() == [2] * 4
    assert out.tool_calls.tolist() == [1] * 4 and loop.last_metrics["multi_turn/tool_errors"] == 0
    for r in range(len(out)):
        row = rows[out.prompt_index[r]]
        ids, mask = out.tokens[r, : out.lengths[r]], out.loss_mask[r, : out.lengths[r]]
        assistant = [tok.decode(s) for s in assistant_spans(ids, mask)]
        assert len(assistant) == 2 and not any(str(SECRET) in a for a in assistant)
        gaps = [tok.decode(s) for s in assistant_spans(ids, 1 - mask)]
        assert len(gaps) == 1 and str(SECRET) in gaps[0]  # the one mask-0 span is the tool turn
        assert ("<tool_response>" in gaps[0]) == (style == "qwen2.5") and ("ipython" in gaps[0]) != (style == "qwen2.5")
        assert np.all(out.logprobs[r, : out.lengths[r]][mask == 0] == 0) and np.all(out.logprobs[r][mask == 1] < 0)
        # The whole sequence is the chat template of the whole conversation (up to the template's glue
        # after the final end-of-turn, which is not part of the response).
        a, b = map(int, re.findall(r"(\d+) times (\d+)", row["messages"][0]["content"])[0])
        tool_text = multiply(a, b)
        conversation = row["messages"] + [
            {"role": "assistant", "content": _call(style, a, b)}, {"role": "tool", "content": tool_text},
            {"role": "assistant", "content": f"The answer is {a * b}."}]
        text = tok.apply_chat_template(conversation, tools=loop.runner.schemas, tokenize=False)
        full = tok(text, add_special_tokens=False)["input_ids"]
        ours = row["prompt_ids"] + ids.tolist()
        assert full[: len(ours)] == ours
        assert tok.decode(full[len(ours):]).strip() == ""


def test_sampled_ids_are_kept_where_retokenizing_would_split_differently():
    """The policy samples ' answer' as two pieces; the response keeps those ids, and every mask-0 span is
    exactly the template's (the canonical tokenization of the assistant text differs)."""
    style = "qwen2.5"
    tok = qwen2_tokenizer(style)
    canonical = tok("The answer is 408.", add_special_tokens=False)["input_ids"]
    odd = [i for piece in ("The ans", "wer is 408.") for i in tok(piece, add_special_tokens=False)["input_ids"]]
    assert odd != canonical and tok.decode(odd) == tok.decode(canonical)
    text_policy = _policy(style)

    def policy(context, seed):
        out = text_policy(context, seed)
        return odd if out == "The answer is 408." else out

    tok, rows, out, loop, _ = _run(style, policy=policy, n=1)
    r = 0  # row 0 asks 12 x 34 = 408
    ids, mask = out.tokens[r, : out.lengths[r]].tolist(), out.loss_mask[r, : out.lengths[r]]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert ids[-len(odd) - 1:] == odd + [eos]  # the final turn exactly as sampled
    spans = assistant_spans(np.asarray(ids), mask)
    fixed = [i for s in spans[:1] for i in s.tolist()]  # rebuild with the canonical final turn
    gap = assistant_spans(np.asarray(ids), 1 - mask)[0].tolist()
    conversation = rows[0]["messages"] + [
        {"role": "assistant", "content": _call(style, 12, 34)}, {"role": "tool", "content": multiply(12, 34)},
        {"role": "assistant", "content": "The answer is 408."}]
    full = tok(tok.apply_chat_template(conversation, tools=loop.runner.schemas, tokenize=False),
               add_special_tokens=False)["input_ids"]
    ours = rows[0]["prompt_ids"] + fixed + gap + canonical + [eos]
    assert full[: len(ours)] == ours


def test_turn_caps_parallel_call_cap_and_length_before_tool_output():
    always = _policy("qwen2.5", always_call=True)
    _, _, out, _, _ = _run("qwen2.5", policy=always, max_assistant_turns=3)
    assert out.assistant_turns.tolist() == [3] * 4 and out.num_turns.tolist() == [5] * 4
    _, _, out, _, _ = _run("qwen2.5", policy=always, max_user_turns=1)
    assert out.assistant_turns.tolist() == [2] * 4 and out.num_turns.tolist() == [3] * 4
    _, _, out, loop, _ = _run("qwen2.5", policy=_policy("qwen2.5", calls_per_turn=3), max_parallel_calls=2)
    assert out.tool_calls.tolist() == [3] * 4 and out.tool_errors["too_many_calls"].tolist() == [1] * 4
    assert loop.last_metrics["multi_turn/tool_errors/too_many_calls"] == 4
    # Room for the first turn but not for the tool's output: the response ends before it.
    _, _, full, _, _ = _run("qwen2.5")
    first_turn = int(np.argmin(full.loss_mask[0]))  # the first mask-0 position
    _, _, out, _, _ = _run("qwen2.5", max_len=first_turn + 5)
    assert out.finish_reasons == ["length"] * 4 and out.tool_calls.tolist() == [1] * 4
    assert np.all(out.loss_mask[:, : out.lengths[0]] == 1) and out.lengths.tolist() == [first_turn] * 4
    np.testing.assert_array_equal(out.tokens[:, :first_turn], full.tokens[:, :first_turn])
    # A turn that runs out of budget ends the response too.
    _, _, out, _, _ = _run("qwen2.5", max_len=4)
    assert out.finish_reasons == ["length"] * 4 and out.lengths.tolist() == [4] * 4


def test_a_slow_tool_holds_back_only_its_own_row_and_a_hanging_one_times_out():
    """Row 0's tool returns only once the other rows' second turns have been sampled (so a loop that
    waited for it would deadlock until the 30 s timeout, and fail below); a tool that hangs for good times
    out, and its row goes on with the error message."""
    others_done = threading.Event()
    style = "qwen2.5"

    def multiply(a: int, b: int) -> str:
        """Multiplies, slowly for 12.

        Args:
          a: the first factor.
          b: the second factor.
        """
        if a == 12:
            others_done.wait(30)
        return f"{a * b} (checked {SECRET})"

    text_policy = _policy(style)

    def policy(context, seed):
        out = text_policy(context, seed)
        if out.startswith("The answer") and "13 times" in context:
            others_done.set()
        return out

    _, _, out, _, engine = _run(style, tools=[multiply], policy=policy, n=1)
    assert engine.calls == [[0, 1], [(1 << 24) | 1], [(1 << 24) | 0]]  # row 1's turn 2 came before row 0's
    assert out.tool_errors["timeout"].tolist() == [0, 0] and out.assistant_turns.tolist() == [2, 2]

    release = threading.Event()

    def hangs(a: int, b: int) -> str:
        """Never answers.

        Args:
          a: the first factor.
          b: the second factor.
        """
        release.wait(60)
        return "late"

    hang = function_tool(hangs, name="multiply")
    try:
        _, _, out, _, _ = _run(style, tools=[hang], n=1, timeout_s=0.2, max_assistant_turns=2)
    finally:
        release.set()
    assert out.tool_errors["timeout"].tolist() == [1, 1] and out.assistant_turns.tolist() == [2, 2]


def test_train_batch_keeps_tool_turns_in_the_sequence_and_out_of_the_loss():
    """build_train_batch on a multi-turn rollout: tool ids stay in `responses` under mask 0; packing runs
    the whole sequence; lengths for packing and the reward's last token span the whole response, while
    the length metrics count sampled tokens only."""
    from jaxrl_llm.agent.loop import AgentBatch
    from jaxrl_llm.trainer import metrics as M
    from jaxrl_llm.trainer.batch import PackShape, build_micro_batch
    from jaxrl_llm.trainer.loop import build_train_batch

    tokens = np.asarray([[5, 6, 7, 90, 91, 8, 9], [5, 6, 0, 0, 0, 0, 0]], np.int32)
    loss_mask = np.asarray([[1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0]], np.float32)
    rollout = AgentBatch(prompt_index=np.asarray([0, 0]), tokens=tokens, logprobs=-loss_mask,
                         lengths=np.asarray([7, 2]), finish_reasons=["stop", "stop"], loss_mask=loss_mask,
                         num_turns=np.asarray([3, 1]),
                         assistant_turns=np.asarray([2, 1]), tool_calls=np.asarray([1.0, 0.0]),
                         tool_seconds=np.zeros(2), tool_rewards=np.asarray([0.5, 0.0]))
    batch = build_train_batch([{"prompt_ids": [1, 2, 3]}], rollout, max_response_length=8)
    np.testing.assert_array_equal(batch.responses[:, :7], tokens)
    np.testing.assert_array_equal(batch.response_mask[:, :7], loss_mask)
    assert batch.response_lengths.tolist() == [7, 2] and batch.loss_token_counts.tolist() == [5, 2]
    assert batch.fields["rollout_log_probs"][0, 3:5].tolist() == [0, 0]
    assert batch.fields["tool_rewards"].tolist() == [0.5, 0.0] and batch.fields["num_turns"].tolist() == [3, 1]
    shape = PackShape(rows=1, length=16, max_seqs=2, resp_len=8)
    mb = build_micro_batch(batch, [(0, 0, 0), (1, 0, 10)], shape)  # both sequences end to end in one row
    assert mb["input_ids"][0, :10].tolist() == [1, 2, 3, 5, 6, 7, 90, 91, 8, 9]  # tool ids inside the sequence
    np.testing.assert_array_equal(mb["response_mask"][0, :7], loss_mask[0])
    assert mb["resp_pos"][0, :7].tolist() == list(range(2, 9))
    batch.fields.update(token_level_scores=np.zeros((2, 8)), token_level_rewards=np.zeros((2, 8)),
                        advantages=np.zeros((2, 8)), returns=np.zeros((2, 8)))
    out = M.data_metrics(batch, max_response_length=7, max_prompt_length=3, use_critic=False)
    assert out["response_length/mean"] == 3.5 and out["response_length/clip_ratio"] == 0.5
