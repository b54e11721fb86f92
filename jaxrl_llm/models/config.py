"""Qwen2 / Qwen2.5 model configuration: presets with HF's exact shapes and HF config.json I/O."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import Any

import gin
import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen2ForTokenClassification")


class ConfigError(ValueError):
    """A model config that we cannot load; the message names the field."""


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """Shapes and numerics of a Qwen2 decoder.

    The shape fields use HF's names so that `from_hf(config.json)` is a rename-free read.
    `dtype` is the compute dtype and `param_dtype` the storage dtype (fp32 master weights with bf16
    compute is the usual training setup). `remat` picks the activation-checkpoint policy of the layer
    scan: "none", "full" (recompute the whole layer) or "dots" (save matmul outputs).
    `attention_impl` is "xla", "cudnn" (flash attention, GPU only) or "auto" (cudnn on GPU when the
    dtype is 16-bit, else xla).
    """

    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    bos_token_id: int | None = 151643
    eos_token_id: int | list[int] | None = 151643
    pad_token_id: int | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    attention_impl: str = "auto"

    def __post_init__(self):
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
        if self.remat not in ("none", "full", "dots"):
            raise ConfigError(f"remat={self.remat!r}; expected 'none', 'full' or 'dots'")
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

    def num_params(self, *, with_value_head: bool = False) -> int:
        """Exact parameter count, as HF's `model.num_parameters()` reports it."""
        d, f, v, layers = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        attn = d * self.q_dim + self.q_dim + 2 * (d * self.kv_dim + self.kv_dim) + self.q_dim * d
        per_layer = attn + 3 * d * f + 2 * d
        total = v * d + layers * per_layer + d
        if with_value_head:
            total += d + 1
        elif not self.tie_word_embeddings:
            total += v * d
        return total

    def replace(self, **changes: Any) -> Qwen2Config:
        _check_field_names(changes, "Qwen2Config.replace")
        return dataclasses.replace(self, **changes)

    @classmethod
    def _make(cls, where: str, *parts: dict[str, Any]) -> Qwen2Config:
        """`cls(**merged parts)` (later parts win); a field name that Qwen2Config does not have is one
        `ConfigError` naming it (and `where`), not a TypeError from `__init__`."""
        fields = {k: v for part in parts for k, v in part.items()}
        _check_field_names(fields, where)
        return cls(**fields)

    # ---- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict, **overrides: Any) -> Qwen2Config:
        """Reads a HF Qwen2 config from a dict, a config.json path, or a model directory."""
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
        archs = raw.get("architectures") or []
        if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ConfigError(
                f"{where}: architectures={archs} is not supported; jaxrl_llm loads "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if raw.get("model_type") not in (None, "qwen2"):
            raise ConfigError(f"{where}: model_type={raw.get('model_type')!r}; expected 'qwen2'")
        if raw.get("use_sliding_window", False):
            raise ConfigError(f"{where}: use_sliding_window=true is not supported")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(f"{where}: rope type {rope_type!r} is not supported (only default RoPE)")
        theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act={raw['hidden_act']!r}; Qwen2 uses 'silu'")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if raw.get(k) is None]
        if missing:
            raise ConfigError(f"{where}: missing field(s) {missing}; a Qwen2 config.json needs {list(required)}")
        fields = dict(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            head_dim=raw.get("head_dim"),
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            rope_theta=float(theta),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            initializer_range=raw.get("initializer_range", 0.02),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
        )
        fields.update(overrides)
        return cls._make(where, fields, overrides)

    def to_hf(self, *, architecture: str = "Qwen2ForCausalLM") -> dict:
        """The config.json dict that transformers and vLLM read."""
        out = {
            "architectures": [architecture],
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "use_sliding_window": False,
            "sliding_window": None,
            "attention_dropout": 0.0,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "bfloat16" if self.param_dtype == "bfloat16" else "float32",
        }
        if self.pad_token_id is not None:
            out["pad_token_id"] = self.pad_token_id
        if architecture == "Qwen2ForTokenClassification":
            out["num_labels"] = 1
            out["id2label"] = {"0": "LABEL_0"}
            out["label2id"] = {"LABEL_0": 0}
        return out

    # ---- presets (HF's exact shapes) -----------------------------------------------------------
    @classmethod
    def qwen2p5_0p5b(cls, **kw) -> Qwen2Config:
        return cls._make("preset 'qwen2p5_0p5b'", _QWEN2P5_COMMON, dict(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, tie_word_embeddings=True), kw)

    @classmethod
    def qwen2p5_1p5b(cls, **kw) -> Qwen2Config:
        return cls._make("preset 'qwen2p5_1p5b'", _QWEN2P5_COMMON, dict(
            hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
            num_key_value_heads=2, tie_word_embeddings=True), kw)

    @classmethod
    def qwen2p5_3b(cls, **kw) -> Qwen2Config:
        return cls._make("preset 'qwen2p5_3b'", _QWEN2P5_COMMON, dict(
            hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
            num_key_value_heads=2, tie_word_embeddings=True), kw)

    @classmethod
    def qwen2p5_7b(cls, **kw) -> Qwen2Config:
        return cls._make("preset 'qwen2p5_7b'", _QWEN2P5_COMMON, dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False), kw)

    @classmethod
    def qwen2p5_14b(cls, **kw) -> Qwen2Config:
        return cls._make("preset 'qwen2p5_14b'", _QWEN2P5_COMMON, dict(
            vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
            num_attention_heads=40, num_key_value_heads=8, rms_norm_eps=1e-5, tie_word_embeddings=False), kw)

    @classmethod
    def qwen2p5_32b(cls, **kw) -> Qwen2Config:
        return cls._make("preset 'qwen2p5_32b'", _QWEN2P5_COMMON, dict(
            vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
            num_attention_heads=40, num_key_value_heads=8, rms_norm_eps=1e-5, tie_word_embeddings=False), kw)

    @classmethod
    def qwen2_7b(cls, **kw) -> Qwen2Config:
        return cls._make("preset 'qwen2_7b'", dict(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
            rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643,
            eos_token_id=151643), kw)

    @classmethod
    def tiny(cls, **kw) -> Qwen2Config:
        """A few-kilobyte model for tests: GQA ratio 2, untied head, odd-free small sizes."""
        base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=1,
                    pad_token_id=0)
        return cls._make("preset 'tiny'", base, kw)


def _check_field_names(fields: dict[str, Any], where: str) -> None:
    """One ConfigError for names that are not Qwen2Config fields (a typo in model.overrides, say)."""
    known = [f.name for f in dataclasses.fields(Qwen2Config)]
    unknown = [k for k in fields if k not in known]
    if unknown:
        close = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
        hints = "".join(f" (did you mean {c[0]!r} for {k!r}?)" for k, c in close.items() if c)
        raise ConfigError(f"{where}: Qwen2Config has no field(s) {unknown}{hints}; check the overrides "
                          f"(gin: model.overrides); known fields: {known}")


_QWEN2P5_COMMON = dict(vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0,
                       rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643)

PRESETS = {
    "qwen2p5_0p5b": Qwen2Config.qwen2p5_0p5b,
    "qwen2p5_1p5b": Qwen2Config.qwen2p5_1p5b,
    "qwen2p5_3b": Qwen2Config.qwen2p5_3b,
    "qwen2p5_7b": Qwen2Config.qwen2p5_7b,
    "qwen2p5_14b": Qwen2Config.qwen2p5_14b,
    "qwen2p5_32b": Qwen2Config.qwen2p5_32b,
    "qwen2_7b": Qwen2Config.qwen2_7b,
    "tiny": Qwen2Config.tiny,
}


@gin.configurable
def model_config(preset: str = gin.REQUIRED, **overrides: Any) -> Qwen2Config:
    """Gin entry point: a preset by name with field overrides (`model_config.preset = 'qwen2p5_7b'`)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown model preset {preset!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[preset](**overrides)
