"""Rollout engines behind one interface: the JAX sampler and the vLLM pool on Ray."""

from jaxrl_llm.rollout.base import RolloutBatch, RolloutEngine, RolloutError, SamplingParams, check_prompts
from jaxrl_llm.rollout.jax_engine import JaxEngine
from jaxrl_llm.rollout.vllm_pool import VllmPool, VllmPoolError  # noqa: F401 (imports no vllm/ray)

__all__ = ["JaxEngine", "RolloutBatch", "RolloutEngine", "RolloutError", "SamplingParams", "check_prompts"]
