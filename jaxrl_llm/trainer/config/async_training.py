"""`async_training.*`: asynchronous RL on split devices (veRL's one_step_off_policy and fully_async_policy keys).

`mode`:
* 'sync' (the default): generate, score, compute log-probs and update in order, on the same devices.
* 'one_step_off': the devices split into a rollout mesh and a training mesh. While the trainer updates on batch
  k, the rollout devices generate batch k + 1 with the weights before that update; the old policy is the
  sampler's (its log-probs), veRL's bypass.
* 'fully_async': the rollout devices generate without stopping (a rollout stream); the trainer takes
  `require_batches` x `actor.ppo_mini_batch_size` prompt groups as they finish, updates, and after
  `trigger_parameter_sync_step` such updates (one step: data.train_batch_size prompts) sends new weights, which
  the rollout side takes at its next decode boundary when `partial_rollout` (else after its rows in flight
  finish). Between syncs it generates at most (1 + staleness_threshold) steps of prompts. The update uses the
  decoupled objective: the trainer's own log-probs before the update as the proximal policy, and the
  sampler's log-probs through algorithm.rollout_correction (TIS / MIS / RS).

The split: `rollout.n_gpus_per_node` x `rollout.nnodes` devices generate, `train.n_gpus_per_node` x
`train.nnodes` train (default: the rest), in one process; over several processes a node is a process of one side
(trainer/processes/placement.py).
"""

from __future__ import annotations

import dataclasses
import math

import gin

from jaxrl_llm.trainer.config.check import check as _check

MODES = ("sync", "one_step_off", "fully_async")


@gin.configurable("async_training")
@dataclasses.dataclass(frozen=True)
class AsyncConfig:
    """veRL's `async_training.*` (its recipes' keys), and what our engine adds."""

    mode: str = "sync"  # 'sync', 'one_step_off' or 'fully_async'
    # fully_async: the share of a step's prompts the rollout side may generate beyond it between two syncs
    # (0: exactly one step's, on-policy with a sync every step)
    staleness_threshold: float = 0.0
    partial_rollout: bool = False  # fully_async: a sync swaps weights mid-rollout at a decode boundary
    # fully_async: what rows running at a swap do with their K/V: 'recompute' it with the new weights, or 'keep' it
    partial_rollout_kv: str = "recompute"
    trigger_parameter_sync_step: int = 1  # fully_async: local updates between two weight syncs
    require_batches: int = 1  # fully_async: ppo_mini_batch_size groups of prompts a local update takes
    use_rollout_log_probs: bool = True  # the sampler's log-probs are the behaviour policy's (always, here)
    # fully_async: the trainer's log-probs before each update as the proximal policy (the decoupled objective);
    # None: on in fully_async with stale samples, off in one_step_off
    compute_prox_log_prob: bool | None = None
    # A sample whose oldest token is more weight versions behind the trainer than this is dropped and counted;
    # None: 1 + ceil(staleness_threshold) (fully_async), 1 (one_step_off)
    max_version_lag: int | None = None

    def validate(self) -> None:
        _check(self.mode in MODES, "async_training.mode", f"{self.mode!r}; use one of {MODES}")
        _check(self.staleness_threshold >= 0, "async_training.staleness_threshold",
               f"{self.staleness_threshold}; need >= 0 (0: one step's prompts between syncs)")
        _check(self.partial_rollout_kv in ("keep", "recompute"), "async_training.partial_rollout_kv",
               f"{self.partial_rollout_kv!r}; use 'keep' or 'recompute'")
        _check(self.trigger_parameter_sync_step >= 1, "async_training.trigger_parameter_sync_step",
               f"{self.trigger_parameter_sync_step}; need >= 1")
        _check(self.require_batches >= 1, "async_training.require_batches", f"{self.require_batches}; need >= 1")
        _check(self.use_rollout_log_probs, "async_training.use_rollout_log_probs",
               "False is not supported: the sampler's log-probs are the behaviour policy's in both async modes")
        _check(self.max_version_lag is None or self.max_version_lag >= 0, "async_training.max_version_lag",
               f"{self.max_version_lag}; need >= 0 or None")
        if self.mode != "fully_async":
            _check(not self.partial_rollout, "async_training.partial_rollout",
                   f"partial rollouts need async_training.mode = 'fully_async' (it is {self.mode!r})")

    @property
    def enabled(self) -> bool:
        return self.mode != "sync"

    @property
    def off_policy(self) -> bool:
        """Whether a sample may be trained on by weights other than the ones that sampled it."""
        if self.mode == "one_step_off":
            return True
        return self.mode == "fully_async" and (self.staleness_threshold > 0 or self.trigger_parameter_sync_step > 1
                                               or self.partial_rollout)

    @property
    def prox(self) -> bool:
        """The decoupled objective: the trainer's own log-probs as the proximal policy."""
        if self.compute_prox_log_prob is not None:
            return self.compute_prox_log_prob and self.off_policy
        return self.mode == "fully_async" and self.off_policy

    @property
    def version_bound(self) -> int:
        if self.max_version_lag is not None:
            return self.max_version_lag
        return 1 if self.mode == "one_step_off" else 1 + math.ceil(self.staleness_threshold)


def check_async(run) -> None:
    """What an async run needs of the rest of the config (one error naming the keys, before any work)."""
    a = run.async_training
    if not a.enabled:
        return
    where = f"async_training.mode = {a.mode!r}"
    _check(run.rollout.engine == "jax", "rollout.engine", f"{where} runs the JAX engine on its own devices; set "
           "rollout.engine = 'jax' (the vLLM pool is not split from the trainer yet)")
    _check(not run.rollout.multi_turn.enable, "rollout.multi_turn.enable", f"{where} does not drive multi-turn "
           "agent rollouts yet; use async_training.mode = 'sync'")
    _check(not run.filter_groups.enable, "algorithm.filter_groups.enable", f"{where}: dynamic sampling draws "
           "batches until enough groups score differently; not with async rollouts yet")
    _check(run.algo.adv_estimator != "remax", "algorithm.adv_estimator", f"{where}: REMAX's greedy rollout a "
           "prompt is not streamed; use another estimator or async_training.mode = 'sync'")
    _check(run.router_replay.mode != "R3", "actor.router_replay.mode", f"{where}: R3 replays the sampler's "
           "routing, which the stream does not return yet; use 'R2' or 'disabled'")
    _check(run.rollout.n_gpus_per_node >= 1 and run.rollout.nnodes >= 1, "rollout.n_gpus_per_node",
           f"{where} needs devices of its own for the rollout: set rollout.n_gpus_per_node (and rollout.nnodes)")
    if a.mode == "fully_async":
        per_sync = a.trigger_parameter_sync_step * a.require_batches * run.actor.ppo_mini_batch_size
        _check(per_sync == run.data.train_batch_size, "async_training.trigger_parameter_sync_step",
               f"{a.trigger_parameter_sync_step} x async_training.require_batches {a.require_batches} x "
               f"actor.ppo_mini_batch_size {run.actor.ppo_mini_batch_size} = {per_sync} prompts between syncs; a "
               f"step is data.train_batch_size = {run.data.train_batch_size}: make them equal")
