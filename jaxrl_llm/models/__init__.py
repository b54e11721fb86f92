"""The decoder of Qwen2/2.5, Qwen3 and Llama 3.x in Flax NNX, its HF import/export, and the HF name tables."""

from jaxrl_llm.models.config import PRESETS, ConfigError, DecoderConfig, Qwen2Config, model_config
from jaxrl_llm.models.families import FAMILIES, is_critic_hf
from jaxrl_llm.models.hf_io import CheckpointError, load_hf, load_params, save_hf, write_hf_dir
from jaxrl_llm.models.hf_table import param_table
from jaxrl_llm.models.params import (
    count_params,
    graphdef_and_abstract_params,
    init_model,
    init_params,
    param_shardings,
    split_model,
)
from jaxrl_llm.models.qwen2 import (
    DecoderCritic,
    DecoderForCausalLM,
    Qwen2Critic,
    Qwen2ForCausalLM,
    abstract_model,
)
from jaxrl_llm.models.rope import RopeScaling

__all__ = [
    "FAMILIES", "PRESETS", "CheckpointError", "ConfigError", "DecoderConfig", "DecoderCritic", "DecoderForCausalLM",
    "Qwen2Config", "Qwen2Critic", "Qwen2ForCausalLM", "RopeScaling", "abstract_model", "count_params",
    "graphdef_and_abstract_params", "init_model", "init_params", "is_critic_hf", "load_hf", "load_params",
    "model_config", "param_shardings", "param_table", "save_hf", "split_model", "write_hf_dir",
]
