"""Where a run's models come from: the model config, the actor's and critic's starting params, and the
LoRA spec and starting adapters (`model.lora_*`)."""

from __future__ import annotations

import os

import jax

from jaxrl_llm import distributed
from jaxrl_llm.models import Qwen2Config, init_params, load_params, param_shardings, quant
from jaxrl_llm.models.config import PRESETS
from jaxrl_llm.models.hf_io import is_critic_checkpoint
from jaxrl_llm.models.lora import LoraSpec, resolve_targets
from jaxrl_llm.trainer.config import RunConfig


def resolve_model_path(path: str) -> str:
    """A local directory as is; otherwise a hub id, fetched with huggingface_hub (needs network)."""
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} is a file; pass a HF model directory")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja"])
    except Exception as e:  # offline, unknown repo, no hub client
        raise FileNotFoundError(f"model path {path!r} is not a local directory, and fetching it as a hub id "
                                f"failed ({type(e).__name__}: {e}); pass a local HF model directory") from None


def model_config(run: RunConfig) -> Qwen2Config:
    m = run.model
    remat = "full" if m.remat == "auto" else m.remat  # "auto" is resolved once the mesh is known
    numerics = dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=remat, attention_impl=m.attention_impl,
                    **(m.overrides or {}))
    if m.preset is not None:
        if m.preset not in PRESETS:
            raise ValueError(f"model.preset: unknown preset {m.preset!r}; known: {sorted(PRESETS)}")
        return PRESETS[m.preset](**numerics)
    return Qwen2Config.from_hf(resolve_model_path(m.path), **numerics)


def lora_spec(run: RunConfig, cfg: Qwen2Config | None = None) -> LoraSpec | None:
    """The adapters of `model.lora_rank` / `lora_alpha` / `target_modules` / `exclude_modules`; None when off.
    The targets depend on the model (`cfg`, default the run's): a MoE's 'all-linear' is its attention."""
    m = run.model
    if not m.lora_rank:
        return None
    cfg = cfg or model_config(run)
    targets = resolve_targets(m.target_modules, m.exclude_modules, cfg)
    quant.apply(cfg, m.base_quantization)  # an 8-bit base it cannot quantize fails here, before any work
    return LoraSpec(rank=m.lora_rank, alpha=float(m.lora_alpha), targets=targets)


def _read_config(cfg: Qwen2Config, lora: LoraSpec | None) -> Qwen2Config:
    """A checkpoint is read in the compute dtype under LoRA: its frozen base keeps no fp32 master copy.
    (A random preset is drawn in param_dtype either way and rounded to the compute dtype in the same
    program: a LoRA run starts from the full run's base, and a 30B preset never holds its fp32 draw.)"""
    return cfg if lora is None else cfg.replace(param_dtype=cfg.dtype)


def _base_dtype(cfg: Qwen2Config, lora: LoraSpec | None):
    return None if lora is None else cfg.dtype


def load_actor_params(run: RunConfig, cfg: Qwen2Config, mesh, lora: LoraSpec | None = None):
    m = run.model
    if m.preset is not None:
        return init_params(cfg, mesh=mesh, seed=m.seed, dtype=_base_dtype(cfg, lora))
    return load_params(resolve_model_path(m.path), _read_config(cfg, lora), mesh=mesh)


def load_critic_params(run: RunConfig, cfg: Qwen2Config, mesh, lora: LoraSpec | None = None):
    m = run.model
    if m.preset is not None:
        return init_params(cfg, mesh=mesh, seed=m.seed + 1, critic=True, dtype=_base_dtype(cfg, lora))
    cfg = _read_config(cfg, lora)
    path = resolve_model_path(m.critic_path or m.path)
    if is_critic_checkpoint(path):  # the family's *ForTokenClassification
        return load_params(path, cfg, mesh=mesh, critic=True)
    # veRL initialises the critic from the actor checkpoint with a fresh value head.
    lm = load_params(path, cfg, mesh=mesh)
    # A one-layer config just for the head (dense, so it stays valid for a MoE with dense layers).
    head_cfg = cfg.replace(num_hidden_layers=1, vocab_size=8, mlp_only_layers=(), decoder_sparse_step=1)
    head = init_params(head_cfg, seed=m.seed + 1, critic=True)
    head_sh = param_shardings(cfg, mesh, critic=True)["score"]
    score = jax.tree.map(lambda x, sh: distributed.put(distributed.fetch(x), sh), head["score"], head_sh)
    return {"model": lm["model"], "score": score}


def load_adapters(run: RunConfig, cfg: Qwen2Config, lora: LoraSpec | None, mesh) -> dict | None:
    """The actor's starting adapters from `model.lora_adapter_path`; None: fresh ones."""
    if lora is None or not run.model.lora_adapter_path:
        return None
    from jaxrl_llm.models.peft_io import load_peft

    return load_peft(run.model.lora_adapter_path, cfg, lora, mesh=mesh)


def lora_meta(run: RunConfig, lora: LoraSpec | None) -> dict | None:
    """What an export needs beside a LoRA checkpoint's adapters: the spec and where the base comes from."""
    if lora is None:
        return None
    m = run.model
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets), "path": m.path,
            "critic_path": m.critic_path, "preset": m.preset, "seed": m.seed, "param_dtype": m.param_dtype,
            "dtype": m.dtype, "base_quantization": m.base_quantization}
