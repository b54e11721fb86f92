"""Params as plain nested dicts of arrays, their shardings, and random initialisation.

The trainer, the checkpointer and the engines all hold params as a pure dict (the same tree that
`nnx.to_pure_dict(nnx.state(model))` gives) plus a static graphdef. `nnx.merge(graphdef, params)`
rebuilds a callable model inside jit at no run-time cost.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from jaxrl_llm import sharding
from jaxrl_llm.models.config import DecoderConfig
from jaxrl_llm.models.hf_table import logical_axes_tree
from jaxrl_llm.models.qwen2 import DecoderCritic, DecoderForCausalLM, abstract_model


def graphdef_and_abstract_params(cfg: DecoderConfig, *, critic: bool = False):
    """(graphdef, params tree of ShapeDtypeStruct)."""
    graphdef, state = nnx.split(abstract_model(cfg, critic=critic))
    return graphdef, nnx.to_pure_dict(state)


def param_shardings(cfg: DecoderConfig, mesh: Mesh | None, *, critic: bool = False):
    """A tree of shardings matching the params, from the logical axes of the HF table."""
    _, abstract = graphdef_and_abstract_params(cfg, critic=critic)
    axes = logical_axes_tree(cfg, critic=critic)
    if mesh is None:
        dev = SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda _: dev, abstract)
    return jax.tree.map(lambda a, ax: sharding.named_sharding(mesh, ax, a.shape), abstract, axes,
                        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def init_params(cfg: DecoderConfig, *, mesh: Mesh | None = None, seed: int = 0, critic: bool = False,
                dtype=None):
    """Random params created directly in their sharded layout (never whole on one device).

    dtype: cast to it inside the same program (the values drawn in param_dtype, then rounded), so a LoRA
    run's bf16 base never holds the fp32 draw: XLA fuses the cast into the draw.
    """
    try:
        hash((cfg, mesh, dtype))
    except TypeError:  # a config holding a list (e.g. lora_targets set directly) is no cache key: traced afresh
        draw = _draw.__wrapped__(cfg, mesh, critic, dtype)
    else:
        draw = _draw(cfg, mesh, critic, dtype)
    return draw(jax.random.key(seed))


@functools.lru_cache(maxsize=16)
def _draw(cfg: DecoderConfig, mesh: Mesh | None, critic: bool, dtype):
    """`init_params`' jitted draw for one config, kept: a second model of the config (each trainer a process builds,
    a test's reference model) is drawn without tracing the modules and lowering them again (0.3 s at the tiny
    preset, most of its draw)."""
    cls = DecoderCritic if critic else DecoderForCausalLM

    def make(key):
        params = nnx.to_pure_dict(nnx.state(cls(cfg, rngs=nnx.Rngs(params=key))))
        return params if dtype is None else jax.tree.map(lambda x: x.astype(dtype), params)

    return jax.jit(make, out_shardings=param_shardings(cfg, mesh, critic=critic))


def init_model(cfg: DecoderConfig, *, mesh: Mesh | None = None, seed: int = 0, critic: bool = False):
    """A model with random params (HF's init: normal(initializer_range), zero biases, unit norms)."""
    graphdef, _ = graphdef_and_abstract_params(cfg, critic=critic)
    return nnx.merge(graphdef, init_params(cfg, mesh=mesh, seed=seed, critic=critic))


def split_model(model: nnx.Module):
    """(graphdef, params dict) of a model."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
