"""The rollout-engine interface shared by the JAX sampler and the vLLM pool.

An engine turns prompt token ids into sampled responses (`generate`) and takes new trainer weights
(`update_weights`). Both engines return the same `RolloutBatch`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import gin
import numpy as np


class RolloutError(ValueError):
    """A request the engine cannot serve; raised before any work starts."""


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one `generate` call.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1.0 disable truncation. Responses stop at
    an EOS of the model, at any of `stop_token_ids` (the stop token is kept in the response, as
    vLLM does), or after `max_new_tokens`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    ignore_eos: bool = False
    # MoE: return each token's experts per sparse layer (`RolloutBatch.routed_experts`), for routing
    # replay R3 (vLLM's `enable_return_routed_experts`); the JAX engines only.
    return_routed_experts: bool = False

    def validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise RolloutError(f"sampling n={self.n}: need at least one response per prompt (n >= 1)")
        if not 0.0 < self.top_p <= 1.0:
            raise RolloutError(f"sampling top_p={self.top_p}: must be in (0, 1]")
        if self.temperature < 0:
            raise RolloutError(f"sampling temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if self.top_k < -1:
            raise RolloutError(f"sampling top_k={self.top_k}: use 0 or -1 to disable, or a positive k")
        if self.max_new_tokens < 1:
            raise RolloutError(f"sampling max_new_tokens={self.max_new_tokens}: must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class RolloutBatch:
    """Responses in prompt-major order: response j of prompt i is row i * n + j.

    tokens / logprobs are right-padded to the longest response; `lengths` counts real tokens
    (the stop token included); `finish_reasons` is "stop" or "length".
    """

    prompt_index: np.ndarray  # [R] int, which prompt each response answers
    tokens: np.ndarray  # [R, T] int32, padded with pad_id
    logprobs: np.ndarray  # [R, T] float32, log softmax(logits / T) of each sampled token; 0 on padding
    lengths: np.ndarray  # [R] int32
    finish_reasons: list[str]
    weight_version: int = 0
    # With `SamplingParams.return_routed_experts` on a MoE: [R, P + T, L_moe, k] int32, the experts each
    # token of row r's sequence (its prompt, then its response, from index 0) was routed to in each
    # sparse layer, -1 past the sequence and for the last response token (never fed to the model). P is
    # the longest prompt.
    routed_experts: np.ndarray | None = None
    # [R, T] int32: the weights' version that sampled each token (the JAX engines; 0 on padding), which an
    # asynchronous trainer reads for staleness
    token_versions: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    def response_ids(self, i: int) -> list[int]:
        return self.tokens[i, : self.lengths[i]].tolist()


class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine."""

    max_prompt_length: int

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                 max_new_tokens_per_row: Sequence[int] | None = None,
                 seeds: Sequence[int] | None = None) -> RolloutBatch: ...

    def update_weights(self, params, *, step: int | None = None) -> int: ...


def check_prompts(prompts: Sequence[Sequence[int]], max_prompt_length: int, vocab_size: int | None,
                  sampling: SamplingParams, max_model_len: int | None = None,
                  budgets: Sequence[int] | None = None) -> None:
    """Validates a request before any work starts (one clear error per problem); `budgets` are the
    prompts' own token caps when they have them (else sampling.max_new_tokens each)."""
    sampling.validate()
    if len(prompts) == 0:
        raise RolloutError("generate() got no prompts")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise RolloutError(f"prompt {i} is empty")
        if len(p) > max_prompt_length:
            raise RolloutError(f"prompt {i} has {len(p)} tokens; this engine allows at most "
                               f"{max_prompt_length} (raise the engine's max_prompt_length)")
        if vocab_size is not None and (min(p) < 0 or max(p) >= vocab_size):
            raise RolloutError(f"prompt {i} has token ids outside [0, {vocab_size})")
    if max_model_len is not None:
        caps = budgets if budgets is not None else [sampling.max_new_tokens] * len(prompts)
        i = max(range(len(prompts)), key=lambda k: len(prompts[k]) + caps[k])
        if len(prompts[i]) + caps[i] > max_model_len:
            raise RolloutError(f"prompt length {len(prompts[i])} + max_new_tokens {caps[i]} exceeds "
                               f"the engine's max_model_len {max_model_len}")
