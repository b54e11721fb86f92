"""Weight sync from a training mesh to a rollout mesh on disjoint devices (rollout/weight_sync.py), on 8 simulated
CPU devices: values equal bit for bit on every split (even, uneven, fsdp and fsdp x tensor on both sides), under
a transfer guard that turns a host round trip into an error (and a check that it does); an engine fed from the
sync generates what an engine fed from the host does; LoRA moves the base once and then the adapters alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm import sharding
from jaxrl_llm.models import DecoderConfig, init_params, load_hf, split_model
from jaxrl_llm.models.lora import LoraSpec, combine, is_adapter, partition, resolve_targets
from jaxrl_llm.models.params import param_shardings
from jaxrl_llm.rollout import JaxEngine, SamplingParams
from jaxrl_llm.rollout.weight_sync import SyncError, WeightSync, no_host_copies
from jaxrl_llm.trainer.roles.model_state import ModelState
from jaxrl_llm.trainer.roles.optim import make_optimizer
from tests.hf_models import make_hf_model

# Widths that 2, 3 and 4 divide, so fsdp 3 and 4 split them; 3 layers, so buckets of 1 layer leave a remainder.
CFG = DecoderConfig.tiny(hidden_size=96, intermediate_size=192, head_dim=24, num_hidden_layers=3)
BUCKET = 3 * 96 * 192 * 2 + 4 * 96 * 96 * 2  # bytes (bf16) a bucket of one layer of CFG takes at most
# split: ((data, fsdp, tensor) of the training mesh on the first devices, the same of the rollout mesh on the next
# ones, whether every shard of the rollout layout exists on the training devices as they are (no bucket program)).
SPLITS = {
    "1+1": ((1, 1, 1), (1, 1, 1), True),
    "2+2": ((1, 2, 1), (1, 2, 1), True),
    "1+3": ((1, 1, 1), (1, 3, 1), True),
    "3+1": ((1, 3, 1), (1, 1, 1), False),  # gather on the training devices: a whole replica
    "2x2+2x2": ((1, 2, 2), (1, 2, 2), True),  # fsdp x tensor on both sides
    "2x2+tp2": ((1, 2, 2), (1, 1, 2), False),  # keep the tensor split, gather fsdp
    "4+tp2": ((1, 4, 1), (1, 1, 2), False),  # fsdp 4 gathered to 2 pieces
    "4+3": ((1, 4, 1), (1, 3, 1), False),  # nothing in common: a whole replica to each of 3
    "2+dp2xtp2": ((1, 2, 1), (2, 1, 2), True),  # the tiling twice over the rollout devices
}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 42]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)


def meshes(split: str):
    (train, rollout, _), devs = SPLITS[split], jax.devices()
    n = int(np.prod(train))
    return (sharding.make_mesh(*train, devices=devs[:n]),
            sharding.make_mesh(*rollout, devices=devs[n:n + int(np.prod(rollout))]))


def leaves(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def assert_bits_equal(got, want, devices):
    """Every leaf of `got` equals `want`'s (numpy arrays) bit for bit, and lives on `devices` alone."""
    got, want, devices = leaves(got), leaves(want), set(devices)
    assert got.keys() == want.keys()
    for k, x in got.items():
        assert x.sharding.device_set == devices, k
        assert x.dtype == want[k].dtype, k
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), want[k].view(np.uint8), err_msg=k)


def host(tree, dtype=None):
    """numpy copies, cast the way the engine casts (ml_dtypes' bf16 rounds to nearest even, as XLA)."""
    return jax.tree.map(lambda x: np.asarray(x).astype(dtype or x.dtype), tree)


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("split", list(SPLITS))
def test_values_arrive_bit_for_bit_on_the_rollout_devices(split, param_dtype):
    """fp32 masters are cast in layer buckets on the training devices; bf16 ones go shard by shard, with no
    program at all where the rollout devices hold the training tiling."""
    train, rollout = meshes(split)
    params = init_params(CFG, mesh=train, seed=1, dtype=param_dtype)
    sync = WeightSync(CFG, rollout, dtype="bfloat16", bucket_bytes=BUCKET)
    with no_host_copies():
        out = sync(params)
    assert_bits_equal(out, host(params, ml_dtypes.bfloat16), rollout.devices.flat)
    direct = SPLITS[split][2] and param_dtype == "bfloat16"
    assert (sync.stats.buckets == 0) == direct, sync.describe(params)
    if not direct:  # the layers went one a bucket: the training devices' transient is a layer's worth at most
        assert sync.stats.buckets >= CFG.num_hidden_layers and 0 < sync.stats.bucket_bytes <= BUCKET
    n_rollout = rollout.devices.size
    assert sync.stats.copies >= n_rollout * len(leaves(params))  # every rollout device got every leaf
    with no_host_copies():  # a second sync reuses the programs and gives the same bits
        again = sync(params)
    assert_bits_equal(again, host(params, ml_dtypes.bfloat16), rollout.devices.flat)


def test_more_replicas_than_holders_fan_out_from_the_rollout_devices():
    """1+3: the one training device sends the model to one rollout device, then to a second while the first
    passes it on to the third: two rounds, twice the model out of the training device instead of three times."""
    train, rollout = meshes("1+3")
    params = init_params(CFG, mesh=train, seed=1, dtype="bfloat16")
    sync = WeightSync(CFG, rollout, dtype="bfloat16")
    with no_host_copies():
        out = sync(params)
    assert_bits_equal(out, host(params), rollout.devices.flat)
    model = sum(x.nbytes for x in jax.tree.leaves(params))
    (t,), (r0, r1, r2) = [d.id for d in train.devices.flat], [d.id for d in rollout.devices.flat]
    assert sync.stats.rounds == 2 and sync.stats.bytes == 3 * model
    assert sync.stats.sent[t] == 2 * model and sorted(sync.stats.sent.get(r, 0) for r in (r0, r1, r2)) == [0, 0, model]


def test_the_guard_catches_a_copy_through_the_host():
    """A device_put whose target shards the source does not hold goes through host memory in JAX; under
    `no_host_copies` that is an error (the same put without the guard works, so it is the guard that caught
    it), while the sync of the same arrays passes."""
    train, rollout = meshes("2x2+tp2")
    x = jax.device_put(np.arange(96 * 8, dtype=np.float32).reshape(96, 8), NamedSharding(train, P("fsdp", "tensor")))
    whole = NamedSharding(rollout, P())
    with pytest.raises(Exception, match="Disallowed host-to-device transfer"), no_host_copies():
        jax.device_put(x, whole).block_until_ready()
    np.testing.assert_array_equal(np.asarray(jax.device_put(x, whole)), np.asarray(x))
    # The engine's old path, a device_put into the engine mesh's trainer layout, is one such copy.
    params = init_params(CFG, mesh=train, seed=0, dtype="bfloat16")
    with pytest.raises(Exception, match="Disallowed"), no_host_copies():
        jax.block_until_ready(jax.device_put(params, param_shardings(CFG, rollout)))
    with no_host_copies():
        out = WeightSync(CFG, rollout)(params)
    assert_bits_equal(out, host(params), rollout.devices.flat)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    make_hf_model(d, vocab_size=96, initializer_range=0.3, eos_token_id=7)
    return d


def _generate(engine, tree):
    engine.update_weights(tree)
    return [engine.generate(PROMPTS, sp) for sp in (GREEDY, SAMPLED)]


def _assert_same(got, want):
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("split, dtype", [("2x2+tp2", "bfloat16"), ("4+3", "float32")])
def test_an_engine_fed_from_the_sync_generates_what_one_fed_from_the_host_does(hf_dir, split, dtype):
    train, rollout = meshes(split)
    m = load_hf(hf_dir)
    cfg, params = m.cfg, split_model(m)[1]
    on_train = jax.device_put(params, param_shardings(cfg, train))
    engine = JaxEngine(cfg, None, mesh=rollout, dtype=dtype, page_size=2)
    want = _generate(engine, jax.device_put(host(params), param_shardings(cfg, rollout)))  # from the host
    with no_host_copies():
        synced = WeightSync.for_engine(engine, bucket_bytes=1)(on_train)
    _assert_same(_generate(engine, synced), want)
    # The engine's own path for params on other devices goes through a WeightSync too.
    with no_host_copies():
        engine.update_weights(on_train)
    _assert_same([engine.generate(PROMPTS, sp) for sp in (GREEDY, SAMPLED)], want)


def _lora_actor(hf_dir, train, kind):
    m = load_hf(hf_dir, dtype="bfloat16", param_dtype="float32")
    cfg, params = m.cfg, split_model(m)[1]
    spec = LoraSpec(rank=4, alpha=8.0, targets=resolve_targets("all-linear"))
    tx, _ = make_optimizer(1e-3, total_steps=4)
    actor = ModelState(cfg, train, jax.device_put(params, param_shardings(cfg, train)), tx, lora=spec,
                       base_quantization=kind, seed=1)
    return cfg, actor


def _trained(actor, seed):
    """Adapters as after some steps: lora_b away from its zero start, so the merge shows in the tokens."""
    def bump(p, x):
        k = jax.random.fold_in(jax.random.key(seed), hash(jax.tree_util.keystr(p)) % 2**31)
        return x + 0.3 * jax.random.normal(k, x.shape, x.dtype)
    out = jax.jit(lambda t: jax.tree_util.tree_map_with_path(bump, t))(actor.state["params"])
    return jax.tree.map(lambda x, y: jax.device_put(x, y.sharding), out, actor.state["params"])


def _prescaled_on_host(frozen, trained, scale):
    """What the engine gets from `ModelState.engine_params`: lora_b * alpha / r in its own dtype, on the host."""
    tree = jax.tree_util.tree_map_with_path(
        lambda p, x: np.asarray(x) * np.asarray(scale, x.dtype) if p[-1].key == "lora_b" else np.asarray(x), trained)
    return combine(host(frozen), tree)


@pytest.mark.parametrize("kind", ["none", "int8"])
def test_lora_moves_the_base_once_and_then_the_adapters_alone(hf_dir, kind):
    train, rollout = meshes("2x2+tp2")
    cfg, actor = _lora_actor(hf_dir, train, kind)
    sync = WeightSync(cfg, rollout, dtype="bfloat16")
    scale = actor.lora.scale
    with no_host_copies():
        sync.base_once(actor.frozen)
        first = sync.adapters(_trained(actor, 1), lora_scale=scale)
    base_bytes = sync.base_stats.bytes
    adapter_bytes = sum(s.data.nbytes for x in jax.tree.leaves(partition(first, is_adapter)[0])
                        for s in x.addressable_shards)
    # Only the adapters moved (rank 4 on a 64-wide model is a third of the base's bytes; at 7B, rank 32, 1%).
    assert sync.stats.bytes == adapter_bytes < base_bytes / 2
    # The base stays as it is on the rollout devices: 8-bit kernels with fp32 scales, or bf16.
    kernel = first["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
    assert kernel.dtype == (jnp.int8 if kind == "int8" else jnp.bfloat16)
    assert_bits_equal(first, _prescaled_on_host(actor.frozen, _trained(actor, 1), scale), rollout.devices.flat)

    trained = _trained(actor, 2)
    with no_host_copies():
        second = sync.adapters(trained, lora_scale=scale)
    assert sync.stats.bytes == adapter_bytes
    base_1, base_2 = (leaves(partition(t, is_adapter)[1]) for t in (first, second))
    assert all(base_2[k] is base_1[k] for k in base_1)  # the same arrays, not copied again
    want_tree = _prescaled_on_host(actor.frozen, trained, scale)
    assert_bits_equal(second, want_tree, rollout.devices.flat)

    engine = JaxEngine(cfg, None, mesh=rollout, dtype="bfloat16", page_size=2)
    want = _generate(engine, jax.device_put(want_tree, sharding.replicated(rollout)))  # from the host
    _assert_same(_generate(engine, second), want)
    base_only = _generate(engine, jax.device_put(host(actor.frozen), sharding.replicated(rollout)))
    assert any((a.tokens != b.tokens).any() for a, b in zip(base_only, want))  # the adapters count


def test_full_fine_tuning_state_syncs_its_master_params_cast(hf_dir):
    train, rollout = meshes("2+2")
    m = load_hf(hf_dir, dtype="bfloat16", param_dtype="float32")
    cfg, params = m.cfg, split_model(m)[1]
    tx, _ = make_optimizer(1e-3, total_steps=4)
    actor = ModelState(cfg, train, jax.device_put(params, param_shardings(cfg, train)), tx)
    sync = WeightSync(cfg, rollout, dtype="bfloat16")
    with no_host_copies():
        out = sync.from_model_state(actor)
    assert_bits_equal(out, host(params, ml_dtypes.bfloat16), rollout.devices.flat)
    assert sync.stats.buckets > 0 and sync.base_stats is None


def test_bad_input_is_one_clear_error():
    train, rollout = meshes("2+2")
    sync = WeightSync(CFG, rollout)
    with pytest.raises(SyncError, match=r"no base on the rollout devices yet; call base_once\(actor.frozen\)"):
        sync.adapters({"model": {}}, lora_scale=2.0)
    with pytest.raises(SyncError, match="model/norm/weight is a ndarray, not a jax.Array"):
        sync({"model": {"norm": {"weight": np.ones(4)}}})
    with pytest.raises(SyncError, match="expected a non-empty params tree"):
        sync({})
    with pytest.raises(SyncError, match="bucket_bytes=0"):
        WeightSync(CFG, rollout, bucket_bytes=0)
