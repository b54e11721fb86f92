"""A rollout in the trainer's layout: `build_train_batch` turns an engine's `RolloutBatch` (or the agent
loop's `AgentBatch`) into a response-layout `TrainBatch`, `response_items` gives each response its dataset
row, and `Rollout` holds one prompt batch's responses as a rollouter hands them to the loop."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_llm.rollout import RolloutBatch
from jaxrl_llm.trainer import router_replay
from jaxrl_llm.trainer.batch import TrainBatch
from jaxrl_llm.trainer.dynamic_sampling import ScoredDraw
from jaxrl_llm.trainer.metrics import Timer


def build_train_batch(prompts: list[dict], rollout: RolloutBatch, max_response_length: int,
                      max_prompt_length: int = 0) -> TrainBatch:
    """Response-layout arrays of a rollout: responses [R, Tr], mask, group ids, sampler logprobs; the
    sampler's MoE routing when it returned it (routing replay R3), [R, max_prompt_length + Tr, L_moe, k]. A
    multi-turn rollout (`AgentBatch`) keeps its tool turns in `responses` under mask 0, and brings its
    per-response tool statistics as [R] fields (`num_turns`, `tool_calls`, `tool_rewards`)."""
    r = len(rollout)
    tr = max_response_length
    lengths = np.minimum(rollout.lengths, tr)
    responses = np.zeros((r, tr), np.int32)
    logps = np.zeros((r, tr), np.float32)
    width = min(tr, rollout.tokens.shape[1])
    responses[:, :width] = rollout.tokens[:, :width]
    logps[:, :width] = rollout.logprobs[:, :width]
    inside = (np.arange(tr)[None, :] < lengths[:, None]).astype(np.float32)  # [R, Tr] the response's tokens
    mask = inside.copy()
    fields = {}
    if getattr(rollout, "loss_mask", None) is not None:  # an AgentBatch: mask-0 tool turns inside
        mask[:, :width] *= rollout.loss_mask[:, :width]
        fields = {"num_turns": rollout.num_turns.astype(np.float32), "tool_calls": rollout.tool_calls,
                  "tool_rewards": rollout.tool_rewards}
    responses *= inside.astype(np.int32)
    logps *= mask
    if getattr(rollout, "prompt_ids", None) is not None:  # environments gave each trajectory its prompt
        prompt_ids = [np.asarray(p, np.int32) for p in rollout.prompt_ids]
    else:
        prompt_ids = [np.asarray(prompts[i]["prompt_ids"], np.int32) for i in rollout.prompt_index]
    fields["rollout_log_probs"] = logps
    if getattr(rollout, "routed_experts", None) is not None:
        width = max(max_prompt_length, max(len(p) for p in prompt_ids)) + tr
        fields[router_replay.FIELD] = router_replay.to_train_layout(rollout.routed_experts, width)
    return TrainBatch(prompt_ids=prompt_ids, responses=responses, response_mask=mask,
                      group_ids=rollout.prompt_index.astype(np.int32), fields=fields)


def response_items(prompts: list[dict], rollout: RolloutBatch) -> list[dict]:
    """The dataset row of each response; a multi-turn response's row carries veRL's `num_turns` and
    `rollout_reward_scores` (its tools' rewards, and its environment's under "env") in extra_info, for the
    reward function."""
    if getattr(rollout, "loss_mask", None) is None:
        return [prompts[i] for i in rollout.prompt_index]
    env = rollout.env_rewards if getattr(rollout, "env_rewards", None) is not None else np.zeros(len(rollout))
    return [{**prompts[i], "extra_info": {**(prompts[i].get("extra_info") or {}), "num_turns": int(turns),
                                          "rollout_reward_scores": {"tools": float(reward), "env": float(e)}}}
            for i, turns, reward, e in zip(rollout.prompt_index, rollout.num_turns, rollout.tool_rewards, env)]


@dataclasses.dataclass
class Rollout:
    """One prompt batch's responses, as a rollouter hands them to the loop.

    Attributes:
      batch: the responses; `items[i]` is the dataset row response i answers.
      greedy / greedy_items: the greedy response of each prompt (REMAX's baseline), else None.
      prompts: the prompt batch (a `PromptBatch` carries the epoch it was drawn in).
      timer: the step's clock so far: what producing the batch counted toward the step (the synchronous
        rollouter's generation; nothing where the rollout side runs beside the trainer).
      metrics: the rollouter's figures of this batch (staleness, the seconds waited for it, dynamic sampling's).
      scored: the batch scored already (dynamic sampling knows its batch only after scoring), else None: the loop
        scores it while the device runs the step's passes.
    """

    batch: TrainBatch
    items: list[dict]
    greedy: TrainBatch | None = None
    greedy_items: list[dict] | None = None
    prompts: list[dict] | None = None
    timer: Timer = dataclasses.field(default_factory=Timer)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    scored: ScoredDraw | None = None
