"""Qwen3-MoE on one GPU (issue 23): grouped matmul throughput, the actor update's MFU on active
parameters, and decode tokens/s.

  python -m jaxrl_llm.bench --sections moe_grouped,moe_update,moe_decode --out $OUT   # Qwen3-30B-A3B's width
  python -m jaxrl_llm.bench --sections moe_update --small --small_preset tiny_moe      # CPU smoke

* moe_grouped: one expert projection of T tokens routed top-k over E experts ([T k, D] x [E, D, I]) with
  the Pallas kernels (kernels/grouped_matmul.py, what models/moe.py runs on GPUs) and with
  `jax.lax.ragged_dot`, against a dense [T k, D] x [D, I] matmul of the same
  FLOPs and a capacity-padded batched matmul ([E, C, D] x [E, D, I], C = 1.25 T k / E, the GShard
  layout); forward, and forward + backward.
* moe_update: the GRPO actor step (models forward/backward through `trainer/steps.py`'s actor loss with the
  router loss on, then AdamW) on packed rows of random tokens; MFU counts active parameters
  (`veRL_flops`: k experts and the router a sparse layer).
* moe_decode: the paged JAX engine generating `--new_tokens` for `--rows` rows of random prompts.

The preset keeps its full width (128 experts, top-8 for Qwen3-30B-A3B); `--layers` (default: as many
as the device memory holds for fp32 params + AdamW, and separately for bf16 decode) cuts the depth.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.bench.harness import emit, generate_twice, option, section, timeit
from jaxrl_llm.models.config import PRESETS
from jaxrl_llm.trainer.metrics import peak_tflops, veRL_flops
from kernels.grouped_matmul import grouped_matmul

DEFAULTS = {"presets": "qwen3_30b_a3b", "remat": "full", "rows": "256"}
option("--layers", type=int, default=0, help="moe_*: decoder layers (0: as many as fit)")
option("--tokens", type=int, default=16384, help="moe_grouped: tokens routed")
option("--update_rows", type=int, default=8, help="moe_update: packed rows")
option("--update_length", type=int, default=2048, help="moe_update: tokens a row")
option("--expert", type=int, default=1, help="moe_update: expert-parallel devices (train.mesh_expert)")
option("--prompt_len", type=int, default=128, help="moe_decode: prompt tokens")
option("--new_tokens", type=int, default=256, help="moe_decode: new tokens")


def fitting_layers(cfg, bytes_per_param: float, reserve_gb: float) -> int:
    """Decoder layers whose params (at `bytes_per_param`, optimizer state included) fit the device
    beside the embedding and head and `reserve_gb` for activations or KV pages; 2 on CPU."""
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    if limit is None:
        return min(2, cfg.num_hidden_layers)
    one = cfg.replace(num_hidden_layers=1, mlp_only_layers=())
    embed_head = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size
    per_layer = one.num_params() - embed_head
    free = 0.9 * limit - reserve_gb * 1e9 - embed_head * bytes_per_param
    return int(max(1, min(cfg.num_hidden_layers, free // (per_layer * bytes_per_param))))


def grouped(cfg, tokens: int, seed: int = 0):
    """The Pallas grouped matmul and ragged_dot vs a dense matmul of the same FLOPs vs the
    capacity-padded batched matmul."""
    e, k, d, i = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    dt = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (tokens * k, d), dt)
    w = jax.random.normal(keys[1], (e, d, i), dt) * 0.02
    experts = jax.random.randint(keys[2], (tokens * k,), 0, e)
    group_sizes = jnp.bincount(experts, length=e).astype(jnp.int32)
    cap = int(np.ceil(1.25 * tokens * k / e))
    xc = jax.random.normal(keys[3], (e, cap, d), dt)
    flops = 2.0 * tokens * k * d * i
    cases = {
        "ragged_dot": (lambda a, b: jax.lax.ragged_dot(a, b, group_sizes), (x, w), flops),
        "pallas_gmm": (lambda a, b: grouped_matmul(a, b, group_sizes, impl="pallas"), (x, w), flops),
        "dense_same_flops": (lambda a, b: a @ b, (x, w[0]), flops),
        "capacity_bmm": (lambda a, b: jnp.einsum("ecd,edi->eci", a, b), (xc, w), 2.0 * e * cap * d * i),
    }
    for name, (fn, args, f) in cases.items():
        fwd = jax.jit(fn)
        bwd = jax.jit(jax.grad(lambda a, b, fn=fn: jnp.sum(fn(a, b).astype(jnp.float32)), argnums=(0, 1)))
        try:
            t_f = timeit(fwd, *args, iters=10, warm_s=0.5)
            t_b = timeit(bwd, *args, iters=10, warm_s=0.5)
        except Exception as err:  # ragged_dot's dense expansion runs out of memory at 16k tokens
            emit(section="moe_grouped", what=name, tokens=tokens, error=f"{type(err).__name__}: {str(err)[:200]}")
            continue
        emit(section="moe_grouped", what=name, tokens=tokens, experts=e, top_k=k, d=d, i=i, dtype=str(jnp.dtype(dt)),
             useful_gflop=flops / 1e9, fwd_ms=t_f * 1e3, fwd_tflops=flops / t_f / 1e12,
             fwd_bwd_ms=t_b * 1e3, fwd_bwd_tflops=3 * flops / t_b / 1e12, executed_gflop=f / 1e9)


def update(cfg, rows: int, length: int, seed: int = 0, expert: int = 1):
    """One actor update (grad step + AdamW) on `rows` packed rows of `length` tokens, one sequence a row;
    `expert` > 1 splits the experts over a mesh axis of that size (the batch over the same devices)."""
    import optax

    from jaxrl_llm import sharding
    from jaxrl_llm.algorithms import LossNorm
    from jaxrl_llm.models import graphdef_and_abstract_params, init_params, param_shardings
    from jaxrl_llm.trainer import steps
    from jaxrl_llm.trainer.batch import PackShape, TrainBatch, build_micro_batch

    rng = np.random.default_rng(seed)
    prompt, resp = length // 4, length - length // 4
    batch = TrainBatch(prompt_ids=[rng.integers(0, cfg.vocab_size, prompt).astype(np.int32) for _ in range(rows)],
                       responses=rng.integers(0, cfg.vocab_size, (rows, resp)).astype(np.int32),
                       response_mask=np.ones((rows, resp), np.float32), group_ids=np.arange(rows, dtype=np.int32))
    batch.fields["advantages"] = rng.standard_normal((rows, resp)).astype(np.float32)
    batch.fields["old_log_prob"] = np.full((rows, resp), -10.0, np.float32)
    mb = build_micro_batch(batch, [(r, r, 0) for r in range(rows)], PackShape(rows, length, rows, resp),
                           fields=("advantages", "old_log_prob"))
    mesh = sharding.make_mesh(fsdp=1, expert=expert) if expert > 1 else None
    if mesh is not None:  # the experts' shard_map reads the ambient mesh; new arrays land on all its devices
        jax.set_mesh(mesh)
    mb = {k: jax.device_put(v, sharding.batch_sharding(mesh, v.ndim, v.shape)) if mesh else jnp.asarray(v)
          for k, v in mb.items()}
    norm = LossNorm(jnp.float32(rows * resp), jnp.float32(rows), jnp.float32(resp))

    graphdef, _ = graphdef_and_abstract_params(cfg)
    shardings = param_shardings(cfg, mesh)
    params = init_params(cfg, mesh=mesh, seed=seed)
    tx = optax.adamw(1e-6)
    state = {"params": params, "opt_state": jax.jit(tx.init)(params), "step": jnp.int32(0), "skipped": jnp.int32(0)}
    settings = steps.ActorLossSettings(router_aux_loss_coef=cfg.router_aux_loss_coef, chunk_size=4096)
    grad = steps.make_grad_step(steps.actor_loss, graphdef, shardings, s=settings)
    metrics0 = steps.make_metrics_init(steps.actor_loss, graphdef, s=settings)
    apply = steps.make_apply_step(tx, jax.tree.map(lambda x: x.sharding, state))
    zeros = steps.make_zeros(shardings)

    def step(state):
        g, m = grad(state["params"], {}, zeros(state["params"]), metrics0(state["params"], mb, norm), mb, norm)
        return apply(state, g)

    for _ in range(2):  # compile, then warm
        state, out = step(state)
        jax.block_until_ready(state)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        state, out = step(state)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    dt = float(np.median(times))
    flops = veRL_flops(cfg, np.full(rows, length))
    emit(section="moe_update", layers=cfg.num_hidden_layers, expert=expert, devices=max(expert, 1), rows=rows,
         length=length, remat=cfg.remat, seconds=dt,
         tokens_per_s=rows * length / dt, active_params=cfg.num_params(active=True), total_params=cfg.num_params(),
         tflops=flops / dt / 1e12, mfu=flops / dt / 1e12 / peak_tflops() / max(expert, 1),
         grad_norm=float(out["grad_norm"]))


def decode(cfg, rows: int, new_tokens: int, prompt_len: int, seed: int = 0):
    from jaxrl_llm.models import init_params
    from jaxrl_llm.rollout import JaxEngine, SamplingParams

    eng = JaxEngine(cfg, init_params(cfg, seed=seed), dtype=cfg.dtype, max_num_seqs=rows,
                    max_prompt_length=prompt_len)  # the initial params are freed once converted
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, prompt_len).tolist() for _ in range(rows)]
    sp = SamplingParams(n=1, temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
    first, out, dt = generate_twice(eng, prompts, sp)
    emit(section="moe_decode", layers=cfg.num_hidden_layers, rows=rows, prompt_len=prompt_len, new_tokens=new_tokens,
         generated=int(out.lengths.sum()), seconds=dt, first_call_s=first, tokens_per_s=float(out.lengths.sum()) / dt)


def _base(opts):
    preset = opts.small_preset if opts.small else opts.presets.split(",")[0]
    base = PRESETS[preset]()
    if not base.is_moe:
        raise ValueError(f"--presets {preset!r} is not a mixture of experts; use qwen3_30b_a3b or tiny_moe")
    return base, "bfloat16" if jax.default_backend() == "gpu" else "float32"


@section("moe_grouped", help="one expert projection: the Pallas grouped matmul and ragged_dot against a dense matmul "
         "of the same FLOPs and a capacity-padded bmm", defaults=DEFAULTS)
def moe_grouped(opts):
    grouped(_base(opts)[0], opts.tokens)


@section("moe_update", help="the GRPO actor update (grad step + AdamW) on a MoE at its full width, MFU on active "
         "parameters", defaults=DEFAULTS)
def moe_update(opts):
    base, dt = _base(opts)
    # fp32 params, AdamW mu/nu, the gradient accumulator and one step's gradient
    layers = opts.layers or fitting_layers(base, 20.0, reserve_gb=12.0)
    cfg = base.replace(num_hidden_layers=layers, dtype=dt, param_dtype="float32", remat=opts.remat,
                       output_router_logits=True)
    update(cfg, opts.update_rows, opts.update_length, expert=opts.expert)


@section("moe_decode", help="the paged engine decoding a MoE at its full width: tokens/s", defaults=DEFAULTS)
def moe_decode(opts):
    base, dt = _base(opts)
    # bf16 weights twice (the initial params and the engine's copy); KV pages in the reserve
    layers = opts.layers or fitting_layers(base, 4.0, reserve_gb=16.0)
    decode(base.replace(num_hidden_layers=layers, dtype=dt, param_dtype=dt), int(opts.rows), opts.new_tokens,
           opts.prompt_len)
