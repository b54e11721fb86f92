"""Weights-only checkpoints (the vLLM pool's sync): the restored config is the saved family's."""

import jax
import numpy as np
import pytest

from jaxrl_llm.models import PRESETS, init_params
from jaxrl_llm.weights_io import restore_weights, save_weights

CONFIGS = {
    "qwen2": PRESETS["tiny"](),
    "qwen3": PRESETS["tiny"](model_type="qwen3", head_dim=24, tie_word_embeddings=True),
    "llama3": PRESETS["tiny"](model_type="llama", eos_token_id=[1, 5], rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_restore_rebuilds_the_family_config_and_params(tmp_path, name):
    cfg = CONFIGS[name]
    params = init_params(cfg, seed=3)
    save_weights(str(tmp_path), 7, params, cfg)
    step, restored, restored_cfg = restore_weights(str(tmp_path))
    assert step == 7 and restored_cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, restored, jax.device_get(params))


def test_sharded_bf16_weights_come_back_as_host_bf16_arrays(tmp_path):
    """The trainer's path: bf16 params sharded over a mesh, read back bit-exactly as numpy arrays."""
    import jax.numpy as jnp
    import ml_dtypes
    from jax.sharding import NamedSharding, PartitionSpec

    cfg = CONFIGS["qwen2"]
    mesh = jax.make_mesh((len(jax.devices()),), ("fsdp",))
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params(cfg, seed=5))

    def place(x):
        spec = PartitionSpec("fsdp") if x.shape[0] % len(jax.devices()) == 0 else PartitionSpec()
        return jax.device_put(x, NamedSharding(mesh, spec))

    params = jax.tree.map(place, params)
    assert any(len(x.sharding.device_set) > 1 for x in jax.tree.leaves(params))
    save_weights(str(tmp_path), 1, params, cfg)
    _, restored, _ = restore_weights(str(tmp_path), 1)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(jax.device_get(params))):
        assert type(got) is np.ndarray and got.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(got.view(np.uint16), np.asarray(want).view(np.uint16))
