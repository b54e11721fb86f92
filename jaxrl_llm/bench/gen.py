"""Generation sections: the JAX sampler's tokens/s against the HBM roofline (`rollout`), generation alone at
the seed run's per-GPU share on the paged and dense engines (`gen`) and with a heavy tail of long responses
(`long`), on one GPU or several (`--devices 1,2`: one data-parallel shard a GPU, the share times the GPUs),
and the dense engine's phases at the seed share (`seed_gen`).

`gen` / `long`: 128 GSM8K prompts x 5 per repeat and GPU (64 x 5 for `long`; each repeat the next prompts, as
each training step), response lengths drawn to the seed run's distribution (mean 232, max 1,024; `long`: a
Pareto tail up to 16,384), at temperature 1 with EOS off so every row runs to its drawn length. Repeat 0
compiles; later repeats report compile time apart. Each (preset, engine) runs in its own process, so its
device peak is its own. Rows: seconds, compile seconds, tokens/s, row-steps (slots x decode steps) per
token, the device's peak against the budget (gpu_memory_utilization x the allocator's limit), the pool's
statistics, and (paged) where the seconds went: `phase_s` / `phase_calls`, the engine's host-side phases (prepare,
plan, prefill, copy, pack, decode, commit, wait, hooks, loop_other, outside: rollout/shard.py), each prefill and
copy call waited for so that its device time is its own with `--phase_timing` (syncs the recorded figures do not
have; `--profile` turns it on). `--profile`: one more generate of the last repeat's work
under `jax.profiler`, summarised as `gen_profile` rows (the top 25 kernels, `gen_profile_kernel`), their totals by
kind (`gen_profile_by_kind`) and where the device's time went (`gen_profile_sorted`: matmul, attention,
elementwise, gaps). Random weights (init_params): the work's shape is the model's, the tokens are not.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np

from jaxrl_llm.bench import trace
from jaxrl_llm.bench.harness import (
    CEILINGS,
    TRAINER_MEM_FRACTION,
    CompileSeconds,
    emit,
    generate_twice,
    option,
    section,
)
from jaxrl_llm.bench.workload import gsm8k_prompts, long_lengths, seed_response_lengths

option("--batches", help="rollout: batch sizes", default="64,256,1024")
option("--attention", help="gen, long: the engine's decode attention", default="auto")
option("--max_num_seqs", type=int, help="gen, long: the paged engine's rows at once (a shard's)", default=1024)
option("--devices", help="gen, long: GPUs a run uses (comma-separated, each in a process of its own: e.g. 1,2)",
       default="1")
option("--shard_work", choices=("drawn", "tiled"), default="drawn",
       help="gen, long: on K GPUs, 'drawn' draws K times a GPU's share of prompts and lengths; 'tiled' gives each "
       "shard a copy of what one GPU gets (the same prompts and lengths), so K GPUs against 1 compares equal work "
       "(a drawn call's longest response is the longest of K times the rows)")
option("--log_compiles", action="store_true", help="gen, long: log every program's tracing, lowering and compile "
       "(or cache hit) to <out>/jaxlog_*.txt, to find what a warm cache misses")
option("--profile", action="store_true", help="gen, long: after the repeats, one more generate under jax.profiler: "
       "the top kernels and where the device's time goes (rows gen_profile*)")
option("--phase_timing", action="store_true", help="gen, long: each prefill and copy call waited for, so that "
       "phase_s gives each phase its own device time (adds syncs: off for the recorded figures; --profile turns it on)")
option("--state_update", choices=("scatter", "in_place"), default="in_place",
       help="gen, long: how the paged engine's decode writes a Qwen3.5's linear states (JaxEngine.state_update)")
option("--gen_prompts", type=int, help="gen, long: prompts (x 5 responses) a GPU's share (default 128; long: 64)")
option("--schedules", help="seed_gen: dense decode schedules (every<K>: drop finished rows every K steps)",
       default="every0,every64")
option("--attentions", help="seed_gen: decode attentions to compare (xla,pallas)", default="xla")
option("--seed_prompts", type=int, help="seed_gen: prompts (x 5 responses)", default=128)
option("--no_profile", action="store_true", help="seed_gen: skip the kernel profile")


def _preset(name: str, small: bool, **kw):
    """A preset by name; the CPU smoke test's tiny model keeps Qwen2's vocabulary for real prompts."""
    from jaxrl_llm.models.config import PRESETS

    return PRESETS[name](**kw, **({"vocab_size": 151936} if small else {}))


@section("rollout", help="JAX sampler tokens/s and % of the HBM roofline at batch 64/256/1024, 232 new tokens",
         defaults={"presets": "qwen2p5_0p5b,qwen2p5_1p5b,qwen2p5_7b"}, mem_fraction=TRAINER_MEM_FRACTION)
def rollout(opts, new_tokens: int = 232):
    from jaxrl_llm.models import init_params
    from jaxrl_llm.rollout import JaxEngine, SamplingParams

    small = opts.small
    presets = [opts.small_preset] if small else opts.presets.split(",")
    batches = [int(b) for b in opts.batches.split(",")]

    bw = CEILINGS["copy_tb_s"] or 4.25  # PEERS.md: 4.25 TB/s measured on the lent H200
    for preset in presets:
        cfg = _preset(preset, small, dtype="bfloat16", param_dtype="bfloat16")
        params = init_params(cfg, seed=0)
        for batch in batches:
            eng = JaxEngine(cfg, params, dtype="bfloat16", max_num_seqs=batch, max_prompt_length=512)
            prompts = gsm8k_prompts(batch)
            sp = SamplingParams(n=1, temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
            first, out, dt = generate_twice(eng, prompts, sp)
            assert int(out.lengths.min()) == new_tokens
            eng.generate(prompts, sp.replace(max_new_tokens=1))
            t0 = time.perf_counter()
            eng.generate(prompts, sp.replace(max_new_tokens=1, seed=2))
            t_prefill = time.perf_counter() - t0
            # Bytes a decode step must read: every weight once (the LM head too, not the embedding
            # table), plus each sequence's K/V so far. Averaged over the 232 steps.
            weight_bytes = (cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)) * 2
            kv_per_token = cfg.num_hidden_layers * 2 * cfg.kv_dim * 2
            mean_ctx = float(np.mean([len(p) for p in prompts])) + (new_tokens - 1) / 2
            step_bytes = weight_bytes + batch * mean_ctx * kv_per_token
            roofline_s = new_tokens * step_bytes / (bw * 1e12)
            decode_s = dt - t_prefill
            emit(section="rollout", preset=preset, batch=batch, new_tokens=new_tokens,
                 mean_prompt=float(np.mean([len(p) for p in prompts])), seconds=dt, first_call_s=first,
                 tokens_per_s=batch * new_tokens / dt, prefill_s=t_prefill,
                 decode_ms_per_step=decode_s / (new_tokens - 1) * 1e3, step_gb=step_bytes / 1e9,
                 roofline_pct=100 * roofline_s / dt,
                 decode_roofline_pct=100 * roofline_s * (new_tokens - 1) / new_tokens / decode_s, hbm_tb_s=bw)
            eng = None
        params = None


@section("gen", help="generation alone at the seed run's per-GPU share (128 prompts x 5), paged vs dense engine",
         defaults={"presets": "qwen2p5_7b", "engines": "dense,paged", "repeats": 2},
         per_process=("presets", "engines", "devices"))
def gen(opts):
    generation(opts, "gen")


@section("long", help="generation with a heavy tail of response lengths up to 16,384 (64 prompts x 5)",
         defaults={"presets": "qwen2p5_7b", "engines": "paged", "repeats": 2},
         per_process=("presets", "engines", "devices"))
def long(opts):
    generation(opts, "long")


def generation(opts, section: str):
    for preset in ([opts.small_preset] if opts.small else opts.presets.split(",")):
        for engine in opts.engines.split(","):
            for devices in str(opts.devices).split(","):
                one(preset, engine, section, opts.repeats, opts.attention, opts.max_num_seqs, opts.log_compiles,
                    opts.out, devices=int(devices), shard_work=opts.shard_work, do_profile=bool(opts.profile),
                    prompts=opts.gen_prompts, phase_timing=bool(opts.phase_timing or opts.profile),
                    state_update=opts.state_update)


def workload(prompts_all: list, rep: int, per_gpu: int, n: int, devices: int, shard_work: str, lengths) -> tuple:
    """Repeat `rep`'s prompts and response lengths (`lengths(rows, seed)`) for `devices` GPUs of `per_gpu` prompts
    x `n` each: 'drawn' takes `devices` shares of new prompts and lengths; 'tiled' one share, copied `devices` times
    (the engine's dealer then hands every shard one GPU's groups, up to swaps between groups of equal cost:
    tests/bench/test_gen_workload.py)."""
    draws = devices if shard_work == "drawn" else 1
    k = per_gpu * draws
    prompts = prompts_all[rep * k:(rep + 1) * k]
    return prompts * (devices // draws), np.tile(lengths(k * n, seed=rep), devices // draws)


def one(preset: str, engine: str, section: str, repeats: int, attention: str, max_num_seqs: int,
        log_compiles: bool = False, out_dir: str | None = None, devices: int = 1, shard_work: str = "drawn",
        do_profile: bool = False, prompts: int | None = None, phase_timing: bool = False,
        state_update: str = "in_place", max_new: int | None = None):
    """One preset's generation rows (see the module docstring). `max_new` caps the drawn response lengths (and the
    engine's `max_model_len`): the CPU tests' short form of the workload, whose rows they check, not its speed."""
    import logging

    from jaxrl_llm import sharding
    from jaxrl_llm.models import init_params
    from jaxrl_llm.models.config import PRESETS
    from jaxrl_llm.rollout import DenseJaxEngine, JaxEngine, SamplingParams
    from jaxrl_llm.rollout.page_pool import device_memory

    compiles = CompileSeconds()  # every jax duration event of each repeat: [count, seconds]
    log_handler = None
    if log_compiles:
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
    extra = {"max_position_embeddings": 32768} if preset.startswith("tiny") else {}  # the CPU smoke test
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="bfloat16", **extra)
    params = init_params(cfg, seed=0)
    jax.block_until_ready(params)
    per_gpu, n = (prompts or (128 if section == "gen" else 64)), 5
    prompts_all = gsm8k_prompts(per_gpu * devices * (repeats + 1), vocab_size=cfg.vocab_size)
    cap, max_new = max_new, max_new or (1024 if section == "gen" else 16384)
    mesh = sharding.make_mesh(1, devices, 1, devices=jax.devices()[:devices]) if devices > 1 else None
    if engine == "dense":
        eng = DenseJaxEngine(cfg, params, mesh=mesh, dtype="bfloat16", max_batch_size=4096 * devices,
                             max_prompt_length=512, decode_attention=attention)
    else:
        eng = JaxEngine(cfg, params, mesh=mesh, dtype="bfloat16", max_prompt_length=512, decode_attention=attention,
                        max_num_seqs=max_num_seqs, max_model_len=512 + max_new, phase_timing=phase_timing,
                        state_update=state_update)
    eng.trace = engine == "dense"  # the dense engine counts its row-steps in its phase trace
    params = None
    sp = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new, ignore_eos=True)
    for rep in range(repeats + 1):
        prompts, lens = workload(prompts_all, rep, per_gpu, n, devices, shard_work,
                                 seed_response_lengths if section == "gen" else long_lengths)
        if cap:
            lens = np.minimum(lens, cap)
        compiles.reset()
        if log_handler:
            log_handler.stream.write(f"=== repeat {rep}\n")
        t0 = time.perf_counter()
        try:
            out = eng.generate(prompts, sp.replace(seed=rep), max_new_tokens_per_row=lens)
        except Exception as e:  # noqa: BLE001 (the row records the failure, e.g. out of memory)
            budget = getattr(eng, "_budget", None)
            emit(section=section, preset=preset, engine=engine, devices=devices, shard_work=shard_work, rep=rep,
                 error=f"{type(e).__name__}: {str(e)[:300]}",
                 **({"budget": dataclasses.asdict(budget)} if dataclasses.is_dataclass(budget) else {}))
            program_memory(eng, section)
            return
        dt = time.perf_counter() - t0
        assert np.array_equal(out.lengths, lens)
        mem = device_memory()
        stats = getattr(eng, "last_stats", {})
        row_steps = stats["row_steps"] if engine == "paged" else sum(
            r["rows"] * (r["t1"] - r["t0"]) for r in eng.last_trace if r["phase"] == "decode")
        if rep == 0:
            program_memory(eng, section)
        emit(section=section, preset=preset, engine=engine, devices=devices, shard_work=shard_work,
             attention=eng.decode_attention, rep=rep, state_update=getattr(eng, "state_update", None),
             seconds=round(dt, 3), compile_s=round(compiles.seconds, 3), tokens=int(lens.sum()),
             tokens_per_s=round(float(lens.sum() / dt), 1),
             row_steps_per_token=round(row_steps / lens.sum(), 3) if row_steps else None,
             peak_gb=round(mem[2] / 1e9, 2) if mem else None, limit_gb=round(mem[0] / 1e9, 2) if mem else None,
             budget_gb=round(0.9 * mem[0] / 1e9, 2) if mem and engine == "paged" else None,
             **{f"kv_{k}": v for k, v in stats.items() if k in (
                 "num_pages", "kv_bytes", "preemptions", "segments", "prefill_calls", "shared_pages", "copies",
                 "workspace_bytes", "shard_segments", "shard_seconds", "plan_s", "stolen", "programs_compiled",
                 "programs_moved", "programs_loaded", "state_copies", "state_slots", "slot_cap", "decode_steps",
                 "row_steps", "prefill_tokens")},
             **{k: stats[k] for k in ("phase_s", "phase_calls") if k in stats},
             events={k: [v[0], round(v[1], 3)] for k, v in sorted(compiles.events.items())},
             programs={k: round(v, 2) for k, v in getattr(getattr(eng, "_programs", None), "stats", {}).items()})
    if do_profile:  # the last repeat's work again (its programs warm), traced
        trace.profile(lambda: eng.generate(prompts, sp.replace(seed=repeats), max_new_tokens_per_row=lens),
                      f"{section}_profile", top=25)
        emit(section=f"{section}_profile_phases", preset=preset, engine=engine,
             **{k: getattr(eng, "last_stats", {}).get(k) for k in ("seconds", "phase_s", "phase_calls")})


def program_memory(eng, section: str) -> None:
    """A `<section>_programs` row per program the paged engine's first shard holds: its input's shape and XLA's
    memory analysis (GiB of temporaries, outputs, outputs aliased to donated inputs, arguments), to find a
    program whose memory the budget's workspace estimate does not cover."""
    shard = getattr(eng, "_base", None) if hasattr(eng, "local_shards") else None
    if shard is None:
        return
    gib = lambda b: round(b / 2**30, 3)
    for (name, shape, static), compiled in sorted(shard.programs.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        try:
            m = compiled.memory_analysis()
        except Exception:  # noqa: BLE001 (a backend without the analysis)
            m = None
        if m is None:
            continue
        emit(section=f"{section}_programs", program=name, input_shape=list(shape),
             static={k: v for k, v in static if k != "spec"}, temp_gib=gib(m.temp_size_in_bytes),
             out_gib=gib(m.output_size_in_bytes), alias_gib=gib(m.alias_size_in_bytes),
             args_gib=gib(m.argument_size_in_bytes), workspace_gib=gib(getattr(eng._budget, "workspace", 0)))


@section("seed_gen", help="the seed step's generation on the dense engine, phase by phase, per decode schedule and "
         "attention; then a kernel profile", defaults={"presets": "qwen2p5_7b", "repeats": 3})
def seed_gen(opts):
    from jaxrl_llm.models.config import PRESETS

    preset = opts.small_preset if opts.small else opts.presets.split(",")[0]
    extra = {"vocab_size": 151936, "max_position_embeddings": 2048} if preset == "tiny" else {}
    cfg = PRESETS[preset](dtype="bfloat16", param_dtype="bfloat16", **extra)
    seed_generation(cfg, opts.schedules.split(","), prompts_per_gpu=opts.seed_prompts, repeats=opts.repeats,
                    do_profile=not opts.no_profile, attentions=tuple(opts.attentions.split(",")))


def seed_generation(cfg, schedules: list[str], prompts_per_gpu: int = 128, n: int = 5, repeats: int = 3,
                    do_profile: bool = True, attentions: tuple[str, ...] = ("xla",)):
    """The seed step's generation on one GPU, per decode schedule ("every<K>": look for finished
    rows to drop every K steps; "every0": only when the cache grows) and decode attention ("xla", or
    "pallas": the ragged kernel)."""
    from jaxrl_llm.models import init_params
    from jaxrl_llm.rollout import DenseJaxEngine, SamplingParams

    compiles = CompileSeconds()
    params = init_params(cfg, seed=0)
    # Each repeat takes the next prompts (as each training step does), so its longest prompt differs.
    pool = gsm8k_prompts(prompts_per_gpu * (repeats + 1))
    sp = SamplingParams(n=n, temperature=1.0, max_new_tokens=1024, ignore_eos=True)
    for sched, attn in [(s, a) for s in schedules for a in attentions]:
        eng = DenseJaxEngine(cfg, params, dtype="bfloat16", max_batch_size=4096, max_prompt_length=512,
                        compact_every=int(sched.removeprefix("every")), decode_attention=attn)
        eng.trace = True
        for rep in range(repeats + 1):
            prompts = pool[rep * prompts_per_gpu:(rep + 1) * prompts_per_gpu]
            lens = seed_response_lengths(len(prompts) * n, seed=rep)
            compiles.reset()
            t0 = time.perf_counter()
            out = eng.generate(prompts, sp.replace(seed=rep), max_new_tokens_per_row=lens)
            dt = time.perf_counter() - t0
            assert np.array_equal(out.lengths, lens)
            decode = [r for r in eng.last_trace if r["phase"] == "decode"]
            row_steps = sum(r["rows"] * (r["t1"] - r["t0"]) for r in decode)
            emit(section="seed_gen", schedule=sched, attention=attn, rep=rep, compile_s=compiles.seconds, seconds=dt,
                 tokens=int(lens.sum()), tokens_per_s=float(lens.sum() / dt), row_steps=row_steps,
                 row_step_efficiency=float(lens.sum() / row_steps),
                 by_phase={ph: round(sum(r["seconds"] for r in eng.last_trace if r["phase"] == ph), 3)
                           for ph in ("prefill", "decode", "grow", "compact")})
            if rep == repeats:
                for r in eng.last_trace:
                    ms = r["seconds"] / max(1, r.get("t1", 1) - r.get("t0", 0)) * 1e3
                    emit(section="seed_gen_trace", schedule=sched, attention=attn, ms_per_step=ms, **r)
        if do_profile and sched == schedules[0] and attn == attentions[0]:
            eng.trace = False
            trace_dir = os.path.join("/tmp", "trace_seed")
            jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
            eng.generate(prompts, sp, max_new_tokens_per_row=seed_response_lengths(len(prompts) * n, seed=0))
            jax.profiler.stop_trace()
            trace.summarize_trace(trace_dir, section="seed_profile")
        eng = None
