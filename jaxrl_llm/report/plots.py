"""The report's plots: one PNG per panel of related curves vs step, and overview.png with all of them.

A panel is drawn only when the run logs its metrics; otherwise it is skipped with a reason, so a GRPO
run does not get an empty value-loss plot.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# The object-oriented API, not pyplot: no global backend or figure state to leak into a caller's
# process (a notebook keeps its backend), and savefig renders PNGs with Agg, so no display is needed.
from matplotlib.figure import Figure

from jaxrl_llm.report.metrics import ASYNC_COUNTS, ASYNC_SHARES, ASYNC_STALENESS, ASYNC_WAITS, RunMetrics

EMA_WEIGHT = 0.9  # TensorBoard-style smoothing of the noisy train curves (reward, KL, entropy)
KL_KEYS = ("actor/kl_loss", "actor/reward_kl_penalty", "actor/ppo_kl")


def compute_ema(values: np.ndarray, weight: float = EMA_WEIGHT) -> np.ndarray:
    """TensorBoard's debiased EMA of [S] values; NaNs are skipped (the last smoothed value carries on)."""
    out, acc, n, last = np.empty_like(values), 0.0, 0, np.nan
    for i, x in enumerate(values):
        if np.isfinite(x):
            acc, n = weight * acc + (1 - weight) * x, n + 1
            last = acc / (1 - weight**n)
        out[i] = last
    return out


def _smoothed(ax, run: RunMetrics, key: str, label: str) -> None:
    """Raw values faintly, the EMA on top in the same colour."""
    steps, vals = run.series(key)
    (raw,) = ax.plot(steps, vals, lw=0.8, alpha=0.3)
    ax.plot(steps, compute_ema(vals), lw=1.6, color=raw.get_color(), label=label)


def _lines(ax, run, keys) -> None:
    """A line for each of `keys` the run logs."""
    for key in keys:
        if run.has(key):
            ax.plot(*run.series(key), lw=1, label=key)


def _draw_reward(ax, run):
    _smoothed(ax, run, "critic/score/mean", "train score (EMA)")
    val = {"val-core/mean": "val-core/mean"} if run.has("val-core/mean") else run.val_keys()
    for key, label in val.items():
        ax.plot(*run.series(key), "o", ms=4, label=f"validation {label}")
    ax.set_ylabel("score")


def _draw_validation(ax, run):
    for key, label in run.val_keys().items():
        ax.plot(*run.series(key), marker="o", ms=4, label=label, ls="--" if key == "val-core/mean" else "-")
    ax.set_ylabel("validation score")


def _draw_kl(ax, run):
    for key in KL_KEYS:
        if run.has(key):
            _smoothed(ax, run, key, f"{key} (EMA)")
    ax.set_ylabel("KL")


def _draw_entropy(ax, run):
    _smoothed(ax, run, "actor/entropy", "actor/entropy (EMA)")
    ax.set_ylabel("nats / token")


def _draw_length(ax, run):
    steps, (mean, lo, hi) = run.table(["response_length/mean", "response_length/min", "response_length/max"],
                                      np.nan)
    (line,) = ax.plot(steps, mean, label="mean")
    if np.isfinite(lo).any() and np.isfinite(hi).any():
        ax.fill_between(steps, lo, hi, alpha=0.2, color=line.get_color(), label="min–max")
    ax.set_ylabel("response tokens")


def _draw_clipfrac(ax, run):
    _lines(ax, run, ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"))
    ax.set_ylabel("fraction of tokens")


def _draw_throughput(ax, run):
    ax.plot(*run.series("perf/throughput"), lw=1, label="perf/throughput")
    ax.set_ylabel("tokens / s / device")
    if not run.has("perf/mfu/actor"):
        return [ax]
    twin = ax.twinx()
    steps, mfu = run.series("perf/mfu/actor")
    twin.plot(steps, 100 * mfu, lw=1, color="C1", label="perf/mfu/actor (right)")
    twin.set_ylabel("MFU (%)")
    return [ax, twin]


def _draw_timing(ax, run):
    phases = run.phases()
    if phases:
        steps, vals = run.table([f"timing_s/{p}" for p in phases], 0.0)
        ax.stackplot(steps, vals, labels=phases, alpha=0.8)
    if run.has("timing_s/step"):
        steps, step = run.series("timing_s/step")
        ax.plot(steps, step, color="k", lw=1, label="step")
        # Steps that compile (the first, the first after a resume) can take 10-100x the rest: scale the
        # axis to the other steps so they stay readable, and name the peak that is cut off.
        typical = step[step <= 5 * np.nanmedian(step)]
        if len(typical) and np.nanmax(step) > 1.2 * np.nanmax(typical):
            top = 1.2 * np.nanmax(typical)
            ax.set_ylim(0, top)
            ax.set_title(f"off scale: {int(np.sum(step > top))} step(s), up to {np.nanmax(step):.3g} s "
                         f"at step {steps[np.nanargmax(step)]}", fontsize=8, loc="right")
    ax.set_ylabel("seconds")


def _draw_grad_norm(ax, run):
    ax.plot(*run.series("actor/grad_norm"), lw=1, label="actor/grad_norm")
    if not run.has("actor/lr"):
        return [ax]
    twin = ax.twinx()
    twin.plot(*run.series("actor/lr"), lw=1, color="C1", label="actor/lr (right)")
    return [ax, twin]


def _draw_vf_loss(ax, run):
    _smoothed(ax, run, "critic/vf_loss", "critic/vf_loss (EMA)")


def _draw_multi_turn(ax, run):
    """Tool use of a multi-turn run: tool calls and turns a response, tool errors a step (right axis)."""
    _lines(ax, run, ("multi_turn/tool_calls_mean", "multi_turn/turns_mean"))
    ax.set_ylabel("per response")
    if not run.has("multi_turn/tool_errors"):
        return [ax]
    twin = ax.twinx()
    twin.plot(*run.series("multi_turn/tool_errors"), lw=1, color="C3", label="multi_turn/tool_errors (right)")
    return [ax, twin]


def _lines_right(ax, run, keys, ylabel: str, colors=("C4", "C5", "C6")) -> list:
    """`keys` on a twin axis at the right (when the run has any), their labels marked so; the axes drawn on."""
    present = [k for k in keys if run.has(k)]
    if not present:
        return [ax]
    twin = ax.twinx()
    for key, color in zip(present, colors):
        twin.plot(*run.series(key), lw=1, ls="--", color=color, label=f"{key} (right)")
    twin.set_ylabel(ylabel)
    return [ax, twin]


def _draw_async_staleness(ax, run):
    """Policy versions between a sample's oldest token and the version that trains on it; stale and partial
    samples a step at the right."""
    _lines(ax, run, ASYNC_STALENESS)
    ax.set_ylabel("policy versions")
    return _lines_right(ax, run, ASYNC_COUNTS, "samples")


def _draw_async_shares(ax, run):
    _lines(ax, run, ASYNC_SHARES)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("share")


def _draw_async_waits(ax, run):
    _lines(ax, run, ASYNC_WAITS)
    ax.set_ylabel("seconds")
    return _lines_right(ax, run, ("fully_async/queue_size",), "samples queued")


def _any_of(*keys: str) -> Callable[[RunMetrics], bool]:
    return lambda run: any(run.has(k) for k in keys)


@dataclass(frozen=True)
class Panel:
    """One plot of related curves, drawn only when `present(run)`; `wanted` names its metrics for the
    summary's list of skipped panels, which leaves out those of a training mode the run does not use
    (`listed=False`: the async panels). `draw(ax, run)` may return its twin axes for the legend."""

    name: str
    title: str
    wanted: str
    present: Callable[[RunMetrics], bool]
    draw: Callable
    listed: bool = True


PANELS = (
    Panel("reward", "Train reward (critic/score/mean) with validation", "critic/score/mean",
          _any_of("critic/score/mean"), _draw_reward),
    Panel("validation", "Validation score per data source", "val-core/<data_source>/<metric>/mean@N",
          lambda run: bool(run.val_keys()), _draw_validation),
    Panel("kl", "KL", " or ".join(KL_KEYS), _any_of(*KL_KEYS), _draw_kl),
    Panel("entropy", "Policy entropy", "actor/entropy", _any_of("actor/entropy"), _draw_entropy),
    Panel("response_length", "Response length", "response_length/mean", _any_of("response_length/mean"),
          _draw_length),
    Panel("clipfrac", "PPO clip fraction", "actor/pg_clipfrac or actor/pg_clipfrac_lower",
          _any_of("actor/pg_clipfrac", "actor/pg_clipfrac_lower"), _draw_clipfrac),
    Panel("throughput", "Throughput and MFU", "perf/throughput", _any_of("perf/throughput"), _draw_throughput),
    Panel("timing", "Time per step by phase", "timing_s/<phase> or timing_s/step",
          lambda run: bool(run.phases()) or run.has("timing_s/step"), _draw_timing),
    Panel("grad_norm", "Gradient norm and learning rate", "actor/grad_norm", _any_of("actor/grad_norm"),
          _draw_grad_norm),
    Panel("multi_turn", "Tool use (multi-turn rollouts)", "multi_turn/tool_calls_mean",
          _any_of("multi_turn/tool_calls_mean"), _draw_multi_turn),
    Panel("vf_loss", "Value loss (PPO critic)", "critic/vf_loss", _any_of("critic/vf_loss"), _draw_vf_loss),
    # Asynchronous training (one_step_off, fully_async): drawn only for runs that log these metrics.
    Panel("async_staleness", "Asynchronous training: staleness, stale and partial samples",
          "fully_async/staleness/* or fully_async/count/*", _any_of(*ASYNC_STALENESS, *ASYNC_COUNTS),
          _draw_async_staleness, listed=False),
    Panel("async_idle", "Asynchronous training: idle devices and partial rollouts",
          "rollouter/idle_ratio, trainer/idle_ratio or fully_async/partial/partial_ratio", _any_of(*ASYNC_SHARES),
          _draw_async_shares, listed=False),
    Panel("async_waits", "Asynchronous training: waits, weight sync and queue",
          "timing_s/wait_prev_gen, timing_s/rollout_wait, timing_s/sync or fully_async/queue_size",
          _any_of(*ASYNC_WAITS, "fully_async/queue_size"), _draw_async_waits, listed=False),
)


def _draw(ax, panel: Panel, run: RunMetrics) -> None:
    axes = panel.draw(ax, run) or [ax]
    handles = [h for a in axes for h in a.get_legend_handles_labels()[0]]
    if handles:
        ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="best")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.set_title(panel.title, fontsize=10, loc="left")


def write_plots(run: RunMetrics, out_dir: str) -> tuple[dict[str, str], dict[str, str]]:
    """One PNG per panel the run has metrics for, plus overview.png with all of them in a grid.

    Returns ({name: path} of the PNGs written, {name: reason} of the panels skipped).
    """
    drawn = [panel for panel in PANELS if panel.present(run)]
    absent = [panel for panel in PANELS if panel not in drawn]
    skipped = {panel.name: f"no {panel.wanted} in metrics.jsonl" for panel in absent if panel.listed}
    for panel in absent:  # a plot left by an earlier report of this run would now be stale
        stale = os.path.join(out_dir, f"{panel.name}.png")
        if os.path.isfile(stale):
            os.remove(stale)
    paths = {}
    if drawn:
        rows = (len(drawn) + 1) // 2
        fig = Figure(figsize=(14, 3.6 * rows), layout="constrained")
        for i, panel in enumerate(drawn):
            _draw(fig.add_subplot(rows, 2, i + 1), panel, run)
        paths["overview"] = os.path.join(out_dir, "overview.png")
        fig.savefig(paths["overview"], dpi=80)
    for panel in drawn:
        fig = Figure(figsize=(7, 3.8), layout="constrained")
        _draw(fig.add_subplot(), panel, run)
        paths[panel.name] = os.path.join(out_dir, f"{panel.name}.png")
        fig.savefig(paths[panel.name], dpi=100)
    return paths, skipped
