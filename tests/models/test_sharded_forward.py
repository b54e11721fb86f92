"""Sharded forward on 8 simulated CPU devices equals the 1-device forward; shardings follow the rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_llm import sharding
from jaxrl_llm.models import load_hf, param_table, split_model
from jaxrl_llm.models.hf_table import get_path
from tests.hf_models import make_hf_model

MESHES = [(1, 8, 1), (1, 4, 2), (2, 2, 2)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    make_hf_model(d, vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2)
    return d


@pytest.fixture(scope="module")
def reference(hf_dir):
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(2, 256, size=(8, 16)), jnp.int32)
    mask = np.ones((8, 16), np.int32)
    mask[::3, :5] = 0
    model = load_hf(hf_dir)
    return ids, jnp.asarray(mask), np.asarray(model(ids, attention_mask=jnp.asarray(mask)))


def test_eight_devices_are_simulated():
    assert jax.device_count() == 8


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_forward_equals_single_device(hf_dir, reference, shape):
    ids, mask, ref = reference
    mesh = sharding.make_mesh(*shape)
    model = load_hf(hf_dir, mesh=mesh)
    graphdef, params = split_model(model)
    cfg = model.cfg

    for row in param_table(cfg):
        arr = get_path(params, row.path)
        assert arr.sharding.spec == sharding.logical_to_spec(row.axes, arr.shape, mesh), row.hf_name
        assert arr.sharding.mesh.shape == mesh.shape

    batch_sh = sharding.batch_sharding(mesh, 2)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda p, i, m: __import__("flax").nnx.merge(graphdef, p)(i, attention_mask=m))(
            params, jax.device_put(ids, batch_sh), jax.device_put(mask, batch_sh))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-5, atol=2e-5)


def test_rules_give_expected_specs():
    mesh = sharding.make_mesh(1, 4, 2)
    spec = lambda axes, shape: sharding.logical_to_spec(axes, shape, mesh)
    assert spec(("layers", "embed", "q_heads"), (2, 64, 64)) == P(None, "fsdp", "tensor")
    assert spec(("layers", "mlp", "embed"), (2, 128, 64)) == P(None, "tensor", "fsdp")
    assert spec(("vocab", "embed"), (256, 64)) == P("tensor", "fsdp")
    assert spec(("layers", "norm"), (2, 64)) == P(None, None)
    # A dimension the mesh axis does not divide stays replicated.
    assert spec(("layers", "embed", "kv_heads"), (2, 36, 6)) == P(None, "fsdp", "tensor")
    assert spec(("layers", "embed", "kv_heads"), (2, 30, 5)) == P(None, None, None)
    # Batches go over data x fsdp.
    mesh3 = sharding.make_mesh(2, 2, 2)
    assert sharding.logical_to_spec(("batch", None), (8, 3), mesh3) == P(("data", "fsdp"), None)


def test_mesh_errors_are_clear():
    with pytest.raises(sharding.MeshError, match="does not fit 8 device"):
        sharding.make_mesh(3, -1, 1)
    assert sharding.make_mesh(1, -1, 1, devices=jax.devices()[:1]).shape["fsdp"] == 1
