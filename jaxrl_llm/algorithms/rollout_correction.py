"""Rollout correction (veRL's `algorithm.rollout_correction`): importance weights and rejection for the
mismatch between the sampler's log-probs and the trainer's.

The sampler (vLLM, our engine) and the trainer score the same tokens slightly differently (bf16 vs fp32
kernels, stale weights). Per token, with log r = old_log_prob - rollout_log_prob (trainer over sampler):

* IS weights (TIS), `rollout_is`: "token" gives r per token, "sequence" gives exp(Σ_t log r) on every
  token of the row; the log-ratio (or its row sum) is clamped to ±20 before `exp`. A numeric threshold
  truncates the weights at it, min(w, upper); a "lower_upper" string (IcePop) zeroes them outside
  [lower, upper]. `rollout_is_batch_normalize` then divides them by their batch mean (of the tokens, or
  of the sequences). The weights carry no gradient.
* Rejection (MIS), `rollout_rs`: a comma list of modes `<level>_<k>`. The per-token divergences, on
  the clamped log-ratio, are k1 = -log r, k2 = ½(log r)², k3 = r - 1 - log r; "token_k*" judges each
  token, "seq_sum_k*", "seq_mean_k*" and "seq_max_k*" (k2, k3 only) judge the whole row by the sum,
  mean or max over its tokens. k2/k3 modes reject a statistic above the threshold; k1 modes keep it in
  [log lower, log upper] (so the ratio bounds apply to π_rollout / π_train, as in veRL), a single k1
  threshold u meaning "1/u_u". A token survives only if every mode keeps it.
* Diagnostics (`compute_offpolicy_metrics`): KL estimates, perplexities, χ² divergences.

Thresholds are parsed on the host from the (static) config; everything under `jit` is arithmetic.

Empty rows (deviation from veRL). Our batches are padded with all-masked rows to bucket shapes. veRL
counts such rows in several sequence statistics (e.g. a PPL of 1, a weight deviation of 1); here every
sequence statistic runs over the non-empty rows only, so padding never changes a metric. Without
empty rows the values are veRL's.

Micro-batching. With `norm` (the mini-batch's `LossNorm`), token means divide by `norm.num_tokens` and
sequence means by `norm.num_seqs`, so they add up exactly over the micro-batches of the mini-batch;
`*_max`/`*_min` keys (and `*_max_deviation`) combine by max/min (an empty micro-batch gives -inf/+inf,
the identity). Standard deviations and the effective sample size are not additive: each micro-batch
reports its own value weighted by its share of the tokens (or sequences), which sums to a weighted
average of the micro-batch values, exact only for a single micro-batch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, NoReturn

import jax
import jax.numpy as jnp

from jaxrl_llm.algorithms.aggregation import LossNorm

# veRL's clamp on a log-ratio (or its row sum) before exp: exp(20) ≈ 4.9e8.
SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
LOSS_TYPES = ("ppo_clip", "reinforce")
METRIC_PREFIX = "rollout_corr/"
# veRL's masked_mean adds this to the count; the per-row means keep it so decisions match veRL's.
_MEAN_EPS = 1e-8


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig:
    """veRL's `algorithm.rollout_correction.*`, with its YAML defaults (everything off).

    Attributes:
      rollout_is: None, "token" or "sequence": the level of the truncated IS weights.
      rollout_is_threshold: a number (TIS: truncate at it) or "lower_upper" (IcePop: zero outside).
      rollout_is_batch_normalize: divide the weights by their batch mean (decoupled mode only).
      rollout_rs: None or a comma list of rejection modes (`RS_OPTIONS`); duplicates are dropped.
      rollout_rs_threshold: one spec shared by all modes, or one per mode (comma list). k1 modes take
        "lower_upper" or an upper u (lower 1/u); k2/k3 modes take one positive upper bound.
      bypass_mode: use the sampler's log-probs as the old ones; the loss (`loss_type`: "ppo_clip" or
        "reinforce") then computes the weights and rejection per micro-batch.
    """

    rollout_is: str | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"  # bypass mode's loss: "ppo_clip" or "reinforce"

    def validate(self) -> None:
        """Raise ValueError naming the field for an unknown mode or a bad / missing threshold."""
        parse_rollout_correction(self)


class RsOption(NamedTuple):
    """One rejection mode with its parsed bounds (`lower` is a ratio bound, k1 modes only)."""

    name: str
    lower: float | None
    upper: float


class ParsedRolloutCorrection(NamedTuple):
    """A validated config with its threshold strings turned into numbers (host side)."""

    is_level: str | None
    is_upper: float
    is_lower: float | None  # IcePop when set, else TIS
    is_batch_normalize: bool
    rs: tuple[RsOption, ...]
    bypass_mode: bool
    loss_type: str


def _fail(field: str, msg: str) -> NoReturn:
    raise ValueError(f"algorithm.rollout_correction.{field}: {msg}")


def _positive(text: str, field: str, spec) -> float:
    try:
        value = float(text)
    except ValueError:
        _fail(field, f"cannot read a number from {spec!r}")
    if not value > 0:  # also rejects NaN
        _fail(field, f"bounds must be positive, got {spec!r}")
    return value


def _parse_is_threshold(spec) -> tuple[float, float | None]:
    field = "rollout_is_threshold"
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        _fail(field, f"{spec!r}; use a positive number (TIS) or a 'lower_upper' string (IcePop)")
    if not isinstance(spec, str):
        return _positive(str(spec), field, spec), None
    text = spec.strip()
    lower_text, sep, upper_text = text.partition("_")
    if not sep:
        return _positive(text, field, spec), None
    if "_" in upper_text:
        _fail(field, f"{spec!r}; use one 'lower_upper' pair")
    lower, upper = _positive(lower_text, field, spec), _positive(upper_text, field, spec)
    if lower > upper:
        _fail(field, f"{spec!r}: lower bound > upper bound")
    return upper, lower


def _parse_rs(modes, spec) -> tuple[RsOption, ...]:
    if not isinstance(modes, str):
        _fail("rollout_rs", f"{modes!r}; use None or a comma list of {list(RS_OPTIONS)}")
    names = list(dict.fromkeys(m.strip() for m in modes.split(",") if m.strip()))
    if not names:
        _fail("rollout_rs", f"{modes!r} names no mode; use None to turn rejection off")
    unknown = [n for n in names if n not in RS_OPTIONS]
    if unknown:
        _fail("rollout_rs", f"unknown mode(s) {unknown}; known: {list(RS_OPTIONS)}")
    field = "rollout_rs_threshold"
    if spec is None:
        _fail(field, f"required when rollout_rs is set ({modes!r})")
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        _fail(field, f"{spec!r}; use a number or a comma list of thresholds")
    parts = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) not in (1, len(names)):
        _fail(field, f"{spec!r}: give one threshold for all modes or one per mode ({len(names)}: {names})")
    parts = parts * len(names) if len(parts) == 1 else parts
    options = []
    for name, part in zip(names, parts, strict=True):
        lower_text, sep, upper_text = part.partition("_")
        if not name.endswith("k1"):
            if sep:
                _fail(field, f"{part!r} for {name}: k2/k3 modes take one upper bound, not 'lower_upper'")
            options.append(RsOption(name, None, _positive(part, field, part)))
            continue
        if "_" in upper_text:
            _fail(field, f"{part!r} for {name}: use one 'lower_upper' pair")
        upper = _positive(upper_text if sep else part, field, part)
        lower = _positive(lower_text, field, part) if sep else 1.0 / upper
        if lower > upper:
            _fail(field, f"{part!r} for {name}: lower bound > upper bound")
        options.append(RsOption(name, lower, upper))
    return tuple(options)


def parse_rollout_correction(config) -> ParsedRolloutCorrection:
    """Validate `config` (any object with `RolloutCorrectionConfig`'s fields) and parse its thresholds.

    Raises:
      ValueError: "algorithm.rollout_correction.<field>: ..." for the first bad field.
    """
    if config.rollout_is is not None and config.rollout_is not in IS_LEVELS:
        _fail("rollout_is", f"{config.rollout_is!r}; use None, 'token' or 'sequence'")
    if config.rollout_is is not None and config.rollout_is_threshold is None:
        _fail("rollout_is_threshold", "required when rollout_is is set")
    upper, lower = (_parse_is_threshold(config.rollout_is_threshold) if config.rollout_is is not None
                    else (math.inf, None))
    rs = () if config.rollout_rs is None else _parse_rs(config.rollout_rs, config.rollout_rs_threshold)
    if config.loss_type not in LOSS_TYPES:
        _fail("loss_type", f"{config.loss_type!r}; use 'ppo_clip' or 'reinforce'")
    if config.bypass_mode and config.rollout_is_batch_normalize:
        _fail("rollout_is_batch_normalize", "in bypass mode the weights are computed per micro-batch, where "
              "the batch mean is unknown; use bypass_mode = False to normalise them")
    return ParsedRolloutCorrection(config.rollout_is, upper, lower, bool(config.rollout_is_batch_normalize), rs,
                                   bool(config.bypass_mode), config.loss_type)


def _log(x: float) -> float:
    """log on the host; an infinite threshold makes the reciprocal bound 0, whose log is -inf."""
    return math.log(x) if x > 0 else -math.inf


# ---- masked reductions -------------------------------------------------------------------------------

def _row_sum(x, tok):
    return jnp.sum(jnp.where(tok, x, 0.0), axis=-1)  # [B]


def _row_mean(x, tok):
    """veRL's per-row masked_mean (sum / (count + 1e-8)); 0 on an empty row."""
    return _row_sum(x, tok) / (jnp.sum(tok, axis=-1) + _MEAN_EPS)  # [B]


def _row_max(x, tok):
    """Max over the row's tokens; 0 on an empty row (veRL)."""
    m = jnp.max(jnp.where(tok, x, -jnp.inf), axis=-1)  # [B]
    return jnp.where(jnp.any(tok, axis=-1), m, 0.0)


class _Reduce:
    """Batch statistics over the selected tokens [B, T] or the non-empty rows [B].

    Means divide by `norm`'s counts when given (additive over micro-batches), else by this batch's.
    """

    def __init__(self, response_mask: jax.Array, norm: LossNorm | None):
        self.tok = response_mask != 0  # [B, T]
        self.seq = jnp.any(self.tok, axis=-1)  # [B]
        self.n_tok = jnp.sum(self.tok.astype(jnp.float32))
        self.n_seq = jnp.sum(self.seq.astype(jnp.float32))
        self.tok_den = jnp.maximum(self.n_tok, 1.0) if norm is None else norm.num_tokens
        self.seq_den = jnp.maximum(self.n_seq, 1.0) if norm is None else norm.num_seqs

    def tokens(self, x):
        return jnp.sum(jnp.where(self.tok, x, 0.0)) / self.tok_den

    def seqs(self, x):
        return jnp.sum(jnp.where(self.seq, x, 0.0)) / self.seq_den

    def token_max(self, x):
        return jnp.max(jnp.where(self.tok, x, -jnp.inf))

    def token_min(self, x):
        return jnp.min(jnp.where(self.tok, x, jnp.inf))

    def seq_max(self, x):
        return jnp.max(jnp.where(self.seq, x, -jnp.inf))

    def seq_min(self, x):
        return jnp.min(jnp.where(self.seq, x, jnp.inf))

    def token_std(self, x):
        """sqrt(E[x²] - E[x]²) over the tokens (veRL: 0 for fewer than 2), times this batch's token share."""
        n = jnp.maximum(self.n_tok, 1.0)
        mean = jnp.sum(jnp.where(self.tok, x, 0.0)) / n
        var = jnp.sum(jnp.where(self.tok, jnp.square(x), 0.0)) / n - jnp.square(mean)
        std = jnp.where(self.n_tok > 1, jnp.sqrt(jnp.maximum(var, 0.0)), 0.0)
        return std * self.n_tok / self.tok_den

    def seq_std(self, x):
        """Unbiased std over the rows (torch's `.std()`; 0 for fewer than 2), times this batch's row share."""
        n = jnp.maximum(self.n_seq, 1.0)
        mean = jnp.sum(jnp.where(self.seq, x, 0.0)) / n
        ss = jnp.sum(jnp.where(self.seq, jnp.square(x - mean), 0.0))
        std = jnp.where(self.n_seq > 1, jnp.sqrt(ss / jnp.maximum(self.n_seq - 1, 1.0)), 0.0)
        return std * self.n_seq / self.seq_den


# ---- importance weights --------------------------------------------------------------------------------

def _is_weights(log_ratio, red: _Reduce, p: ParsedRolloutCorrection):
    """Truncated (TIS) or IcePop weights [B, T] and veRL's `rollout_is_*` metrics."""
    tok = red.tok
    upper, icepop = p.is_upper, p.is_lower is not None
    lower = p.is_lower if icepop else 1.0 / upper  # the metrics' lower threshold
    if p.is_level == "token":
        raw = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))  # [B, T]
    else:
        seq_log_ratio = _row_sum(log_ratio, tok)  # [B]
        raw = jnp.broadcast_to(jnp.exp(jnp.clip(seq_log_ratio, -SAFETY_BOUND, SAFETY_BOUND))[:, None], tok.shape)
    raw = jnp.where(tok, raw, 0.0)
    if icepop:
        weights = jnp.where((raw >= lower) & (raw <= upper), raw, 0.0)
    else:
        weights = jnp.minimum(raw, upper)

    m = {}
    if p.is_level == "sequence":
        # Extremes of the untruncated sequence weights, read in log space.
        m["rollout_is_max"] = jnp.exp(jnp.minimum(red.seq_max(seq_log_ratio), SAFETY_BOUND))
        m["rollout_is_min"] = jnp.exp(red.seq_min(seq_log_ratio))
        m["rollout_is_mean"] = red.tokens(weights)
        m["rollout_is_ratio_fraction_high"] = red.seqs((seq_log_ratio > _log(upper)).astype(jnp.float32))
        m["rollout_is_ratio_fraction_low"] = red.seqs((seq_log_ratio < _log(lower)).astype(jnp.float32))
    else:
        m["rollout_is_mean"] = red.tokens(weights)
        m["rollout_is_ratio_fraction_high"] = red.tokens((raw > upper).astype(jnp.float32))
        m["rollout_is_ratio_fraction_low"] = red.tokens((raw < lower).astype(jnp.float32))
        m["rollout_is_max"] = red.token_max(weights)
        m["rollout_is_min"] = red.token_min(weights)
    clamped = jnp.clip(weights, 0.0, upper)
    m["rollout_is_std"] = red.token_std(clamped)
    # ESS = 1 / E[(w / E[w])²], of this batch, weighted by its token share like the std.
    n = red.n_tok
    local_mean = jnp.sum(jnp.where(tok, clamped, 0.0)) / (n + _MEAN_EPS)
    second = jnp.sum(jnp.where(tok, jnp.square(clamped / (local_mean + _MEAN_EPS)), 0.0)) / (n + _MEAN_EPS)
    m["rollout_is_eff_sample_size"] = jnp.where(n > 0, 1.0 / second * n / red.tok_den, 0.0)

    seq_weight = _row_mean(weights, tok)  # [B]
    m["rollout_is_seq_mean"] = red.seqs(seq_weight)
    m["rollout_is_seq_std"] = red.seq_std(seq_weight)
    m["rollout_is_seq_max"] = red.seq_max(seq_weight)
    m["rollout_is_seq_min"] = red.seq_min(seq_weight)
    m["rollout_is_seq_max_deviation"] = red.seq_max(jnp.abs(seq_weight - 1.0))
    # From the untruncated weights: a mean of truncated weights never exceeds the threshold.
    raw_seq_weight = _row_mean(raw, tok)  # [B]
    m["rollout_is_seq_fraction_high"] = red.seqs((raw_seq_weight > upper).astype(jnp.float32))
    m["rollout_is_seq_fraction_low"] = red.seqs((raw_seq_weight < lower).astype(jnp.float32))
    if icepop:
        m["rollout_is_oob_ratio"] = red.tokens(((raw < lower) | (raw > upper)).astype(jnp.float32))
    return weights, m


def _batch_normalize(weights, red: _Reduce, level: str):
    """Divide by the batch mean of the weights (tokens, or sequences); unchanged if it is ~0."""
    if level == "token":
        mean = jnp.sum(jnp.where(red.tok, weights, 0.0)) / (red.n_tok + _MEAN_EPS)
    else:
        mean = jnp.sum(jnp.where(red.seq, _row_mean(weights, red.tok), 0.0)) / jnp.maximum(red.n_seq, _MEAN_EPS)
    ok = mean > _MEAN_EPS
    return jnp.where(ok, weights / jnp.where(ok, mean, 1.0), weights), jnp.where(ok, mean, 1.0)


# ---- rejection -------------------------------------------------------------------------------------------

def _within(stat, lo, hi, is_k1):
    """k1 statistics must lie in [lo, hi]; k2/k3 ones only below hi."""
    return (stat >= lo) & (stat <= hi) if is_k1 else stat <= hi


def _rejection(log_ratio, red: _Reduce, options: tuple[RsOption, ...]):
    """Keep mask [B, T] bool (every mode passes) and veRL's `rollout_rs_*` metrics."""
    tok = red.tok
    safe = jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)  # [B, T]
    divergence = {"k1": -safe, "k2": 0.5 * jnp.square(safe), "k3": jnp.exp(safe) - 1.0 - safe}
    row_reduce = {"sum": _row_sum, "mean": _row_mean, "max": _row_max}
    f32 = lambda b: b.astype(jnp.float32)
    keep_all = jnp.ones(tok.shape, bool)
    m = {}
    for opt in options:
        level, kind = opt.name.rsplit("_", 1)
        is_k1 = kind == "k1"
        hi = _log(opt.upper) if is_k1 else opt.upper
        lo = _log(opt.lower) if is_k1 else 0.0
        if level == "token":
            stat = divergence[kind]  # [B, T]
            keep = _within(stat, lo, hi, is_k1)
            seq_values = _row_mean(stat, tok)  # [B]
        else:
            seq_values = row_reduce[level.removeprefix("seq_")](divergence[kind], tok)  # [B]
            stat = jnp.broadcast_to(seq_values[:, None], tok.shape)
            keep = jnp.broadcast_to(_within(seq_values, lo, hi, is_k1)[:, None], tok.shape)

        pre = f"rollout_rs_{opt.name}"
        m[f"{pre}_mean"] = red.tokens(stat)
        if level == "token":
            m[f"{pre}_max"], m[f"{pre}_min"] = red.token_max(stat), red.token_min(stat)
            m[f"{pre}_fraction_high"] = red.tokens(f32(stat > hi))
            m[f"{pre}_fraction_low"] = red.tokens(f32(stat < lo)) if is_k1 else jnp.zeros((), jnp.float32)
        else:
            m[f"{pre}_max"], m[f"{pre}_min"] = red.seq_max(seq_values), red.seq_min(seq_values)
            m[f"{pre}_fraction_high"] = red.seqs(f32(seq_values > hi))
            m[f"{pre}_fraction_low"] = red.seqs(f32(seq_values < lo)) if is_k1 else jnp.zeros((), jnp.float32)
        m[f"{pre}_std"] = red.token_std(jnp.clip(stat, lo, hi))
        m[f"{pre}_seq_mean"] = red.seqs(seq_values)
        m[f"{pre}_seq_std"] = red.seq_std(seq_values)
        m[f"{pre}_seq_max"] = red.seq_max(seq_values)
        m[f"{pre}_seq_min"] = red.seq_min(seq_values)
        m[f"{pre}_seq_max_deviation"] = red.seq_max(jnp.abs(seq_values))
        m[f"{pre}_seq_fraction_high"] = red.seqs(f32(seq_values > hi))
        if is_k1:
            m[f"{pre}_seq_fraction_low"] = red.seqs(f32(seq_values < lo))
        m[f"{pre}_masked_fraction"] = red.tokens(f32(~keep))
        m[f"{pre}_seq_masked_fraction"] = red.seqs(f32(jnp.any(~keep & tok, axis=-1)))
        keep_all = keep_all & keep
    m["rollout_rs_masked_fraction"] = red.tokens(f32(~keep_all))
    m["rollout_rs_seq_masked_fraction"] = red.seqs(f32(jnp.any(~keep_all & tok, axis=-1)))
    return keep_all, m


# ---- public API ------------------------------------------------------------------------------------------

def compute_offpolicy_metrics(log_prob: jax.Array, rollout_log_prob: jax.Array, response_mask: jax.Array, *,
                              norm: LossNorm | None = None) -> dict[str, jax.Array]:
    """veRL's off-policy diagnostics between the trainer's and the sampler's log-probs.

    Keys (veRL's, without the "rollout_corr/" prefix): training_ppl, training_log_ppl, rollout_ppl,
    rollout_log_ppl (means over sequences of exp(-mean log-prob) and -mean log-prob); kl (token mean of
    rollout - training, k1 of KL(π_rollout || π_training)); k3_kl (token mean of r - log r - 1, r
    unclamped); log_ppl_diff, log_ppl_abs_diff, log_ppl_diff_max, log_ppl_diff_min, ppl_ratio (of the
    per-sequence rollout - training mean log-prob d, and exp(d)); chi2_token (E_tokens[r²] - 1) and
    chi2_seq (E_seqs[(Π r)²] - 1), with log r (or its row sum) clamped to ±20.

    Args:
      log_prob: [B, T] the trainer's log-probs (old, or current in bypass mode).
      rollout_log_prob: [B, T] the sampler's.
      response_mask: [B, T] 0/1.
      norm: the mini-batch's denominators when this is one micro-batch (see the module docstring).
    Returns:
      dict of float32 scalars (no gradient).
    """
    red = _Reduce(response_mask, norm)
    tok = red.tok
    lp = jnp.where(tok, jax.lax.stop_gradient(log_prob).astype(jnp.float32), 0.0)  # [B, T]
    rlp = jnp.where(tok, jax.lax.stop_gradient(rollout_log_prob).astype(jnp.float32), 0.0)
    log_ratio = lp - rlp
    mean_lp, mean_rlp = _row_mean(lp, tok), _row_mean(rlp, tok)  # [B]
    diff = mean_rlp - mean_lp  # [B] log(training PPL / rollout PPL)
    rho = jnp.exp(jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    seq_rho = jnp.exp(jnp.clip(_row_sum(log_ratio, tok), -SAFETY_BOUND, SAFETY_BOUND))  # [B]
    return {
        "training_ppl": red.seqs(jnp.exp(-mean_lp)),
        "training_log_ppl": red.seqs(-mean_lp),
        "kl": red.tokens(rlp - lp),
        "k3_kl": red.tokens(jnp.exp(log_ratio) - log_ratio - 1.0),
        "rollout_ppl": red.seqs(jnp.exp(-mean_rlp)),
        "rollout_log_ppl": red.seqs(-mean_rlp),
        "log_ppl_diff": red.seqs(diff),
        "log_ppl_abs_diff": red.seqs(jnp.abs(diff)),
        "log_ppl_diff_max": red.seq_max(diff),
        "log_ppl_diff_min": red.seq_min(diff),
        "ppl_ratio": red.seqs(jnp.exp(diff)),
        "chi2_token": red.tokens(jnp.square(rho) - 1.0),  # the -1 per token keeps it additive
        "chi2_seq": red.seqs(jnp.square(seq_rho) - 1.0),
    }


def compute_rollout_correction_and_rejection_mask(
        old_log_prob: jax.Array, rollout_log_prob: jax.Array, response_mask: jax.Array, config, *,
        norm: LossNorm | None = None) -> tuple[jax.Array | None, jax.Array, dict[str, jax.Array]]:
    """IS weights, rejection mask and metrics of a batch (veRL's batch-level helper); jit with `config` static.

    Decoupled mode calls it once per step on the whole batch; the trainer multiplies each policy loss
    by the weights and trains on the returned mask. Bypass mode calls it per micro-batch (with `norm`)
    from `compute_policy_loss_bypass_mode`, on the current log-probs.

    Args:
      old_log_prob: [B, T] the trainer's log-probs of the sampled tokens (no gradient flows through).
      rollout_log_prob: [B, T] the sampler's.
      response_mask: [B, T] 0/1.
      config: a `RolloutCorrectionConfig` (or any object with its fields); validated and parsed here.
      norm: the mini-batch's denominators when this is one micro-batch; metrics then add up over the
        micro-batches. Incompatible with `rollout_is_batch_normalize`.
    Returns:
      weights: [B, T] float32 (0 on masked tokens), or None when `rollout_is` is None.
      mask: [B, T] `response_mask` with the rejected tokens zeroed, same dtype.
      metrics: "rollout_corr/<veRL key>" -> float32 scalar.
    """
    p = parse_rollout_correction(config)
    if p.is_batch_normalize and norm is not None:
        raise ValueError("algorithm.rollout_correction.rollout_is_batch_normalize: the batch mean of the weights "
                         "is not known inside a micro-batch (norm was given)")
    red = _Reduce(response_mask, norm)
    log_ratio = jax.lax.stop_gradient(old_log_prob).astype(jnp.float32) - jax.lax.stop_gradient(
        rollout_log_prob).astype(jnp.float32)
    log_ratio = jnp.where(red.tok, log_ratio, 0.0)  # [B, T]; padding may hold anything
    metrics = {}
    weights = None
    if p.is_level is not None:
        weights, is_metrics = _is_weights(log_ratio, red, p)
        metrics.update(is_metrics)
        if p.is_batch_normalize:
            weights, metrics["rollout_is_batch_norm_factor"] = _batch_normalize(weights, red, p.is_level)
    mask = response_mask
    if p.rs:
        keep, rs_metrics = _rejection(log_ratio, red, p.rs)
        metrics.update(rs_metrics)
        mask = jnp.where(keep, response_mask, 0).astype(response_mask.dtype)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask, norm=norm))
    return weights, mask, {METRIC_PREFIX + k: v for k, v in metrics.items()}
