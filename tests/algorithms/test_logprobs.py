"""Chunked token log-probs/entropy: equal to the full-logits version in values and gradients, and
never materialising the [N, V] fp32 logits."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.algorithms import compute_token_logprobs, compute_token_logprobs_naive, logprobs_from_logits
from tests.algorithms import numpy_reference as ref

# V = 300 is not a multiple of the chunk 64 (the last chunk overlaps the previous one).
B, T, D, V, CHUNK = 3, 5, 16, 300, 64


def _inputs(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(B, T, D)), dtype)
    weight = jnp.asarray(rng.normal(size=(D, V)) * 0.7, dtype)
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    return hidden, weight, targets


def _loss(fn, hidden, weight, targets):
    """Uses both outputs with distinct per-token weights, so both cotangents are exercised."""
    lp, ent = fn(hidden, weight, targets)
    w_lp = jnp.linspace(-1.0, 2.0, lp.size).reshape(lp.shape)
    w_ent = jnp.cos(jnp.arange(ent.size, dtype=jnp.float32)).reshape(ent.shape)
    return jnp.sum(lp * w_lp) + jnp.sum(ent * w_ent)


def _outputs_and_grads(fn):
    """One jitted call: both outputs, and the gradients of `_loss` wrt hidden and weight."""
    def go(hidden, weight, targets):
        loss = lambda h, w: (_loss(fn, h, w, targets), fn(h, w, targets))
        (_, outputs), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hidden, weight)
        return outputs, grads
    return jax.jit(go)


# chunk 64: V = 300 is no multiple (the last chunk overlaps); 100 divides V; 1000 > V is one chunk.
@pytest.mark.parametrize("temperature, chunk", [(0.7, CHUNK), (1.0, 100), (1.0, 1000)])
def test_fp32_values_and_gradients_equal_naive(temperature, chunk):
    hidden, weight, targets = _inputs()
    chunked = functools.partial(compute_token_logprobs, temperature=temperature, chunk_size=chunk)
    naive = functools.partial(compute_token_logprobs_naive, temperature=temperature)
    chex.assert_trees_all_close(_outputs_and_grads(chunked)(hidden, weight, targets),
                                _outputs_and_grads(naive)(hidden, weight, targets), rtol=1e-5, atol=1e-5)


def test_values_against_float64_numpy():
    hidden, weight, targets = _inputs(seed=1)
    logits = np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64) / 0.9
    with jax.default_matmul_precision("highest"):  # no TF32 when this runs on a GPU
        lp, ent = jax.jit(functools.partial(compute_token_logprobs, temperature=0.9, chunk_size=CHUNK))(
            hidden, weight, targets)
    want_lp = np.take_along_axis(ref.log_softmax(logits), np.asarray(targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose(lp, want_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ref.entropy(logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.jit(logprobs_from_logits)(logits.astype(np.float32), targets), want_lp,
                               rtol=1e-5, atol=1e-5)


def test_bf16_close_to_naive():
    hidden, weight, targets = _inputs(jnp.bfloat16, seed=2)
    (lp, ent), grads = _outputs_and_grads(functools.partial(compute_token_logprobs, chunk_size=CHUNK))(
        hidden, weight, targets)
    assert lp.dtype == ent.dtype == jnp.float32
    assert grads[0].dtype == grads[1].dtype == jnp.bfloat16
    # Reference: fp32 maths at the same (bf16-rounded) point. Values match closely (same bf16
    # products, fp32 accumulation); bf16 gradients are ~0.5% off.
    f32 = lambda x: x.astype(jnp.float32)
    outputs, want = _outputs_and_grads(compute_token_logprobs_naive)(f32(hidden), f32(weight), targets)
    chex.assert_trees_all_close((lp, ent), outputs, rtol=1e-4, atol=1e-4)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(f32(g), w, atol=1e-2 * float(jnp.abs(w).max()))


def test_large_logits_and_without_entropy():
    hidden, weight, targets = _inputs(seed=3)
    lp, ent = jax.jit(functools.partial(compute_token_logprobs, chunk_size=CHUNK))(hidden * 40, weight, targets)
    assert np.all(np.isfinite(lp)) and np.all(np.asarray(ent) >= -1e-5)
    chex.assert_trees_all_close((lp, ent), jax.jit(compute_token_logprobs_naive)(hidden * 40, weight, targets),
                                rtol=1e-5, atol=2e-4)
    lp2, none = jax.jit(functools.partial(compute_token_logprobs, chunk_size=CHUNK, with_entropy=False))(
        hidden, weight, targets)
    assert none is None and lp2.shape == (B, T)


def test_no_full_fp32_logits_buffer():
    """Compile forward+backward for N·V·4 = 160 MB of logits; the chunked temp stays ~N·C·4·few."""
    n, d, v, chunk = 2048, 8, 20_000, 512
    args = (jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.int32))

    def step(fn):
        def loss(h, w, t):
            lp, ent = fn(h, w, t)
            return jnp.sum(lp) + jnp.sum(ent)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()

    logits_bytes = n * v * 4
    chunked = step(functools.partial(compute_token_logprobs, chunk_size=chunk))
    naive = step(compute_token_logprobs_naive)
    assert f"f32[{n},{v}]" not in chunked.as_text()
    assert f"f32[{n},{v}]" in naive.as_text()  # the check can see a full-logits buffer
    chunked_mem, naive_mem = chunked.memory_analysis(), naive.memory_analysis()
    if chunked_mem is not None:
        assert naive_mem.temp_size_in_bytes >= logits_bytes
        assert chunked_mem.temp_size_in_bytes < logits_bytes / 8


# ---- sum_pi_squared: Σ_v softmax(logits / temperature)_v², forward-only ----------------------------


def _sum_pi_squared_f64(hidden, weight, temperature):
    logits = np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64) / temperature
    return np.square(np.exp(ref.log_softmax(logits))).sum(-1)


@pytest.mark.parametrize("temperature, chunk, scale", [(0.7, CHUNK, 1.0), (1.0, 100, 1.0), (1.0, 1000, 1.0),
                                                       (0.5, CHUNK, 40.0)])
def test_sum_pi_squared_against_float64_numpy(temperature, chunk, scale):
    """Chunk sizes as above; scale 40 gives logits in the hundreds (a near one-hot softmax)."""
    hidden, weight, targets = _inputs(seed=4)
    hidden = hidden * scale
    fn = functools.partial(compute_token_logprobs, temperature=temperature, chunk_size=chunk,
                           with_sum_pi_squared=True)
    with jax.default_matmul_precision("highest"):
        lp, ent, spp = jax.jit(fn)(hidden, weight, targets)
        lp0, ent0 = jax.jit(functools.partial(fn, with_sum_pi_squared=False))(hidden, weight, targets)
    chex.assert_shape((lp, ent, spp), (B, T))
    assert spp.dtype == jnp.float32
    want = _sum_pi_squared_f64(hidden, weight, temperature)
    np.testing.assert_allclose(spp, want, rtol=1e-5, atol=1e-6)
    assert np.all((np.asarray(spp) > 0) & (np.asarray(spp) <= 1 + 1e-6))
    chex.assert_trees_all_close((lp, ent), (lp0, ent0), rtol=1e-6, atol=1e-6)  # the other outputs are unchanged
    naive = jax.jit(functools.partial(compute_token_logprobs_naive, temperature=temperature,
                                      with_sum_pi_squared=True))(hidden, weight, targets)
    np.testing.assert_allclose(naive[2], want, rtol=1e-5, atol=1e-6)


def test_sum_pi_squared_leaves_gradients_unchanged_and_is_forward_only():
    hidden, weight, targets = _inputs(seed=5)
    base = functools.partial(compute_token_logprobs, temperature=0.8, chunk_size=CHUNK)
    with_spp = lambda h, w, t: base(h, w, t, with_sum_pi_squared=True)[:2]
    chex.assert_trees_all_close(_outputs_and_grads(with_spp)(hidden, weight, targets),
                                _outputs_and_grads(base)(hidden, weight, targets), rtol=1e-6, atol=1e-6)

    def spp_only(h, w):
        return jnp.sum(base(h, w, targets, with_entropy=False, with_sum_pi_squared=True)[2])

    grads = jax.jit(jax.grad(spp_only, argnums=(0, 1)))(hidden, weight)
    chex.assert_trees_all_equal(grads, jax.tree.map(jnp.zeros_like, grads))  # as if under stop_gradient
    lp, none, spp = jax.jit(functools.partial(base, with_entropy=False, with_sum_pi_squared=True))(
        hidden, weight, targets)
    assert none is None and spp.shape == lp.shape == (B, T)


def test_sum_pi_squared_keeps_the_full_fp32_logits_out_of_the_program():
    """The old-log-prob pass (forward only) and a training step, both asking for sum_pi_squared."""
    n, d, v, chunk = 2048, 8, 20_000, 512
    args = (jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.int32))
    fn = functools.partial(compute_token_logprobs, chunk_size=chunk, with_sum_pi_squared=True)
    forward = jax.jit(fn).lower(*args).compile()

    def loss(h, w, t):
        lp, ent, spp = fn(h, w, t)
        return jnp.sum(lp) + jnp.sum(ent) + jnp.sum(spp)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile()
    naive = jax.jit(functools.partial(compute_token_logprobs_naive, with_sum_pi_squared=True)).lower(*args).compile()
    assert f"f32[{n},{v}]" in naive.as_text()  # the check can see a full-logits buffer
    for compiled in (forward, step):
        assert f"f32[{n},{v}]" not in compiled.as_text()
        mem = compiled.memory_analysis()
        if mem is not None:
            assert mem.temp_size_in_bytes < n * v * 4 / 8


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_qwen2p5_7b_head_on_gpu():
    """Qwen2.5-7B's LM head (D = 3584, V = 151,936) on 8k bf16 tokens: equal to the naive version,
    with a fraction of its memory. Prints the step times."""
    import time

    n, d, v = 8192, 3584, 151_936
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(n, d)), jnp.bfloat16)
    weight = jnp.asarray(rng.normal(size=(d, v)) * d**-0.5 * 4, jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    results = {}
    for name, fn in [("chunked", functools.partial(compute_token_logprobs, chunk_size=8192)),
                     ("naive", compute_token_logprobs_naive)]:
        step = _outputs_and_grads(fn).lower(hidden, weight, targets).compile()
        out = jax.block_until_ready(step(hidden, weight, targets))
        t0 = time.perf_counter()
        for _ in range(3):
            out = jax.block_until_ready(step(hidden, weight, targets))
        results[name] = (out, step.memory_analysis().temp_size_in_bytes, (time.perf_counter() - t0) / 3)
        print(f"{name}: temp {results[name][1] / 2**30:.2f} GiB, fwd+bwd {results[name][2] * 1e3:.1f} ms")
    (c_out, c_grads), c_temp, _ = results["chunked"]
    (n_out, n_grads), n_temp, _ = results["naive"]
    assert c_temp < n * v * 4 / 4 < n_temp
    chex.assert_trees_all_close(c_out, n_out, rtol=2e-3, atol=2e-3)
    for g, w in zip(c_grads, n_grads):
        g, w = g.astype(jnp.float32), w.astype(jnp.float32)
        assert float(jnp.abs(g - w).max()) <= 2e-2 * float(jnp.abs(w).max())
