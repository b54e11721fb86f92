"""The paged decode-attention kernel (interpret mode on CPU) against a float64 numpy reference and the jnp
reference; the jnp reference against the dense one on the same K/V laid out densely."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.decode_attention import decode_attention_reference
from kernels.paged_attention import (
    paged_attention_supported,
    paged_decode_attention,
    paged_decode_attention_reference,
)

# As in test_decode_attention.py: fp32 about 5e-7 seen; bf16 about one output ulp (outputs up to ~3).
ATOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _paged_inputs(seed, slots, kv_heads, group, head_dim, page_size, width, dtype):
    """A pool of shuffled pages shared out as the sampler shares them, and lengths covering the edge cases.

    Page 0 is scratch: table entries past a slot's pages point at it, or (every other slot) at random
    pages, which the kernel must ignore as well. Slot 1's first page is slot 0's (a prompt's samples
    share its prompt pages). Lengths: one position, mid-page, exactly a page end, the whole table, empty
    and negative (finished slots), the rest random.
    """
    rng = np.random.default_rng(seed)
    full = width * page_size
    lengths = rng.integers(1, full + 1, slots)
    lengths[:6] = [1, page_size + 3, 2 * page_size, full, 0, -2][:slots]
    used = [max(0, -(-int(n) // page_size)) for n in lengths]
    pages = 1 + sum(used)
    ids = rng.permutation(np.arange(1, pages))  # shuffled: a slot's pages are neither adjacent nor in order
    tables = np.zeros((slots, width), np.int32)
    at = 0
    for s, u in enumerate(used):
        tables[s, :u] = ids[at:at + u]
        at += u
        if s % 2:
            tables[s, u:] = rng.integers(0, pages, width - u)
    shared = min(used[0], used[1], 1)
    tables[1, :shared] = tables[0, :shared]
    q = jnp.asarray(rng.normal(size=(slots, kv_heads * group, head_dim)), dtype)
    k_pages = jnp.asarray(rng.normal(size=(kv_heads, pages, page_size, head_dim)), dtype)
    v_pages = jnp.asarray(rng.normal(size=(kv_heads, pages, page_size, head_dim)), dtype)
    return q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32)


def _gather_dense(pages, tables):
    """[K, P, ps, H] pages -> [S, K, W * ps, H] dense cache, one position at a time."""
    pages, tables = np.asarray(pages), np.asarray(tables)
    kh, _, ps, h = pages.shape
    slots, width = tables.shape
    dense = np.zeros((slots, kh, width * ps, h), pages.dtype)
    for s in range(slots):
        for p in range(width * ps):
            dense[s, :, p] = pages[:, tables[s, p // ps], p % ps]
    return dense


def _numpy_reference(q, k_pages, v_pages, tables, lengths):
    """float64: softmax over each slot's positions [0, length) (zeros for an empty slot)."""
    q = np.asarray(q, np.float64)
    k = _gather_dense(np.asarray(k_pages, np.float64), tables)
    v = _gather_dense(np.asarray(v_pages, np.float64), tables)
    slots, n, h = q.shape
    kh = k.shape[1]
    out = np.zeros((slots, kh, n // kh, h))
    for s in range(slots):
        e = min(int(lengths[s]), k.shape[2])
        if e <= 0:
            continue
        scores = np.einsum("kgh,kch->kgc", q[s].reshape(kh, n // kh, h), k[s, :, :e]) / np.sqrt(h)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[s] = np.einsum("kgc,kch->kgh", p / p.sum(-1, keepdims=True), v[s, :, :e])
    return out.reshape(slots, n, h)


def _close(out, want, atol):
    chex.assert_trees_all_close(np.asarray(out, np.float64), np.asarray(want, np.float64), atol=atol, rtol=0)


def _reference(*args):
    """The jnp reference with IEEE fp32 dots, like the kernel's (XLA on a GPU would use TF32)."""
    with jax.default_matmul_precision("highest"):
        return paged_decode_attention_reference(*args)


def _poisoned(q, k_pages, v_pages, tables, lengths):
    """The same inputs with every pool position no slot attends to (scratch page 0, the rest of a last
    page, unused pages) set to NaN, and the table entries past each slot's pages redrawn at random."""
    t, lens = np.asarray(tables), np.maximum(np.asarray(lengths), 0)
    ps = k_pages.shape[2]
    live = np.zeros(k_pages.shape[1:3], bool)  # [P, ps]
    for s in range(t.shape[0]):
        for p in range(min(int(lens[s]), t.shape[1] * ps)):
            live[t[s, p // ps], p % ps] = True
    poison = lambda x: jnp.where(jnp.asarray(live)[None, :, :, None], x, jnp.nan)
    past = np.arange(t.shape[1])[None, :] >= -(-lens // ps)[:, None]
    garbage = np.random.default_rng(0).integers(0, k_pages.shape[1], t.shape)
    return q, poison(k_pages), poison(v_pages), jnp.asarray(np.where(past, garbage, t), jnp.int32), lengths


# (page size, pages per block, splits, kv heads, group, head dim, dtype): steps of 16-64 positions
# over 1-8 pages, N == K, G = 2 and 7, one to three splits; None takes the defaults.
CASES = [
    (16, 1, 1, 2, 1, 32, jnp.float32),
    (8, 2, 3, 1, 7, 32, jnp.float32),
    (32, 2, 2, 2, 2, 64, jnp.float32),
    (4, 8, 1, 2, 7, 32, jnp.float32),
    (16, None, None, 2, 7, 64, jnp.bfloat16),
    (32, 1, 3, 2, 1, 32, jnp.bfloat16),
]


@pytest.mark.parametrize("page_size,pages_per_block,splits,kv_heads,group,head_dim,dtype", CASES)
def test_kernel_matches_references(page_size, pages_per_block, splits, kv_heads, group, head_dim, dtype):
    """Equal to float64 numpy and to the jnp reference (bf16: also to fp32 arithmetic on the same
    values); zeros for finished slots; and the same output when everything a slot must not read is
    NaN or garbage (nothing at or past a slot's length is read)."""
    args = _paged_inputs(page_size * group + head_dim, slots=8, kv_heads=kv_heads, group=group, head_dim=head_dim,
                         page_size=page_size, width=6, dtype=dtype)
    kernel = lambda *a: paged_decode_attention(*a, pages_per_block=pages_per_block, num_splits=splits,
                                               interpret=True)
    out = kernel(*args)
    chex.assert_shape(out, args[0].shape)
    chex.assert_type(out, dtype)
    _close(out, _numpy_reference(*args), ATOL[dtype])
    _close(out, _reference(*args), ATOL[dtype])
    if dtype == jnp.bfloat16:
        ref32 = _reference(*[x.astype(jnp.float32) if x.dtype == dtype else x for x in args])
        _close(out, ref32, ATOL[dtype])
    assert np.all(np.asarray(out[4:6]) == 0)  # length 0 and -2: finished slots
    chex.assert_trees_all_equal(kernel(*_poisoned(*args)), out)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_is_the_dense_reference(dtype):
    """The paged reference equals the dense ragged one on the pages gathered into [S, K, W * ps, H]
    with starts 0 and ends = lengths."""
    q, kp, vp, tables, lengths = _paged_inputs(7, slots=8, kv_heads=2, group=7, head_dim=32, page_size=4, width=9,
                                               dtype=dtype)
    dense = jax.jit(decode_attention_reference)(q[:, None], jnp.asarray(_gather_dense(kp, tables)),
                                                jnp.asarray(_gather_dense(vp, tables)), jnp.zeros_like(lengths),
                                                lengths)
    chex.assert_trees_all_equal(paged_decode_attention_reference(q, kp, vp, tables, lengths), dense[:, 0])


def test_shapes_the_triton_kernel_cannot_take_fail_clearly():
    q, kp, vp, tables, lengths = _paged_inputs(1, slots=4, kv_heads=1, group=2, head_dim=24, page_size=8, width=2,
                                               dtype=jnp.float32)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(q, kp, vp, tables, lengths, pages_per_block=3, interpret=True)
    with pytest.raises(ValueError, match=r"pages_per_block \* page_size \(1 \* 8\)"):
        paged_decode_attention(q[..., :16], kp[..., :16], vp[..., :16], tables, lengths, pages_per_block=1,
                               interpret=False)
    with pytest.raises(ValueError, match=r"head dim >= 16 \(got 24\)"):
        paged_decode_attention(q, kp, vp, tables, lengths, interpret=False)
    with pytest.raises(ValueError, match="lengths"):
        paged_decode_attention(q, kp, vp, tables, lengths[:2], interpret=True)
    assert paged_attention_supported(16, 128) and paged_attention_supported(8, 64)
    assert not paged_attention_supported(24, 128) and not paged_attention_supported(16, 96)
    assert not paged_attention_supported(16, 8)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("slots,page_size", [(256, 16), (16, 64)])
def test_compiled_kernel_at_7b_shapes_on_gpu(slots, page_size):
    """The Triton-compiled kernel at Qwen2.5-7B's decode shapes (28 q heads, 4 kv heads, H 128) with
    up to 1,280 positions a slot: bf16 against the jnp reference, fp32 against it at full precision;
    one split (256 slots) and several (16 slots)."""
    args = _paged_inputs(0, slots=slots, kv_heads=4, group=7, head_dim=128, page_size=page_size,
                         width=1280 // page_size, dtype=jnp.bfloat16)
    out = paged_decode_attention(*args)
    _close(out, paged_decode_attention_reference(*args), 2e-2)
    f32 = [x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args]
    ref32 = _reference(*f32)
    _close(out, ref32, 2e-2)
    _close(paged_decode_attention(*f32), ref32, 1e-4)
