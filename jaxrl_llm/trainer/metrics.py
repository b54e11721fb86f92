"""Step metrics with veRL's names: data statistics, timing, throughput, MFU and memory.

FLOPs follow veRL's `FlopsCounter` for Qwen2 (and Qwen3-MoE), so MFU figures are comparable:
  dense params N = L·(3·D·F + D·(2·N·H + 2·K·H)) + 2·V·D  (embedding and LM head both counted)
  a MoE's sparse layer counts its active MLP instead of 3·D·F: k·3·D·I + D·E (k experts and the router)
  FLOPs = 6·N·tokens + 12·Σ seqlen²·H·N_heads·L
(6 = forward 2 + backward 4 per multiply-add; the second term is causal-agnostic attention, as veRL).

Qwen3.5 (`flops_params`, `delta_rule_macs`), in the same spirit:
  * an attention layer's q_proj is twice as wide (each head's query and its output gate): D·(3·N·H + 2·K·H);
  * a Gated DeltaNet layer (`linear_layers`) counts its projections D·(2·Kd + Vd) + D·Vd + 2·D·Hv + Vd·D
    (in_proj_qkv, in_proj_z, in_proj_b and in_proj_a, out_proj; Kd = Hk·Dk, Vd = Hv·Dv) and its conv E·Kw
    (E = 2·Kd + Vd channels, Kw wide) as weights; the quadratic term counts the attention layers only;
  * the delta rule itself adds 6·tokens·Hv·(3·Dk·Dv + C·(5·Dk + 3·Dv)/2) a linear layer: the multiply-adds of
    the chunked form a token (chunk C, models/gated_delta.py) — per chunk and value head, K·K^T and Q·K^T
    (2·C²·Dk), the two triangular solves (C²·(Dk + Dv)/2), the intra-chunk A·V (C²·Dv) and the three products
    with the [Dk, Dv] state (3·C·Dk·Dv), divided by the C tokens;
  * a Qwen3.5-MoE's sparse layer adds its shared expert and gate, 3·D·Is + D.
"""

from __future__ import annotations

import contextlib
import resource
import time

import jax
import numpy as np

from jaxrl_llm.models.config import Qwen2Config
from jaxrl_llm.models.gated_delta import CHUNK

# bf16 dense peak (TFLOP/s) per device kind, for MFU when train.peak_tflops is unset.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "L40S": 362.0, "cpu": 1.0}


def flops_params(cfg: Qwen2Config) -> int:
    """The N of 6·N·tokens: the weights a token multiplies (the active ones of a MoE), embedding and head included."""
    d, layers = cfg.hidden_size, cfg.num_hidden_layers
    gate = 2 if cfg.is_hybrid else 1  # Qwen3.5's q_proj also makes the output gate
    attn_linear = d * ((gate + 1) * cfg.q_dim + 2 * cfg.kv_dim)
    kd, vd, hv = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_num_value_heads
    linear = d * (2 * kd + vd) + d * vd + 2 * d * hv + vd * d + cfg.linear_conv_dim * cfg.linear_conv_kernel_dim
    moe_mlp = cfg.num_experts_per_tok * 3 * d * cfg.moe_intermediate_size + d * cfg.num_experts
    if cfg.shared_expert_intermediate_size:
        moe_mlp += 3 * d * cfg.shared_expert_intermediate_size + d
    n_linear = sum(cfg.is_linear_layer(i) for i in range(layers))
    sparse = len(cfg.sparse_layers)
    return ((layers - sparse) * 3 * d * cfg.intermediate_size + sparse * moe_mlp + (layers - n_linear) * attn_linear
            + n_linear * linear + 2 * cfg.vocab_size * d)


def delta_rule_macs(cfg: Qwen2Config, chunk: int = CHUNK) -> float:
    """Multiply-adds a token of one Gated DeltaNet layer's chunked delta rule (module docstring), all heads."""
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    return cfg.linear_num_value_heads * (3 * dk * dv + chunk * (5 * dk + 3 * dv) / 2)


def veRL_flops(cfg: Qwen2Config, seqlens: np.ndarray) -> float:
    """Training FLOPs (fwd + bwd) of sequences of these lengths, veRL's formula (Qwen3.5's layers: module
    docstring)."""
    seqlens = np.asarray(seqlens, np.float64)
    tokens = float(np.sum(seqlens))
    n_linear = sum(cfg.is_linear_layer(i) for i in range(cfg.num_hidden_layers))
    n_attention = cfg.num_hidden_layers - n_linear
    attn = 12 * float(np.sum(seqlens ** 2)) * cfg.head_dim * cfg.num_attention_heads * n_attention
    delta = 6.0 * tokens * n_linear * delta_rule_macs(cfg) if n_linear else 0.0
    return 6.0 * flops_params(cfg) * tokens + attn + delta


def peak_tflops(override: float | None = None) -> float:
    if override:
        return float(override)
    kind = jax.devices()[0].device_kind
    for name, value in PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return value
    return PEAK_TFLOPS["cpu"]


def _stats(prefix: str, x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {f"{prefix}/mean": float(np.mean(x)), f"{prefix}/max": float(np.max(x)), f"{prefix}/min": float(np.min(x))}


def data_metrics(batch, *, max_response_length: int, max_prompt_length: int, use_critic: bool) -> dict[str, float]:
    """veRL's `compute_data_metrics` over a step's `TrainBatch`."""
    f = batch.fields
    mask = batch.response_mask > 0
    out = {}
    out.update(_stats("critic/score", f["token_level_scores"].sum(-1)))
    out.update(_stats("critic/rewards", f["token_level_rewards"].sum(-1)))
    out.update(_stats("critic/advantages", f["advantages"][mask]))
    out.update(_stats("critic/returns", f["returns"][mask]))
    if use_critic:
        vals = f["values"][mask]
        out.update(_stats("critic/values", vals))
        ret = f["returns"][mask]
        var = np.var(ret)
        out["critic/vf_explained_var"] = float(1.0 - np.var(ret - vals) / (var + 1e-5))
    # Lengths count the sampled (mask-1) tokens; a multi-turn response's tool turns are left out, but
    # they count towards max_response_length, so the clip ratio reads the whole response.
    rl = batch.loss_token_counts.astype(np.float64)
    pl = batch.prompt_lengths.astype(np.float64)
    out.update(_stats("response_length", rl))
    out["response_length/clip_ratio"] = float(np.mean(batch.response_lengths >= max_response_length))
    out.update(_stats("prompt_length", pl))
    out["prompt_length/clip_ratio"] = float(np.mean(pl == max_prompt_length))
    return out


def perf_metrics(timing: dict[str, float], batch, cfg: Qwen2Config, *, ppo_epochs: int, n_devices: int,
                 peak: float, log_prob_passes: int = 0) -> dict[str, float]:
    """Throughput and MFU.

    `perf/throughput` is tokens (prompt + response) per second per device over the step time minus
    validation and checkpoint time; veRL divides by the whole step time, which understates it on
    steps that validate or save. `perf/mfu/actor` is veRL's: update FLOPs x ppo_epochs over the
    update_actor time, per device, against `peak` TFLOP/s. `perf/mfu/log_prob` is the same for the
    `log_prob_passes` forward passes (a third of veRL's FLOPs each: old, reference, values) over the
    log_probs time, which the reward's scoring overlaps (a lower bound where the scoring is the longer).
    """
    seqlens = batch.prompt_lengths + batch.response_lengths
    tokens = float(np.sum(seqlens))
    step_time = timing.get("step", 0.0)
    busy = max(step_time - timing.get("testing", 0.0) - timing.get("save_checkpoint", 0.0), 1e-9)
    out = {"perf/total_num_tokens": tokens, "perf/time_per_step": step_time,
           "perf/throughput": tokens / busy / n_devices}
    if timing.get("update_actor"):
        flops = veRL_flops(cfg, seqlens) * ppo_epochs
        out["perf/mfu/actor"] = flops / timing["update_actor"] / 1e12 / peak / n_devices
    if timing.get("log_probs") and log_prob_passes:
        flops = veRL_flops(cfg, seqlens) / 3 * log_prob_passes
        out["perf/mfu/log_prob"] = flops / timing["log_probs"] / 1e12 / peak / n_devices
    out["perf/max_memory_allocated_gb"] = max_memory_gb()
    return out


def max_memory_gb() -> float:
    """Peak device memory in use (GB); on CPU the process's peak resident memory."""
    peaks = []
    for d in jax.local_devices():
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    if peaks:
        return max(peaks) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


class Timer:
    """`with timer("gen"): ...` records seconds under timing_s/gen."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self, num_tokens: float) -> dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.times.items()}
        if num_tokens:
            out.update({f"timing_per_token_ms/{k}": v * 1000 / num_tokens for k, v in self.times.items()
                        if k not in ("step", "testing", "save_checkpoint")})
        return out
