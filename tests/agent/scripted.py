"""A scripted policy behind the engine interface, for the agent loop's mechanics (what a random model
would never write: well-formed tool calls). The loop, renderer, runner and formats under test are real."""

from __future__ import annotations

import numpy as np

from jaxrl_llm.rollout import RolloutBatch


class ScriptedEngine:
    """`generate` answers each prompt with `policy(context_text, turn_ids)` -> text or a list of ids; the
    end-of-turn id is appended, and the row is cut at its budget (finish 'length'). The log-prob of the
    t-th token of a turn is -(t + 1) / 8, so tests can tell the sampled positions apart."""

    def __init__(self, tokenizer, policy, eos_id: int):
        self.tokenizer = tokenizer
        self.policy = policy
        self.eos_id = eos_id
        self.calls: list[list[int]] = []  # the seeds of each generate call

    def generate(self, prompts, sampling, max_new_tokens_per_row=None, seeds=None) -> RolloutBatch:
        assert sampling.n == 1
        budgets = max_new_tokens_per_row or [sampling.max_new_tokens] * len(prompts)
        self.calls.append(list(seeds))
        rows = []
        for prompt, budget, seed in zip(prompts, budgets, seeds):
            out = self.policy(self.tokenizer.decode(prompt), seed)
            ids = out if isinstance(out, list) else self.tokenizer(out, add_special_tokens=False)["input_ids"]
            ids = (ids + [self.eos_id])[:budget]
            rows.append((ids, "stop" if ids[-1] == self.eos_id else "length"))
        width = max(len(ids) for ids, _ in rows)
        tokens = np.zeros((len(rows), width), np.int32)
        logps = np.zeros((len(rows), width), np.float32)
        for i, (ids, _) in enumerate(rows):
            tokens[i, : len(ids)] = ids
            logps[i, : len(ids)] = -(np.arange(len(ids)) + 1) / 8
        return RolloutBatch(prompt_index=np.arange(len(rows)), tokens=tokens, logprobs=logps,
                            lengths=np.asarray([len(ids) for ids, _ in rows], np.int32),
                            finish_reasons=[f for _, f in rows])
