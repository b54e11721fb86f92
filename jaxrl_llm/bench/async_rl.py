"""`async_longtail`: asynchronous training against the synchronous colocated step (issue 30's acceptance), on a
long-tailed, DAPO-style workload, one mode after the other on the same devices and the same response lengths.

  python -m jaxrl_llm.bench --sections async_longtail [--train_presets qwen2p5_1p5b] [--rollout_gpus 2]
                            [--async_modes sync,one_step_off,fully_async] [--long_cap 8192] [--steps 6]
  python -m jaxrl_llm.bench.async_rl A/rows.jsonl B/rows.jsonl   # the summary over modes run in several calls
  XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
      python -m jaxrl_llm.bench --sections async_longtail --small     # the tiny preset on the demo's task, on CPU

Each mode trains `--steps` GRPO steps of `--prompts_per_gpu` x the machine's devices prompts x 5 responses (the
same share whatever the split, so samples a second compare), token-mean loss and DAPO's clip-higher (0.28).
Response lengths are drawn once from a heavy tail (most a few hundred tokens, a few past --long_cap / 2, some at
the cap), or with `--async_lengths seed` from the seed run's GSM8K shape (mean 232, at most 1,024), and handed out
in the same order to every mode, with EOS off so every row runs to its length.

  sync          RLTrainer on every device (the engine colocated with the trainer)
  one_step_off  --rollout_gpus devices generate batch k + 1 while the others train on batch k
  fully_async   the same split, a rollout stream with partial rollouts (K/V recomputed at a swap), staleness
                --staleness, a sync every half step (trigger_parameter_sync_step 2)

A row a step (wall, samples/s, the trainer's wait for rollouts and its share of the step, staleness, partial
ratio, compile seconds), then a summary a mode over the steps from 2 on: median samples/s, its ratio to sync's
(only where both modes have such steps), and the wait share. Targets (issue 30, 4 GPUs): one_step_off >= 1.25x,
fully_async >= 1.6x, wait <= 15%.
"""

from __future__ import annotations

import dataclasses
import gc
import tempfile
import time

import jax
import numpy as np

from jaxrl_llm.bench.harness import TRAINER_MEM_FRACTION, CompileSeconds, emit, option, section
from jaxrl_llm.bench.workload import SEED_RESPONSE_MAX, long_lengths, make_run, seed_response_lengths

option("--async_modes", default="sync,one_step_off,fully_async",
       help="async_longtail: the modes, one after the other (sync, one_step_off, fully_async)")
option("--rollout_gpus", type=int, help="async_longtail: devices of the rollout mesh in the async modes (default half)")
option("--train_gpus", type=int, help="async_longtail: devices of the training mesh in the async modes (default the "
       "rest); sync runs on train + rollout devices")
option("--long_cap", type=int, default=8192, help="async_longtail: the longest response (the heavy tail's cap)")
option("--async_lengths", default="long", choices=("long", "seed"),
       help="async_longtail: response lengths from the heavy tail (long, up to --long_cap) or the seed run's GSM8K "
            "shape (seed: lognormal, mean 232, at most 1,024)")
option("--staleness", type=float, default=0.5, help="async_longtail: fully_async's async_training.staleness_threshold")
MODES = ("sync", "one_step_off", "fully_async")


@section("async_longtail", help="one_step_off and fully_async against the synchronous colocated step on a long tail",
         defaults={"train_presets": "qwen2p5_1p5b", "steps": 6, "prompts_per_gpu": 16, "token_budget": 32768,
                   "remat": "full"}, mem_fraction=TRAINER_MEM_FRACTION)
def async_longtail(opts):
    modes = opts.async_modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        raise ValueError(f"--async_modes: {bad} unknown; use any of {', '.join(MODES)}")
    rollout, train = plan_devices(opts.rollout_gpus, opts.train_gpus, jax.device_count())
    n_dev = rollout + train
    rows = []
    for preset in [opts.small_preset] if opts.small else opts.train_presets.split(","):
        for mode in modes:
            rows += run_mode(opts, preset, mode, n_dev, rollout)
            (mine,) = [r for r in summarize(rows) if (r["preset"], r["mode"]) == (preset, mode)]
            emit(**mine)


STEADY_FROM = 2  # the steps a summary counts: from this one on (step 0 compiles; step 1 can still load programs)


def summarize(rows: list[dict]) -> list[dict]:
    """A summary row per (preset, lengths, devices, mode) of `async_longtail` step rows, of one run or of several
    (a mode a process: at cap 8,192 one mode takes about a 10-minute call): the median over the steady steps (from
    STEADY_FROM on) of samples/s, wall and wait share, and samples/s against sync's of the same preset, lengths
    and devices. A mode with no steady step gets no figures, and no ratio is computed unless both modes have
    steady steps: a compiling step 0 against a steady step is no comparison. `note` says what is missing."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("section") == "async_longtail":
            groups.setdefault((r["preset"], r.get("lengths", "long"), r["devices"], r["mode"]), []).append(r)
    steady = {key: [r for r in rs if r["step"] >= STEADY_FROM] for key, rs in groups.items()}
    rate = {key: float(np.median([r["samples_per_s"] for r in rs])) for key, rs in steady.items() if rs}
    out = []
    for key, rs in steady.items():
        preset, lengths, devices, mode = key
        sync_key = (preset, lengths, devices, "sync")
        row = dict(section="async_longtail_summary", preset=preset, mode=mode, lengths=lengths,
                   rollout_gpus=groups[key][0]["rollout_gpus"], devices=devices, steps=len(groups[key]),
                   steady_steps=len(rs), samples_per_s=rate.get(key), vs_sync=None, wait_share=None, wall_s=None)
        if rs:
            row.update(wait_share=float(np.median([r["wait_share"] for r in rs])),
                       wall_s=float(np.median([r["wall_s"] for r in rs])))
        if not rs:
            row["note"] = f"no steady step (steps from {STEADY_FROM} on): run --steps {STEADY_FROM + 1} or more"
        elif sync_key not in groups:
            row["note"] = "no sync run of this preset, lengths and devices to compare with"
        elif sync_key not in rate:
            row["note"] = f"vs_sync needs steady steps in both modes; sync has none (steps from {STEADY_FROM} on)"
        else:
            row["vs_sync"] = rate[key] / rate[sync_key]
        out.append(row)
    return out


def plan_devices(rollout: int | None, train: int | None, n_all: int) -> tuple[int, int]:
    """(rollout, training) devices: the options, else half the machine each; one ValueError if they cannot fit."""
    rollout = rollout or n_all // 2
    train = train or n_all - rollout
    if not (rollout >= 1 and train >= 1 and rollout + train <= n_all):
        raise ValueError(f"--rollout_gpus {rollout} --train_gpus {train}: need at least one each, and at most the "
                         f"{n_all} devices of this machine together")
    return rollout, train


def _run_config(opts, preset: str, mode: str, n_dev: int, rollout: int):
    from jaxrl_llm.trainer.config.async_training import AsyncConfig

    n = 2 if opts.small else 5
    prompts = (4 if opts.small else opts.prompts_per_gpu) * n_dev
    cap = 64 if opts.small else opts.long_cap if opts.async_lengths == "long" else SEED_RESPONSE_MAX
    run = make_run(preset, prompts=prompts, n=n, mini=prompts // 2, budget=2048 if opts.small else opts.token_budget,
                   remat=opts.remat.split(",")[0], small=opts.small, max_response=cap,
                   max_prompt=64 if opts.small else 512, run_dir=tempfile.mkdtemp(),
                   max_batch=4096 * n_dev, fsdp=n_dev if mode == "sync" else -1,
                   # the run's own length: one_step_off generates no batch past its last step, so a shorter run
                   # would turn the steps after it synchronous (generate, then train)
                   total_steps=opts.steps, ignore_eos=True)
    run = dataclasses.replace(run, actor=dataclasses.replace(run.actor, loss_agg_mode="token-mean",
                                                             clip_ratio_high=0.28))
    if opts.small:  # the CPU check on the demo's task and vocabulary (gin/grpo_tiny.gin): Qwen2's 151,936 ids made the
        # tiny model's logits and their sampling the whole cost (16 rows of up to 64 tokens decoded in 25 s on 2 cores)
        run = dataclasses.replace(run, model=dataclasses.replace(run.model, overrides={"vocab_size": 16}),
                                  data=dataclasses.replace(run.data, source="arithmetic", train_files=()))
    if mode != "sync":
        fully = mode == "fully_async"
        run = dataclasses.replace(
            run, async_training=AsyncConfig(mode=mode, staleness_threshold=opts.staleness if fully else 0.0,
                                            partial_rollout=fully, trigger_parameter_sync_step=2 if fully else 1),
            rollout=dataclasses.replace(run.rollout, n_gpus_per_node=rollout),
            trainer=dataclasses.replace(run.trainer, n_gpus_per_node=n_dev - rollout))
    return run.validate(), prompts * n, cap


def _capped_lengths(opts, count: int, cap: int):
    """The same response lengths, in the same order, for every mode: a pool drawn once, handed out in turn."""
    if opts.async_lengths == "seed":
        pool = seed_response_lengths(count, seed=0)
    else:
        pool = long_lengths(count, seed=0, cap=opts.long_cap)
    if opts.small:  # the same shape, scaled down to the tiny run's cap
        pool = np.clip(pool // 32, 2, cap)
    state = {"at": 0}

    def take(k: int) -> np.ndarray:
        i = state["at"] % len(pool)
        state["at"] += k
        return np.resize(np.roll(pool, -i), k)

    return take


def run_mode(opts, preset: str, mode: str, n_dev: int, rollout: int) -> list[dict]:
    from jaxrl_llm.rollout.stream import RolloutStream
    from jaxrl_llm.trainer.loop import RLTrainer

    run, samples, cap = _run_config(opts, preset, mode, n_dev, rollout)
    take = _capped_lengths(opts, samples * (opts.steps + 4), cap)
    t0 = time.perf_counter()
    trainer = RLTrainer(run)  # the mode's rollouter: async_training.mode
    print(f"  {mode}: trainer built in {time.perf_counter() - t0:.1f}s", flush=True)
    engine = trainer.engine  # the engine role: the rollouters generate through it
    generate, submit = engine.generate, RolloutStream.submit

    def capped_generate(prompts, sampling, max_new_tokens_per_row=None, **kw):
        lens = take(len(prompts) * sampling.n)
        return generate(prompts, sampling.replace(ignore_eos=True), max_new_tokens_per_row=lens, **kw)

    def capped_submit(stream, prompts, metas, *, max_new_tokens_per_row=None, partial=None, **kw):
        if partial is None:  # a resumed row keeps its budget
            max_new_tokens_per_row = take(len(prompts) * stream.n)
        return submit(stream, prompts, metas, max_new_tokens_per_row=max_new_tokens_per_row, partial=partial, **kw)

    sampling = trainer.sampling  # EOS off for the stream too (it takes its sampling from here)
    trainer.sampling = lambda *a, **kw: sampling(*a, **kw).replace(ignore_eos=True)
    engine.generate = capped_generate
    RolloutStream.submit = capped_submit
    rows = []
    try:
        with CompileSeconds() as compiles:
            for step in range(opts.steps):
                compiles.reset()
                t0 = time.perf_counter()
                m = trainer.step(step)
                trainer.global_step = step + 1
                wall = time.perf_counter() - t0
                wait = m.get("timing_s/wait_prev_gen", m.get("timing_s/gen", 0.0))
                rows.append(emit(
                    section="async_longtail", preset=preset, mode=mode, lengths=opts.async_lengths, step=step,
                    devices=n_dev,
                    rollout_gpus=rollout if mode != "sync" else 0, samples=samples, wall_s=wall,
                    samples_per_s=samples / wall, tokens_per_s=m.get("perf/total_num_tokens", 0.0) / wall,
                    wait_s=wait, wait_share=wait / wall, compile_s=compiles.seconds, compiled=compiles.slowest(),
                    response_mean=m.get("response_length/mean"), response_max=m.get("response_length/max"),
                    staleness_max=m.get("fully_async/staleness/max"),
                    partial_ratio=m.get("fully_async/partial/partial_ratio"), sync_s=m.get("timing_s/sync"),
                    rollout_idle=m.get("rollouter/idle_ratio")))
    finally:
        RolloutStream.submit = submit
        del engine.generate  # the instance attribute (a closure over the engine) goes; the class method is back
        trainer.close()
        del trainer, engine
        gc.collect()  # the next mode's engine sizes its KV pool from the memory free now
    return rows


if __name__ == "__main__":  # python -m jaxrl_llm.bench.async_rl ROWS.jsonl ...: the summary over several runs' rows
    import json
    import sys

    for row in summarize([json.loads(line) for path in sys.argv[1:] for line in open(path) if line.strip()]):
        print(json.dumps(row))
