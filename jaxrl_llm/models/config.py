"""Decoder configuration for every supported family (Qwen2/2.5, Qwen3, Llama 3.x, Qwen3-MoE, Qwen3.5): presets
with HF's exact shapes, and HF config.json I/O (the family specifics live in `families.py`)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import Any

import gin
import jax.numpy as jnp

from jaxrl_llm.models import families
from jaxrl_llm.models.errors import ConfigError
from jaxrl_llm.models.presets import Presets
from jaxrl_llm.models.remat import POLICIES as REMAT_POLICIES
from jaxrl_llm.models.rope import RopeScaling, rope_scaling_from_hf

SUPPORTED_ARCHITECTURES = tuple(a for f in families.FAMILIES.values() for a in f.architectures)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DecoderConfig(Presets):
    """Shapes and numerics of a decoder of one of the supported families.

    `model_type` is the HF family ("qwen2", "qwen3" or "llama", see `families.py`); it switches the
    q/k/v biases (`qkv_bias`) and the per-head q/k RMSNorm (`qk_norm`). `rope_scaling` is None (plain
    RoPE) or Llama 3's frequency bands (a `RopeScaling`, or HF's dict form, converted on creation).
    The shape fields use HF's names so that `from_hf(config.json)` is a rename-free read.
    `dtype` is the compute dtype and `param_dtype` the storage dtype (fp32 master weights with bf16
    compute is the usual training setup). `remat` picks the activation-checkpoint policy of the layer
    scan: "none", "full" (recompute the whole layer), "dots" (save matmul outputs), or one between them
    (`models/remat.py`).
    `attention_impl` is "xla", "cudnn" (flash attention, GPU only) or "auto" (cudnn on GPU when the
    dtype is 16-bit, else xla). `lora_*` add LoRA adapters to the model (not part of HF's config.json).

    Mixture of experts (model_type "qwen3_moe", `models/moe.py`): layer i is sparse when it is not in
    `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0; a sparse layer routes each token to
    `num_experts_per_tok` of `num_experts` SwiGLU experts of width `moe_intermediate_size`, the other
    layers keep a dense MLP of `intermediate_size`. `output_router_logits` (HF's switch) adds
    `router_aux_loss_coef` x the load-balancing loss to the actor loss.

    Hybrid linear attention (Qwen3.5, model_type "qwen3_5_text" / "qwen3_5_moe_text"): `layer_types[i]` is
    "linear_attention" (a Gated DeltaNet of `linear_num_key_heads` key and `linear_num_value_heads` value heads
    of `linear_key_head_dim` / `linear_value_head_dim`, with a causal conv of width `linear_conv_kernel_dim`) or
    "full_attention" (attention with an output gate and RoPE on the first `partial_rotary_factor` of each head).
    The MoE sibling adds a shared expert of width `shared_expert_intermediate_size` to every sparse layer.
    """

    model_type: str = "qwen2"
    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    bos_token_id: int | None = 151643
    eos_token_id: int | tuple[int, ...] | None = 151643
    pad_token_id: int | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    attention_impl: str = "auto"
    num_experts: int = 0  # 0: a dense model
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    shared_expert_intermediate_size: int = 0  # Qwen3.5-MoE: the gated shared expert's width
    # Qwen3.5's hybrid layers (empty layer_types: every layer full attention)
    layer_types: tuple[str, ...] = ()
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    partial_rotary_factor: float = 1.0
    # LoRA adapters on the linear layers named in `lora_targets` (see `models/lora.py`); 0 is off.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()
    # The layers' linear kernels held in 8 bits with per-channel scales: 'none', 'int8', 'fp8' (`models/quant.py`).
    base_quantization: str = "none"

    def __post_init__(self):
        families.family(self.model_type)  # a ConfigError naming the supported families
        if isinstance(self.eos_token_id, list):  # hashable: configs are cache keys and static jit arguments
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers or ()))
        object.__setattr__(self, "layer_types", tuple(self.layer_types or ()))
        self._check_experts()
        self._check_hybrid()
        if isinstance(self.rope_scaling, dict):  # HF's form, e.g. from gin's model.overrides
            object.__setattr__(self, "rope_scaling", rope_scaling_from_hf(
                self.rope_scaling, where="DecoderConfig", max_position_embeddings=self.max_position_embeddings))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(f"rope_scaling={self.rope_scaling!r}; expected None, a RopeScaling or HF's dict")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"remat={self.remat!r}; expected one of {REMAT_POLICIES}")
        if self.attention_impl not in ("auto", "xla", "cudnn"):
            raise ConfigError(f"attention_impl={self.attention_impl!r}; expected 'auto', 'xla' or 'cudnn'")
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            try:
                ok = jnp.issubdtype(jnp.dtype(value), jnp.floating)
            except TypeError:
                ok = False
            if not ok:
                raise ConfigError(f"{name}={value!r} is not a floating-point dtype; use 'float32' or 'bfloat16'")

    def _check_experts(self) -> None:
        if not self.family.moe:
            if self.num_experts or self.output_router_logits:
                raise ConfigError(f"num_experts={self.num_experts}, output_router_logits={self.output_router_logits}"
                                  f" need a mixture-of-experts model_type ('qwen3_moe', 'qwen3_5_moe_text'; got "
                                  f"{self.model_type!r}); a dense model has num_experts=0 and no router loss")
            return
        if self.num_experts < 1:
            raise ConfigError(f"model_type={self.model_type!r} needs num_experts >= 1 (config.json: num_experts)")
        if self.family.shared_expert and self.shared_expert_intermediate_size < 1:
            raise ConfigError(f"model_type={self.model_type!r} needs shared_expert_intermediate_size >= 1")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts="
                              f"{self.num_experts}]")
        if self.moe_intermediate_size < 1:
            raise ConfigError(f"moe_intermediate_size={self.moe_intermediate_size}; set the experts' MLP width")
        if self.decoder_sparse_step < 1:
            raise ConfigError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(f"mlp_only_layers has {bad}, outside the {self.num_hidden_layers} layers")
        if not any(self.is_sparse_layer(i) for i in range(self.num_hidden_layers)):
            raise ConfigError(f"no sparse layer (decoder_sparse_step={self.decoder_sparse_step}, mlp_only_layers="
                              f"{list(self.mlp_only_layers)}); use model_type 'qwen3' for a dense model")

    def _check_hybrid(self) -> None:
        from jaxrl_llm.models.families import LAYER_TYPES

        if not self.family.hybrid:
            if any(t != "full_attention" for t in self.layer_types) or self.partial_rotary_factor != 1.0:
                raise ConfigError(f"layer_types={list(self.layer_types)}, partial_rotary_factor="
                                  f"{self.partial_rotary_factor} need a Qwen3.5 model_type ('qwen3_5_text', "
                                  f"'qwen3_5_moe_text'; got {self.model_type!r})")
            return
        if len(self.layer_types) != self.num_hidden_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ConfigError(f"layer_types={list(self.layer_types)}: need one of {list(LAYER_TYPES)} for each of the "
                              f"{self.num_hidden_layers} layers")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                              f"linear_num_key_heads={self.linear_num_key_heads}")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor={self.partial_rotary_factor}: need a fraction in (0, 1] that "
                              f"leaves an even number of rotated dims (head_dim={self.head_dim})")
        if self.linear_conv_kernel_dim < 1:
            raise ConfigError(f"linear_conv_kernel_dim={self.linear_conv_kernel_dim} must be >= 1")
        if "full_attention" not in self.layer_types:
            raise ConfigError(f"layer_types={list(self.layer_types)}: need at least one 'full_attention' layer")

    # ---- family switches -----------------------------------------------------------------------
    @property
    def family(self) -> families.Family:
        return families.FAMILIES[self.model_type]

    @property
    def qkv_bias(self) -> bool:
        return self.family.qkv_bias

    @property
    def qk_norm(self) -> bool:
        return self.family.qk_norm

    @property
    def is_hybrid(self) -> bool:
        """Qwen3.5: linear-attention layers, an attention output gate, zero-centred norms."""
        return self.family.hybrid

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE rotates (all but for Qwen3.5's partial RoPE)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear_layer(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "linear_attention"

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the Gated DeltaNet's conv: q, k and v side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    # ---- layer kinds (mixture of experts) -------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, i: int) -> bool:
        """HF's rule for which layers hold experts (Qwen3MoeDecoderLayer)."""
        return (self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The HF indices of the layers with experts, in order (the L_moe axis of recorded routing)."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_sparse_layer(i))

    def layer_stack(self, i: int) -> str:
        """The params stack layer i lives in: one stack per kind of layer (see `layer_stacks`)."""
        if self.is_linear_layer(i):
            return "linear_layers"
        if self.is_moe and not self.is_sparse_layer(i) and not self.is_hybrid:
            return "dense_layers"
        return "layers"

    @property
    def layer_stacks(self) -> dict[str, tuple[int, ...]]:
        """Stacked layer groups of the params -> the HF layer indices they hold, in order.

        Layers of one kind share a stack (scanned together): `layers` holds every layer of a dense
        model, the sparse layers of a Qwen3-MoE and the attention layers of a Qwen3.5; `dense_layers` the
        dense layers of a Qwen3-MoE, if any; `linear_layers` the Gated DeltaNet layers of a Qwen3.5.
        """
        stacks: dict[str, list[int]] = {"layers": []}
        for i in range(self.num_hidden_layers):
            stacks.setdefault(self.layer_stack(i), []).append(i)
        return {name: tuple(ids) for name, ids in stacks.items()}

    @property
    def layer_runs(self) -> tuple[tuple[str, int, int], ...]:
        """Execution order as runs of one kind: (stack name, start, stop) into that stack."""
        where = {i: (name, j) for name, ids in self.layer_stacks.items() for j, i in enumerate(ids)}
        runs: list[list] = []
        for i in range(self.num_hidden_layers):
            name, j = where[i]
            if runs and runs[-1][0] == name:
                runs[-1][2] = j + 1
            else:
                runs.append([name, j, j + 1])
        return tuple(tuple(r) for r in runs)

    @property
    def layer_period(self) -> int:
        """The shortest p that divides the depth with layer i of the kind of layer i % p (Qwen3.5: the
        full-attention interval); the layer scan then runs over depth / p groups of p layers. The depth itself
        when the kinds repeat with no shorter period."""
        kinds = [self.layer_stack(i) for i in range(self.num_hidden_layers)]
        n = len(kinds)
        return next(p for p in range(1, n + 1) if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)))

    @property
    def active_intermediate_size(self) -> int:
        """The MLP width one token runs through in the widest layer kind (k experts' in a MoE, plus the shared
        expert's in a Qwen3.5-MoE)."""
        if not self.is_moe:
            return self.intermediate_size
        dense = self.intermediate_size if "dense_layers" in self.layer_stacks else 0
        return max(self.num_experts_per_tok * self.moe_intermediate_size + self.shared_expert_intermediate_size,
                   dense)

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def num_params(self, *, with_value_head: bool = False, active: bool = False) -> int:
        """Exact parameter count, as HF's `model.num_parameters()` reports it; `active`: the parameters
        one token uses (a sparse layer counts its router and `num_experts_per_tok` experts)."""
        d, f, v, layers = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        gate = 2 if self.is_hybrid else 1  # Qwen3.5's q_proj also makes the attention output's gate
        attn = (1 + gate) * d * self.q_dim + 2 * d * self.kv_dim
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        hv = self.linear_num_value_heads
        linear = (d * self.linear_conv_dim + d * self.linear_value_dim + 2 * d * hv
                  + self.linear_conv_dim * self.linear_conv_kernel_dim + 2 * hv + self.linear_value_head_dim
                  + self.linear_value_dim * d)
        n_linear = sum(self.is_linear_layer(i) for i in range(layers))
        n_sparse = sum(self.is_sparse_layer(i) for i in range(layers))
        experts = self.num_experts_per_tok if active else self.num_experts
        moe_mlp = d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
        if self.shared_expert_intermediate_size:
            moe_mlp += 3 * d * self.shared_expert_intermediate_size + d
        total = (v * d + (layers - n_linear) * attn + n_linear * linear + layers * 2 * d
                 + (layers - n_sparse) * 3 * d * f + n_sparse * moe_mlp + d)
        if with_value_head:
            total += d + 1
        elif not self.tie_word_embeddings:
            total += v * d
        return total

    def replace(self, **changes: Any) -> DecoderConfig:
        _check_field_names(changes, "DecoderConfig.replace")
        return dataclasses.replace(self, **changes)

    @classmethod
    def _make(cls, where: str, *parts: dict[str, Any]) -> DecoderConfig:
        """`cls(**merged parts)` (later parts win); a field name that DecoderConfig does not have is one
        `ConfigError` naming it (and `where`), not a TypeError from `__init__`."""
        fields = {k: v for part in parts for k, v in part.items()}
        _check_field_names(fields, where)
        try:
            return cls(**fields)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    # ---- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict, **overrides: Any) -> DecoderConfig:
        """Reads a HF config (any supported family) from a dict, a config.json path, or a model directory."""
        if isinstance(path_or_dict, dict):
            raw, where = path_or_dict, "config dict"
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            where = path
            try:
                with open(path) as f:
                    raw = json.load(f)
            except FileNotFoundError:
                raise ConfigError(f"{where}: no config.json; is this a HF model directory?") from None
            except (OSError, json.JSONDecodeError) as e:
                raise ConfigError(f"{where}: cannot read config.json ({e})") from None
        return cls._make(where, families.fields_from_hf(raw, where), overrides)

    def to_hf(self, *, critic: bool = False) -> dict:
        """The config.json dict that transformers and vLLM read (`critic`: the token-classification model)."""
        return families.hf_from_config(self, critic=critic)


def _check_field_names(fields: dict[str, Any], where: str) -> None:
    """One ConfigError for names that are not DecoderConfig fields (a typo in model.overrides, say)."""
    known = [f.name for f in dataclasses.fields(DecoderConfig)]
    unknown = [k for k in fields if k not in known]
    if unknown:
        close = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
        hints = "".join(f" (did you mean {c[0]!r} for {k!r}?)" for k, c in close.items() if c)
        raise ConfigError(f"{where}: DecoderConfig has no field(s) {unknown}{hints}; check the overrides "
                          f"(gin: model.overrides); known fields: {known}")


PRESETS = {
    "qwen2p5_0p5b": DecoderConfig.qwen2p5_0p5b,
    "qwen2p5_1p5b": DecoderConfig.qwen2p5_1p5b,
    "qwen2p5_3b": DecoderConfig.qwen2p5_3b,
    "qwen2p5_7b": DecoderConfig.qwen2p5_7b,
    "qwen2p5_14b": DecoderConfig.qwen2p5_14b,
    "qwen2p5_32b": DecoderConfig.qwen2p5_32b,
    "qwen2_7b": DecoderConfig.qwen2_7b,
    "qwen3_0p6b": DecoderConfig.qwen3_0p6b,
    "qwen3_1p7b": DecoderConfig.qwen3_1p7b,
    "qwen3_4b": DecoderConfig.qwen3_4b,
    "qwen3_8b": DecoderConfig.qwen3_8b,
    "llama3p2_1b": DecoderConfig.llama3p2_1b,
    "llama3p2_3b": DecoderConfig.llama3p2_3b,
    "llama3p1_8b": DecoderConfig.llama3p1_8b,
    "qwen3_30b_a3b": DecoderConfig.qwen3_30b_a3b,
    "qwen3_235b_a22b": DecoderConfig.qwen3_235b_a22b,
    "qwen3_5_9b": DecoderConfig.qwen3_5_9b,
    "qwen3_5_35b_a3b": DecoderConfig.qwen3_5_35b_a3b,
    "tiny": DecoderConfig.tiny,
    "tiny_moe": DecoderConfig.tiny_moe,
    "tiny_qwen35": DecoderConfig.tiny_qwen35,
    "tiny_qwen35_moe": DecoderConfig.tiny_qwen35_moe,
}


# The name most modules import: the decoder config was Qwen2's before the other families joined.
Qwen2Config = DecoderConfig


@gin.configurable
def model_config(preset: str = gin.REQUIRED, **overrides: Any) -> DecoderConfig:
    """Gin entry point: a preset by name with field overrides (`model_config.preset = 'qwen2p5_7b'`)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[preset](**overrides)
