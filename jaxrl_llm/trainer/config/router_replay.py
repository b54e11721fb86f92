"""`actor.router_replay.*`: which recorded MoE routing the trainer's forward passes replay (veRL's key and modes;
the replay itself: trainer/router_replay.py)."""

from __future__ import annotations

import dataclasses

import gin

from jaxrl_llm.trainer.config.check import ConfigValueError

MODES = ("disabled", "R2", "R3")


@gin.configurable("router_replay", module="actor")
@dataclasses.dataclass(frozen=True)
class RouterReplaySettings:
    """veRL's `actor.router_replay.*`: which recorded routing the trainer's MoE forward passes replay."""

    mode: str = "disabled"  # 'disabled', 'R2' (the old-log-prob pass's routing) or 'R3' (the sampler's)

    def validate(self, engine: str = "jax", multi_turn: bool = False):
        if self.mode == "R3" and multi_turn:
            raise ConfigValueError("actor.router_replay.mode: 'R3' is not available with rollout.multi_turn.enable "
                                   "(the agent loop does not stitch each turn's routing); use 'R2'")
        if self.mode not in MODES:
            raise ConfigValueError(f"actor.router_replay.mode: {self.mode!r}; use one of {MODES}")
        if self.mode == "R3" and engine != "jax":
            raise ConfigValueError("actor.router_replay.mode: 'R3' replays the sampler's routing, and the vLLM pool "
                             "(rollout.engine = 'vllm') does not return it; use rollout.engine = 'jax', or "
                             "actor.router_replay.mode = 'R2' (the old-log-prob pass's routing)")

    def check_model(self, cfg) -> None:
        """One clear error for replay on a dense model (it has no routing to replay)."""
        if self.mode != "disabled" and not cfg.is_moe:
            raise ValueError(f"actor.router_replay.mode: {self.mode!r} replays MoE routing, but the model "
                             f"({cfg.model_type}) has no experts; set it to 'disabled'")
