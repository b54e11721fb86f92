"""The decode step of the gated delta rule (kernels/gdn_decode.py), writing the rows' new states or (in place)
their slots, against the jnp reference and the recurrent form of models/gated_delta.py, in Pallas' interpreter
and (gpu) compiled by Triton."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.models.gated_delta import l2norm, recurrent_gated_delta_rule
from kernels import gdn_decode
from kernels.gdn_decode import gdn_decode_step, gdn_decode_step_reference


def _inputs(rows=5, slots=9, hk=2, hv=4, dk=16, dv=32, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    state = jnp.asarray(rng.normal(size=(slots, hv, dk, dv)), dtype)
    q = l2norm(jnp.asarray(rng.normal(size=(rows, hk, dk)))) * dk ** -0.5
    k = l2norm(jnp.asarray(rng.normal(size=(rows, hk, dk))))
    v = jnp.asarray(rng.normal(size=(rows, hv, dv)), jnp.float32)
    g = -jnp.exp(jnp.asarray(rng.normal(size=(rows, hv)), jnp.float32))
    beta = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(rows, hv)), jnp.float32))
    order = rng.permutation(np.arange(1, slots))[:rows].astype(np.int32)  # distinct slots, out of order
    return state, jnp.asarray(order), q, k, v, g, beta


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_kernel_equals_the_reference(dtype, tol):
    state, slots, q, k, v, g, beta = _inputs(dtype=dtype)
    ref_o, ref_rows = gdn_decode_step_reference(state, slots, q, k, v, g, beta)
    o, rows = gdn_decode_step(state, slots, q, k, v, g, beta, impl="pallas")
    np.testing.assert_allclose(np.asarray(o), np.asarray(ref_o), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(rows, np.float32), np.asarray(ref_rows, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_in_place_kernel_writes_each_rows_slot_and_leaves_the_others(dtype, tol):
    state, slots, q, k, v, g, beta = _inputs(dtype=dtype)
    ref_o, ref_rows = gdn_decode_step_reference(state, slots, q, k, v, g, beta)
    o, pool = gdn_decode_step(state, slots, q, k, v, g, beta, impl="pallas", in_place=True)
    xo, xpool = gdn_decode_step(state, slots, q, k, v, g, beta, impl="xla", in_place=True)
    np.testing.assert_allclose(np.asarray(o), np.asarray(ref_o), rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(xo), np.asarray(ref_o))
    for got in (pool, xpool):
        got = np.asarray(got, np.float32)
        np.testing.assert_allclose(got[np.asarray(slots)], np.asarray(ref_rows, np.float32), rtol=tol, atol=tol)
        others = np.setdiff1d(np.arange(state.shape[0]), np.asarray(slots))
        np.testing.assert_array_equal(got[others], np.asarray(state, np.float32)[others])


@pytest.mark.parametrize("block_v,skip_dead", [(16, False), (32, True), (16, True)])
def test_launch_forms_agree_and_a_skipped_dead_row_writes_nothing(block_v, skip_dead):
    """Each launch shape (the tuning's forms) gives the reference's live rows; with dead rows (slot 0) skipped,
    the scratch slot is left as it was, and without, it is written (so the test can tell the two apart)."""
    state, slots, q, k, v, g, beta = _inputs(rows=6)
    slots = slots.at[jnp.array([1, 4])].set(0)  # two finished rows in the scratch slot
    live = np.asarray(slots) != 0
    ref_o, ref_rows = gdn_decode_step_reference(state, slots, q, k, v, g, beta)
    o, pool = gdn_decode._step(state, slots, q, k, v, g, beta, interpret=True, in_place=True, block_v=block_v,
                               num_warps=4, skip_dead=skip_dead)
    np.testing.assert_allclose(np.asarray(o)[live], np.asarray(ref_o)[live], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pool)[np.asarray(slots)[live]], np.asarray(ref_rows)[live], rtol=1e-5,
                               atol=1e-5)
    scratch_kept = np.array_equal(np.asarray(pool[0]), np.asarray(state[0]))
    assert scratch_kept == skip_dead


def test_the_reference_is_one_step_of_the_recurrent_form():
    state, slots, q, k, v, g, beta = _inputs()
    o, rows = gdn_decode_step_reference(state, slots, q, k, v, g, beta)
    ro, rs = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                        initial_state=state[slots])
    np.testing.assert_allclose(np.asarray(o), np.asarray(ro[:, 0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(rows), np.asarray(rs), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
def test_compiled_kernel_at_qwen35_9b_shapes(dtype, tol):
    """256 rows of Qwen3.5-9B's linear layer (16 key, 32 value heads of 128) in 300 slots, compiled by Triton."""
    state, slots, q, k, v, g, beta = _inputs(rows=256, slots=300, hk=16, hv=32, dk=128, dv=128, dtype=dtype)
    ref_o, ref_rows = jax.jit(gdn_decode_step_reference)(state, slots, q, k, v, g, beta)
    o, rows = jax.jit(lambda *a: gdn_decode_step(*a, impl="pallas"))(state, slots, q, k, v, g, beta)
    rel = lambda a, b: float(jnp.linalg.norm((a.astype(jnp.float32) - b.astype(jnp.float32)).ravel())
                             / jnp.linalg.norm(b.astype(jnp.float32).ravel()))
    assert rel(o, ref_o) < tol and rel(rows, ref_rows) < tol


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
def test_compiled_in_place_kernel_at_qwen35_9b_shapes(dtype, tol):
    """The in-place form compiled by Triton at the 9B's shapes, the pool donated (its buffer aliased): each row's
    slot holds the reference's new state, the other slots are untouched."""
    state, slots, q, k, v, g, beta = _inputs(rows=256, slots=300, hk=16, hv=32, dk=128, dv=128, dtype=dtype)
    before = np.asarray(state, np.float32)
    ref_o, ref_rows = jax.jit(gdn_decode_step_reference)(state, slots, q, k, v, g, beta)
    step = jax.jit(lambda *a: gdn_decode_step(*a, impl="pallas", in_place=True), donate_argnums=0)
    o, pool = step(state, slots, q, k, v, g, beta)
    rel = lambda a, b: float(jnp.linalg.norm((a.astype(jnp.float32) - b.astype(jnp.float32)).ravel())
                             / jnp.linalg.norm(b.astype(jnp.float32).ravel()))
    assert rel(o, ref_o) < tol and rel(pool[slots], ref_rows) < tol
    others = np.setdiff1d(np.arange(300), np.asarray(slots))
    np.testing.assert_array_equal(np.asarray(pool, np.float32)[others], before[others])
