"""The paged sampler against the dense one: generation alone at the seed run's per-GPU share, on one GPU or on
several (one data-parallel shard a GPU, the share times the GPUs).

    python scripts/bench_paged.py --out $OUT --presets qwen2p5_7b,qwen3_8b --engines dense,paged
    python scripts/bench_paged.py --out $OUT --presets qwen2p5_7b --devices 1,2 --repeats 5
    python scripts/bench_paged.py --out $OUT --sections long --presets qwen2p5_1p5b

* gen: 128 GSM8K prompts x 5 per repeat (each repeat the next prompts, as each training step), response
  lengths drawn to the seed run's distribution (mean 232, max 1,024), sampled at temperature 1 with EOS
  off so every row runs to its drawn length. Repeat 0 compiles; later repeats report compile time apart.
  Each (preset, engine) runs in its own process, so its device peak is its own.
* long: 64 prompts x 5 with a heavy tail of response lengths up to 16,384 (paged only).

Rows: seconds, compile seconds, tokens/s, row-steps (slots x decode steps) per token, the device's peak
bytes against the budget (gpu_memory_utilization x the allocator's limit), and the pool's statistics.
Random weights (init_params): the work's shape is the model's, the tokens are not.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_common import ROWS, emit  # noqa: E402


def long_lengths(n: int, seed: int = 0, cap: int = 16384) -> np.ndarray:
    """A heavy tail: most responses a few hundred tokens, a few past 8k, one at the cap."""
    rng = np.random.default_rng(seed)
    lens = np.clip(np.round(rng.pareto(1.1, size=n) * 300 + 64), 64, cap).astype(np.int32)
    lens[0] = cap
    return lens


def one(preset: str, engine: str, section: str, repeats: int, attention: str, max_num_seqs: int,
        compile_cache: str | None = None, out_dir: str | None = None, devices: int = 1):
    import logging

    import jax

    from jaxrl_llm import sharding
    from jaxrl_llm.models import init_params
    from jaxrl_llm.models.config import PRESETS
    from jaxrl_llm.rollout import DenseJaxEngine, JaxEngine, SamplingParams
    from jaxrl_llm.rollout.page_pool import device_memory
    from scripts.bench_common import gsm8k_prompts, seed_response_lengths

    compile_s = [0.0]
    events: dict[str, list[float]] = {}  # every jax duration event of the repeat: [count, seconds]

    def on_duration(event, duration, **_):
        if event.endswith("backend_compile_duration"):
            compile_s[0] += duration
        e = events.setdefault(event.rsplit("/", 1)[-1], [0, 0.0])
        e[0] += 1
        e[1] += duration

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    log_handler = None
    if compile_cache:
        from jaxrl_llm.trainer.process import enable_compilation_cache
        enable_compilation_cache(compile_cache)
        # Per program: tracing, lowering and compile (or cache hit) times, to find what a warm cache misses.
        jax.config.update("jax_log_compiles", True)
        jax.config.update("jax_explain_cache_misses", True)
        log_handler = logging.FileHandler(os.path.join(out_dir or ".", f"jaxlog_{preset}_{engine}_{section}.txt"))
        log_handler.setFormatter(logging.Formatter("%(relativeCreated)d %(name)s %(message)s"))
        for name in ("jax._src.dispatch", "jax._src.interpreters.pxla", "jax._src.compiler",
                     "jax._src.compilation_cache", "jax._src.pjit"):
            lg = logging.getLogger(name)
            lg.setLevel(logging.DEBUG)
            lg.addHandler(log_handler)
    extra = {"max_position_embeddings": 32768} if preset == "tiny" else {}  # the CPU smoke test
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="bfloat16", **extra)
    params = init_params(cfg, seed=0)
    jax.block_until_ready(params)
    n_prompts, n = (128 * devices, 5) if section == "gen" else (64 * devices, 5)
    prompts_all = gsm8k_prompts(n_prompts * (repeats + 1), vocab_size=cfg.vocab_size)
    max_new = 1024 if section == "gen" else 16384
    mesh = sharding.make_mesh(1, devices, 1, devices=jax.devices()[:devices]) if devices > 1 else None
    if engine == "dense":
        eng = DenseJaxEngine(cfg, params, mesh=mesh, dtype="bfloat16", max_batch_size=4096 * devices,
                             max_prompt_length=512, decode_attention=attention)
    else:
        eng = JaxEngine(cfg, params, mesh=mesh, dtype="bfloat16", max_prompt_length=512, decode_attention=attention,
                        max_num_seqs=max_num_seqs, max_model_len=512 + max_new)
    eng.trace = engine == "dense"  # the dense engine counts its row-steps in its phase trace
    params = None
    sp = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new, ignore_eos=True)
    for rep in range(repeats + 1):
        prompts = prompts_all[rep * n_prompts:(rep + 1) * n_prompts]
        lens = (seed_response_lengths if section == "gen" else long_lengths)(n_prompts * n, seed=rep)
        compile_s[0] = 0.0
        events.clear()
        if log_handler:
            log_handler.stream.write(f"=== repeat {rep}\n")
        t0 = time.perf_counter()
        try:
            out = eng.generate(prompts, sp.replace(seed=rep), max_new_tokens_per_row=lens)
        except Exception as e:  # noqa: BLE001 (the row records the failure, e.g. out of memory)
            emit(section=section, preset=preset, engine=engine, devices=devices, rep=rep,
                 error=f"{type(e).__name__}: {str(e)[:300]}")
            return
        dt = time.perf_counter() - t0
        assert np.array_equal(out.lengths, lens)
        mem = device_memory()
        stats = getattr(eng, "last_stats", {})
        row_steps = stats["row_steps"] if engine == "paged" else sum(
            r["rows"] * (r["t1"] - r["t0"]) for r in eng.last_trace if r["phase"] == "decode")
        emit(section=section, preset=preset, engine=engine, devices=devices, attention=eng.decode_attention, rep=rep,
             seconds=round(dt, 3), compile_s=round(compile_s[0], 3), tokens=int(lens.sum()),
             tokens_per_s=round(float(lens.sum() / dt), 1),
             row_steps_per_token=round(row_steps / lens.sum(), 3) if row_steps else None,
             peak_gb=round(mem[2] / 1e9, 2) if mem else None, limit_gb=round(mem[0] / 1e9, 2) if mem else None,
             budget_gb=round(0.9 * mem[0] / 1e9, 2) if mem and engine == "paged" else None,
             **{f"kv_{k}": v for k, v in stats.items() if k in (
                 "num_pages", "kv_bytes", "preemptions", "segments", "prefill_calls", "shared_pages", "copies",
                 "workspace_bytes", "shard_segments", "shard_seconds", "plan_s", "stolen", "programs_compiled",
                 "programs_moved", "programs_loaded")},
             events={k: [v[0], round(v[1], 3)] for k, v in sorted(events.items())},
             programs={k: round(v, 2) for k, v in getattr(getattr(eng, "_programs", None), "stats", {}).items()})


def check(preset: str, repeats: int):
    """The shards' tokens on every mesh of the machine's GPUs equal one GPU's (greedy, and sampled: row streams),
    so the executables loaded onto the other shards' devices compute what the first shard's do."""
    import jax
    import numpy as np

    from jaxrl_llm import sharding
    from jaxrl_llm.models import init_params
    from jaxrl_llm.models.config import PRESETS
    from jaxrl_llm.rollout import JaxEngine, SamplingParams
    from scripts.bench_common import gsm8k_prompts

    k = jax.device_count()
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="bfloat16")
    params = init_params(cfg, seed=0)
    prompts = gsm8k_prompts(16 * k, vocab_size=cfg.vocab_size)
    lens = np.random.default_rng(0).integers(1, 128, size=len(prompts) * 2)
    meshes = {"1": None, f"fsdp{k}": sharding.make_mesh(1, k, 1)}
    if k % 2 == 0 and cfg.num_key_value_heads % 2 == 0:
        meshes[f"fsdp{k // 2}_tensor2"] = sharding.make_mesh(1, k // 2, 2)
    for sp in (SamplingParams(n=2, temperature=0.0, max_new_tokens=128, ignore_eos=True),
               SamplingParams(n=2, temperature=1.0, max_new_tokens=128, ignore_eos=True, seed=7)):
        ref = None
        for name, mesh in meshes.items():
            eng = JaxEngine(cfg, params, mesh=mesh, dtype="bfloat16", max_prompt_length=512, max_model_len=640)
            for _ in range(max(1, repeats)):  # the later calls reuse the programs and the pool
                out = eng.generate(prompts, sp, max_new_tokens_per_row=lens)
            ref = out if ref is None else ref
            same = float(np.mean(np.all(out.tokens == ref.tokens, axis=1)))  # bf16 sums differ on tensor meshes
            emit(section="check", preset=preset, mesh=name, temperature=sp.temperature, rows_equal_1gpu=same,
                 logp_gap=float(np.abs(out.logprobs - ref.logprobs).max()),
                 **{k2: v for k2, v in eng.last_stats.items() if k2 in ("shard_segments", "programs_compiled",
                                                                         "programs_moved", "stolen", "seconds")})
            del eng


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/paged_out"))
    ap.add_argument("--presets", default="qwen2p5_7b")
    ap.add_argument("--engines", default="dense,paged")
    ap.add_argument("--sections", default="gen")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--max_num_seqs", type=int, default=1024)
    ap.add_argument("--compile_cache", default=None,
                    help="a persistent compilation cache dir; also logs each program's trace/lower/compile times")
    ap.add_argument("--devices", default="1", help="GPUs a run uses (comma-separated: each in turn, e.g. 1,2)")
    ap.add_argument("--one", nargs=4, metavar=("PRESET", "ENGINE", "SECTION", "DEVICES"),
                    help="(internal) one process's run")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    ROWS.path = os.path.join(args.out, "paged.jsonl")
    if args.sections == "check":
        check(args.presets.split(",")[0], args.repeats)
        return
    if args.one:
        preset, engine, section, devices = args.one
        one(preset, engine, section, repeats=args.repeats, attention=args.attention, max_num_seqs=args.max_num_seqs,
            compile_cache=args.compile_cache, out_dir=args.out, devices=int(devices))
        return
    for section in args.sections.split(","):
        for preset in args.presets.split(","):
            for engine in (args.engines.split(",") if section == "gen" else ["paged"]):
                for devices in args.devices.split(","):
                    cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--one", preset, engine,
                           section, devices, "--repeats", str(args.repeats), "--attention", args.attention,
                           "--max_num_seqs", str(args.max_num_seqs)]
                    cmd += ["--compile_cache", args.compile_cache] if args.compile_cache else []
                    rc = subprocess.run(cmd).returncode
                    if rc:
                        emit(section=section, preset=preset, engine=engine, devices=int(devices),
                             error=f"process exited {rc}")


if __name__ == "__main__":
    main()
