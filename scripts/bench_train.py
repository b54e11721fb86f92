"""The training sections of scripts/bench.py: `train` (the actor update at the peers' and the seed's
shapes) and `e2e` (full GRPO steps through RLTrainer), and the run config and synthetic batch they share."""

from __future__ import annotations

import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.trainer.metrics import veRL_flops
from scripts.bench_common import (
    ATTENTION,
    CEILINGS,
    compiled_gb,
    data_dir,
    device_gb,
    emit,
    gsm8k_prompts,
    seed_response_lengths,
    timeit,
)


def make_run(preset: str, *, prompts: int, n: int, mini: int, budget: int, remat: str, fsdp: int = -1, tensor: int = 1,
             max_response: int = 1024, max_prompt: int = 512, small: bool = False, run_dir: str = "/tmp/bench_run",
             max_batch: int = 4096, decode_attention: str = "auto", kv_cache: str = "paged", lora_rank: int = 0,
             lora_alpha: float = 64.0, base_quantization: str = "none"):
    from jaxrl_llm.models.config import PRESETS
    from jaxrl_llm.trainer import config as C

    d = data_dir()
    return C.RunConfig(
        model=C.ModelConfig(preset=preset, tokenizer_path=os.path.join(d, "qwen2_tokenizer"),
                            dtype="float32" if small else "bfloat16", param_dtype="float32", remat=remat,
                            attention_impl=ATTENTION["impl"],
                            # Qwen2 token ids: a model of a smaller vocabulary (Llama 3) gets Qwen2's, so the
                            # real prompts stay in range (+2-4% parameters at Llama's shapes)
                            overrides={"vocab_size": 151936} if small or PRESETS[preset]().vocab_size < 151936
                            else None,
                            # LoRA on every linear layer (rank 0: full fine-tuning), at 10x the learning rate
                            lora_rank=lora_rank, lora_alpha=lora_alpha, base_quantization=base_quantization),
        data=C.DataConfig(source="files", train_files=(os.path.join(d, "gsm8k_test.jsonl"),),
                          train_batch_size=prompts, max_prompt_length=max_prompt, max_response_length=max_response),
        rollout=C.RolloutConfig(n=n, temperature=1.0, max_batch_size=max_batch, decode_attention=decode_attention,
                                kv_cache=kv_cache),
        actor=C.ActorConfig(lr=1e-5 if lora_rank else 1e-6, ppo_mini_batch_size=mini,
                            ppo_max_token_len_per_gpu=budget, use_kl_loss=True,
                            kl_loss_coef=0.001, kl_loss_type="low_var_kl"),
        critic=C.CriticConfig(), algo=C.AlgoConfig(adv_estimator="grpo"), reward=C.RewardConfig(),
        trainer=C.TrainerConfig(run_dir=run_dir, logger=("jsonl",), driver="inprocess", mesh_fsdp=fsdp,
                                mesh_tensor=tensor,
                                progress_bar=False, total_training_steps=3)).validate()


def synthetic_batch(n_prompts: int, n: int, max_response: int, vocab: int, seed: int = 0, max_prompt: int = 512):
    """GSM8K prompts with random responses of the seed's lengths and random advantages."""
    from jaxrl_llm.trainer.batch import TrainBatch

    prompts = [p[-max_prompt:] for p in gsm8k_prompts(n_prompts)]
    r = n_prompts * n
    lens = np.minimum(seed_response_lengths(r, seed), max_response)
    rng = np.random.default_rng(seed)
    responses = rng.integers(0, min(vocab, 150000), size=(r, max_response)).astype(np.int32)
    mask = (np.arange(max_response)[None] < lens[:, None]).astype(np.float32)
    prompt_ids = [np.asarray(prompts[i // n], np.int32) for i in range(r)]
    b = TrainBatch(prompt_ids=prompt_ids, responses=responses * mask.astype(np.int32), response_mask=mask,
                   group_ids=np.repeat(np.arange(n_prompts), n).astype(np.int32))
    b.fields["advantages"] = (rng.standard_normal((r, 1)) * mask).astype(np.float32)
    return b


def train(presets, small: bool, remat_list):
    from jaxrl_llm.algorithms import LossNorm
    from jaxrl_llm.trainer.batch import PackShape, build_micro_batch, plan_micro_batches
    from jaxrl_llm.trainer.worker import TrainerWorker

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
            plans = plan_micro_batches(seqlens, worker.pack)
            fill = seqlens.sum() / (len(plans) * worker.pack.rows * worker.pack.length)
            emit(section="train_grpo_update", preset=preset, remat=remat, sequences=len(batch),
                 tokens=int(seqlens.sum()), micro_batches=len(plans), pack_fill=float(fill), seconds=t_up,
                 tokens_per_s=seqlens.sum() / t_up, mfu_measured_peak=flops / t_up / 1e12 / peak_meas,
                 mfu_989=flops / t_up / 1e12 / 989.0, grad_norm=metrics["actor/grad_norm"], device_peak_gb=device_gb())
            worker = params = None  # free the device memory before the next model


def e2e(presets, small: bool, steps: int = 3, fsdp: int = -1, tensor: int = 1, remat: str = "full",
        budget: int = 32768, decode_attention: str = "auto", kv_cache: str = "paged", lora_rank: int = 0,
        lora_alpha: float = 64.0, base_quantization: str = "none", prompts_per_gpu: int = 128):
    from jaxrl_llm.trainer.loop import RLTrainer

    for preset in presets:
        # The seed run's per-GPU share (128 prompts x 5, or `prompts_per_gpu` x 5) times the devices in the mesh.
        n_dev = jax.device_count() if fsdp == -1 else fsdp * tensor
        n_prompts, n = (8 * n_dev, 2) if small else (prompts_per_gpu * n_dev, 5)
        run = make_run(preset, prompts=n_prompts, n=n, mini=n_prompts // 4, budget=2048 if small else budget,
                       remat=remat, small=small, max_response=64 if small else 1024, max_prompt=64 if small else 512,
                       run_dir=tempfile.mkdtemp(), fsdp=fsdp, tensor=tensor,
                       max_batch=4096 * n_dev, decode_attention=decode_attention, kv_cache=kv_cache,
                       lora_rank=lora_rank, lora_alpha=lora_alpha, base_quantization=base_quantization)
        t_init = time.perf_counter()
        trainer = RLTrainer(run)
        if jax.process_index() == 0:
            print(f"  RLTrainer built in {time.perf_counter() - t_init:.1f}s", flush=True)
        engine = trainer.worker.obj.engine
        generate = engine.generate
        draws = iter(range(1000))

        def capped(prompts, sampling, generate=generate, draws=draws, max_new_tokens_per_row=None, **kw):
            lens = seed_response_lengths(len(prompts) * sampling.n, seed=next(draws))
            if max_new_tokens_per_row is not None:  # the worker's own per-row caps (agent turns) still bind
                lens = np.minimum(lens, max_new_tokens_per_row)
            return generate(prompts, sampling.replace(ignore_eos=True), max_new_tokens_per_row=lens, **kw)

        engine.generate = capped
        role_call = trainer.worker.call

        def traced_call(method, *a, role_call=role_call, **kw):  # progress on stdout: where a slow step is
            t = time.perf_counter()
            out = role_call(method, *a, **kw)
            if jax.process_index() == 0 and method not in ("forward_passes_ready",):
                print(f"  [{time.strftime('%H:%M:%S')}] {method} {time.perf_counter() - t:.1f}s", flush=True)
            return out

        trainer.worker.call = traced_call
        compile_s = [0.0]

        def on_duration(event, duration, compile_s=compile_s, **_):
            if event.endswith("backend_compile_duration"):
                compile_s[0] += duration

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        for step in range(steps):
            compile_s[0] = 0.0
            t0 = time.perf_counter()
            m = trainer.train_step(next(trainer.iterator), step)
            wall = time.perf_counter() - t0
            keep = {k: v for k, v in m.items() if k.startswith(("timing_s/", "perf/")) or k in (
                "response_length/mean", "response_length/max", "prompt_length/mean", "actor/grad_norm", "actor/pg_loss",
                "actor/kl_loss", "actor/entropy", "critic/score/mean")}
            mesh = "x".join(f"{k}{v}" for k, v in trainer.worker.obj.mesh.shape.items() if v > 1) or "1"
            pool = {f"kv/{k}": v for k, v in getattr(engine, "last_stats", {}).items()
                    if k in ("num_pages", "kv_bytes", "preemptions", "row_steps", "tokens", "budget_source")}
            emit(section="e2e", preset=preset, mesh=mesh, remat=remat, lora_rank=lora_rank,
                 base_quantization=base_quantization,
                 decode_attention=decode_attention, step=step,
                 kv_cache=kv_cache, device_peak_gb=device_gb(), **pool, devices=n_dev,
                 processes=jax.process_count(), wall_s=wall, compile_s=compile_s[0], prompts=n_prompts, n=n,
                 budget=budget, **keep)
        jax.monitoring.unregister_event_duration_listener(on_duration)
