"""Test setup: 8 simulated CPU devices (set before jax is imported), shared data paths, tiny HF models."""

import os

if "XLA_FLAGS" not in os.environ or "device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
# XLA's CPU backend spent most of the suite's time in LLVM, optimising programs that then run once or a few times
# on a tiny model: compiled unoptimised, trainer, sampler and weight-sync tests ran 1.6-3x faster. The programs
# are the same HLO, compiled for speed or not (no fast-math either way). Processes the tests start inherit the
# flag with the rest of XLA_FLAGS; the long learning runs, whose programs run hundreds of times, drop it
# (`tests/trainer/runs.py:optimised_env`). XLA_FLAGS=--xla_backend_optimization_level=3 runs everything optimised.
# Its fusions emitted the legacy way, not through the MLIR fusion emitters: each fusion then costs a fraction of the
# compile (2 CLI steps of tiny Qwen2: 8.0 -> 4.1 s of XLA compilation; of tiny Qwen3.5: 12.2 -> 6.2 s; the same
# losses). The long learning runs drop it with the level: optimised, the MLIR emitters' code ran their steps 6%
# faster, and their recorded trajectories were made with them.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
    if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gc  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# One persistent compilation cache for the whole session: every trainer a test builds jits its own
# functions, and most of them lower to programs an earlier test compiled already (the sampler's above
# all); loading those from disk takes a fraction of compiling them. A fresh directory per session, so
# nothing carries over between jax versions or checkouts.
# Under pytest-xdist the controller imports this file first and its workers inherit the variable, so the
# workers share one cache.
_OWN_CACHE = "JAXRL_TEST_XLA_CACHE" not in os.environ  # made here (by the controller), so removed at the end
_CACHE = os.environ.setdefault("JAXRL_TEST_XLA_CACHE", tempfile.mkdtemp(prefix="jaxrl_test_xla_cache_"))
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# Processes the tests start inherit it too: a trainer worker in a Ray actor (`train.driver='ray'`) compiled cold
# each time. CLI runs and Ray's trainer processes set `train.compilation_cache_dir` (~/.cache/jaxrl_llm/xla), which
# the second variable replaces: on a fresh CI machine they compiled cold, and shared no program with the in-process
# tests, whose programs (the sampler's above all) are theirs too.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAXRL_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Ray starts its workers (the trainer's processes and workers, the vLLM engines) at niceness 15. Beside the
# other xdist worker, which runs at 0, they then got almost no CPU: a two-process run under the Ray driver
# took minutes, and one of its processes missed gloo's 30 s rendezvous (a flaky failure under load).
os.environ.setdefault("RAY_worker_niceness", "0")
# No idle workers started ahead: a cluster's first driver made the raylet start one a CPU, and the tests' actors take
# none of them (the vLLM actors and the trainer's processes each carry a runtime_env of their own, so Ray starts
# workers for them anyway). A start, one actor and a shutdown took 6.6-7.6 CPU-seconds with them, 5.9-6.6 without.
os.environ.setdefault("RAY_enable_worker_prestart", "0")
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

REPO = pathlib.Path(__file__).resolve().parents[1]
# Test files that start a Ray cluster (in-process or in a child). They run one after another on one xdist
# worker: two clusters on one small machine compete for its memory and cores.
RAY_FILES = {"tests/rewards/test_manager_ray.py", "tests/rollout/test_vllm_pool.py", "tests/trainer/test_loop_e2e.py",
             "tests/trainer/test_multiprocess.py", "tests/trainer/test_async_multiprocess.py",
             "tests/trainer/test_ray_driver.py"}
SHARED_DATA = pathlib.Path(os.environ.get("JAXRL_SHARED_DATA", REPO.parent / "shared" / "data"))


def pytest_unconfigure(config):
    """The controller removes the cache it made (each session starts one afresh; /tmp kept them all)."""
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray cluster of 2 CPUs for one test module (`pytestmark = pytest.mark.usefixtures("ray_local")`)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _resident_gib() -> float:
    """This process's resident memory now (not its peak), in GiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


# Resident memory at which the next module's end clears jit's caches: the first module's end, and after each clear
# this process's memory then plus JAXRL_TEST_CLEAR_GROWTH_GIB.
_CLEAR_AT: list[float] = []


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs():
    """Drops jit's in-memory caches after a test module once this process has grown by
    `JAXRL_TEST_CLEAR_GROWTH_GIB` (0.75) since the last time. A full run compiles thousands of programs (every
    trainer a test builds jits its own functions); kept alive, their executables grew one pytest process past what a
    24 GB machine holds. Clearing after every module cost ~1.1 s each (127 modules: 139.5 s of a 1,880 s run on 2
    workers), and it returns no memory to the system (the resident size after a clear is the size before it): it
    only stops the growth. The persistent cache above makes any recompile cheap."""
    yield
    rss = _resident_gib()
    if not _CLEAR_AT:
        _CLEAR_AT.append(rss)
    cleared = rss >= _CLEAR_AT[0]
    if cleared:
        jax.clear_caches()
        gc.collect()
        _CLEAR_AT[0] = _resident_gib() + float(os.environ.get("JAXRL_TEST_CLEAR_GROWTH_GIB", "0.75"))
    if os.environ.get("JAXRL_TEST_RSS_LOG"):  # pid, resident GiB at the module's end, after the clear, cleared
        with open(os.environ["JAXRL_TEST_RSS_LOG"], "a") as f:
            f.write(f"{os.getpid()} {rss:.2f} {_resident_gib():.2f} {int(cleared)}\n")


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


# ---- pytest-xdist: whole files per worker ------------------------------------------------------------
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker a core, at most 4 and at most one per 6 GiB of memory (a trainer test with
    8 simulated devices and a vLLM test each take a few GiB)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return max(1, min(cores, 4, int(mem_gib // 6)))


def _group(item) -> str:
    path = item.nodeid.split("::")[0]
    return "ray" if path in RAY_FILES or item.get_closest_marker("vllm") is not None else path


def pytest_itemcollected(item):
    """Marks each test with its xdist group as it is collected, before any `pytest_collection_modifyitems`
    (xdist's own reads the groups into the node ids there)."""
    item.add_marker(pytest.mark.xdist_group(_group(item)))


def pytest_collection_modifyitems(config, items):
    """Schedules whole files under `--dist loadgroup` (an expensive module fixture is built once), with
    the Ray and vLLM tests as one group on one worker. Long units start first (the Ray group, then the
    trainer and agent runs, then the engines and models), so that no long file starts last and leaves the
    other workers idle at the end (`--no-loadscope-reorder` keeps this order). Without xdist only the
    order changes."""

    def rank(item) -> int:
        name = _group(item)
        if name == "ray":
            return 0
        for i, prefix in enumerate(("tests/trainer/", "tests/agent/", "tests/rollout/", "tests/models/"), 1):
            if name.startswith(prefix):
                return i
        return 5

    items.sort(key=rank)
