"""The ragged decode-attention kernel (interpret mode on CPU) against a float64 numpy reference, the
jnp reference and the sampler's own attention; and greedy generation with it against without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import sharding
from jaxrl_llm.models import load_hf, split_model
from jaxrl_llm.rollout import DenseJaxEngine, JaxEngine, SamplingParams
from jaxrl_llm.rollout import decode as decode_lib
from kernels.decode_attention import decode_attention, decode_attention_reference
from tests.hf_models import make_hf_model

# Worst |difference| seen on these inputs (outputs up to ~3), with margin: fp32 5e-7; bf16 8e-3, about
# one output ulp (the kernel rounds unnormalised probabilities to bf16 where XLA rounds normalised ones).
ATOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _sampler_rows(rng, rows, capacity, prompt_slots):
    """Row bounds laid out as the sampler lays them: a left-padded prompt [P - len, P), then t >= 1
    generated slots from P; plus the edge cases (one valid slot, the full cache, a finished row)."""
    lens = rng.integers(1, prompt_slots + 1, rows)
    starts = prompt_slots - lens
    ends = prompt_slots + rng.integers(1, capacity - prompt_slots + 1, rows)
    starts[0], ends[0] = prompt_slots - 1, prompt_slots  # a single valid slot
    starts[1], ends[1] = 0, capacity  # the whole cache
    starts[2], ends[2] = prompt_slots - 3, prompt_slots - 3  # empty: a finished row reads nothing
    return jnp.asarray(starts, jnp.int32), jnp.asarray(ends, jnp.int32)


def _inputs(seed, rows, kv_heads, group, capacity, head_dim, dtype, prompt_slots=24):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(rows, 1, kv_heads * group, head_dim)), dtype)
    kc = jnp.asarray(rng.normal(size=(rows, kv_heads, capacity, head_dim)), dtype)
    vc = jnp.asarray(rng.normal(size=(rows, kv_heads, capacity, head_dim)), dtype)
    return (q, kc, vc, *_sampler_rows(rng, rows, capacity, prompt_slots))


def _numpy_reference(q, kc, vc, starts, ends):
    """float64: softmax over each row's slots [start, end) (zeros for an empty row)."""
    q, kc, vc = (np.asarray(x, np.float64) for x in (q, kc, vc))
    r, _, n, h = q.shape
    k = kc.shape[1]
    out = np.zeros((r, k, n // k, h))
    for i in range(r):
        s, e = int(starts[i]), int(ends[i])
        if e <= s:
            continue
        scores = np.einsum("kgh,kch->kgc", q[i, 0].reshape(k, n // k, h), kc[i, :, s:e]) / np.sqrt(h)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[i] = np.einsum("kgc,kch->kgh", p / p.sum(-1, keepdims=True), vc[i, :, s:e])
    return out.reshape(r, 1, n, h)


CASES = [(g, h, jnp.float32) for g in (1, 2, 7) for h in (32, 64, 128)] + \
        [(g, 128, jnp.bfloat16) for g in (1, 2, 7)] + [(7, 32, jnp.bfloat16)]


@pytest.mark.parametrize("group,head_dim,dtype", CASES)
def test_kernel_matches_references(group, head_dim, dtype):
    """GQA ratios 1, 2, 7 and head dims 32-128 on ragged rows: several blocks per row (block 16 of a
    96-slot cache), split over 1 and 3 programs; equal to float64 numpy and to the jnp reference."""
    args = _inputs(group * head_dim, rows=6, kv_heads=2, group=group, capacity=96, head_dim=head_dim, dtype=dtype)
    exact = _numpy_reference(*args)
    ref = decode_attention_reference(*args)
    np.testing.assert_allclose(np.asarray(ref, np.float64), exact, atol=ATOL[dtype], rtol=0)
    for splits in (1, 3):
        out = decode_attention(*args, block_kv=16, num_splits=splits, interpret=True)
        assert out.shape == args[0].shape and out.dtype == dtype
        np.testing.assert_allclose(np.asarray(out, np.float64), exact, atol=ATOL[dtype], rtol=0)
        np.testing.assert_allclose(np.asarray(out, np.float64), np.asarray(ref, np.float64), atol=ATOL[dtype],
                                   rtol=0)
        assert np.all(np.asarray(out[2]) == 0)  # the empty row


def test_block_size_falls_back_to_a_divisor_of_the_cache():
    """A 40-slot cache with block_kv 64 runs in blocks of 8 (the largest power of two dividing 40)."""
    args = _inputs(1, rows=4, kv_heads=1, group=4, capacity=40, head_dim=32, dtype=jnp.float32, prompt_slots=8)
    out = decode_attention(*args, block_kv=64, interpret=True)
    np.testing.assert_allclose(np.asarray(out, np.float64), _numpy_reference(*args), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_is_the_samplers_attention(dtype):
    """The jnp reference computes exactly what the sampler's XLA attention computes on its valid mask."""
    q, kc, vc, starts, ends = _inputs(3, rows=6, kv_heads=2, group=7, capacity=64, head_dim=32, dtype=dtype)
    slots = jnp.arange(64)[None, :]
    valid = (slots >= starts[:, None]) & (slots < ends[:, None])
    sampler = decode_lib._decode_attention(q, kc, vc, valid)
    ref = decode_attention_reference(q, kc, vc, starts, ends)
    live = np.asarray(ends > starts)  # the sampler never attends over nothing
    np.testing.assert_array_equal(np.asarray(ref, np.float32)[live], np.asarray(sampler, np.float32)[live])


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("rows", [256, 16])
def test_compiled_kernel_at_7b_shapes_on_gpu(rows):
    """The Triton-compiled kernel at Qwen2.5-7B's decode shapes (28 q heads, 4 kv heads, H 128, bf16,
    1,216 slots), one split (256 rows) and several (16 rows)."""
    args = _inputs(0, rows=rows, kv_heads=4, group=7, capacity=1216, head_dim=128, dtype=jnp.bfloat16,
                   prompt_slots=192)
    out = decode_attention(*args)
    ref = decode_attention_reference(*args)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=0)
    f32 = [x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args]
    with jax.default_matmul_precision("highest"):  # XLA's fp32 reference without TF32, like the kernel
        ref32 = decode_attention_reference(*f32)
    np.testing.assert_allclose(np.asarray(decode_attention(*f32)), np.asarray(ref32), atol=1e-4, rtol=0)


# ---- the sampler with the kernel --------------------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    make_hf_model(d, vocab_size=96, initializer_range=0.3, eos_token_id=7)
    return load_hf(d)


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
def test_greedy_generation_with_the_kernel_equals_xla(model, mesh_shape):
    """Greedy tokens equal and logprobs agree with the kernel on; with rows that finish early (the kernel
    skips them), compaction and cache growth, on one device and on a data x fsdp x tensor mesh."""
    params = split_model(model)[1]
    mesh = sharding.make_mesh(*mesh_shape) if mesh_shape else None
    sp = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, ignore_eos=True)
    caps = [12, 2, 2, 5, 2, 2, 3, 9]  # 3 rows live after 4 steps: the batch compacts from 8 to 4
    outs = {}
    for impl in ("xla", "pallas"):
        engine = DenseJaxEngine(model.cfg, params, dtype="float32", prompt_bucket=8, gen_bucket=4, mesh=mesh,
                           decode_attention=impl)
        engine.trace = True
        outs[impl] = engine.generate(PROMPTS, sp, max_new_tokens_per_row=caps)
        phases = [r["phase"] for r in engine.last_trace]
        assert "compact" in phases and phases.count("decode") > 2, phases
    np.testing.assert_array_equal(outs["pallas"].lengths, caps)
    np.testing.assert_array_equal(outs["pallas"].tokens, outs["xla"].tokens)
    np.testing.assert_allclose(outs["pallas"].logprobs, outs["xla"].logprobs, atol=2e-5, rtol=0)


def test_unknown_decode_attention_fails(model):
    with pytest.raises(ValueError, match="decode_attention"):
        JaxEngine(model.cfg, None, decode_attention="cudnn")


def test_grpo_step_with_the_kernel_equals_xla(tmp_path):
    """`rollout.decode_attention = 'pallas'` through the trainer (Ray-free, 8 devices, fsdp): the same
    responses and the same step metrics as XLA's attention."""
    from jaxrl_llm.trainer.loop import RLTrainer
    from tests.trainer import runs

    metrics = {}
    for impl in ("xla", "pallas"):
        trainer = RLTrainer(runs.run_config("train.driver='inprocess'", f"rollout.decode_attention='{impl}'",
                                            "model.dtype='float32'", steps=1, run_dir=tmp_path / impl))
        metrics[impl] = trainer.train_step(next(trainer.iterator), 0)
        trainer.worker.close_checkpointer()
    want = {k: v for k, v in metrics["xla"].items() if k.startswith(("actor/", "critic/", "response_length/"))}
    assert want
    for k, v in want.items():
        np.testing.assert_allclose(metrics["pallas"][k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_auto_picks_the_kernel_on_gpus_where_its_shapes_allow(monkeypatch, model):
    """'auto' is XLA off GPU; on a GPU the kernel unless the cache blocks or the head dim rule it out,
    where an explicit 'pallas' fails at build time with what to change."""
    from jaxrl_llm.rollout.dense_engine import _resolve_decode_attention as resolve

    cfg = model.cfg
    assert resolve("auto", cfg, 32, 128) == "xla"  # CPU
    assert resolve("pallas", cfg, 8, 4) == "pallas"  # interpret mode off GPU takes any shape
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    big = cfg.replace(head_dim=128)
    assert resolve("auto", big, 32, 128) == "pallas"
    assert resolve("xla", big, 32, 128) == "xla"
    assert resolve("auto", big, 32, 8) == "xla"
    assert resolve("auto", cfg.replace(head_dim=96), 32, 128) == "xla"
    with pytest.raises(ValueError, match=r"gen_bucket \(8\) multiples of 16.*'auto'"):
        resolve("pallas", big, 32, 8)
    with pytest.raises(ValueError, match="power-of-two head dim >= 16 \\(the model's is 96\\)"):
        resolve("pallas", cfg.replace(head_dim=96), 32, 128)
