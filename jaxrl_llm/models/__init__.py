"""Qwen2 / Qwen2.5 models in Flax NNX, their HF import/export, and the HF name table."""

from jaxrl_llm.models.config import PRESETS, ConfigError, Qwen2Config, model_config
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
from jaxrl_llm.models.qwen2 import Qwen2Critic, Qwen2ForCausalLM, abstract_model

__all__ = [
    "PRESETS", "CheckpointError", "ConfigError", "Qwen2Config", "Qwen2Critic", "Qwen2ForCausalLM",
    "abstract_model", "count_params", "graphdef_and_abstract_params", "init_model", "init_params",
    "load_hf", "load_params", "model_config", "param_shardings", "param_table", "save_hf", "split_model",
    "write_hf_dir",
]
