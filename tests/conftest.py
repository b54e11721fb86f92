"""Test setup: 8 simulated CPU devices (set before jax is imported), shared data paths, tiny HF models."""

import os

if "XLA_FLAGS" not in os.environ or "device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gc  # noqa: E402
import pathlib  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# One persistent compilation cache for the whole session: every trainer a test builds jits its own
# functions, and most of them lower to programs an earlier test compiled already (the sampler's above
# all); loading those from disk takes a fraction of compiling them. A fresh directory per session, so
# nothing carries over between jax versions or checkouts.
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="jaxrl_test_xla_cache_"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = pathlib.Path(os.environ.get("JAXRL_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Drops jit's in-memory caches after each test module. A full run compiles thousands of programs
    (every trainer a test builds jits its own functions); kept alive, their executables grew one pytest
    process past what a 24 GB machine holds. The persistent cache above makes any recompile cheap."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"shared data not found at {SHARED_DATA}; set JAXRL_SHARED_DATA")
    return SHARED_DATA


@pytest.fixture(scope="session")
def qwen2_tokenizer_dir(shared_data) -> pathlib.Path:
    return shared_data / "qwen2_tokenizer"


@pytest.fixture(scope="session")
def gsm8k_dir(shared_data) -> pathlib.Path:
    return shared_data / "gsm8k"
