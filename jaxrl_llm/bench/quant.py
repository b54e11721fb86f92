"""The 8-bit frozen LoRA base against bf16 (`model.base_quantization`), on random weights of a preset.

  python -m jaxrl_llm.bench --sections quant [--presets qwen2p5_7b,qwen2p5_14b] [--kinds int8,fp8]
                            [--lora_rank 32] [--prompts 64] [--token_budget 32768] [--small]

For each preset, the base drawn in bf16 with the model's normal init (`init_params`), then quantized as a
run does it (`quant.quantize_base`):
  memory     the frozen base's bytes on the device, bf16 and each 8-bit kind (the arrays' bytes, and the
             allocator's bytes in use before and after)
  gap        teacher-forced over real GSM8K prompts (the chat-templated test questions, Qwen2 tokenizer):
             mean |log p_bf16(next) - log p_8bit(next)| and mean KL(p_bf16 || p_8bit) over the vocabulary,
             per token
  update     one LoRA actor fwd+bwd (the GRPO loss with the KL loss, remat "full") of a packed micro-batch
             of `--token_budget` tokens (the seed's actor.ppo_max_token_len_per_gpu), rank `--lora_rank` on
             every linear layer, with each base; the compiled step's memory and the device's peak
Rows: sections quant_memory, quant_gap, quant_update. It runs on JAX's default platform (lora_sync pins
CPU for its vLLM half); a full preset refuses to run on a CPU. `--small` checks it with the tiny preset.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.bench.harness import compiled_gb, device_gb, emit, option, section, timeit
from jaxrl_llm.bench.workload import gsm8k_prompts

option("--kinds", default="int8,fp8", help="quant: 8-bit kinds to compare against bf16")
option("--prompts", type=int, default=64, help="quant: GSM8K prompts for the log-prob gap")
option("--seq", type=int, default=1024, help="quant: tokens a row of the timed micro-batch")


def _tree_gb(tree) -> float:
    return sum(x.nbytes for x in jax.tree.leaves(tree)) / 1e9


def _in_use_gb() -> float:
    return (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", 0) / 1e9


def logprob_gap(cfg, base, frozen, qcfg, prompts, rows: int = 8):
    """(mean |Δ log p| of the next token, mean KL(p_base || p_quant)) over the prompts' tokens."""
    from flax import nnx

    from jaxrl_llm.models import graphdef_and_abstract_params

    gd, _ = graphdef_and_abstract_params(cfg)
    qgd, _ = graphdef_and_abstract_params(qcfg)

    @jax.jit
    def sums(base, frozen, ids, lengths):
        lp = jax.nn.log_softmax(nnx.merge(gd, base)(ids, lengths=lengths), -1)  # [B, T, V] fp32
        lq = jax.nn.log_softmax(nnx.merge(qgd, frozen)(ids, lengths=lengths), -1)
        t = ids.shape[1]
        valid = (jnp.arange(t - 1)[None] < lengths[:, None] - 1).astype(jnp.float32)  # [B, T-1]
        nxt = ids[:, 1:, None]
        dp = jnp.abs(jnp.take_along_axis(lp[:, :-1], nxt, -1) - jnp.take_along_axis(lq[:, :-1], nxt, -1))[..., 0]
        kl = jnp.sum(jnp.exp(lp) * (lp - lq), -1)[:, :-1]
        return jnp.sum(dp * valid), jnp.sum(kl * valid), jnp.sum(valid)

    width = max(len(p) for p in prompts)
    width = -(-width // 64) * 64
    tot = np.zeros(3)
    for i in range(0, len(prompts), rows):
        chunk = prompts[i:i + rows]
        ids = np.zeros((rows, width), np.int32)
        lengths = np.zeros(rows, np.int32)
        for r, p in enumerate(chunk):
            ids[r, :len(p)], lengths[r] = p, len(p)
        tot += np.array([float(x) for x in sums(base, frozen, jnp.asarray(ids), jnp.asarray(lengths))])
    return tot[0] / tot[2], tot[1] / tot[2], int(tot[2])


def update_step(cfg, base, kind, spec, budget: int, seq: int):
    """(seconds of one fwd+bwd of a `budget`-token micro-batch, compiled GB) for a LoRA state on `base`."""
    from jaxrl_llm import sharding
    from jaxrl_llm.algorithms import LossNorm
    from jaxrl_llm.bench.workload import synthetic_batch
    from jaxrl_llm.trainer import steps
    from jaxrl_llm.trainer.batch import PackShape, build_micro_batch
    from jaxrl_llm.trainer.roles.model_state import ModelState
    from jaxrl_llm.trainer.roles.optim import make_optimizer

    tx, _ = make_optimizer(1e-5, total_steps=10)
    mesh = sharding.make_mesh(fsdp=1, tensor=1)
    state = ModelState(cfg, mesh, base, tx, lora=spec, base_quantization=kind)  # a bf16 base is shared, not copied
    s = steps.ActorLossSettings(use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type="low_var_kl")
    grad = steps.make_grad_step(steps.actor_loss, state.graphdef, state.param_sh, s=s)
    metrics0 = steps.make_metrics_init(steps.actor_loss, state.graphdef, s=s)
    zeros = steps.make_zeros(state.param_sh)
    rows = budget // seq
    shape = PackShape(rows=rows, length=seq, max_seqs=rows, resp_len=seq - 1)
    batch = synthetic_batch(rows, 1, seq - 1, cfg.vocab_size)
    batch.prompt_ids = [p[:1] for p in batch.prompt_ids]  # 1-token prompt + (seq - 1) response tokens
    batch.response_mask[:] = 1.0
    for f in ("old_log_prob", "ref_log_prob"):
        batch.fields[f] = np.full_like(batch.response_mask, -2.0)
    mb = build_micro_batch(batch, [(i, i, 0) for i in range(rows)], shape,
                           fields=("old_log_prob", "advantages", "ref_log_prob"))
    mb = jax.device_put(mb, sharding.replicated(mesh))
    norm = LossNorm(jnp.float32(rows * (seq - 1)), jnp.float32(rows), jnp.float32(seq - 1))
    p = state.state["params"]
    with jax.set_mesh(mesh):
        m0 = metrics0(state.params(), mb, norm)

    def step():  # the accumulators are donated: fresh ones each call, as the worker does
        return grad(p, state.frozen, zeros(p), metrics0(state.params(), mb, norm), mb, norm)[0]

    with jax.set_mesh(mesh):
        gb = compiled_gb(grad, p, state.frozen, zeros(p), m0, mb, norm)
        return timeit(step, iters=3), gb, state.frozen


@section("quant", help="the 8-bit frozen LoRA base against bf16: memory, log-prob gap on GSM8K prompts, LoRA "
         "fwd+bwd time", defaults={"presets": "qwen2p5_7b,qwen2p5_14b", "lora_rank": 32, "token_budget": 32768})
def quant_section(args):
    from jaxrl_llm.models import PRESETS, init_params, quant
    from jaxrl_llm.models.lora import LoraSpec, resolve_targets

    presets = ["tiny"] if args.small else args.presets.split(",")
    if not args.small and jax.default_backend() == "cpu":
        raise ValueError("quant: full presets need an accelerator (JAX's default platform is CPU here); use --small "
                         "to check it on a CPU")
    budget, seq, n_prompts = (512, 128, 8) if args.small else (args.token_budget, args.seq, args.prompts)
    spec = LoraSpec(rank=args.lora_rank, alpha=2.0 * args.lora_rank, targets=resolve_targets("all-linear"))
    for preset in presets:
        over = {"vocab_size": 151936} if args.small else {}
        cfg = PRESETS[preset](dtype="bfloat16", param_dtype="bfloat16", remat="full", **over)
        prompts = gsm8k_prompts(n_prompts, vocab_size=cfg.vocab_size)
        before = _in_use_gb()
        base = init_params(cfg, seed=0)  # the model's normal init (initializer_range), drawn in bf16
        emit(section="quant_memory", preset=preset, base="bfloat16", params_gb=_tree_gb(base),
             in_use_gb=_in_use_gb() - before, device=jax.devices()[0].device_kind)
        dt, gb, _ = update_step(cfg, base, "none", spec, budget, seq)
        emit(section="quant_update", preset=preset, base="bfloat16", rank=args.lora_rank, tokens=budget, fwd_bwd_s=dt,
             compiled_gb=gb, device_peak_gb=device_gb())
        for kind in args.kinds.split(","):
            before = _in_use_gb()
            frozen = jax.jit(lambda b, kind=kind: quant.quantize_base(b, kind))(base)
            emit(section="quant_memory", preset=preset, base=kind, params_gb=_tree_gb(frozen),
                 in_use_gb=_in_use_gb() - before, estimate_gb=quant.base_bytes(cfg, kind) / 1e9)
            dlogp, kl, tokens = logprob_gap(cfg, base, frozen, quant.apply(cfg, kind), prompts)
            emit(section="quant_gap", preset=preset, base=kind, tokens=tokens, mean_abs_dlogp=dlogp, mean_kl=kl)
            frozen = None
            dt, gb, _ = update_step(cfg, base, kind, spec, budget, seq)
            emit(section="quant_update", preset=preset, base=kind, rank=args.lora_rank, tokens=budget, fwd_bwd_s=dt,
                 compiled_gb=gb, device_peak_gb=device_gb())
        base = None
