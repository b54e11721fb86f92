"""Token ids of the non-assistant turns of a conversation, from the tokenizer's chat template.

Token-in-token-out: the assistant's ids are exactly what the sampler drew; they are never decoded and
re-tokenized (a re-tokenization can split the text differently, and then the trainer scores ids the
sampler never drew). Only what the template adds between assistant turns is tokenized here: the glue
after the assistant's end-of-turn (Qwen's "\\n" after `<|im_end|>`), the tool or user turn, and the
next assistant header. That text is the delta of two renderings of the conversation: without the new
messages, and with them plus the generation prompt.
"""

from __future__ import annotations

from collections.abc import Sequence


class RenderError(ValueError):
    """The chat template cannot render a tool turn (no role 'tool', or it rewrites earlier turns)."""


def render_prompt(tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None) -> list[int]:
    """The prompt's ids: the chat template with the tool schemas and the generation prompt."""
    text = tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _render(tokenizer, messages, tools, *, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                         add_generation_prompt=generation_prompt, tokenize=False)


class TurnRenderer:
    """Renders the ids that follow an assistant turn: glue, the new (tool / user) messages, and the
    next assistant header.

    Args:
      tokenizer: a HF tokenizer with a chat template that renders role 'tool' (Qwen2.5's does;
        Llama 3.1's renders it as 'ipython').
      tools: the OpenAI function schemas given to the template (they only shape the system turn).
    """

    def __init__(self, tokenizer, tools: Sequence[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self._special = set(tokenizer.all_special_tokens) | {
            t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}

    def _delta(self, history: list[dict], new: list[dict], end_of_turn: str | None) -> str:
        prefix = _render(self.tokenizer, history[:-1], self.tools, generation_prompt=True)
        before = _render(self.tokenizer, history, self.tools, generation_prompt=False)
        after = _render(self.tokenizer, history + new, self.tools, generation_prompt=True)
        if not (before.startswith(prefix) and after.startswith(before)):
            raise RenderError("the chat template renders earlier turns differently once a new message follows "
                              "(e.g. it drops an assistant's reasoning); the agent loop needs a template that "
                              "appends turns, such as Qwen2.5's or Llama 3.1's (set the tokenizer's "
                              "chat_template)")
        # The assistant message as rendered: its text, the template's end-of-turn, then glue. The sampled
        # ids cover the text and, when the turn stopped on it, the end-of-turn token; the rest is ours.
        portion = before[len(prefix):]
        content = history[-1]["content"]
        for text in (content, content.strip()):
            if portion.startswith(text):
                rest = portion[len(text):]
                break
        else:
            raise RenderError("the chat template does not render the assistant's text verbatim after the "
                              f"generation prompt (rendered: {portion[:120]!r}); the agent loop cannot place "
                              "the sampled ids in the conversation")
        if end_of_turn is not None and rest.startswith(end_of_turn):
            rest = rest[len(end_of_turn):]
        return rest + after[len(before):]

    def turn_ids(self, history: list[dict], new: list[dict], last_token: int | None) -> list[int]:
        """Ids to append after an assistant turn whose last sampled id is `last_token`.

        Args:
          history: the conversation so far, ending with the assistant message just sampled (its content
            is the decoded text without the end-of-turn token).
          new: the messages to append (role 'tool' or 'user').
          last_token: the assistant turn's last sampled id (its stop token when it stopped).
        """
        text = self.tokenizer.convert_ids_to_tokens(int(last_token)) if last_token is not None else None
        eot = text if text in self._special else None
        delta = self._delta(history, new, eot)
        return self.tokenizer(delta, add_special_tokens=False)["input_ids"]

    def assistant_text(self, ids: Sequence[int]) -> str:
        """An assistant turn's text as the template should see it: special tokens dropped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
