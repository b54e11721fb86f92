"""Batches and configs shared by the policy-loss tests."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl_llm.algorithms import PolicyLossConfig
from tests.algorithms.batches import random_batch

LOSS_NAMES = ("vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv", "dppo_kl", "dro")
COV_LOSSES = ("clip_cov", "kl_cov")
# Losses that aggregate their own way whatever loss_agg_mode says.
MODE_FREE_LOSSES = ("sapo", "geo_mean")
# veRL's metric keys per loss (without "actor/").
METRIC_KEYS = {
    "vanilla": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
    "gspo": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
    "sapo": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
    "gpg": set(),
    "clip_cov": {"pg_clipfrac", "ppo_kl"},
    "kl_cov": {"ppo_kl"},
    "geo_mean": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
    "cispo": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
    "dppo_tv": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
    "dppo_kl": {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"},
    "dro": {"ppo_kl"},
}


def config_for(name: str, mode: str = "token-mean", **overrides) -> PolicyLossConfig:
    """A config whose thresholds every path of `name` crosses on `pg_batch`: clip-higher, a dual-clip
    and TIS cap the spread ratios exceed, a 10% share for the cov losses, and a clip_cov window wide
    enough to hold more candidates than that share."""
    cfg = PolicyLossConfig(loss_mode=name, clip_ratio_low=0.2, clip_ratio_high=0.28,
                           clip_ratio_c=1.5 if name.startswith("dppo") else 2.5, loss_agg_mode=mode,
                           clip_cov_ratio=0.1, clip_cov_lb=0.1, kl_cov_ratio=0.1, ppo_kl_coef=0.5, dro_beta=0.3)
    return dataclasses.replace(cfg, **overrides)


def pg_batch(seed: int = 0, spread: float = 6.0) -> dict:
    """A `random_batch` (empty rows included) with a row of length 1, valid (<= 0) log-probs whose
    ratios to the old ones are spread wide, and positive rollout-correction weights."""
    b = random_batch(seed)
    lengths = b["response_mask"].sum(-1)
    one = int(np.flatnonzero(lengths > 1)[0])
    b["response_mask"][one] = 0.0
    b["response_mask"][one, 0] = 1.0
    old = b["old_log_prob"]
    b["log_prob"] = -np.abs(old + spread * (b["log_prob"] - old)).astype(np.float32)
    rng = np.random.default_rng(seed + 100)
    b["rollout_is_weights"] = rng.uniform(0.5, 1.5, old.shape).astype(np.float32)
    return b
