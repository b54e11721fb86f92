"""`train.xla_gpu_overlap`'s XLA flags: composed with the user's XLA_FLAGS (theirs win, nothing twice), added only
where a GPU backend is to start, and every one known to this XLA (an unknown flag stops the backend)."""

import os
import subprocess
import sys

from jaxrl_llm import xla_flags
from jaxrl_llm.xla_flags import GPU_OVERLAP_FLAGS, apply_gpu_overlap, compose, flag_names


def test_the_users_flags_stay_and_nothing_is_twice():
    user = "--xla_force_host_platform_device_count=8 --xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_hlo"
    out = compose(user, GPU_OVERLAP_FLAGS)
    tokens = out.split()
    assert tokens[:3] == user.split()  # first, as given
    assert len({t.split("=")[0] for t in tokens}) == len(tokens)  # one of each
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in tokens  # the user's value
    assert flag_names(out) == flag_names(user) | set(GPU_OVERLAP_FLAGS)
    assert compose(out, GPU_OVERLAP_FLAGS) == out  # idempotent
    assert compose("", {"a": "1"}) == "--a=1"


def test_added_only_where_a_gpu_backend_is_to_start(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_hlo")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert not apply_gpu_overlap(True) and os.environ["XLA_FLAGS"] == "--xla_dump_hlo"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert not apply_gpu_overlap(False)
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert not apply_gpu_overlap(True)  # the backend has started: too late, left as it is
    assert os.environ["XLA_FLAGS"] == "--xla_dump_hlo"
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    assert apply_gpu_overlap(True)
    assert os.environ["XLA_FLAGS"] == compose("--xla_dump_hlo", GPU_OVERLAP_FLAGS)
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(xla_flags.importlib.util, "find_spec", lambda name: None)  # no CUDA plugin installed
    assert not xla_flags.gpu_backend_expected()


def test_every_flag_is_known_to_this_xla():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": compose("", GPU_OVERLAP_FLAGS)}
    out = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.ones(1).block_until_ready()"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
