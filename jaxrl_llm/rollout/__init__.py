"""Rollout engines behind one interface: the JAX sampler (paged, or the dense baseline) and the vLLM pool on Ray."""

from jaxrl_llm.rollout.base import RolloutBatch, RolloutEngine, RolloutError, SamplingParams, check_prompts
from jaxrl_llm.rollout.dense_engine import DenseJaxEngine
from jaxrl_llm.rollout.jax_engine import JaxEngine, make_jax_engine
from jaxrl_llm.rollout.vllm_pool import VllmPool, VllmPoolError  # noqa: F401 (imports no vllm/ray)

__all__ = ["DenseJaxEngine", "JaxEngine", "RolloutBatch", "RolloutEngine", "RolloutError", "SamplingParams",
           "check_prompts", "make_jax_engine"]
