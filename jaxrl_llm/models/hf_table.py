"""The tables between our parameter tree and HF tensor names, one per model family.

HF import, HF export, checkpoint export and the vLLM weight sync all walk `param_table(cfg)`, which
picks the family's layer rows by `cfg.model_type` (Qwen2: biased q/k/v; Qwen3: q/k norms, no biases;
Llama: neither) around the rows every family shares (embedding, final norm, head or value head). A
Qwen3-MoE's sparse layers carry a router and per-expert rows (one HF tensor per layer and expert,
stacked as [L, E, ...] in ours); its dense layers, if any, form a second stack (`dense_layers`). Each row
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
    hf_name: str  # "model.layers.{i}.self_attn.q_proj.weight" for stacked rows ({j}: the expert)
    transpose: bool  # ours is HF's transposed (linear kernels)
    axes: tuple[str | None, ...]  # logical sharding axes of our layout
    stacked: bool = False  # leading layer axis in ours; one HF tensor per layer
    layers: tuple[int, ...] = ()  # the HF layer index of each slot of the stacked axis (set by param_table)
    experts: int = 0  # > 0: a second leading axis of this many experts; one HF tensor per (layer, expert)

    def hf_names(self) -> list[str]:
        """HF names in our order: layer-major, then expert."""
        if not self.stacked:
            return [self.hf_name]
        if self.experts:
            return [self.hf_name.format(i=i, j=j) for i in self.layers for j in range(self.experts)]
        return [self.hf_name.format(i=i) for i in self.layers]

    def shape(self, cfg: DecoderConfig) -> tuple[int, ...]:
        """Our (stacked, transposed) shape."""
        if not self.stacked:
            return _SHAPES[self.path](cfg)
        return (len(self.layers),) + layer_shape(self.path, cfg)

    def hf_shape(self, cfg: DecoderConfig) -> tuple[int, ...]:
        """The shape of each of the row's HF tensors."""
        per = self.shape(cfg)[int(self.stacked) + int(self.experts > 0):]
        return tuple(reversed(per)) if self.transpose else per


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
# A sparse layer's MLP (Qwen3-MoE): the router [D, E], then per-expert SwiGLU weights [E, D, I] / [E, I, D]
# that HF stores one tensor per expert (`mlp.experts.{j}.gate_proj.weight`, [I, D]).
_MOE = [
    _layer(("mlp", "gate", "kernel"), "mlp.gate.weight", ("embed", None), True),
    *(dataclasses.replace(_layer(("mlp", "experts", name), f"mlp.experts.{{j}}.{name}.weight", axes, True), experts=-1)
      for name, axes in (("gate_proj", ("expert", "embed", "mlp")), ("up_proj", ("expert", "embed", "mlp")),
                         ("down_proj", ("expert", "mlp", "embed")))),
]

# Qwen3.5-MoE's shared expert beside the routed ones: a SwiGLU of its own width and a [D, 1] sigmoid gate.
_SHARED_EXPERT = [
    _layer(("mlp", "shared_expert", "gate_proj", "kernel"), "mlp.shared_expert.gate_proj.weight", ("embed", "mlp"),
           True),
    _layer(("mlp", "shared_expert", "up_proj", "kernel"), "mlp.shared_expert.up_proj.weight", ("embed", "mlp"), True),
    _layer(("mlp", "shared_expert", "down_proj", "kernel"), "mlp.shared_expert.down_proj.weight", ("mlp", "embed"),
           True),
    _layer(("mlp", "shared_expert_gate", "kernel"), "mlp.shared_expert_gate.weight", ("embed", None), True),
]
# A Qwen3.5 linear-attention layer's Gated DeltaNet (`linear_attn`). Its projections are split only over fsdp:
# in_proj_qkv's columns are q, k and v side by side, which an even split over `tensor` would not keep whole.
_LINEAR = [
    _INPUT_NORM,
    _layer(("linear_attn", "in_proj_qkv", "kernel"), "linear_attn.in_proj_qkv.weight", ("embed", None), True),
    _layer(("linear_attn", "in_proj_z", "kernel"), "linear_attn.in_proj_z.weight", ("embed", None), True),
    _layer(("linear_attn", "in_proj_b", "kernel"), "linear_attn.in_proj_b.weight", ("embed", None), True),
    _layer(("linear_attn", "in_proj_a", "kernel"), "linear_attn.in_proj_a.weight", ("embed", None), True),
    _layer(("linear_attn", "conv1d", "kernel"), "linear_attn.conv1d.weight", (None, None, None), True),
    _layer(("linear_attn", "dt_bias"), "linear_attn.dt_bias", (None,), False),
    _layer(("linear_attn", "A_log"), "linear_attn.A_log", (None,), False),
    _layer(("linear_attn", "norm", "weight"), "linear_attn.norm.weight", ("norm",), False),
    _layer(("linear_attn", "out_proj", "kernel"), "linear_attn.out_proj.weight", (None, "embed"), True),
    _POST_NORM,
]

# One decoder layer's attention and norm rows, per family (keyed by HF model_type); the MLP rows follow.
LAYER_TABLES = {
    "qwen2": [_INPUT_NORM, _Q, _Q_BIAS, _K, _K_BIAS, _V, _V_BIAS, _O, _POST_NORM],
    "qwen3": [_INPUT_NORM, _Q, _Q_NORM, _K, _K_NORM, _V, _O, _POST_NORM],
    "qwen3_moe": [_INPUT_NORM, _Q, _Q_NORM, _K, _K_NORM, _V, _O, _POST_NORM],
    "llama": [_INPUT_NORM, _Q, _K, _V, _O, _POST_NORM],
    "qwen3_5_text": [_INPUT_NORM, _Q, _Q_NORM, _K, _K_NORM, _V, _O, _POST_NORM],
    "qwen3_5_moe_text": [_INPUT_NORM, _Q, _Q_NORM, _K, _K_NORM, _V, _O, _POST_NORM],
}

# Per-layer shapes of the stacked rows, keyed by the last three path entries, else the last two.
_LAYER_SHAPES = {
    ("input_layernorm", "weight"): lambda c: (c.hidden_size,),
    ("post_attention_layernorm", "weight"): lambda c: (c.hidden_size,),
    ("q_proj", "kernel"): lambda c: (c.hidden_size, c.q_dim * (2 if c.is_hybrid else 1)),  # Qwen3.5: + the gate
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
    ("gate", "kernel"): lambda c: (c.hidden_size, c.num_experts),
    ("experts", "gate_proj"): lambda c: (c.num_experts, c.hidden_size, c.moe_intermediate_size),
    ("experts", "up_proj"): lambda c: (c.num_experts, c.hidden_size, c.moe_intermediate_size),
    ("experts", "down_proj"): lambda c: (c.num_experts, c.moe_intermediate_size, c.hidden_size),
    ("shared_expert", "gate_proj", "kernel"): lambda c: (c.hidden_size, c.shared_expert_intermediate_size),
    ("shared_expert", "up_proj", "kernel"): lambda c: (c.hidden_size, c.shared_expert_intermediate_size),
    ("shared_expert", "down_proj", "kernel"): lambda c: (c.shared_expert_intermediate_size, c.hidden_size),
    ("shared_expert_gate", "kernel"): lambda c: (c.hidden_size, 1),
    ("in_proj_qkv", "kernel"): lambda c: (c.hidden_size, c.linear_conv_dim),
    ("in_proj_z", "kernel"): lambda c: (c.hidden_size, c.linear_value_dim),
    ("in_proj_b", "kernel"): lambda c: (c.hidden_size, c.linear_num_value_heads),
    ("in_proj_a", "kernel"): lambda c: (c.hidden_size, c.linear_num_value_heads),
    ("conv1d", "kernel"): lambda c: (c.linear_conv_kernel_dim, 1, c.linear_conv_dim),
    ("linear_attn", "dt_bias"): lambda c: (c.linear_num_value_heads,),
    ("linear_attn", "A_log"): lambda c: (c.linear_num_value_heads,),
    ("linear_attn", "norm", "weight"): lambda c: (c.linear_value_head_dim,),
    ("out_proj", "kernel"): lambda c: (c.linear_value_dim, c.hidden_size),
}


def layer_shape(path: tuple[str, ...], cfg: DecoderConfig) -> tuple[int, ...]:
    """One layer's shape of a stacked row (no layer axis), by its path in the params."""
    fn = _LAYER_SHAPES.get(path[-3:]) or _LAYER_SHAPES[path[-2:]]
    return fn(cfg)

_SHAPES = {
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
    for stack, layer_ids in cfg.layer_stacks.items():  # `layers`, a Qwen3-MoE's `dense_layers`, `linear_layers`
        sparse = cfg.is_moe and stack != "dense_layers"
        mixer = _LINEAR if stack == "linear_layers" else LAYER_TABLES[cfg.model_type]
        mlp = (_MOE + (_SHARED_EXPERT if cfg.shared_expert_intermediate_size else [])) if sparse else _MLP
        for row in mixer + mlp:
            rows.append(dataclasses.replace(row, path=("model", stack) + row.path[2:], layers=layer_ids,
                                            experts=cfg.num_experts if row.experts else 0))
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
