"""What every benchmark section shares: the section registry, result rows, timing, the device's meta data,
and the markdown report. Sections live in the modules beside this one; `__main__` runs them.

A section is a function of the parsed options, registered with `@section(name, ...)`. It emits one row (a
dict) per measurement with `emit(section=..., ...)`; rows print as JSON lines, are appended to
`<out>/rows.jsonl` as they come, and end up in `<out>/bench.json` ({"meta", "results"}) and `bench.md`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The trainer's CLI share of the device (train.py); sections that run the trainer measure with it.
TRAINER_MEM_FRACTION = "0.92"


@dataclasses.dataclass(frozen=True)
class Section:
    """One benchmark section.

    fn: (opts) -> None, emitting rows; opts holds every option, with this section's `defaults` applied.
    mem_fraction: XLA_PYTHON_CLIENT_MEM_FRACTION it measures with (None: XLA's default, 75%).
    env: environment it needs before JAX starts (set where unset), e.g. JAX_PLATFORMS=cpu for vLLM on CPU.
    per_process: options whose values each get a process of their own (e.g. one per preset and engine,
      so that each reports its own device peak).
    uses_jax: False for a section that must not start JAX (the torch peers: JAX would take the GPU's memory).
    """

    name: str
    fn: Callable
    help: str
    defaults: dict
    mem_fraction: str | None = None
    env: dict = dataclasses.field(default_factory=dict)
    per_process: tuple[str, ...] = ()
    uses_jax: bool = True

    @property
    def in_process(self) -> bool:
        return not self.env and not self.per_process


SECTIONS: dict[str, Section] = {}
OPTIONS: dict[str, tuple] = {}  # "--flag": (default when no section sets one, argparse keywords)


def section(name: str, *, help: str, defaults: dict | None = None, **kw):
    """Registers the decorated function as section `name` (see `Section` for the keywords)."""

    def register(fn):
        if name in SECTIONS and not _same_source(SECTIONS[name].fn, fn):
            raise ValueError(f"benchmark section {name!r} is registered twice")
        SECTIONS[name] = Section(name, fn, help, dict(defaults or {}), **kw)
        return fn

    return register


def _same_source(a, b) -> bool:
    """One function imported twice: `python -m jaxrl_llm.bench.<module>` runs a module that the package has already
    imported, as `__main__`, and its sections register again."""
    return a.__qualname__ == b.__qualname__ and a.__code__.co_filename == b.__code__.co_filename


def option(flag: str, default=None, **kw) -> None:
    """Declares a command-line option that sections read as `opts.<name>`: its value where given, else the
    section's own default (`section(defaults=...)`), else `default`. Declared again, it must be the same."""
    if flag in OPTIONS and OPTIONS[flag] != (default, kw):
        raise ValueError(f"benchmark option {flag} is declared twice, differently")
    OPTIONS[flag] = (default, kw)


# ---- result rows ----------------------------------------------------------------------------------
class Rows:
    """Result rows: kept in `rows`, printed as a JSON line by process 0 and appended to `path` when set."""

    def __init__(self):
        self.rows: list[dict] = []
        self.path: str | None = None

    def emit(self, **row) -> dict:
        row = {k: (float(v) if isinstance(v, np.floating) else int(v) if isinstance(v, np.integer) else v)
               for k, v in row.items()}
        self.rows.append(row)
        if process_index() == 0:
            line = json.dumps(row)
            print(line, flush=True)
            if self.path:
                with open(self.path, "a") as f:
                    f.write(line + "\n")
        return row


ROWS = Rows()
emit = ROWS.emit

# Roofline and MFU denominators: the hardware as torch's copy and cuBLAS matmul reach it on this GPU (the
# `torch` section), read back by `--torch_results`; XLA's own kernels reach less, reported beside.
CEILINGS = {"copy_tb_s": None, "matmul_tflops": None}
ATTENTION = {"impl": "auto"}  # the `attention` section sets "xla" if the cuDNN self-check fails


def process_index() -> int:
    import sys

    if "jax" not in sys.modules:  # a section that does not start JAX (the torch peers)
        return 0
    import jax

    return jax.process_index()


# ---- timing ---------------------------------------------------------------------------------------
def scratch_dir(prefix: str, work_dir: str | None) -> str:
    """A fresh directory for a section's checkpoints or adapters: under `--work_dir` (made if missing: a lent
    machine's /tmp/<name> does not exist yet), else under the system's temp."""
    if work_dir:
        os.makedirs(work_dir, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=work_dir)


def timeit(fn, *args, warmup: int = 1, iters: int = 5, warm_s: float = 0.0) -> float:
    """Median wall seconds of `fn(*args)` with the result synchronised (after `warmup` calls and at
    least `warm_s` seconds of them, so the clocks are up)."""
    import jax

    t_end = time.perf_counter() + warm_s
    for i in range(10 ** 6):
        jax.block_until_ready(fn(*args))
        if i + 1 >= warmup and time.perf_counter() >= t_end:
            break
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def layered(attn):
    """A jitted program running `attn(q, k, v, *rest)` over each layer's K/V, the query chained like layers
    (a timed call then reads every layer's caches once: no L2 reuse between calls)."""
    import jax

    @jax.jit
    def run(q, ks, vs, *rest):
        for k, v in zip(ks, vs):
            q = q + (attn(q, k, v, *rest) * 0.01).astype(q.dtype)
        return q

    return run


def timed(fn, *args, iters=10, warmup=2):
    """(first call s, incl. compile; median s of `iters` calls after `warmup`)."""
    import jax

    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return first, float(np.median(times))


class CompileSeconds:
    """XLA compile seconds since the last `reset`, counted by a jax.monitoring listener from construction to
    `close` (or the end of a `with` block), with every jax duration event's count and seconds in `events` and
    the compile seconds of each program by name in `programs` (what a step that should compile nothing did)."""

    def __init__(self):
        import jax

        self.seconds, self.events, self.programs = 0.0, {}, {}
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, fun_name=None, **_):
        if event.endswith("backend_compile_duration"):
            self.seconds += duration
            name = fun_name or "?"
            self.programs[name] = self.programs.get(name, 0.0) + duration
        e = self.events.setdefault(event.rsplit("/", 1)[-1], [0, 0.0])
        e[0] += 1
        e[1] += duration

    def reset(self) -> None:
        self.seconds, self.events, self.programs = 0.0, {}, {}

    def slowest(self, k: int = 5) -> list[str]:
        """The `k` programs that took the most compile seconds since the last reset, as 'name 1.23s'."""
        top = sorted(self.programs.items(), key=lambda kv: -kv[1])[:k]
        return [f"{name} {sec:.2f}s" for name, sec in top]

    def close(self) -> None:
        import jax

        jax.monitoring.unregister_event_duration_listener(self._on)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def generate_twice(engine, prompts, sampling):
    """A first (compiling) generation, then a timed one with the next seed: (first_s, batch, seconds)."""
    t0 = time.perf_counter()
    engine.generate(prompts, sampling)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling.replace(seed=sampling.seed + 1))
    return first, out, time.perf_counter() - t0


def compiled_gb(jitted, *args) -> float:
    """Peak device memory of one compiled call: arguments + outputs + temporaries - aliased."""
    m = jitted.lower(*args).compile().memory_analysis()
    if m is None:
        return float("nan")
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return total / 1e9


def device_gb() -> float:
    """The device's peak memory in use so far (GB); 0 where the backend keeps no statistics."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 1e9


# ---- meta and report ------------------------------------------------------------------------------
def commit() -> str:
    """This tree's commit, with '+dirty' when its tracked files differ from it (a copied tree on a lent machine
    can sit on an older commit than the code it holds)."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    sha = out.stdout.strip()
    if not sha:
        return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=REPO, capture_output=True).returncode == 1
    return sha + "+dirty" if dirty else sha


RUNS = "benchmarks/runs"  # a run's output, not its files: left out of the tree hash


def _write_tree(repo: str, env: dict, *setup: list[str]) -> str | None:
    """`git write-tree` of the index in env's GIT_INDEX_FILE after the `setup` git commands and the removal of
    RUNS from it; None where a command fails."""
    for cmd in (*setup, ["rm", "-r", "-q", "--cached", "--ignore-unmatch", "--", RUNS]):
        if subprocess.run(["git", *cmd], cwd=repo, env=env, capture_output=True).returncode != 0:
            return None
    out = subprocess.run(["git", "write-tree"], cwd=repo, env=env, capture_output=True, text=True)
    return out.stdout.strip() or None


def tree(repo: str = REPO) -> str | None:
    """The git tree of the files here, tracked and untracked less the ignored, and less benchmarks/runs/, as
    `git write-tree` names it: a copied tree on a lent machine names whatever commit its git sits on, but this hash
    is the files of the commit that ran (`commit_of_tree` finds it where that commit exists). None outside a git
    checkout. benchmarks/runs/ is left out whole: what a run writes there (the GPU check's report, after its first
    config) is its output, and a lent machine's git index, of an older commit, lacks the runs committed since,
    which made the 9B's checks name no commit (2026-11-27, 2026-11-28)."""
    git_index = subprocess.run(["git", "rev-parse", "--git-path", "index"], cwd=repo, capture_output=True, text=True)
    if git_index.returncode != 0:
        return None
    with tempfile.TemporaryDirectory() as d:
        index = os.path.join(d, "index")
        src = os.path.join(repo, git_index.stdout.strip())
        if os.path.exists(src):  # a copy of git's index: only the files that changed are hashed again
            shutil.copy(src, index)
        return _write_tree(repo, {**os.environ, "GIT_INDEX_FILE": index}, ["add", "-A", "--", ".", f":!{RUNS}"])


def commit_tree(commit: str, repo: str = REPO) -> str | None:
    """`tree`'s hash for a commit's files (its tree less benchmarks/runs/)."""
    with tempfile.TemporaryDirectory() as d:
        return _write_tree(repo, {**os.environ, "GIT_INDEX_FILE": os.path.join(d, "index")}, ["read-tree", commit])


def commit_of_tree(tree_hash: str | None, repo: str = REPO, newest: int = 400) -> str | None:
    """The newest commit (any branch, of the `newest` last) whose files are `tree_hash` (`tree`'s hash), as a short
    hash; None where none is."""
    if not tree_hash:
        return None
    out = subprocess.run(["git", "log", "--all", "-n", str(newest), "--format=%h"], cwd=repo, capture_output=True,
                         text=True)
    return next((c for c in out.stdout.split() if commit_tree(c, repo) == tree_hash), None)


def meta(uses_jax: bool = True) -> dict:
    """Date, device, devices, processes, versions and commit of this run."""
    out = {"date": datetime.date.today().isoformat(), "commit": commit(), "tree": tree()}
    if uses_jax:
        import jax

        out.update(device=jax.devices()[0].device_kind, n_devices=jax.device_count(), processes=jax.process_count(),
                   jax=jax.__version__)
    else:
        import torch

        out.update(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                   n_devices=max(1, torch.cuda.device_count()), processes=1, torch=torch.__version__)
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    """One table a section, its columns the union of its rows' keys."""
    lines = [f"### {meta['date']} · {meta['device']} · commit {meta['commit']}", ""]
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r.get("section", "-"), []).append(r)
    for name, items in by.items():
        keys: list[str] = []
        for it in items:
            keys += [k for k in it if k not in keys and k != "section"]
        lines += [f"**{name}**", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for it in items:
            lines.append("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(it.get(k, ""))
                                           for k in keys for v in [it.get(k, "")]) + " |")
        lines.append("")
    return "\n".join(lines)


def write_results(out_dir: str, meta: dict, rows: list[dict]) -> None:
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(markdown(rows, meta))


# ---- options several sections read (each section's own defaults apply where a command leaves one out) ----
option("--presets", help="presets of the generation, decode, sync, MoE, quant and LoRA-sync sections")
option("--train_presets", help="presets of the training sections (train, e2e, profile_update)")
option("--remat", help="model.remat: full, dots, none, or auto (the trainer's default)")
option("--token_budget", type=int, help="tokens of a micro-batch: actor.ppo_max_token_len_per_gpu (e2e, "
       "profile_update, memory), the timed micro-batch (quant)")
option("--repeats", type=int, help="repeats of a measurement")
option("--lora_rank", type=int, help="LoRA rank on every linear layer (e2e: 0 is full fine-tuning)")
option("--lora_alpha", type=float, help="LoRA alpha")
option("--engines", help="engines to compare (gen: dense,paged; lora_sync: jax,vllm)")
option("--work_dir", help="where checkpoints and adapter directories go (lora_sync, weight_path, checkpoint; "
       "default: temp)")
option("--kv_cache_mb", type=int, default=64, help="the vLLM engine's KV cache in MB (lora_sync, weight_path)")
option("--torch_results", help="the torch section's --out: its rows, the hardware ceilings and the parity reference")
option("--rows", help="rows or slots (paged_kernel: slot counts; moe_decode: rows)")
option("--budget_s", type=float, help="decode_kernel, paged_kernel, gated_delta: skip the parts left after this many "
       "seconds")
