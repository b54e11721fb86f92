"""Where the GRPO actor update's GPU time goes: a kernel profile of one update at the seed's shape.

  python scripts/profile_update.py --preset qwen2p5_1p5b --out $OUT/update_profile.jsonl

Builds the trainer's worker on one device (remat and token budget as given; `auto` is the trainer's
default), makes a synthetic seed-shaped batch (128 prompts x 5, the seed's response lengths), runs the
old-log-prob pass and two updates (compile, then timed), traces a third update and the log-prob pass
with `jax.profiler`, and prints the top kernels and their totals by kind (GEMM, attention, other
fusions, copies): JSON rows, also appended to --out. `--small` runs the tiny preset (a CPU smoke test).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import scripts.bench_decode as bd  # noqa: E402
from jaxrl_llm.trainer.metrics import veRL_flops  # noqa: E402
from scripts.bench import make_run, synthetic_batch  # noqa: E402

KINDS = (  # first match wins (cuDNN's attention kernels also say wgmma); XLA's / cuBLAS's / cuDNN's names
    ("attention", ("fmha", "flash", "sdpa", "cudnn", "attn")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "wgmma", "triton_gemm", "dot")),
    ("copy / transpose", ("copy", "transpose", "memcpy", "memset")),
    ("reduce / collective", ("reduce", "all-gather", "nccl")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other fusions"


def profile(fn, label: str, top: int):
    trace_dir = os.path.join("/tmp", f"trace_{label}")
    shutil.rmtree(trace_dir, ignore_errors=True)  # an earlier run's trace would be read instead
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    jax.profiler.stop_trace()
    kernels = bd.summarize_trace(trace_dir, top=top, section=label)
    by_kind: dict[str, float] = {}
    for r in kernels:
        by_kind[kind_of(r["name"])] = by_kind.get(kind_of(r["name"]), 0.0) + r["total_ms"]
    bd.emit(section=f"{label}_by_kind", wall_s=wall, top=top, **{k: round(v, 1) for k, v in by_kind.items()})



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2p5_1p5b")
    ap.add_argument("--remat", default="auto")
    ap.add_argument("--token_budget", type=int, default=16384)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default=None)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    bd.OUT_FILE = args.out
    from jaxrl_llm.trainer.worker import TrainerWorker

    preset = "tiny" if args.small else args.preset
    n_prompts, n, max_resp = (8, 2, 64) if args.small else (128, 5, 1024)
    budget = 2048 if args.small else args.token_budget
    run = make_run(preset, prompts=n_prompts, n=n, mini=n_prompts // 4, budget=budget, remat=args.remat,
                   small=args.small, max_response=max_resp, max_prompt=64 if args.small else 512)
    worker = TrainerWorker(run, total_steps=10)
    batch = synthetic_batch(n_prompts, n, max_resp, worker.cfg.vocab_size, max_prompt=run.data.max_prompt_length)
    lp = worker.compute_log_prob(batch)
    batch.fields["old_log_prob"] = lp["old_log_prob"]
    batch.fields["ref_log_prob"] = lp["old_log_prob"]
    worker.update_actor(batch, 0)  # compile
    t0 = time.perf_counter()
    metrics = worker.update_actor(batch, 1)
    jax.block_until_ready(worker.actor_state["params"])
    t_up = time.perf_counter() - t0
    seqlens = batch.prompt_lengths + batch.response_lengths
    flops = veRL_flops(worker.cfg, seqlens)
    bd.emit(section="update", preset=preset, remat=worker.cfg.remat, budget=run.actor.ppo_max_token_len_per_gpu,
                   tokens=int(seqlens.sum()), seconds=t_up, mfu_989=flops / t_up / 1e12 / 989.0,
                   grad_norm=metrics["actor/grad_norm"], peak_gb=(jax.devices()[0].memory_stats() or {}).get(
                       "peak_bytes_in_use", 0) / 1e9,
                   pack_rows=worker.pack.rows, pack_length=worker.pack.length)

    def update():
        worker.update_actor(batch, 2)
        jax.block_until_ready(worker.actor_state["params"])

    profile(update, "update", args.top)
    profile(lambda: worker.compute_log_prob(batch), "log_prob", args.top)


if __name__ == "__main__":
    main()
