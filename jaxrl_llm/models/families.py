"""The HF model families the one decoder serves, and their config.json in and out.

A family is a HF `model_type`. What sets one apart inside the decoder is a few switches (biases on
q/k/v, a per-head RMSNorm on q and k) plus what its config.json may carry (Llama 3's scaled RoPE).
Everything else (GQA, explicit head_dim, tied or untied head, SwiGLU MLP, RMSNorm) is shared.

  family             architectures                           q/k/v bias  q/k norm  RoPE
  qwen2              Qwen2ForCausalLM, ...ForTokenClassification    yes    no     default
  qwen3              Qwen3ForCausalLM, ...                          no     yes    default
  llama              LlamaForCausalLM, ...                          no     no     default or llama3
  qwen3_moe          Qwen3MoeForCausalLM, ...                       no     yes    default
  qwen3_5_text       Qwen3_5ForCausalLM, Qwen3_5ForTokenClassification  no  yes   partial (a quarter)
  qwen3_5_moe_text   Qwen3_5MoeForCausalLM, ...                     no     yes    partial

Qwen3-MoE is Qwen3 with routed experts in its sparse layers (`models/moe.py`). Qwen3.5 is a hybrid: most
layers are Gated DeltaNet linear attention (`models/linear_attention.py`), every `full_attention_interval`-th
is attention with an output gate; its norms hold their weight as an offset from 1 (zero-centred); the MoE
sibling adds a gated shared expert beside 256 routed ones. A released Qwen3.5 checkpoint is the
vision-language `Qwen3_5ForConditionalGeneration` (model_type `qwen3_5`): its `text_config` is read, its
language model's tensors load from their `model.language_model.` prefix, and its vision tower and MTP head
are skipped. What none of them supports here (other mixtures of experts, sliding-window attention, other
RoPE types, other activations, biases on o_proj or the MLP) is one ConfigError naming the config.json field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxrl_llm.models.errors import ConfigError
from jaxrl_llm.models.rope import rope_scaling_from_hf


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    causal_lm: str  # HF architecture of the causal LM
    critic: str  # HF architecture of the value model (token classification, num_labels = 1)
    qkv_bias: bool  # q/k/v projections carry biases (o_proj never does)
    qk_norm: bool  # RMSNorm over each head's q and k, before RoPE
    default_head_dim: int | None  # HF's head_dim when config.json has none (None: hidden / heads)
    default_max_position_embeddings: int
    hf_extras: Callable[[Any], dict]  # fixed config.json keys of this family, given our config
    moe: bool = False  # routed experts in the sparse layers
    hybrid: bool = False  # Qwen3.5: linear-attention layers, an attention output gate, zero-centred norms
    shared_expert: bool = False  # a sigmoid-gated shared expert beside the routed ones
    wrapper: str | None = None  # the model_type of the vision-language checkpoints that hold it as text_config

    @property
    def architectures(self) -> tuple[str, str]:
        return (self.causal_lm, self.critic)


FAMILIES = {
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", "Qwen2ForTokenClassification", qkv_bias=True, qk_norm=False,
                    default_head_dim=None, default_max_position_embeddings=32768,
                    hf_extras=lambda c: {"use_sliding_window": False, "sliding_window": None,
                                         "max_window_layers": c.num_hidden_layers}),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", "Qwen3ForTokenClassification", qkv_bias=False, qk_norm=True,
                    default_head_dim=128, default_max_position_embeddings=32768,
                    hf_extras=lambda c: {"attention_bias": False, "use_sliding_window": False,
                                         "sliding_window": None, "max_window_layers": c.num_hidden_layers}),
    "llama": Family("llama", "LlamaForCausalLM", "LlamaForTokenClassification", qkv_bias=False, qk_norm=False,
                    default_head_dim=None, default_max_position_embeddings=2048,
                    hf_extras=lambda c: {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeForTokenClassification", qkv_bias=False,
                        qk_norm=True, default_head_dim=128, default_max_position_embeddings=32768,
                        hf_extras=lambda c: {"attention_bias": False, "use_sliding_window": False,
                                             "sliding_window": None, "max_window_layers": c.num_hidden_layers,
                                             **moe_fields_to_hf(c)}, moe=True),
    "qwen3_5_text": Family("qwen3_5_text", "Qwen3_5ForCausalLM", "Qwen3_5ForTokenClassification", qkv_bias=False,
                           qk_norm=True, default_head_dim=256, default_max_position_embeddings=32768,
                           hf_extras=lambda c: {"attention_bias": False, **hybrid_fields_to_hf(c)}, hybrid=True,
                           wrapper="qwen3_5"),
    "qwen3_5_moe_text": Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForTokenClassification",
                               qkv_bias=False, qk_norm=True, default_head_dim=256,
                               default_max_position_embeddings=32768,
                               hf_extras=lambda c: {"attention_bias": False, **hybrid_fields_to_hf(c),
                                                    **moe_fields_to_hf(c)},
                               moe=True, hybrid=True, shared_expert=True, wrapper="qwen3_5_moe"),
}
# The vision-language checkpoints (released Qwen3.5) -> the family of their language model.
_WRAPPERS = {f.wrapper: f for f in FAMILIES.values() if f.wrapper}
# Their architectures, accepted in config.json beside the text model's own.
_WRAPPER_ARCHITECTURES = {"qwen3_5": ("Qwen3_5ForConditionalGeneration",),
                          "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration",)}

_BY_ARCHITECTURE = {a: f for f in FAMILIES.values() for a in f.architectures}

# config.json keys that mark a mixture-of-experts model (Qwen2/3-MoE, Mixtral, DeepSeek); only a MoE family
# (qwen3_moe, qwen3_5_moe_text) may carry them.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")

_SUPPORTED = "; ".join(f"model_type {f.model_type!r} ({', '.join(f.architectures)})" for f in FAMILIES.values())


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type={model_type!r} is not supported; jaxrl_llm loads {_SUPPORTED}")
    return FAMILIES[model_type]


def unwrap_text_config(raw: dict, where: str) -> tuple[dict, bool]:
    """A vision-language checkpoint's config (Qwen3.5's `Qwen3_5ForConditionalGeneration`) -> its language
    model's config.json dict, and whether it was wrapped; any other config comes back as it is."""
    if raw.get("model_type") not in _WRAPPERS:
        return raw, False
    fam = _WRAPPERS[raw["model_type"]]
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: model_type={raw['model_type']!r} without a text_config; a Qwen3.5 "
                          "checkpoint's config.json nests its language model's fields under text_config")
    archs = raw.get("architectures") or []
    ok = _WRAPPER_ARCHITECTURES[raw["model_type"]] + (fam.critic,)
    if archs and not any(a in ok for a in archs):
        raise ConfigError(f"{where}: architectures={archs} is not supported for model_type {raw['model_type']!r}; "
                          f"jaxrl_llm loads {', '.join(ok)} (all supported: {_SUPPORTED})")
    arch = fam.critic if fam.critic in archs else fam.causal_lm
    out = {**text, "model_type": fam.model_type, "architectures": [arch]}
    if "tie_word_embeddings" in raw and "tie_word_embeddings" not in text:
        out["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return out, True


def _family_of(raw: dict, where: str) -> Family:
    """The family of a config.json, with one ConfigError for a model we cannot run."""
    for key in _MOE_KEYS:
        if raw.get(key) and not (raw.get("model_type") in FAMILIES and FAMILIES[raw["model_type"]].moe):
            raise ConfigError(f"{where}: {key}={raw[key]!r}: mixture-of-experts models are not supported "
                              f"for model_type={raw.get('model_type')!r}; jaxrl_llm loads {_SUPPORTED}")
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if model_type is None:  # an old or hand-written config.json: go by the architecture, else Qwen2
        known = [_BY_ARCHITECTURE[a] for a in archs if a in _BY_ARCHITECTURE]
        model_type = known[0].model_type if known else "qwen2"
    if model_type not in FAMILIES:
        raise ConfigError(f"{where}: model_type={model_type!r} (architectures={archs}) is not supported; "
                          f"jaxrl_llm loads {_SUPPORTED}")
    fam = FAMILIES[model_type]
    if archs and not any(a in fam.architectures for a in archs):
        raise ConfigError(f"{where}: architectures={archs} is not supported for model_type {model_type!r}; "
                          f"jaxrl_llm loads {', '.join(fam.architectures)} (all supported: {_SUPPORTED})")
    return fam


LAYER_TYPES = ("full_attention", "linear_attention")


def _check_unsupported(raw: dict, fam: Family, where: str) -> None:
    if raw.get("use_sliding_window", False):
        raise ConfigError(f"{where}: use_sliding_window=true is not supported (sliding-window attention); "
                          f"set it to false only if the model was trained without it")
    layer_types = raw.get("layer_types") or []
    allowed = LAYER_TYPES if fam.hybrid else ("full_attention",)
    other = sorted({t for t in layer_types if t not in allowed})
    if other:
        why = "" if fam.hybrid else " (no sliding-window or linear attention)"
        raise ConfigError(f"{where}: layer_types has {other}; model_type {fam.model_type!r} supports "
                          f"{list(allowed)} layers{why}")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={raw['hidden_act']!r} is not supported; the decoder's MLP is SwiGLU "
                          f"('silu')")
    if fam.model_type != "qwen2":  # Qwen2 hard-codes its biases; the others switch them in config.json
        for key in ("attention_bias", "mlp_bias"):
            if raw.get(key, False):
                raise ConfigError(f"{where}: {key}=true is not supported for model_type {fam.model_type!r} "
                                  f"(biases on o_proj / the MLP)")


def fields_from_hf(raw: dict, where: str) -> dict[str, Any]:
    """DecoderConfig fields of a HF config.json dict (any supported family; a Qwen3.5 vision-language
    checkpoint's language model)."""
    raw, _ = unwrap_text_config(raw, where)
    fam = _family_of(raw, where)
    _check_unsupported(raw, fam, where)
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    if not fam.shared_expert:  # Qwen3.5-MoE has no dense MLP and no intermediate_size
        required += ("intermediate_size",)
    if fam.moe:
        required += ("moe_intermediate_size", "num_experts_per_tok")
    missing = [k for k in required if raw.get(k) is None]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {missing}; a {fam.model_type} config.json needs {list(required)}")
    # transformers 5 writes `rope_parameters` (with rope_theta inside); older files `rope_scaling`.
    rope_field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    rope = dict(raw.get(rope_field) or {})
    max_pos = raw.get("max_position_embeddings", fam.default_max_position_embeddings)
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    partial = 1.0
    if fam.hybrid:  # Qwen3.5 rotates a quarter of each head; its M-RoPE sections matter only for images
        partial = float(rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
        for key in ("mrope_section", "mrope_interleaved"):
            rope.pop(key, None)
    return dict(
        model_type=fam.model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw.get("intermediate_size") or 0,
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        head_dim=raw.get("head_dim") or fam.default_head_dim,
        max_position_embeddings=max_pos,
        rope_theta=float(theta),
        rope_scaling=rope_scaling_from_hf(rope, where=where, field=rope_field, max_position_embeddings=max_pos),
        partial_rotary_factor=partial,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        initializer_range=raw.get("initializer_range", 0.02),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        **(_moe_fields_from_hf(raw, fam, where) if fam.moe else {}),
        **(_hybrid_fields_from_hf(raw, where) if fam.hybrid else {}),
    )


# Qwen3MoeConfig's defaults for the keys a config.json may omit.
_MOE_DEFAULTS = dict(norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=None, router_aux_loss_coef=0.001,
                     output_router_logits=False)


def _moe_fields_from_hf(raw: dict, fam: Family, where: str) -> dict[str, Any]:
    # Released files say num_experts; transformers 5 writes num_local_experts (its attribute alias).
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if not experts:
        raise ConfigError(f"{where}: a {fam.model_type} config.json needs num_experts >= 1 (got {experts!r})")
    out = {k: raw.get(k, default) for k, default in _MOE_DEFAULTS.items()}
    out["mlp_only_layers"] = tuple(out["mlp_only_layers"] or ())
    if fam.shared_expert:  # Qwen3.5-MoE: every layer sparse, the top-k always renormalised, a shared expert
        shared = raw.get("shared_expert_intermediate_size")
        if not shared:
            raise ConfigError(f"{where}: a {fam.model_type} config.json needs shared_expert_intermediate_size >= 1")
        out.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(),
                   shared_expert_intermediate_size=shared)
    return dict(num_experts=experts, num_experts_per_tok=raw["num_experts_per_tok"],
                moe_intermediate_size=raw["moe_intermediate_size"], **out)


def moe_fields_to_hf(cfg) -> dict[str, Any]:
    if cfg.family.shared_expert:
        return {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
                "moe_intermediate_size": cfg.moe_intermediate_size,
                "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
                "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": cfg.output_router_logits}
    return {"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": cfg.decoder_sparse_step, "mlp_only_layers": list(cfg.mlp_only_layers),
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": cfg.output_router_logits}


# Qwen3_5TextConfig's defaults for the linear-attention keys a config.json may omit.
_HYBRID_DEFAULTS = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_num_key_heads=16, linear_num_value_heads=32)


def _hybrid_fields_from_hf(raw: dict, where: str) -> dict[str, Any]:
    out = {k: raw.get(k) or default for k, default in _HYBRID_DEFAULTS.items()}
    types = raw.get("layer_types")
    if types is None:  # transformers' rule: every `full_attention_interval`-th layer is attention
        interval = raw.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention"
                 for i in range(raw["num_hidden_layers"])]
    if len(types) != raw["num_hidden_layers"]:
        raise ConfigError(f"{where}: layer_types has {len(types)} entries for num_hidden_layers="
                          f"{raw['num_hidden_layers']}")
    return dict(layer_types=tuple(types), **out)


def hybrid_fields_to_hf(cfg) -> dict[str, Any]:
    return {"layer_types": list(cfg.layer_types), **{k: getattr(cfg, k) for k in _HYBRID_DEFAULTS},
            "partial_rotary_factor": cfg.partial_rotary_factor}


def hf_from_config(cfg, *, critic: bool = False) -> dict:
    """The config.json dict that transformers and vLLM read, for a causal LM or (critic) a value model."""
    fam = family(cfg.model_type)
    out = {
        "architectures": [fam.critic if critic else fam.causal_lm],
        "model_type": fam.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling.to_hf() if cfg.rope_scaling is not None else None,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.initializer_range,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
        "torch_dtype": "bfloat16" if cfg.param_dtype == "bfloat16" else "float32",
        **fam.hf_extras(cfg),
    }
    if cfg.pad_token_id is not None:
        out["pad_token_id"] = cfg.pad_token_id
    if fam.hybrid:  # transformers 5 reads RoPE from rope_parameters only for this family
        del out["rope_theta"], out["rope_scaling"]
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                  "partial_rotary_factor": cfg.partial_rotary_factor}
    if fam.shared_expert:  # Qwen3.5-MoE's config has no dense MLP width
        del out["intermediate_size"]
    if critic:
        labels = {"num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
        if fam.wrapper == "qwen3_5":
            return wrapped_critic_config(out, labels)
        out.update(labels)
    return out


# transformers' Qwen3_5ForTokenClassification is built on the vision-language config and always makes a vision
# tower. A value model is text-only: its export names the smallest tower and carries no weights for it
# (transformers initialises it, unused, and says the weights were missing).
PLACEHOLDER_VISION_CONFIG = {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 16, "intermediate_size": 16,
                             "num_heads": 1, "out_hidden_size": 16, "patch_size": 2, "temporal_patch_size": 1,
                             "spatial_merge_size": 1, "num_position_embeddings": 4}


def wrapped_critic_config(text: dict, labels: dict) -> dict:
    """The config.json of a Qwen3.5 value model: the vision-language wrapper around `text` (see above)."""
    fam = FAMILIES[text["model_type"]]
    inner = {k: v for k, v in text.items() if k not in ("architectures", "torch_dtype")}
    return {"architectures": [fam.critic], "model_type": fam.wrapper, "text_config": inner,
            "vision_config": PLACEHOLDER_VISION_CONFIG, "tie_word_embeddings": text["tie_word_embeddings"],
            "torch_dtype": text["torch_dtype"], **labels}


def is_critic_hf(raw: dict) -> bool:
    """Whether a config.json is a value model (`*ForTokenClassification`) of a supported family."""
    return any(a == f.critic for a in raw.get("architectures") or [] for f in FAMILIES.values())


def hf_prefix(raw: dict) -> str:
    """Where the language model's tensors sit in a checkpoint of this config.json: `model.language_model.` in a
    Qwen3.5 vision-language checkpoint (and its value model), else `model.`."""
    return "model.language_model." if raw.get("model_type") in _WRAPPERS else "model."
