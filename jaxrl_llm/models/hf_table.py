"""The tables between our parameter tree and HF tensor names, one per model family.

HF import, HF export, checkpoint export and the vLLM weight sync all walk `param_table(cfg)`, which
picks the family's layer rows by `cfg.model_type` (Qwen2: biased q/k/v; Qwen3: q/k norms, no biases;
Llama: neither) around the rows every family shares (embedding, final norm, head or value head). Each row
says where a tensor lives in our params (a path into the nested dict), its HF name (with `{i}` for
the layer index of stacked layer params), whether its layout is transposed relative to HF's
(`nn.Linear` stores [out, in]; we store [in, out]), and its logical sharding axes.
"""

from __future__ import annotations

import dataclasses

from jaxrl_llm.models.config import DecoderConfig


@dataclasses.dataclass(frozen=True)
class ParamRow:
    path: tuple[str, ...]  # into the nested params dict
    hf_name: str  # "model.layers.{i}.self_attn.q_proj.weight" for stacked rows
    transpose: bool  # ours is HF's transposed (linear kernels)
    axes: tuple[str | None, ...]  # logical sharding axes of our layout
    stacked: bool = False  # leading [L] axis in ours; one HF tensor per layer

    def hf_names(self, num_layers: int) -> list[str]:
        if not self.stacked:
            return [self.hf_name]
        return [self.hf_name.format(i=i) for i in range(num_layers)]

    def shape(self, cfg: DecoderConfig) -> tuple[int, ...]:
        """Our (stacked, transposed) shape."""
        return _SHAPES[self.path[-2:] if self.stacked else self.path](cfg)


def _layer(path, hf, axes, transpose):
    return ParamRow(("model", "layers") + path, "model.layers.{i}." + hf, transpose, ("layers",) + axes,
                    stacked=True)


_INPUT_NORM = _layer(("input_layernorm", "weight"), "input_layernorm.weight", ("norm",), False)
_Q = _layer(("self_attn", "q_proj", "kernel"), "self_attn.q_proj.weight", ("embed", "q_heads"), True)
_Q_BIAS = _layer(("self_attn", "q_proj", "bias"), "self_attn.q_proj.bias", ("q_heads",), False)
_K = _layer(("self_attn", "k_proj", "kernel"), "self_attn.k_proj.weight", ("embed", "kv_heads"), True)
_K_BIAS = _layer(("self_attn", "k_proj", "bias"), "self_attn.k_proj.bias", ("kv_heads",), False)
_V = _layer(("self_attn", "v_proj", "kernel"), "self_attn.v_proj.weight", ("embed", "kv_heads"), True)
_V_BIAS = _layer(("self_attn", "v_proj", "bias"), "self_attn.v_proj.bias", ("kv_heads",), False)
_Q_NORM = _layer(("self_attn", "q_norm", "weight"), "self_attn.q_norm.weight", ("norm",), False)
_K_NORM = _layer(("self_attn", "k_norm", "weight"), "self_attn.k_norm.weight", ("norm",), False)
_O = _layer(("self_attn", "o_proj", "kernel"), "self_attn.o_proj.weight", ("q_heads", "embed"), True)
_POST_NORM = _layer(("post_attention_layernorm", "weight"), "post_attention_layernorm.weight", ("norm",), False)
_MLP = [
    _layer(("mlp", "gate_proj", "kernel"), "mlp.gate_proj.weight", ("embed", "mlp"), True),
    _layer(("mlp", "up_proj", "kernel"), "mlp.up_proj.weight", ("embed", "mlp"), True),
    _layer(("mlp", "down_proj", "kernel"), "mlp.down_proj.weight", ("mlp", "embed"), True),
]

# One decoder layer's rows, per family (keyed by HF model_type).
LAYER_TABLES = {
    "qwen2": [_INPUT_NORM, _Q, _Q_BIAS, _K, _K_BIAS, _V, _V_BIAS, _O, _POST_NORM, *_MLP],
    "qwen3": [_INPUT_NORM, _Q, _Q_NORM, _K, _K_NORM, _V, _O, _POST_NORM, *_MLP],
    "llama": [_INPUT_NORM, _Q, _K, _V, _O, _POST_NORM, *_MLP],
}
_ALL_LAYER_ROWS = {row.path: row for rows in LAYER_TABLES.values() for row in rows}.values()


def _per_layer_shape(path):
    c = {
        ("input_layernorm", "weight"): lambda c: (c.hidden_size,),
        ("post_attention_layernorm", "weight"): lambda c: (c.hidden_size,),
        ("q_proj", "kernel"): lambda c: (c.hidden_size, c.q_dim),
        ("q_proj", "bias"): lambda c: (c.q_dim,),
        ("k_proj", "kernel"): lambda c: (c.hidden_size, c.kv_dim),
        ("k_proj", "bias"): lambda c: (c.kv_dim,),
        ("v_proj", "kernel"): lambda c: (c.hidden_size, c.kv_dim),
        ("v_proj", "bias"): lambda c: (c.kv_dim,),
        ("q_norm", "weight"): lambda c: (c.head_dim,),
        ("k_norm", "weight"): lambda c: (c.head_dim,),
        ("o_proj", "kernel"): lambda c: (c.q_dim, c.hidden_size),
        ("gate_proj", "kernel"): lambda c: (c.hidden_size, c.intermediate_size),
        ("up_proj", "kernel"): lambda c: (c.hidden_size, c.intermediate_size),
        ("down_proj", "kernel"): lambda c: (c.intermediate_size, c.hidden_size),
    }[path]
    return lambda cfg: (cfg.num_hidden_layers,) + c(cfg)


_SHAPES = {
    **{row.path[-2:]: _per_layer_shape(row.path[-2:]) for row in _ALL_LAYER_ROWS},
    ("model", "embed_tokens", "embedding"): lambda c: (c.vocab_size, c.hidden_size),
    ("model", "norm", "weight"): lambda c: (c.hidden_size,),
    ("lm_head", "kernel"): lambda c: (c.hidden_size, c.vocab_size),
    ("score", "kernel"): lambda c: (c.hidden_size, 1),
    ("score", "bias"): lambda c: (1,),
}

# HF tensors that carry no weights of ours and are skipped on import.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def param_table(cfg: DecoderConfig, *, critic: bool = False) -> list[ParamRow]:
    """All rows for a causal LM (or, with `critic`, the value model) of this config."""
    rows = [ParamRow(("model", "embed_tokens", "embedding"), "model.embed_tokens.weight", False,
                     ("vocab", "embed"))]
    rows += LAYER_TABLES[cfg.model_type]
    rows.append(ParamRow(("model", "norm", "weight"), "model.norm.weight", False, ("norm",)))
    if critic:
        rows.append(ParamRow(("score", "kernel"), "score.weight", True, ("embed", "value")))
        rows.append(ParamRow(("score", "bias"), "score.bias", False, ("value",)))
    elif not cfg.tie_word_embeddings:
        rows.append(ParamRow(("lm_head", "kernel"), "lm_head.weight", True, ("embed", "vocab")))
    return rows


def get_path(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def set_path(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def logical_axes_tree(cfg: DecoderConfig, *, critic: bool = False) -> dict:
    """Nested dict of logical axes with the same structure as the params."""
    out: dict = {}
    for row in param_table(cfg, critic=critic):
        set_path(out, row.path, row.axes)
    return out
