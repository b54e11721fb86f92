"""KL between the policy and the reference: per-token estimators, KL in the reward, KL as a loss,
and the KL coefficient controllers.

Estimators (http://joschu.net/blog/kl-approx.html), with d = logprob - ref_logprob:
  "kl" / "k1": d.  "abs": |d|.  "mse" / "k2": d²/2.
  "low_var_kl" / "k3": exp(-d) + d - 1, with -d clamped to [-20, 20] and the result to [-10, 10].
A "+" suffix ("k1+", "k3+", "low_var_kl+", "abs+") is the straight-through variant: the forward
value of the estimator with the gradient of k2. k1 and k3 are unbiased for the KL value but their
gradients are not the KL's gradient; k2's is. "k2+" / "mse+" equal k2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.algorithms.aggregation import LossNorm, agg_loss
from jaxrl_llm.algorithms.masked import masked_mean

KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def _kl_forward(logprob: jax.Array, ref_logprob: jax.Array, name: str) -> jax.Array:
    if name in ("kl", "k1"):
        return logprob - ref_logprob
    if name == "abs":
        return jnp.abs(logprob - ref_logprob)
    if name in ("mse", "k2"):
        return 0.5 * jnp.square(logprob - ref_logprob)
    if name in ("low_var_kl", "k3"):
        neg_d = jnp.clip(ref_logprob - logprob, -20.0, 20.0)
        return jnp.clip(jnp.exp(neg_d) - neg_d - 1, -10.0, 10.0)
    if name == "full":
        raise NotImplementedError("kl_penalty 'full' needs the whole vocabulary distribution")
    known = list(KL_ESTIMATORS) + [n + "+" for n in KL_ESTIMATORS]
    raise ValueError(f"unknown kl_penalty {name!r}; known: {known}")


def _kl_estimate(logprob: jax.Array, ref_logprob: jax.Array, name: str) -> jax.Array:
    logprob = logprob.astype(jnp.float32)
    ref_logprob = ref_logprob.astype(jnp.float32)
    straight_through = name.endswith("+")
    base = name[:-1] if straight_through else name
    forward = _kl_forward(logprob, ref_logprob, base)
    if not straight_through or base in ("mse", "k2"):
        return forward
    backward = 0.5 * jnp.square(logprob - ref_logprob)
    return backward - jax.lax.stop_gradient(backward) + jax.lax.stop_gradient(forward)


def kl_penalty(logprob: jax.Array, ref_logprob: jax.Array, kl_penalty: str) -> jax.Array:
    """Per-token KL estimate of KL(policy || ref) from the log-probs of the sampled tokens.

    Args:
      logprob: [B, T] log-probs under the policy.
      ref_logprob: [B, T] log-probs under the reference policy.
      kl_penalty: estimator name (static), see the module docstring; "+" for straight-through.
    Returns:
      [B, T] float32, not masked.
    """
    return _kl_estimate(logprob, ref_logprob, kl_penalty)


def apply_kl_penalty(token_level_scores: jax.Array, old_log_prob: jax.Array, ref_log_prob: jax.Array,
                     response_mask: jax.Array, kl_coef, kl_penalty: str = "kl"
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """KL in the reward: token_level_rewards = scores - kl_coef · KL (masked), as veRL's trainer.

    The controller update is left to the caller (it has side effects):
    `ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=B)`.

    Args:
      token_level_scores: [B, T] rewards from the reward functions.
      old_log_prob, ref_log_prob: [B, T] log-probs under the rollout and reference policies.
      response_mask: [B, T] 0/1.
      kl_coef: the controller's current value (float, may be traced).
      kl_penalty: estimator name (static).
    Returns:
      token_level_rewards [B, T], and metrics "actor/reward_kl_penalty" (batch mean of each
      sequence's masked-mean KL) and "actor/reward_kl_penalty_coeff".
    """
    mask = response_mask.astype(jnp.float32)
    kld = jnp.where(mask != 0, _kl_estimate(old_log_prob, ref_log_prob, kl_penalty), 0.0)  # [B, T]
    rewards = token_level_scores.astype(jnp.float32) - kl_coef * kld
    current_kl = jnp.mean(masked_mean(kld, mask, axis=-1))
    metrics = {"actor/reward_kl_penalty": current_kl,
               "actor/reward_kl_penalty_coeff": jnp.asarray(kl_coef, jnp.float32)}
    return rewards, metrics


def compute_kl_loss(logprob: jax.Array, ref_logprob: jax.Array, response_mask: jax.Array,
                    kl_loss_type: str = "low_var_kl", loss_agg_mode: str = "token-mean",
                    norm: LossNorm | None = None) -> jax.Array:
    """KL as a loss term (GRPO's `use_kl_loss`): agg_loss(kl_penalty(logprob, ref), mask, mode).

    Args:
      logprob: [B, T] current policy log-probs (differentiated); ref_logprob: [B, T].
      response_mask: [B, T] 0/1.
      kl_loss_type: estimator name (static); loss_agg_mode: see `agg_loss`; norm: micro-batch
        denominators (see `aggregation`).
    Returns:
      float32 scalar; the trainer multiplies it by `kl_loss_coef`.
    """
    return agg_loss(_kl_estimate(logprob, ref_logprob, kl_loss_type), response_mask, loss_agg_mode, norm=norm)


# ---- controllers (host side, stateful) ---------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient."""

    type = "fixed"

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl, n_steps: int) -> None:
        """No-op; kept so the trainer can treat both controllers alike."""
        del current_kl, n_steps

    def state_dict(self) -> dict:
        return {"type": self.type, "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _check_type(self.type, state)
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).

    Each update moves the coefficient towards the value that keeps the KL at `target_kl`:
    error = clip(current_kl / target - 1, -0.2, 0.2); value *= 1 + error · n_steps / horizon.
    """

    type = "adaptive"

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if not horizon > 0:
            raise ValueError(f"adaptive KL controller: horizon must be > 0, got {horizon}")
        if not target_kl > 0:
            raise ValueError(f"adaptive KL controller: target_kl must be > 0, got {target_kl}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl, n_steps: int) -> None:
        """Update from the batch's KL (a float or a scalar array) over `n_steps` samples."""
        error = float(np.clip(float(current_kl) / self.target - 1, -0.2, 0.2))
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"type": self.type, "value": self.value, "target_kl": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        _check_type(self.type, state)
        self.value = float(state["value"])
        self.target = float(state.get("target_kl", self.target))
        self.horizon = int(state.get("horizon", self.horizon))


def _check_type(expected: str, state: dict) -> None:
    if state.get("type", expected) != expected:
        raise ValueError(f"cannot load a {state['type']!r} KL controller state into a {expected!r} one")


def make_kl_controller(type: str, kl_coef: float, target_kl: float | None = None,
                       horizon: int | None = None) -> FixedKLController | AdaptiveKLController:
    """Build the KL controller from veRL's `algorithm.kl_ctrl` fields.

    Args:
      type: "fixed" or "adaptive".
      kl_coef: the (initial) coefficient.
      target_kl, horizon: required for "adaptive".
    """
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("adaptive KL controller needs target_kl and horizon, "
                             f"got target_kl={target_kl}, horizon={horizon}")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller type {type!r}; expected 'fixed' or 'adaptive'")
