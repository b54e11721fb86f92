"""A LoRA state of a Qwen3.5 on a mesh: its adapters sit on both stacks (the Gated DeltaNet's projections in
`linear_layers`, the attention and the shared expert in `layers`), sharded like their kernels; the merged tree the
engines and exports take is W + A @ B * scale for exactly the adapted kernels, the rest the frozen arrays; on an
8-bit base the dequantized merge equals the engine's layer-by-layer one."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import sharding
from jaxrl_llm.models import DecoderConfig, init_params, quant
from jaxrl_llm.models.hf_table import get_path
from jaxrl_llm.models.lora import LoraSpec, adapted_paths, resolve_targets
from jaxrl_llm.trainer.roles.model_state import ModelState
from jaxrl_llm.trainer.roles.optim import make_optimizer


def _trained(state, seed=1):
    """The state's adapters with a non-zero lora_b (a trained adapter)."""
    key = jax.random.key(seed)
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(key, x.shape, x.dtype), state.state["params"])


def test_the_merged_moe_tree_adapts_both_stacks_and_keeps_the_rest():
    mesh = sharding.make_mesh(fsdp=2, expert=4)
    cfg = DecoderConfig.tiny_qwen35_moe()
    spec = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear", cfg=cfg))
    tx, _ = make_optimizer(1e-3, total_steps=4)
    state = ModelState(cfg, mesh, init_params(cfg, mesh=mesh), tx, lora=spec)
    state.state["params"] = _trained(state)
    paths = adapted_paths(state.adapters())
    assert ("model", "linear_layers", "linear_attn", "in_proj_qkv", "kernel") in paths
    assert ("model", "layers", "mlp", "shared_expert", "down_proj", "kernel") in paths
    # each stack: its mixer's projections (4 attention, 5 linear) and the shared expert's 4 modules
    assert len(paths) == 4 + 5 + 2 * 4 and not any("experts" in p for p in paths)
    merged, frozen = state.merged("float32"), state.frozen
    assert merged["model"]["layers"]["mlp"]["experts"]["gate_proj"] is frozen["model"]["layers"]["mlp"]["experts"][
        "gate_proj"]
    for path in paths:
        ad = get_path(state.adapters(), path[:-1])
        want = np.asarray(get_path(frozen, path), np.float64) + spec.scale * np.einsum(
            "lir,lro->lio", np.asarray(ad["lora_a"], np.float64), np.asarray(ad["lora_b"], np.float64))
        got = get_path(merged, path)
        assert got.sharding == get_path(state.base_sh, path)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_an_int8_base_merges_layer_by_layer_as_the_whole_tree():
    cfg = DecoderConfig.tiny_qwen35()
    spec = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear", cfg=cfg))
    tx, _ = make_optimizer(1e-3, total_steps=4)
    mesh = sharding.make_mesh(fsdp=2)
    state = ModelState(cfg, mesh, init_params(cfg, mesh=mesh), tx, lora=spec, base_quantization="int8")
    assert state.frozen["model"]["linear_layers"]["linear_attn"]["out_proj"]["kernel"].dtype == jnp.int8
    state.state["params"] = _trained(state)
    merged = state.merged("float32")
    engine = state.engine_params()  # the 8-bit base and pre-scaled adapters, merged by the engine a layer at a time
    for stack, ids in cfg.layer_stacks.items():
        for j in range(len(ids)):
            layer = quant.plain_layer(jax.tree.map(lambda x, j=j: x[j], engine["model"][stack]), jnp.float32)
            want = jax.tree.map(lambda x, j=j: x[j], merged["model"][stack])
            jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6),
                         layer, want)
