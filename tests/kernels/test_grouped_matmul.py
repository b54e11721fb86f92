"""The grouped matmul kernels (Pallas, interpreted on CPU) against `jax.lax.ragged_dot`: the product,
both gradients, empty groups, groups that share a row tile, and rows past the groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.grouped_matmul import _visits, default_block_m, grouped_matmul

M, C, N = 40, 16, 32
SIZES = [(9, 0, 20, 7), (0, 0, 0, 0), (36, 0, 0, 0)]  # shared tiles + an empty group; nothing; one group


def _inputs(sizes, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(M, C)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(len(sizes), C, N)), jnp.float32)
    return x, w, jnp.asarray(sizes, jnp.int32)


def _reference(x, w, gs):
    out = jax.lax.ragged_dot(x, w, gs)
    return jnp.where((jnp.arange(M) < jnp.sum(gs))[:, None], out, 0)


@pytest.mark.parametrize("sizes", SIZES)
def test_product_and_gradients_equal_ragged_dot(sizes):
    x, w, gs = _inputs(sizes)
    got = grouped_matmul(x, w, gs, impl="pallas", block_m=16)
    np.testing.assert_allclose(got, _reference(x, w, gs), rtol=1e-5, atol=1e-5)

    cot = jnp.asarray(np.random.default_rng(1).normal(size=(M, N)), jnp.float32)
    loss = {"pallas": lambda x, w: jnp.sum(grouped_matmul(x, w, gs, impl="pallas", block_m=16) * cot),
            "ref": lambda x, w: jnp.sum(_reference(x, w, gs) * cot)}
    got_dx, got_dw = jax.grad(loss["pallas"], argnums=(0, 1))(x, w)
    ref_dx, ref_dw = jax.grad(loss["ref"], argnums=(0, 1))(x, w)
    np.testing.assert_allclose(got_dx, ref_dx, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got_dw, ref_dw, rtol=1e-5, atol=1e-4)


def test_visits_cover_every_group_tile_once():
    gs = jnp.asarray([9, 0, 20, 7], jnp.int32)
    tile, group = _visits(gs, 48, 16)
    real = [(int(t), int(g)) for t, g in zip(tile, group) if g < 4]
    assert real == [(0, 0), (0, 2), (1, 2), (1, 3), (2, 3)]
    assert len(tile) == 48 // 16 + 4  # the static bound, the rest empty


def test_block_m_and_bad_inputs():
    assert default_block_m(16384 * 8, 128) == 128 and default_block_m(2048, 128) == 16
    x, w, gs = _inputs(SIZES[0])
    with pytest.raises(ValueError, match="impl='nope'"):
        grouped_matmul(x, w, gs, impl="nope")
    with pytest.raises(ValueError, match="multiples of 16"):
        grouped_matmul(x[:, :10], w[:, :10], gs, impl="pallas")
    with pytest.raises(ValueError, match="do not fit"):
        grouped_matmul(x, w, gs[:2])


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_a_layer_of_stacked_experts_is_read_in_place(impl):
    """rhs [L, E, C, N] with `layer`: the product with that layer's experts, the stack never sliced by the kernel."""
    rng = np.random.default_rng(7)
    stack = jnp.asarray(rng.normal(size=(3, 4, 32, 48)).astype(np.float32))
    lhs = jnp.asarray(rng.normal(size=(40, 32)).astype(np.float32))
    sizes = jnp.asarray([9, 0, 20, 7], jnp.int32)
    out = grouped_matmul(lhs, stack, sizes, impl=impl, layer=2)
    ref = jax.lax.ragged_dot(lhs, stack[2], sizes)
    np.testing.assert_allclose(np.asarray(out)[:36], np.asarray(ref)[:36], rtol=1e-5, atol=1e-5)
