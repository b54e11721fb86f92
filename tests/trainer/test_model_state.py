"""The trained state under LoRA on an 8-device mesh: only the adapters (and a critic's new value head) are
trained and have optimizer state, the base is frozen in the compute dtype, adapters shard like their
kernels, and the jitted grad step gives gradients for the trained leaves alone."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxrl_llm import sharding
from jaxrl_llm.models import DecoderConfig, init_params
from jaxrl_llm.models.lora import LoraSpec, is_adapter, resolve_targets
from jaxrl_llm.trainer.roles.model_state import ModelState
from jaxrl_llm.trainer.roles.optim import make_optimizer
from jaxrl_llm.trainer.steps import make_grad_step, make_zeros

SPEC = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear"))


def _paths(tree):
    return [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]


def _state(critic=False):
    mesh = sharding.make_mesh(fsdp=4, tensor=2)
    cfg = DecoderConfig.tiny(dtype="bfloat16", param_dtype="float32")
    tx, _ = make_optimizer(1e-3, total_steps=4)
    params = init_params(cfg, mesh=mesh, critic=critic)
    return ModelState(cfg, mesh, params, tx, lora=SPEC, critic=critic), mesh


def test_only_adapters_train_and_the_base_is_frozen_in_the_compute_dtype():
    state, mesh = _state()
    trained, frozen = state.state["params"], state.frozen
    assert all(is_adapter(p) for p in _paths(trained)) and not any(is_adapter(p) for p in _paths(frozen))
    assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype("bfloat16")}  # no fp32 master copy
    assert {x.dtype for x in jax.tree.leaves(trained)} == {jnp.dtype("float32")}
    # Adam's two moments for the adapters, and counters: nothing the size of the base.
    opt_size = sum(x.size for x in jax.tree.leaves(state.state["opt_state"]))
    assert 2 * state.num_trained() <= opt_size < 2 * state.num_trained() + 16
    # Adapters shard like the kernel they adapt: lora_a on its input axis, lora_b on its output axis.
    q = trained["model"]["layers"]["self_attn"]["q_proj"]
    kernel = frozen["model"]["layers"]["self_attn"]["q_proj"]["kernel"].sharding.spec
    assert tuple(kernel)[1:] == ("fsdp", "tensor") and len(q["lora_a"].sharding.device_set) == 8
    assert q["lora_a"].sharding.spec == P(kernel[0], kernel[1], None)
    assert q["lora_b"].sharding.spec == P(kernel[0], None, kernel[2])

    def loss(params, graphdef, mb, norm):
        from flax import nnx

        logits = nnx.merge(graphdef, params)(mb["ids"])
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3]), {}

    grad = make_grad_step(loss, state.graphdef, state.param_sh)
    ids = jnp.asarray(np.arange(16, dtype=np.int32).reshape(2, 8) % 200)
    with jax.set_mesh(mesh):
        grads, _ = grad(trained, frozen, make_zeros(state.param_sh)(trained), {}, {"ids": ids}, None)
    assert jax.tree.structure(grads) == jax.tree.structure(trained)
    flat = dict(zip(_paths(grads), jax.tree.leaves(grads)))
    # lora_b starts at zero, so only it gets a gradient at step 0; lora_a's is exactly zero.
    assert all(np.any(np.asarray(g)) == (p[-1] == "lora_b") for p, g in flat.items())


def test_a_critic_trains_its_adapters_and_its_new_value_head():
    state, _ = _state(critic=True)
    trained = _paths(state.state["params"])
    assert {p[0] for p in trained if not is_adapter(p)} == {"score"}
    assert any(is_adapter(p) for p in trained) and not any(is_adapter(p) for p in _paths(state.frozen))
    assert state.state["params"]["score"]["kernel"].dtype == jnp.float32
    assert "score" not in state.frozen


def test_the_merged_sync_copies_only_the_adapted_kernels():
    """Qwen3-MoE under LoRA: `merged()` gives new arrays for the adapted attention kernels only; the experts
    (most of a MoE's bytes) and every other untouched leaf are the frozen tree's own arrays, and the
    merged kernels equal W + A @ B * scale."""
    mesh = sharding.make_mesh(fsdp=2, expert=4)
    cfg = DecoderConfig.tiny_moe(dtype="bfloat16", param_dtype="float32")
    spec = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear", cfg=cfg))
    tx, _ = make_optimizer(1e-3, total_steps=4)
    state = ModelState(cfg, mesh, init_params(cfg, mesh=mesh), tx, lora=spec)
    merged, frozen = state.merged(), state.frozen
    experts = frozen["model"]["layers"]["mlp"]["experts"]["gate_proj"]
    assert merged["model"]["layers"]["mlp"]["experts"]["gate_proj"] is experts
    assert merged["model"]["embed_tokens"]["embedding"] is frozen["model"]["embed_tokens"]["embedding"]
    q = merged["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
    assert q is not frozen["model"]["layers"]["self_attn"]["q_proj"]["kernel"] and q.sharding == state.base_sh[
        "model"]["layers"]["self_attn"]["q_proj"]["kernel"]
    np.testing.assert_array_equal(np.asarray(q, np.float32),
                                  np.asarray(frozen["model"]["layers"]["self_attn"]["q_proj"]["kernel"], np.float32))
    assert merged["model"]["layers"]["mlp"]["experts"]["gate_proj"] is not state.merged("float32")["model"][
        "layers"]["mlp"]["experts"]["gate_proj"]  # another dtype: cast
