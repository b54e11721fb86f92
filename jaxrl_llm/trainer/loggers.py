"""Where step metrics go: a console line and progress bar, metrics.jsonl, TensorBoard, wandb."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time

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


def cut_metrics(path: str, step: int) -> int:
    """Cuts `metrics.jsonl` back to `step`, the step a run starts from (0: all of it), so no step appears
    twice once the run logs the steps after it again. The rows cut (and a last line a kill left half
    written) move to a `metrics.set-aside-<time>.jsonl` beside it; returns how many."""
    if not os.path.exists(path):
        return 0
    keep, cut = [], []
    with open(path) as f:
        for line in f:
            try:
                row_step = json.loads(line)["step"]
                ok = line.endswith("\n") and step > 0 and row_step <= step
            except (json.JSONDecodeError, KeyError, TypeError):
                ok = False
            (keep if ok else cut).append(line if line.endswith("\n") else line + "\n")
    if cut:
        aside = os.path.join(os.path.dirname(path), f"metrics.set-aside-{int(time.time())}.jsonl")
        with open(aside, "w") as f:
            f.writelines(cut)
        with open(path + ".tmp", "w") as f:
            f.writelines(keep)
        os.replace(path + ".tmp", path)
        log.info("metrics.jsonl: moved %d rows after step %d to %s (the run logs those steps again)", len(cut),
                 step, aside)
    return len(cut)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False



def _summary_writer() -> type:
    """tensorboardX's SummaryWriter, imported without torch where this process has not imported it: tensorboardX's
    writer imports torch only to accept torch tensors as values (we log floats), and that import was 2-4 s of every
    trainer process's start on 2 cores (a test session starts about a hundred). `import torch` fails while
    tensorboardX loads, which it handles; torch imports normally afterwards."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # an ImportError for `import torch`, for as long as tensorboardX loads
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter

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
        self._jsonl = None
        if "jsonl" in self.sinks:
            path = os.path.join(run_dir, "metrics.jsonl")
            cut_metrics(path, start_step)
            self._jsonl = open(path, "a")
        self._tb = None
        if "tensorboard" in self.sinks:
            SummaryWriter = _summary_writer()
            tb_dir = os.path.join(run_dir, "tensorboard")
            # An earlier run's events past the start step: TensorBoard hides them (the steps are logged again).
            earlier = os.path.isdir(tb_dir) and any(n.startswith("events.") for n in os.listdir(tb_dir))
            self._tb = SummaryWriter(tb_dir, purge_step=(start_step + 1 if start_step else 0) if earlier else None)
        self._wandb = None
        if "wandb" in self.sinks:
            try:
                import wandb

                self._wandb = wandb.init(project=project, name=experiment, config=config or {}, dir=run_dir)
            except ImportError:
                log.warning("wandb logging requested but wandb is not installed; skipping it")
        self._bar = None
        # A bar redraws its line with carriage returns: in a file or a pipe it garbles the step lines.
        if progress_bar and "console" in self.sinks and _is_terminal(sys.stderr):
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
