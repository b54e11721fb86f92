"""Remat policies change what the backward pass keeps, never its values; `auto` picks by memory."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.models import PRESETS, init_model
from jaxrl_llm.models.remat import AUTO_LADDER, POLICIES, remat_policy
from jaxrl_llm.trainer.memory.estimate import choose_remat, estimate_step_bytes


def test_every_policy_gives_the_same_loss_and_gradients():
    """Every policy of the same model (offload_mlp too: the CPU has a pinned host memory space), in one jitted
    program (one compile)."""
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 100, size=(2, 12)), jnp.int32)
    losses = []
    for remat in POLICIES:
        cfg = PRESETS["tiny"](dtype="float32", param_dtype="float32", remat=remat)
        graphdef, params = nnx.split(init_model(cfg, seed=2))  # the same params under every policy

        def loss(p, graphdef=graphdef):
            logits = nnx.merge(graphdef, p)(ids)
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * jnp.arange(12.0))

        losses.append(loss)
    out = jax.jit(lambda p: [jax.value_and_grad(f)(p) for f in losses])(params)
    ref = out[POLICIES.index("none")]
    for remat, got in zip(POLICIES, out):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=remat)


def test_the_named_policies_keep_their_tags_and_cudnn_attention():
    from jax.ad_checkpoint import checkpoint_name

    x = jnp.ones((2, 3))
    name_p = jax.make_jaxpr(lambda x: checkpoint_name(x, "t"))(x).eqns[0].primitive  # the tagging primitive
    tags = ("q_proj", "k_proj", "v_proj", "attention", "o_proj", "gate_proj", "up_proj")
    kept = {}
    for remat in ("attention", "attention_block", "mlp_gate"):
        policy = remat_policy(remat)
        kept[remat] = {t for t in tags if policy(name_p, x, name=t)}
        assert policy(types.SimpleNamespace(name="dot_product_attention_fwd_wrapper"))  # cuDNN: output and stats
        assert not policy(types.SimpleNamespace(name="dot_product_attention_bwd_wrapper"))
        assert not policy(jax.lax.dot_general_p, x, x.T, dimension_numbers=(((1,), (0,)), ((), ())),
                          precision=None, preferred_element_type=None)  # an untagged matmul: recomputed
    block = {"q_proj", "k_proj", "v_proj", "attention", "o_proj"}
    assert kept == {"attention": {"attention"}, "attention_block": block, "mlp_gate": block | {"gate_proj"}}
    assert AUTO_LADDER == ("dots", "mlp_gate", "attention_block", "attention", "full")


def test_dots_saves_batch_free_matmuls_and_cudnn_attention_forward_only():
    dots = remat_policy("dots")
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    plain = dict(dimension_numbers=(((1,), (0,)), ((), ())), precision=None, preferred_element_type=None)
    batched = dict(dimension_numbers=(((2,), (1,)), ((0,), (0,))), precision=None, preferred_element_type=None)
    assert dots(jax.lax.dot_general_p, x, x, **plain)
    assert not dots(jax.lax.dot_general_p, x, x, **batched)  # XLA attention's scores: recomputed
    assert dots(types.SimpleNamespace(name="dot_product_attention_fwd_wrapper"))
    assert not dots(types.SimpleNamespace(name="dot_product_attention_bwd_wrapper"))
    assert not dots(jax.lax.exp_p, x)
    assert not remat_policy("full")(jax.lax.dot_general_p, x, x, **plain)


def test_auto_starts_at_the_least_recompute_the_estimate_fits():
    c15, c7 = PRESETS["qwen2p5_1p5b"](), PRESETS["qwen2p5_7b"]()
    h200 = int(139e9 * 0.92)  # XLA's share of an H200 under the trainer's memory fraction
    assert choose_remat(c15, tokens_per_device=16384, param_shards=1, device_bytes=h200) == "dots"
    assert choose_remat(c7, tokens_per_device=16384, param_shards=4, device_bytes=h200) == "dots"
    # 32k tokens: "dots" ~153 GB, "mlp_gate" ~119 GB, "attention_block" ~84 GB of the 108 GB allowed
    assert choose_remat(c7, tokens_per_device=32768, param_shards=4, device_bytes=h200) == "attention_block"
    assert choose_remat(c7, tokens_per_device=16384, param_shards=1, device_bytes=h200) == "full"  # none fits
    assert choose_remat(c15, tokens_per_device=16384, param_shards=1, device_bytes=None) == "full"
    full = estimate_step_bytes(c7, remat="full", tokens_per_device=16384, param_shards=4)
    dots = estimate_step_bytes(c7, remat="dots", tokens_per_device=16384, param_shards=4)
    # per layer, in bf16 values: q and the attention output, k and v, o_proj's and down's outputs less
    # the layer input "full" keeps, gate and up, fp32 softmax statistics (28 heads)
    per_layer = 2 * 3584 + 2 * 512 + (2 * 3584 - 3584) + 2 * 18944 + 2 * 28
    assert dots - full == pytest.approx(16384 * 28 * 2 * per_layer, rel=1e-9)


def test_a_lora_moe_counts_the_base_in_the_compute_dtype_and_the_optimizer_for_adapters_only():
    """Qwen3-30B-A3B with rank-32 attention adapters on one H200: the frozen bf16 base (61 GB) and the
    adapters' fp32 state, no master copy and no reference copy; full fine-tuning would need 16 bytes a param."""
    from jaxrl_llm.models.lora import LoraSpec, num_adapter_params, resolve_targets

    cfg = PRESETS["qwen3_30b_a3b"]()
    spec = LoraSpec(rank=32, alpha=64.0, targets=resolve_targets("all-linear", cfg=cfg))
    lora = num_adapter_params(cfg, spec)
    assert 20e6 < lora < 40e6  # 48 layers x (q, k, v, o) x 32 x (in + out)
    kw = dict(remat="full", tokens_per_device=16384, param_shards=1, engine=False)
    lora_bytes = estimate_step_bytes(cfg, lora_params=lora, **kw)
    base_bytes = 2.0 * cfg.num_params()
    assert base_bytes + 16 * lora < lora_bytes < base_bytes + 16 * lora + 20e9  # + activations, no reference
    assert estimate_step_bytes(cfg, **kw) > 16 * cfg.num_params()


def test_dots_counts_the_adapters_matmul_outputs():
    """Issue 32: the 7B rank-32 LoRA step at a 16,384-token budget on one H100. Its "dots" update asked XLA
    for 84.8 GiB (91.1 GB) of temporaries, because `auto` had taken "dots" on an estimate of 65 GB that
    left out the adapters' own saved outputs (x·A and (x·A)·B of 7 modules a layer). Counted, "dots" needs
    about that 91 GB and `auto` starts lower on the H100 (at "mlp_gate", which keeps no adapter output)."""
    from jaxrl_llm.models.lora import LoraSpec, num_adapter_params, resolve_targets
    from jaxrl_llm.trainer.memory.estimate import lora_outputs_per_token, saved_bytes_per_token

    c7 = PRESETS["qwen2p5_7b"]()
    spec = LoraSpec(rank=32, alpha=64.0, targets=resolve_targets("all-linear"))
    outs = lora_outputs_per_token(c7, spec)
    # per layer: q, o, down out 3584; k, v 512; gate, up 18944; and the rank-32 x·A of each of the 7
    assert outs == 28 * (3 * 3584 + 2 * 512 + 2 * 18944 + 7 * 32)
    assert saved_bytes_per_token(c7, "full", lora_outputs=outs) == saved_bytes_per_token(c7, "full")
    h100 = int(85.52e9 * 0.92)  # XLA's share of an H100 80GB under the trainer's memory fraction
    kw = dict(tokens_per_device=15360, param_shards=1, engine=False, device_bytes=h100,
              lora_params=num_adapter_params(c7, spec))
    assert choose_remat(c7, **kw, lora_outputs=outs) == "mlp_gate"  # the adapters' outputs recomputed
    assert choose_remat(c7, **kw) == "dots"  # what the regression chose
    kw.pop("device_bytes")
    dots = estimate_step_bytes(c7, remat="dots", **kw, lora_outputs=outs)
    state = 2 * c7.num_params() + 16 * kw["lora_params"]  # the bf16 base, the adapters' fp32 state
    assert 88e9 < dots - state < 94e9  # saved outputs and one layer's working set: XLA's 91.1 GB
