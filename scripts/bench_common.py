"""Shared workload definitions for the benchmarks: GSM8K prompts and the seed's response lengths.

Prompts are real GSM8K test questions with veRL's instruction, through the Qwen2 chat template
(94 tokens on average). Data comes from `.bench_data/` in the repo (carried to the GPU machine) or
`../shared/data/`.
"""

from __future__ import annotations

import functools
import json
import os
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# The seed run's responses: 232 tokens on average, at most 1024. We draw lognormal lengths with that
# mean (sigma 0.5), clipped to [16, 1024].
SEED_RESPONSE_MEAN = 232
SEED_RESPONSE_MAX = 1024


def data_dir() -> str:
    for d in (os.path.join(REPO, ".bench_data"), os.path.join(REPO, "..", "shared", "data")):
        if os.path.isdir(os.path.join(d, "qwen2_tokenizer")):
            return d
    raise FileNotFoundError("no .bench_data/ or ../shared/data/ with qwen2_tokenizer")


@functools.cache
def tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(os.path.join(data_dir(), "qwen2_tokenizer"))


@functools.cache
def _questions() -> tuple[str, ...]:
    d = data_dir()
    path = os.path.join(d, "gsm8k_test.jsonl")
    if os.path.exists(path):  # veRL-schema rows
        with open(path) as f:
            return tuple(json.loads(line)["prompt"][0]["content"] for line in f)
    with open(os.path.join(d, "gsm8k", "test.jsonl")) as f:
        return tuple(json.loads(line)["question"] + " " + INSTRUCTION for line in f)


def gsm8k_prompts(n: int, vocab_size: int | None = None) -> list[list[int]]:
    """n prompt token-id lists (cycling through the 1,319 test questions), in the Qwen2 vocabulary.

    With `vocab_size` (a model of a smaller vocabulary, e.g. Llama 3's 128,256), ids past it are folded into
    it (id % vocab_size): random weights care about the shape of the work, not which ids it reads."""
    tok = tokenizer()
    qs = _questions()
    out = []
    for i in range(n):
        text = tok.apply_chat_template([{"role": "user", "content": qs[i % len(qs)]}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out.append([i % vocab_size for i in ids] if vocab_size else ids)
    return out


def seed_response_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mu = np.log(SEED_RESPONSE_MEAN) - 0.5 ** 2 / 2
    return np.clip(np.round(rng.lognormal(mu, 0.5, size=n)), 16, SEED_RESPONSE_MAX).astype(np.int32)


def hf_config_dict(preset: str) -> dict:
    from jaxrl_llm.models.config import PRESETS

    extra = {"vocab_size": 151936, "head_dim": 32, "num_attention_heads": 2, "num_key_value_heads": 1} \
        if preset == "tiny" else {}
    cfg = PRESETS[preset](**extra).to_hf()
    cfg.pop("architectures", None)
    cfg.pop("model_type", None)
    return cfg


def dir_bytes(path: str) -> int:
    """Bytes of every file under `path`."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


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


def generate_twice(engine, prompts, sampling):
    """A first (compiling) generation, then a timed one with the next seed: (first_s, batch, seconds)."""
    t0 = time.perf_counter()
    engine.generate(prompts, sampling)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling.replace(seed=sampling.seed + 1))
    return first, out, time.perf_counter() - t0


# ---- result rows ----------------------------------------------------------------------------------
# Roofline and MFU denominators: the hardware as torch's copy and cuBLAS matmul reach it on this GPU
# (scripts/bench_torch.py); XLA's own elementwise and GEMM kernels reach less, reported beside.
CEILINGS = {"copy_tb_s": None, "matmul_tflops": None}
ATTENTION = {"impl": "auto"}  # bench.py's attention section sets "xla" if the cuDNN self-check fails


class Rows:
    """A benchmark's result rows: each kept in `rows`, printed as a JSON line by process 0, and appended
    to `path` (JSON lines) when set; `stamp` adds the device and the date to every row."""

    def __init__(self):
        self.rows: list[dict] = []
        self.path: str | None = None
        self.stamp = False

    def emit(self, **row) -> dict:
        import jax

        row = {k: (float(v) if isinstance(v, np.floating) else v) for k, v in row.items()}
        if self.stamp:
            row = {"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"), **row}
        self.rows.append(row)
        if jax.process_index() == 0:
            line = json.dumps(row)
            print(line, flush=True)
            if self.path:
                with open(self.path, "a") as f:
                    f.write(line + "\n")
        return row


ROWS = Rows()
emit = ROWS.emit


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
