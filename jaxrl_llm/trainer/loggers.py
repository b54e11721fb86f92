"""Where step metrics go: a console line and progress bar, metrics.jsonl, TensorBoard, wandb."""

from __future__ import annotations

import json
import logging
import math
import os
import sys

log = logging.getLogger(__name__)

# Keys of the one-line console summary, with short labels.
CONSOLE_KEYS = [
    ("critic/score/mean", "score"), ("val-core/mean", "val"), ("actor/pg_loss", "pg_loss"),
    ("actor/kl_loss", "kl"), ("actor/entropy", "ent"), ("actor/grad_norm", "gnorm"),
    ("response_length/mean", "resp_len"), ("timing_s/step", "s/step"), ("perf/throughput", "tok/s/dev"),
]


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsLogger:
    """Fans metrics out to the configured sinks ("console", "jsonl", "tensorboard", "wandb")."""

    def __init__(self, run_dir: str, sinks: tuple[str, ...], *, total_steps: int, start_step: int = 0,
                 project: str = "jaxrl_llm", experiment: str = "run", config: dict | None = None,
                 progress_bar: bool = True):
        self.sinks = set(sinks)
        unknown = self.sinks - {"console", "jsonl", "tensorboard", "wandb"}
        if unknown:
            raise ValueError(f"train.logger: unknown sink(s) {sorted(unknown)}; use console, jsonl, "
                             "tensorboard, wandb")
        os.makedirs(run_dir, exist_ok=True)
        self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a") if "jsonl" in self.sinks else None
        self._tb = None
        if "tensorboard" in self.sinks:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        self._wandb = None
        if "wandb" in self.sinks:
            try:
                import wandb

                self._wandb = wandb.init(project=project, name=experiment, config=config or {}, dir=run_dir)
            except ImportError:
                log.warning("wandb logging requested but wandb is not installed; skipping it")
        self._bar = None
        if progress_bar and "console" in self.sinks:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", file=sys.stderr,
                             dynamic_ncols=True, leave=True)

    def log(self, step: int, metrics: dict[str, float], *, advance: bool = True) -> None:
        """Writes one step's metrics; `advance=False` for lines that are not a training step (validation
        before training)."""
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, int | float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if "console" in self.sinks:
            parts = [f"{label} {metrics[k]:.4g}" for k, label in CONSOLE_KEYS if k in metrics]
            line = f"step {step} | " + " | ".join(parts)
            if self._bar is not None:
                self._bar.update(int(advance))
                self._bar.write(line)
            else:
                print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
