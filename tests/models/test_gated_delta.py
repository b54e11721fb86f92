"""The gated delta rule: recurrent and chunked forms against a float64 numpy loop and transformers' torch
functions; resets (packed rows) and padding; the causal conv's state."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl_llm.models.gated_delta import (
    causal_conv1d,
    chunked_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)


def _inputs(b=2, t=37, hk=2, hv=4, dk=8, dv=6, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, hk, dk)).astype(np.float32)
    k = rng.normal(size=(b, t, hk, dk)).astype(np.float32)
    v = rng.normal(size=(b, t, hv, dv)).astype(np.float32)
    g = -np.exp(rng.normal(size=(b, t, hv)) - 1).astype(np.float32)  # log decay <= 0
    beta = (1 / (1 + np.exp(-rng.normal(size=(b, t, hv))))).astype(np.float32)
    q = np.asarray(l2norm(jnp.asarray(q))) * dk ** -0.5
    k = np.asarray(l2norm(jnp.asarray(k)))
    return q, k, v, g, beta


def _numpy_loop(q, k, v, g, beta, s0=None, resets=None, valid=None):
    """float64 reference: one token at a time, straight from the definition."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    rep = hv // hk
    s = np.zeros((b, hv, dk, dv)) if s0 is None else np.asarray(s0, np.float64).copy()
    o = np.zeros((b, t, hv, dv))
    for bi in range(b):
        for ti in range(t):
            if valid is not None and not valid[bi, ti]:
                continue
            if resets is not None and resets[bi, ti]:
                s[bi] = 0
            for h in range(hv):
                kk, qq = k[bi, ti, h // rep], q[bi, ti, h // rep]
                s[bi, h] *= np.exp(g[bi, ti, h])
                s[bi, h] += np.outer(kk, beta[bi, ti, h] * (v[bi, ti, h] - kk @ s[bi, h]))
                o[bi, ti, h] = qq @ s[bi, h]
    return o, s


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
@pytest.mark.parametrize("chunk", [8, 64])
def test_forms_match_numpy_with_state_resets_and_padding(form, chunk):
    q, k, v, g, beta = _inputs()
    b, t = q.shape[:2]
    rng = np.random.default_rng(1)
    s0 = rng.normal(size=(b, v.shape[2], q.shape[3], v.shape[3])).astype(np.float32)
    resets = np.zeros((b, t), bool)
    resets[0, [5, 6, 20]] = True  # packed rows, one of a single token
    resets[1, 9] = True
    valid = np.ones((b, t), bool)
    valid[1, 30:] = False  # right padding
    ref_o, ref_s = _numpy_loop(q, k, v, g, beta, s0, resets, valid)
    kw = dict(initial_state=jnp.asarray(s0), resets=jnp.asarray(resets), valid=jnp.asarray(valid))
    if form == "recurrent":
        o, s = recurrent_gated_delta_rule(*map(jnp.asarray, (q, k, v, g, beta)), **kw)
    else:
        o, s = chunked_gated_delta_rule(*map(jnp.asarray, (q, k, v, g, beta)), chunk=chunk, **kw)
    o = np.where(valid[..., None, None], np.asarray(o), 0)
    np.testing.assert_allclose(o, np.where(valid[..., None, None], ref_o, 0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(s), ref_s, rtol=1e-5, atol=1e-5)


def test_chunked_equals_recurrent_and_transformers_torch_form():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta = _inputs(t=150, hk=2, hv=2, dk=16, dv=16)
    o_c, s_c = chunked_gated_delta_rule(*map(jnp.asarray, (q, k, v, g, beta)))
    o_r, s_r = recurrent_gated_delta_rule(*map(jnp.asarray, (q, k, v, g, beta)))
    chex.assert_trees_all_close((o_c, s_c), (o_r, s_r), rtol=1e-5, atol=2e-6)
    # transformers normalises and scales q, k itself: hand it the raw directions (already unit, so l2norm is
    # the identity up to eps) and undo its scaling of q.
    t_o, t_s = torch_chunk_gated_delta_rule(
        torch.tensor(q * q.shape[-1] ** 0.5), torch.tensor(k), torch.tensor(v), g=torch.tensor(g),
        beta=torch.tensor(beta), output_final_state=True, use_qk_l2norm_in_kernel=False)
    np.testing.assert_allclose(np.asarray(o_c), t_o.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(s_c), t_s.numpy(), rtol=1e-4, atol=1e-5)


def test_packed_rows_equal_separate_rows_and_gradients_agree():
    """Two rows packed in one sequence with a reset give each row's own outputs, and the chunked form's
    gradients are the recurrent form's."""
    q, k, v, g, beta = _inputs(b=1, t=40)
    resets = np.zeros((1, 40), bool)
    resets[0, 17] = True
    o, _ = chunked_gated_delta_rule(*map(jnp.asarray, (q, k, v, g, beta)), resets=jnp.asarray(resets), chunk=16)
    first, _ = chunked_gated_delta_rule(*(jnp.asarray(a[:, :17]) for a in (q, k, v, g, beta)), chunk=16)
    second, _ = chunked_gated_delta_rule(*(jnp.asarray(a[:, 17:]) for a in (q, k, v, g, beta)), chunk=16)
    chex.assert_trees_all_close(o, jnp.concatenate([first, second], axis=1), rtol=1e-5, atol=1e-6)

    def loss(fn, q, k, v, g, beta):
        o, s = fn(q, k, v, g, beta, resets=jnp.asarray(resets))
        return jnp.sum(jnp.sin(o)) + jnp.sum(s ** 2)

    args = tuple(map(jnp.asarray, (q, k, v, g, beta)))
    chunked = jax.grad(lambda *a: loss(lambda *x, **kw: chunked_gated_delta_rule(*x, chunk=16, **kw), *a),
                       argnums=(0, 1, 2, 3, 4))(*args)
    recurrent = jax.grad(lambda *a: loss(recurrent_gated_delta_rule, *a), argnums=(0, 1, 2, 3, 4))(*args)
    chex.assert_trees_all_close(chunked, recurrent, rtol=1e-4, atol=1e-5)


def test_causal_conv_matches_torch_and_carries_its_state():
    rng = np.random.default_rng(0)
    b, t, e, kw = 2, 11, 6, 4
    x = rng.normal(size=(b, t, e)).astype(np.float32)
    w = rng.normal(size=(kw, e)).astype(np.float32)
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(
        torch.tensor(x).transpose(1, 2), torch.tensor(w.T[:, None, :]), padding=kw - 1, groups=e)[..., :t])
    out, state = causal_conv1d(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(out), ref.transpose(1, 2).numpy(), rtol=1e-5, atol=1e-6)
    # In two calls, the second starting from the first's state: the same outputs.
    a, st = causal_conv1d(jnp.asarray(x[:, :5]), jnp.asarray(w))
    c, st2 = causal_conv1d(jnp.asarray(x[:, 5:]), jnp.asarray(w), initial=st)
    np.testing.assert_allclose(np.concatenate([a, c], axis=1), np.asarray(out), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(st2), np.asarray(state), rtol=0, atol=0)
    # Right padding: the state is the last K-1 valid inputs.
    valid = np.ones((b, t), bool)
    valid[1, 7:] = False
    _, st_pad = causal_conv1d(jnp.asarray(x), jnp.asarray(w), valid=jnp.asarray(valid))
    np.testing.assert_array_equal(np.asarray(st_pad[1]), x[1, 4:7])
    # A reset: the row after it sees nothing before it.
    resets = np.zeros((b, t), bool)
    resets[0, 6] = True
    packed, _ = causal_conv1d(jnp.asarray(x), jnp.asarray(w), resets=jnp.asarray(resets))
    alone, _ = causal_conv1d(jnp.asarray(x[:, 6:]), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(packed[0, 6:]), np.asarray(alone[0]), rtol=1e-6, atol=1e-6)
