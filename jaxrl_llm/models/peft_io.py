"""PEFT adapter directories (adapter_config.json + adapter_model.safetensors) to and from our adapters.

PEFT names an adapter of a causal LM `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r]: torch's [out, in] layout, one tensor a layer. Ours are stacked
over layers and transposed (lora_a [L, in, r], lora_b [L, r, out]); each kind of layer has its own stack (a
mixed MoE's `dense_layers`, a Qwen3.5's `linear_layers`), whose slots map to HF layer indices through
`cfg.layer_stacks`, and the module's path under the layer is its path in our tree (`linear_attn.in_proj_qkv`,
`mlp.shared_expert.gate_proj`).

A Qwen3.5 inside its vision-language wrapper (the released `Qwen3_5ForConditionalGeneration`, and our Qwen3.5
value model) keeps its layers under `model.language_model.`: adapters for such a base are written with that
prefix (read from the base's config.json), and either prefix is read back.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from jaxrl_llm import distributed
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.errors import ConfigError
from jaxrl_llm.models.families import hf_prefix
from jaxrl_llm.models.lora import (
    LoraSpec,
    adapter_shapes,
    adapter_shardings,
    adapter_sites,
    resolve_targets,
)
from jaxrl_llm.models.safetensors_io import SafetensorsFile, save_file

CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."
_LEAVES = {"lora_a": "lora_A", "lora_b": "lora_B"}


_PREFIXES = ("model.", "model.language_model.")  # the text model's layers; a vision-language wrapper's


def peft_key(path: tuple[str, ...], layer: int, leaf: str, prefix: str = "model.") -> str:
    """PEFT's name of HF layer `layer`'s adapter leaf of the module at params path `path` (`module_path`)."""
    return f"{_PREFIX}{prefix}layers.{layer}.{'.'.join(path[2:])}.{_LEAVES[leaf]}.weight"


def _layers_prefix(cfg: DecoderConfig, base_model: str | None, critic: bool) -> str:
    """Where the base's layers sit: a critic's as our value model holds them; an actor's as the base directory's
    config.json says (a vision-language checkpoint's under its wrapper), else as the text model holds them."""
    raw = cfg.to_hf(critic=critic)
    config = os.path.join(base_model, "config.json") if base_model is not None and not critic else ""
    if os.path.isfile(config):
        try:
            with open(config) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError):
            pass
    return hf_prefix(raw if isinstance(raw, dict) else {})


def adapter_config(spec: LoraSpec, *, base_model: str | None, critic: bool = False) -> dict:
    """A critic's adapter is PEFT's TOKEN_CLS task, its value head (`score`) a module saved in full."""
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    return {"peft_type": "LORA", "task_type": "TOKEN_CLS" if critic else "CAUSAL_LM",
            "base_model_name_or_path": base_model, "r": spec.rank, "lora_alpha": alpha, "lora_dropout": 0.0,
            "target_modules": list(spec.targets), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "init_lora_weights": True, "modules_to_save": ["score"] if critic else None, "inference_mode": True}


def save_peft(adapters: dict, spec: LoraSpec, out_dir: str | os.PathLike, cfg: DecoderConfig, *,
              base_model: str | None = None, dtype: str | None = None, head: dict | None = None) -> str:
    """Writes `adapters` (our tree, on any devices) as a PEFT directory; `dtype` None keeps theirs. Every
    process of a multi-process run calls it (the gather is collective); process 0 alone writes.

    `head`: a critic's value head ({"kernel": [D, 1], "bias": [1]}), trained in full; the directory is then
    a TOKEN_CLS adapter that PEFT loads onto the family's *ForTokenClassification.
    """
    host = jax.tree.map(lambda x: np.asarray(distributed.fetch(x)), adapters)
    head = None if head is None else jax.tree.map(lambda x: np.asarray(distributed.fetch(x)), head)
    if not distributed.is_main():
        return os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    prefix = _layers_prefix(cfg, base_model, head is not None)

    def tensors():
        for stack, _, path in adapter_sites(cfg, spec):
            node = host
            for k in path:
                node = node[k]
            for leaf in ("lora_a", "lora_b"):
                stacked = node[leaf]  # [L, in, r] or [L, r, out]
                if dtype is not None:
                    stacked = stacked.astype(jax.numpy.dtype(dtype))
                for slot, layer in enumerate(cfg.layer_stacks[stack]):
                    yield peft_key(path, layer, leaf, prefix), np.ascontiguousarray(stacked[slot].T)
        for leaf, hf in (("kernel", "weight"), ("bias", "bias")):
            if head is not None and leaf in head:
                x = head[leaf].astype(jax.numpy.dtype(dtype)) if dtype is not None else head[leaf]
                yield f"{_PREFIX}score.{hf}", np.ascontiguousarray(x.T)  # [1, D] (torch layout), [1]

    save_file(tensors(), os.path.join(out_dir, WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG_NAME), "w") as f:
        json.dump(adapter_config(spec, base_model=base_model, critic=head is not None), f, indent=2)
    return os.fspath(out_dir)


def read_peft_config(path: str) -> dict:
    where = os.path.join(path, CONFIG_NAME)
    try:
        with open(where) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"model.lora_adapter_path={path!r}: no {CONFIG_NAME}; give a PEFT adapter directory "
                          "(what PeftModel.save_pretrained or `python -m jaxrl_llm.export` writes)") from None


def load_peft(path: str, cfg: DecoderConfig, spec: LoraSpec, *, mesh=None) -> dict:
    """Reads a PEFT adapter directory into our adapter tree (param_dtype, placed on `mesh`).

    Its rank, alpha and targets must be the run's (`model.lora_rank`, `model.lora_alpha`,
    `model.target_modules`): the adapter computes what it computed when it was trained.
    """
    conf = read_peft_config(path)
    theirs = {"model.lora_rank": conf.get("r"), "model.lora_alpha": conf.get("lora_alpha")}
    ours = {"model.lora_rank": spec.rank, "model.lora_alpha": spec.alpha}
    for key in theirs:
        if theirs[key] is None or float(theirs[key]) != float(ours[key]):
            raise ConfigError(f"{key}={ours[key]} but the adapter in model.lora_adapter_path={path!r} has "
                              f"{theirs[key]}; set {key} = {theirs[key]}")
    if conf.get("target_parameters"):
        raise ConfigError(f"model.lora_adapter_path={path!r}: the adapter has target_parameters "
                          f"{conf['target_parameters']} (PEFT's adapters on 3-D parameters, e.g. the routed experts); "
                          "only adapters on linear modules (target_modules) are supported")
    targets = conf.get("target_modules")
    targets = sorted(resolve_targets("all-linear", cfg=cfg)) if targets == "all-linear" else sorted(targets or ())
    if targets != sorted(spec.targets):
        raise ConfigError(f"model.target_modules resolves to {sorted(spec.targets)} but the adapter in "
                          f"model.lora_adapter_path={path!r} targets {targets}; set model.target_modules to those")
    if conf.get("use_rslora") or conf.get("use_dora"):
        raise ConfigError(f"model.lora_adapter_path={path!r}: rsLoRA and DoRA adapters are not supported")
    file = SafetensorsFile(os.path.join(path, WEIGHTS_NAME))
    wrapped = any(n.startswith(_PREFIX + _PREFIXES[1]) for n in file.names())
    prefix = _PREFIXES[1] if wrapped else _PREFIXES[0]
    shapes, shardings = adapter_shapes(cfg, spec), adapter_shardings(cfg, spec, mesh)
    out: dict = {}
    for stack, _, site in adapter_sites(cfg, spec):
        node_s, node_sh, node_o = shapes, shardings, out
        for k in site:
            node_s, node_sh, node_o = node_s[k], node_sh[k], node_o.setdefault(k, {})
        for leaf in ("lora_a", "lora_b"):
            shape = node_s[leaf].shape
            layers = []
            for i in cfg.layer_stacks[stack]:
                key = peft_key(site, i, leaf, prefix)
                if key not in file.names():
                    raise ConfigError(f"model.lora_adapter_path={path!r}: {WEIGHTS_NAME} has no {key!r}; the adapter "
                                      f"is for another model (this one has {cfg.num_hidden_layers} layers)")
                t = file.get(key).T
                if t.shape != shape[1:]:
                    raise ConfigError(f"model.lora_adapter_path={path!r}: {key} has shape {t.shape[::-1]}, this "
                                      f"model needs {shape[1:][::-1]}; the adapter is for another model")
                layers.append(t.astype(node_s[leaf].dtype))
            node_o[leaf] = distributed.put(np.stack(layers), node_sh[leaf])
    return out
