"""jaxrl_llm: RL post-training (GRPO, PPO) of Qwen2/Qwen2.5, Qwen3 and Llama 3.x models in JAX/Flax."""

__version__ = "0.1.0"
