"""XLA compiles are counted apart from loads out of the persistent compilation cache (jax records one
backend-compile event for both)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import compile_watch


def test_a_persistent_cache_load_is_not_a_compile():
    assert jax.config.jax_compilation_cache_dir  # conftest's session cache, min compile time 0
    salt = float(np.random.default_rng().integers(1 << 30))  # a program no earlier run has cached

    def fn(x):
        return jnp.sin(x) * salt

    x = jnp.ones(3)
    before = compile_watch.totals()
    jax.jit(fn)(x)
    compiled = compile_watch.totals()
    assert compiled["compiles"] - before["compiles"] == 1 and compiled["cache_loads"] == before["cache_loads"]
    jax.clear_caches()  # in-memory caches gone: the next call finds the program on disk
    jax.jit(fn)(x)
    loaded = compile_watch.totals()
    assert loaded["compiles"] == compiled["compiles"] and loaded["cache_loads"] - compiled["cache_loads"] == 1
    delta = compile_watch.delta(before, loaded)
    assert delta["perf/compiles"] == 1 and delta["perf/cache_loads"] == 1 and delta["perf/compile_s"] > 0
