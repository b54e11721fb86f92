"""AdamW with warmup and a constant or cosine schedule, and grad clipping (veRL's `optim.*`).

veRL steps its LR scheduler once per training step, not per optimizer update, so the schedule here
is a function of `update_count // updates_per_step`: every mini-batch update of one training step
uses the same learning rate.
"""

from __future__ import annotations

import optax


def make_schedule(lr: float, *, total_steps: int, warmup_steps: int = 0, warmup_ratio: float = 0.0,
                  scheduler: str = "constant", min_lr_ratio: float = 0.0):
    """Learning rate as a function of the training step (warmup is linear from 0)."""
    warmup = warmup_steps or int(warmup_ratio * total_steps)
    if scheduler == "constant":
        body = optax.constant_schedule(lr)
    elif scheduler == "cosine":
        body = optax.cosine_decay_schedule(lr, max(1, total_steps - warmup), alpha=min_lr_ratio)
    else:
        raise ValueError(f"lr scheduler {scheduler!r}; use 'constant' or 'cosine'")
    if warmup <= 0:
        return body
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), body], [warmup])


def make_optimizer(lr: float, *, total_steps: int, updates_per_step: int = 1, warmup_steps: int = 0,
                   warmup_ratio: float = 0.0, scheduler: str = "constant", min_lr_ratio: float = 0.0,
                   weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   grad_clip: float | None = 1.0):
    """Returns (optax transformation, lr_at_training_step)."""
    per_step = make_schedule(lr, total_steps=total_steps, warmup_steps=warmup_steps, warmup_ratio=warmup_ratio,
                             scheduler=scheduler, min_lr_ratio=min_lr_ratio)
    per_update = lambda count: per_step(count // updates_per_step)
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip else []
    parts.append(optax.adamw(per_update, b1=betas[0], b2=betas[1], eps=eps, weight_decay=weight_decay))
    return optax.chain(*parts), per_step
