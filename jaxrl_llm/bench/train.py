"""The training sections: `train` (the actor update at the peers' and the seed's shapes), `e2e` (full GRPO
steps through RLTrainer) and `profile_update` (where the update's GPU time goes, by kernel)."""

from __future__ import annotations

import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import compile_watch
from jaxrl_llm.bench import trace
from jaxrl_llm.bench.harness import (
    CEILINGS,
    TRAINER_MEM_FRACTION,
    CompileSeconds,
    compiled_gb,
    device_gb,
    emit,
    option,
    section,
    timeit,
)
from jaxrl_llm.bench.workload import make_run, seed_response_lengths, synthetic_batch
from jaxrl_llm.trainer.metrics import veRL_flops

option("--fsdp", type=int, help="e2e mesh: fsdp size (-1: the devices left by --tensor)", default=-1)
option("--tensor", type=int, help="e2e mesh: tensor-parallel size", default=1)
option("--steps", type=int, help="e2e: GRPO steps", default=3)
option("--prompts_per_gpu", type=int, help="e2e: prompts a GPU (x5; the seed run: 128)", default=128)
option("--decode_attention", help="e2e: rollout.decode_attention (auto, xla or pallas)", default="auto")
option("--kv_cache", help="e2e: rollout.kv_cache (paged or dense)", default="paged")
option("--base_quantization", help="e2e: model.base_quantization (none, int8, fp8; needs --lora_rank > 0)",
       default="none")
option("--top", type=int, help="profile_update: kernels listed", default=40)
# Issue 40's levers, each on by default (the trainer's defaults) and off by its flag's 0.
option("--tail_shapes", type=int, default=4, help="e2e, profile_update: actor.tail_shapes (the packing's shapes)")
option("--fuse_log_prob_passes", type=int, default=1, help="e2e, profile_update: rollout.fuse_log_prob_passes")
option("--compile_ahead", type=int, default=-1, help="e2e, profile_update: train.compile_ahead (-1: the "
       "trainer's default, on off the CPU)")
option("--mini_batches", type=int, default=4, help="e2e, profile_update: mini-batches a step (1: exactly "
       "on-policy, the old-log-prob pass skipped)")


@section("train", help="fwd+bwd+AdamW at the peers' shapes, and the GRPO actor update at the seed's per-GPU batch",
         defaults={"train_presets": "qwen2p5_0p5b,qwen2p5_1p5b", "remat": "full"}, mem_fraction=TRAINER_MEM_FRACTION)
def train_section(opts):
    small = opts.small
    train([opts.small_preset] if small else opts.train_presets.split(","), small, opts.remat.split(","))


def train(presets, small: bool, remat_list):
    from jaxrl_llm.algorithms import LossNorm
    from jaxrl_llm.trainer.batch import PackShape, build_micro_batch
    from jaxrl_llm.trainer.packing import padded_tokens, plan_packing
    from jaxrl_llm.trainer.roles.worker import TrainerWorker

    peak_meas = CEILINGS["matmul_tflops"] or 790.0  # PEERS.md: 774-787 TFLOP/s on the lent H200
    peer_shapes = {"qwen2p5_0p5b": (32, 512), "qwen2p5_1p5b": (16, 512), "qwen2p5_7b": (16, 512), "tiny": (8, 64)}
    for preset in presets:
        for remat in remat_list:
            # The seed run's per-GPU share: 1024 prompts x 5 over 8 GPUs = 128 prompts x 5 a GPU.
            n_prompts, n = (8, 2) if small else (128, 5)
            budget = 2048 if small else 32768
            run = make_run(preset, prompts=n_prompts, n=n, mini=n_prompts // 4, budget=budget, remat=remat,
                           small=small, max_response=64 if small else 1024, max_prompt=64 if small else 512)
            worker = TrainerWorker(run, total_steps=10)
            cfg = worker.cfg
            # (a) the peers' shape: B x S tokens, one sequence a row, one optimizer step.
            bsz, seq = peer_shapes.get(preset, (8, 64))
            shape = PackShape(rows=bsz, length=seq, max_seqs=bsz, resp_len=seq - 1)
            batch = synthetic_batch(bsz, 1, seq - 1, cfg.vocab_size)
            batch.prompt_ids = [p[:1] for p in batch.prompt_ids]  # 1-token prompt + (seq - 1) response
            batch.response_mask[:] = 1.0
            batch.fields["advantages"] = np.ones_like(batch.response_mask)
            batch.fields["old_log_prob"] = np.zeros_like(batch.response_mask)
            batch.fields["ref_log_prob"] = np.zeros_like(batch.response_mask)
            mb_np = build_micro_batch(batch, [(i, i, 0) for i in range(bsz)], shape,
                                      fields=("old_log_prob", "advantages", "ref_log_prob"))
            with jax.set_mesh(worker.mesh):
                mb = worker._put(mb_np)
                norm = LossNorm(jnp.float32(bsz * (seq - 1)), jnp.float32(bsz), jnp.float32(seq - 1))
                params, frozen = worker.actor_state["params"], worker.actor.frozen
                metrics0 = worker.actor_metrics0(worker.actor.params(), mb, norm)

                def step(w=worker, p=params, mb=mb, norm=norm):
                    m0 = w.actor_metrics0(w.actor.params(), mb, norm)
                    return w.actor_grad(p, w.actor.frozen, w.actor_zeros(p), m0, mb, norm)[0]

                dt_grad = timeit(step, iters=3)
                mem = compiled_gb(worker.actor_grad, params, frozen, worker.actor_zeros(params), metrics0, mb, norm)
            tokens = bsz * seq
            flops = veRL_flops(cfg, np.full(bsz, seq))
            emit(section="train_peer_shape", preset=preset, remat=remat, batch=bsz, seq=seq, fwd_bwd_s=dt_grad,
                 tokens_per_s=tokens / dt_grad, mfu_measured_peak=flops / dt_grad / 1e12 / peak_meas,
                 mfu_989=flops / dt_grad / 1e12 / 989.0, grad_step_gb=mem)
            # (b) the GRPO actor update on the seed's per-GPU batch (packed micro-batches, 4 mini-batches).
            batch = synthetic_batch(n_prompts, n, run.data.max_response_length, cfg.vocab_size,
                                    max_prompt=run.data.max_prompt_length)
            t0 = time.perf_counter()
            lp = worker.compute_log_prob(batch)
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            lp = worker.compute_log_prob(batch)
            t_lp = time.perf_counter() - t0
            batch.fields["old_log_prob"] = lp["old_log_prob"]
            batch.fields["ref_log_prob"] = lp["old_log_prob"]
            seqlens = batch.prompt_lengths + batch.response_lengths
            fwd_flops = veRL_flops(cfg, seqlens) / 3  # forward only: 2 of the 6
            emit(section="logprob_pass", preset=preset, remat=remat, sequences=len(batch),
                 tokens=int(seqlens.sum()), seconds=t_lp, first_call_s=t_first, tokens_per_s=seqlens.sum() / t_lp,
                 mfu_measured_peak=fwd_flops / t_lp / 1e12 / peak_meas, mfu_989=fwd_flops / t_lp / 1e12 / 989.0)
            worker.update_actor(batch, 0)  # compile
            t0 = time.perf_counter()
            metrics = worker.update_actor(batch, 1)
            jax.block_until_ready(worker.actor_state["params"])
            t_up = time.perf_counter() - t0
            flops = veRL_flops(cfg, seqlens)
            plans = [p for idx in np.array_split(np.arange(len(batch)), 4)  # the 4 mini-batches
                     for p in plan_packing(seqlens[idx], worker.pack_ladder, worker.dp)]
            fill = seqlens.sum() / padded_tokens(plans)
            emit(section="train_grpo_update", preset=preset, remat=remat, sequences=len(batch),
                 tokens=int(seqlens.sum()), micro_batches=len(plans), pack_fill=float(fill), seconds=t_up,
                 tokens_per_s=seqlens.sum() / t_up, mfu_measured_peak=flops / t_up / 1e12 / peak_meas,
                 mfu_989=flops / t_up / 1e12 / 989.0, grad_norm=metrics["actor/grad_norm"], device_peak_gb=device_gb())
            worker = params = None  # free the device memory before the next model


@section("e2e", help="full GRPO steps (the seed's shape a GPU) through RLTrainer: time a phase, tokens/s/GPU, MFU",
         defaults={"train_presets": "qwen2p5_0p5b,qwen2p5_1p5b", "remat": "full", "token_budget": 32768,
                   "lora_rank": 0, "lora_alpha": 64.0}, mem_fraction=TRAINER_MEM_FRACTION)
def e2e_section(opts):
    e2e([opts.small_preset] if opts.small else opts.train_presets.split(","), opts.small, opts.steps, opts.fsdp,
        opts.tensor, opts.remat.split(",")[0], opts.token_budget, opts.decode_attention, opts.kv_cache,
        opts.lora_rank, opts.lora_alpha, opts.base_quantization, opts.prompts_per_gpu, levers(opts),
        opts.mini_batches)


def levers(opts) -> dict:
    """make_run's settings of issue 40's levers from the options."""
    return dict(tail_shapes=opts.tail_shapes, fuse_log_prob_passes=bool(opts.fuse_log_prob_passes),
                compile_ahead=None if opts.compile_ahead < 0 else bool(opts.compile_ahead))


def e2e(presets, small: bool, steps: int = 3, fsdp: int = -1, tensor: int = 1, remat: str = "full",
        budget: int = 32768, decode_attention: str = "auto", kv_cache: str = "paged", lora_rank: int = 0,
        lora_alpha: float = 64.0, base_quantization: str = "none", prompts_per_gpu: int = 128,
        lever_settings: dict | None = None, mini_batches: int = 4):
    from jaxrl_llm.trainer.loop import RLTrainer
    from jaxrl_llm.trainer.roles.handles import traced
    from jaxrl_llm.trainer.roles.protocols import WorkerRole

    for preset in presets:
        # The seed run's per-GPU share (128 prompts x 5, or `prompts_per_gpu` x 5) times the devices in the mesh.
        n_dev = jax.device_count() if fsdp == -1 else fsdp * tensor
        n_prompts, n = (8 * n_dev, 2) if small else (prompts_per_gpu * n_dev, 5)
        run = make_run(preset, prompts=n_prompts, n=n, mini=n_prompts // mini_batches,
                       budget=2048 if small else budget,
                       remat=remat, small=small, max_response=64 if small else 1024, max_prompt=64 if small else 512,
                       run_dir=tempfile.mkdtemp(), fsdp=fsdp, tensor=tensor,
                       max_batch=4096 * n_dev, decode_attention=decode_attention, kv_cache=kv_cache,
                       lora_rank=lora_rank, lora_alpha=lora_alpha, base_quantization=base_quantization,
                       ignore_eos=True,  # rows run to the seed's drawn lengths (`capped`), as built ahead
                       **(lever_settings or {}))
        t_init, before = time.perf_counter(), compile_watch.totals()
        with CompileSeconds() as building:  # where a cold build goes (the 9B's took 259 s on an H100)
            trainer = RLTrainer(run)
        build_s = time.perf_counter() - t_init
        if jax.process_index() == 0:
            print(f"  RLTrainer built in {build_s:.1f}s", flush=True)
        after = compile_watch.totals()
        emit(section="e2e_build", preset=preset, lora_rank=lora_rank, seconds=build_s,
             **{k: after[k] - before[k] for k in after}, slowest=building.slowest(8))
        engine = trainer.engine  # the engine role: its generate caps each row at a drawn length
        generate = engine.generate
        draws = iter(range(1000))

        def capped(prompts, sampling, generate=generate, draws=draws, max_new_tokens_per_row=None, **kw):
            lens = seed_response_lengths(len(prompts) * sampling.n, seed=next(draws))
            if max_new_tokens_per_row is not None:  # the worker's own per-row caps (agent turns) still bind
                lens = np.minimum(lens, max_new_tokens_per_row)
            return generate(prompts, sampling, max_new_tokens_per_row=lens, **kw)

        engine.generate = capped

        def progress(method: str, seconds: float) -> None:  # on stdout: where a slow step is
            if jax.process_index() == 0 and method not in ("forward_passes_ready",):
                print(f"  [{time.strftime('%H:%M:%S')}] {method} {seconds:.1f}s", flush=True)

        trainer.worker = traced(trainer.worker, WorkerRole, progress)
        for row in trainer.worker.memory_rows():  # XLA's account of the step's programs, per device
            emit(section="e2e_memory", preset=preset, lora_rank=lora_rank, **row)
        settled = trainer.worker.describe()
        with CompileSeconds() as compiles:
            for step in range(steps):
                compiles.reset()
                t0 = time.perf_counter()
                m = trainer.train_step(next(trainer.iterator), step)
                wall = time.perf_counter() - t0
                keep = {k: v for k, v in m.items() if k.startswith(("timing_s/", "perf/")) or k in (
                    "response_length/mean", "response_length/max", "prompt_length/mean", "actor/grad_norm",
                    "actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/score/mean")}
                mesh = "x".join(f"{k}{v}" for k, v in settled["mesh"].items() if v > 1) or "1"
                pool = {f"kv/{k}": v for k, v in engine.stats().items()
                        if k in ("num_pages", "kv_bytes", "preemptions", "row_steps", "tokens", "budget_source")}
                emit(section="e2e", preset=preset, mesh=mesh, remat=remat, remat_used=settled["remat"],
                     **(lever_settings or {}), mini_batches=mini_batches,
                     fused=settled["fused"], on_policy=settled["on_policy"],
                     lora_rank=lora_rank, base_quantization=base_quantization,
                     decode_attention=decode_attention, step=step,
                     kv_cache=kv_cache, device_peak_gb=device_gb(), **pool, devices=n_dev,
                     processes=jax.process_count(), wall_s=wall, compile_s=compiles.seconds,
                     compiled=compiles.slowest(), prompts=n_prompts, n=n, budget=budget, **keep)


@section("profile_update", help="a kernel profile of one GRPO actor update at the seed's shape (and of the log-prob "
         "pass), top kernels and totals by kind", defaults={"train_presets": "qwen2p5_1p5b", "remat": "auto",
                                                            "token_budget": 16384, "lora_rank": 0,
                                                            "lora_alpha": 64.0}, mem_fraction=TRAINER_MEM_FRACTION)
def profile_update(opts):
    """Builds the trainer's worker (mesh, remat, token budget and levers as given; `auto` is the trainer's
    default), makes a synthetic seed-shaped batch (`--prompts_per_gpu` x 5 a device, the seed's response
    lengths), runs the log-prob passes (old and reference, fused where on) and two updates (the first compiles
    what the worker did not build ahead), times the second of each, then traces one more of each and sorts the
    trace's time into matmul, attention, collectives (exposed, overlapped), elementwise and norms, the
    optimizer and the gaps between kernels (`trace.sort_trace`)."""
    from jaxrl_llm.trainer.roles.worker import TrainerWorker

    preset = "tiny" if opts.small else opts.train_presets.split(",")[0]
    n_dev = jax.device_count() if opts.fsdp == -1 else opts.fsdp * opts.tensor
    n_prompts, n, max_resp = (8 * n_dev, 2, 64) if opts.small else (opts.prompts_per_gpu * n_dev, 5, 1024)
    budget = 2048 if opts.small else opts.token_budget
    run = make_run(preset, prompts=n_prompts, n=n, mini=n_prompts // opts.mini_batches, budget=budget,
                   remat=opts.remat, small=opts.small, max_response=max_resp, max_prompt=64 if opts.small else 512,
                   fsdp=opts.fsdp, tensor=opts.tensor, lora_rank=opts.lora_rank, lora_alpha=opts.lora_alpha,
                   **levers(opts))
    worker = TrainerWorker(run, total_steps=10)
    batch = synthetic_batch(n_prompts, n, max_resp, worker.cfg.vocab_size, max_prompt=run.data.max_prompt_length)
    passes = dict(old=worker.needs_old_log_prob(), ref=worker.needs_ref)
    seqlens = batch.prompt_lengths + batch.response_lengths
    flops = veRL_flops(worker.cfg, seqlens)
    lp = worker._forward(batch, **passes)
    t0 = time.perf_counter()
    lp = worker._forward(batch, **passes)
    t_lp = time.perf_counter() - t0
    fwd_flops = flops / 3 * sum(passes.values())
    emit(section="log_prob_pass", preset=preset, remat=worker.cfg.remat, devices=n_dev, lora_rank=opts.lora_rank,
         **passes,
         fused=worker.run.rollout.fuse_log_prob_passes, budget=worker.fwd_pack.rows * worker.fwd_pack.length // n_dev,
         tokens=int(seqlens.sum()), seconds=t_lp, mfu_989=fwd_flops / t_lp / 1e12 / 989.0 / n_dev,
         **worker.pack_metrics())
    batch.fields.update(lp)
    worker.update_actor(batch, 0)  # compiles what the worker did not build ahead
    t0 = time.perf_counter()
    metrics = worker.update_actor(batch, 1)
    jax.block_until_ready(worker.actor_state["params"])
    t_up = time.perf_counter() - t0
    emit(section="update", preset=preset, remat=worker.cfg.remat, devices=n_dev, lora_rank=opts.lora_rank,
         budget=run.actor.ppo_max_token_len_per_gpu, tokens=int(seqlens.sum()), seconds=t_up,
         mfu_989=flops / t_up / 1e12 / 989.0 / n_dev, grad_norm=metrics["actor/grad_norm"], peak_gb=device_gb(),
         pack_rows=worker.pack.rows, pack_length=worker.pack.length, **worker.pack_metrics())

    def update():
        worker.update_actor(batch, 2)
        jax.block_until_ready(worker.actor_state["params"])

    trace.profile(update, "update", opts.top)
    trace.profile(lambda: worker._forward(batch, **passes), "log_prob", opts.top)
